"""A pair's identity is what its models are: the same two models spelled as a name, two directories, a
symlink or hub ids are one pair (so the certificate ledger catches them); other weights are another pair."""

from __future__ import annotations

import shutil

from workers.models.identity import model_fingerprint, pair_fingerprint
from workers.models.tiny import save_tiny_pair


def _hub_cache(root, repo: str, src, commit: str) -> None:
    base = root / ("models--" + repo.replace("/", "--"))
    shutil.copytree(src, base / "snapshots" / commit)
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)


def test_every_spelling_of_the_same_two_models_is_one_pair(tmp_path, monkeypatch):
    from huggingface_hub import constants

    draft, target = save_tiny_pair(tmp_path / "tiny", head_dim=16)
    (tmp_path / "link").symlink_to(tmp_path / "tiny")
    shutil.copytree(tmp_path / "tiny", tmp_path / "copy")
    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    _hub_cache(cache, "acme/draft", draft, "a" * 40)
    _hub_cache(cache, "acme/target", target, "b" * 40)
    spellings = [f"{draft}+{target}", f"{draft},{target}", f"{tmp_path / 'link' / 'draft'}+{tmp_path / 'link' / 'target'}",
                 f"{tmp_path / 'copy' / 'draft'}+{tmp_path / 'copy' / 'target'}", "acme/draft+acme/target",
                 f"acme/draft@{'a' * 40}+acme/target"]
    ids = {pair_fingerprint(s) for s in spellings}
    assert len(ids) == 1, ids
    # the order matters (draft and target swapped is another pair), and so do the weights
    assert pair_fingerprint(f"{target}+{draft}") not in ids
    other_draft, _ = save_tiny_pair(tmp_path / "seed1", seed=1, head_dim=16)
    assert pair_fingerprint(f"{other_draft}+{target}") not in ids


def test_a_fine_tune_with_the_same_config_and_tokenizer_is_another_model(tmp_path):
    draft, _ = save_tiny_pair(tmp_path / "tiny", head_dim=16)
    shutil.copytree(draft, tmp_path / "tuned")
    weights = tmp_path / "tuned" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one byte of the last tensor: inside the last sampled window
    weights.write_bytes(bytes(data))
    assert model_fingerprint(tmp_path / "tuned") != model_fingerprint(draft)
    # the dtype a config names, its path and library version are not the model
    import json

    shutil.copytree(draft, tmp_path / "renamed")
    config = tmp_path / "renamed" / "config.json"
    data = json.loads(config.read_text())
    config.write_text(json.dumps({**data, "_name_or_path": "/elsewhere", "dtype": "bfloat16",
                                  "transformers_version": "0.0.0"}))
    assert model_fingerprint(tmp_path / "renamed") == model_fingerprint(draft)

def test_the_shipped_pair_is_its_pinned_sources_whether_named_or_fetched():
    from workers.models import assets

    pinned = assets.pair_assets(assets.DEFAULT_PAIR)
    fid = pair_fingerprint(assets.DEFAULT_PAIR)
    assert fid.startswith("pair:") and fid == pair_fingerprint(assets.DEFAULT_PAIR)
    assert pinned.draft.sha256 != pinned.target.sha256 and pair_fingerprint("tiny-random") != fid
