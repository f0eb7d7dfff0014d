"""Pair loading: tiny-random properties, local-directory pairs, name errors, the real pair (marked)."""

from __future__ import annotations

import time

import pytest
import torch

from workers.models import pair as pair_mod
from workers.models.pair import PAIRS, load_pair
from workers.models.tiny import tiny_random_pair, tiny_tokenizer


@pytest.fixture(scope="module")
def tiny():
    return load_pair("tiny-random", dtype=torch.float32)


def _state_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tiny_random_builds_in_under_a_second(tiny):
    t0 = time.perf_counter()  # imports are warm thanks to the fixture; the build itself is measured
    load_pair("tiny-random", seed=7)
    assert time.perf_counter() - t0 < 1.0


def test_tiny_random_is_deterministic_and_leaves_global_rng_alone(tiny):
    before = torch.get_rng_state()
    again = load_pair("tiny-random", dtype=torch.float32)
    other = load_pair("tiny-random", dtype=torch.float32, seed=1)
    assert torch.equal(before, torch.get_rng_state()), "building a pair must not consume the caller's RNG"
    assert _state_equal(tiny.target, again.target) and _state_equal(tiny.draft, again.draft)
    assert not _state_equal(tiny.target, other.target)


def test_tiny_pair_shares_vocab_and_has_untied_separate_heads(tiny):
    x = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        widths = {tiny.draft(x).logits.shape[-1], tiny.target(x).logits.shape[-1]}
    assert widths == {tiny.vocab_size} and tiny.vocab_size >= len(tiny.tokenizer)
    for model in (tiny.draft, tiny.target):
        assert not model.config.tie_word_embeddings
        assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
        assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert tiny.draft.lm_head.weight.data_ptr() != tiny.target.lm_head.weight.data_ptr(), "no shared storage"
    vocab = tiny.tokenizer.get_vocab()
    assert set(tiny.eos_token_ids) == {vocab["<|im_end|>"], vocab["<|endoftext|>"]}
    assert tiny.cache_dir is None


def test_tiny_draft_agrees_with_target_often_but_not_always(tiny):
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, len(tiny.tokenizer), (8, 64), generator=gen)
    with torch.no_grad():
        agree = (tiny.draft(x).logits.argmax(-1) == tiny.target(x).logits.argmax(-1)).float().mean().item()
    # 512 positions: a true rate of ~0.65 lands outside (0.3, 0.95) with negligible probability.
    assert 0.3 < agree < 0.95, agree
    # Along the target's own greedy continuation too (what a speculative decoder actually sees).
    prompt = torch.tensor([tiny.tokenizer.encode("def main():")])
    with torch.no_grad():
        out = tiny.target.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=None,
                                   pad_token_id=tiny.tokenizer.pad_token_id)
        draft_next = tiny.draft(out).logits[0, prompt.shape[1] - 1:-1].argmax(-1)
    along = (draft_next == out[0, prompt.shape[1]:]).float().mean().item()
    assert 0.2 < along < 1.0, along


def test_tiny_tokenizer_round_trips_bytes_and_applies_chat_template():
    tok = tiny_tokenizer()
    text = "héllo, wörld\n\t{}"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("A") == [65], "ids 0-255 are the bytes themselves"
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=False)
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_honours_dtype():
    bf = load_pair("tiny-random", dtype="bf16")
    assert bf.dtype == torch.bfloat16
    assert {p.dtype for m in (bf.draft, bf.target) for p in m.parameters()} == {torch.bfloat16}


def test_unknown_pair_error_lists_valid_names():
    with pytest.raises(ValueError) as err:
        load_pair("no-such-pair")
    for name in PAIRS:
        assert name in str(err.value)
    assert "DRAFT+TARGET" in str(err.value) and "hub id" in str(err.value)


def _save(model, tokenizer, path):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("sep", ["+", ","])
def test_local_dirs_pair_reloads_the_same_models(tiny, tmp_path, sep):
    d = _save(tiny.draft, tiny.tokenizer, tmp_path / "draft")
    t = _save(tiny.target, tiny.tokenizer, tmp_path / "target")
    loaded = load_pair(f"{d}{sep}{t}", dtype=torch.float32, cache_dir=tmp_path / "cache")
    x = torch.tensor([tiny.tokenizer.encode("same logits")])
    with torch.no_grad():
        assert torch.equal(loaded.target(x).logits, tiny.target(x).logits)
        assert torch.equal(loaded.draft(x).logits, tiny.draft(x).logits)
    assert loaded.vocab_size == tiny.vocab_size and set(loaded.eos_token_ids) == set(tiny.eos_token_ids)
    assert loaded.cache_dir is not None and loaded.cache_dir.parent == tmp_path / "cache" / "pairs"


def _hub_cache(root, repo: str, src, commit: str) -> None:
    """``src`` laid out as the Hugging Face cache holds a downloaded snapshot of ``repo`` at ``commit``."""
    import shutil

    base = root / ("models--" + repo.replace("/", "--"))
    shutil.copytree(src, base / "snapshots" / commit)
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)


def test_hub_ids_resolve_from_the_local_cache_and_never_download(tiny, tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    _hub_cache(cache, "acme/tiny-draft", _save(tiny.draft, tiny.tokenizer, tmp_path / "d"), "a" * 40)
    _hub_cache(cache, "acme/tiny-target", _save(tiny.target, tiny.tokenizer, tmp_path / "t"), "b" * 40)
    loaded = load_pair(f"acme/tiny-draft+acme/tiny-target@{'b' * 40}", dtype=torch.float32, cache_dir=tmp_path / "c")
    x = torch.tensor([tiny.tokenizer.encode("hub")])
    with torch.no_grad():
        assert torch.equal(loaded.target(x).logits, tiny.target(x).logits)
    pair_mod.check_pair_name("acme/tiny-draft,acme/tiny-target")
    with pytest.raises(ValueError, match=r"acme/missing: not in the local Hugging Face cache.*huggingface-cli download"):
        load_pair("acme/tiny-draft+acme/missing", cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        load_pair("acme/tiny-draft+acme/tiny-target@nope", cache_dir=tmp_path / "c")


def test_local_dirs_with_different_vocab_raise(tiny, tmp_path):
    draft_tok, target_tok = tiny_tokenizer(), tiny_tokenizer()
    draft_tok.add_tokens(["<extra>"])
    target_tok.add_tokens(["<other>"])  # the same id, another token
    d = _save(tiny.draft, draft_tok, tmp_path / "draft")
    t = _save(tiny.target, target_tok, tmp_path / "target")
    with pytest.raises(ValueError, match=r"do not share a tokenizer vocabulary.*1 of the 260 ids both have differ "
                                         r"\(259: '<extra>' vs '<other>'\)"):
        load_pair(f"{d}+{t}", cache_dir=tmp_path / "cache")


def test_ids_only_one_tokenizer_has_are_allowed_when_the_shared_range_agrees(tiny, tmp_path):
    draft_tok = tiny_tokenizer()
    draft_tok.add_tokens(["<extra>"])  # id 259: the target scores it (its head is 320 wide) but has no token there
    d = _save(tiny.draft, draft_tok, tmp_path / "draft")
    t = _save(tiny.target, tiny.tokenizer, tmp_path / "target")
    assert load_pair(f"{d}+{t}", dtype=torch.float32, cache_dir=tmp_path / "cache").vocab_size == 320


def test_local_dirs_with_different_special_tokens_raise(tiny, tmp_path):
    draft_tok = tiny_tokenizer()
    draft_tok.eos_token = "<|endoftext|>"
    d = _save(tiny.draft, draft_tok, tmp_path / "draft")
    t = _save(tiny.target, tiny.tokenizer, tmp_path / "target")
    with pytest.raises(ValueError, match=r"different special tokens \(eos_token: draft '<\|endoftext\|>', "
                                         r"target '<\|im_end\|>'\)"):
        load_pair(f"{d}+{t}", cache_dir=tmp_path / "cache")


def test_a_draft_wider_than_its_target_is_refused(tiny, tmp_path):
    wide = load_pair("tiny-random", dtype=torch.float32).draft
    wide.resize_token_embeddings(384)
    d = _save(wide, tiny.tokenizer, tmp_path / "draft")
    t = _save(tiny.target, tiny.tokenizer, tmp_path / "target")
    with pytest.raises(ValueError, match="scores 384 ids but target .* only 320.*no wider than the target"):
        load_pair(f"{d},{t}", cache_dir=tmp_path / "cache")


def test_a_narrower_draft_loads_and_records_its_width(tmp_path):
    narrow = tiny_random_pair(torch.float32, draft_vocab=288)
    assert narrow.padded and narrow.draft_width == 288 and narrow.vocab_size == 320
    d = _save(narrow.draft, narrow.tokenizer, tmp_path / "draft")
    t = _save(narrow.target, narrow.tokenizer, tmp_path / "target")
    loaded = load_pair(f"{d}+{t}", dtype=torch.float32, cache_dir=tmp_path / "cache")
    assert loaded.padded and (loaded.draft_width, loaded.vocab_size) == (288, 320)
    assert not tiny_random_pair(torch.float32).padded
    with pytest.raises(ValueError, match=r"draft_vocab must be in \[259, 320\]"):
        tiny_random_pair(torch.float32, draft_vocab=200)


def test_a_draft_too_narrow_for_the_tokenizer_is_refused(tiny, tmp_path):
    narrow = load_pair("tiny-random", dtype=torch.float32).draft
    narrow.resize_token_embeddings(258)  # the tokenizer has 259 tokens
    d = _save(narrow, tiny.tokenizer, tmp_path / "draft")
    t = _save(tiny.target, tiny.tokenizer, tmp_path / "target")
    with pytest.raises(ValueError, match="tokenizer has 259 tokens but draft .* scores only 258 ids"):
        load_pair(f"{d},{t}", cache_dir=tmp_path / "cache")


def test_dtype_names_resolve():
    assert pair_mod.resolve_dtype("bfloat16") is torch.bfloat16
    assert pair_mod.resolve_dtype("torch.float32") is torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        pair_mod.resolve_dtype("int3")


@pytest.mark.real
def test_real_pair_loads_with_shared_tokenizer_and_untied_heads():
    """Fails with the AssetError (and its fetch command) when the assets are absent: never skipped."""
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    real = load_pair("qwen2.5-coder-0.5b+1.5b")
    load_s = time.perf_counter() - t0
    assert real.vocab_size == 151936 and real.dtype == torch.bfloat16
    for model in (real.draft, real.target):
        assert model.get_output_embeddings().weight.shape[0] == 151936
        assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
        assert not torch.equal(model.lm_head.weight, model.get_input_embeddings().weight), "heads are untied"
    draft_tok = AutoTokenizer.from_pretrained(real.draft.name_or_path, local_files_only=True)
    assert draft_tok.get_vocab() == real.tokenizer.get_vocab()
    # The two GGUFs' chat templates differ only in the tools preamble (the target's has the older
    # doubled braces `{{"name": ...}}`), so compare what they render for plain conversations.
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sum 2+3."}]
    assert draft_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        real.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    vocab = real.tokenizer.get_vocab()
    assert {vocab["<|im_end|>"], vocab["<|endoftext|>"]} <= set(real.eos_token_ids)
    assert real.cache_dir is not None and real.cache_dir.is_dir()
    ids = torch.tensor([real.tokenizer.encode("def fib(n):\n    return")])
    with torch.no_grad():
        assert real.draft(ids).logits.shape == real.target(ids).logits.shape == (1, ids.shape[1], 151936)
    print(f"real pair load {load_s:.1f}s")


def test_native_dtype_is_bf16_only_where_the_cpu_has_bf16_instructions():
    from workers.models.pair import native_dtype

    assert native_dtype("flags : fpu sse avx2 avx512f avx512_bf16", cuda=False) == "bf16"
    assert native_dtype("flags : fpu sse avx2 amx_bf16 amx_tile", cuda=False) == "bf16"
    assert native_dtype("flags : fpu sse avx2 fma", cuda=False) == "fp32", "emulated bf16 is ~4x slower than fp32 here"
    assert native_dtype("flags : fpu sse avx2 fma", cuda=True) == "bf16"
