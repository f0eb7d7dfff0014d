"""The fast CPU path (dtype int8, and int4+int8 with its 4-bit draft): close to fp32, a row's result independent of
the rows beside it, lossless speculative decoding token-for-token equal to target-only decoding, the KV cache's crop
and growth, stored conversions."""

from __future__ import annotations

import pytest
import torch

from workers.cpu_engine import SpecDecoder
from workers.models import fast, fast_store
from workers.models.pair import INT4_DRAFT, INT8, auto_dtype, dtype_tag, fast_path, load_pair
from workers.models.tiny import tiny_random_pair


@pytest.fixture(scope="module")
def fp32():
    return tiny_random_pair(torch.float32, seed=0)


@pytest.fixture(scope="module")
def int8():
    return load_pair("tiny-random", dtype="int8")


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def test_int8_pair_is_named_int8_and_keeps_the_pair_contract(int8):
    assert int8.dtype is INT8 and dtype_tag(int8.dtype) == "int8" and dtype_tag("int8") == "int8"
    assert isinstance(int8.target, fast.Int8CausalLM) and isinstance(int8.draft, fast.Int8CausalLM)
    assert int8.vocab_size == 320
    assert int8.target.get_output_embeddings().weight.shape == (320, 64), "the dequantized head DropMatch reads"


@torch.inference_mode()
def test_logits_stay_close_to_fp32(fp32, int8):
    ids = _ids(48)
    ref = fp32.target(ids).logits[0].float()
    got = int8.target(ids).logits[0]
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    rel = ((ref - got).abs().median() / ref.abs().median()).item()
    assert agree >= 0.9, f"int8 argmax agrees with fp32 on only {agree:.0%} of 48 positions"
    assert rel < 0.05, f"median |int8 - fp32| is {rel:.1%} of the median |logit|"


@torch.inference_mode()
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(int8):
    """Per-token activation quantization and one attention call per query row: a pass over n tokens gives,
    bit for bit, what n one-token steps give (what makes lossless output equal target-only output)."""
    model = int8.target
    ids = _ids(30, seed=1)
    cache = model.new_cache()
    full = model.lm_head(model.get_decoder()(ids, past_key_values=cache).last_hidden_state)[0]
    cache = model.new_cache()
    model.get_decoder()(ids[:, :7], past_key_values=cache)
    rows = [model.lm_head(model.get_decoder()(ids[:, j:j + 1], past_key_values=cache).last_hidden_state)[0, 0]
            for j in range(7, 30)]
    assert torch.equal(full[7:], torch.stack(rows)), "a verify pass's rows must equal one-token steps exactly"
    lin = model.get_decoder().layers[0].gate_up
    x = torch.randn(5, lin.in_features)
    x[0, 3] = 500.0  # a massive activation in one row must not change the others
    assert torch.equal(lin(x)[1:], torch.cat([lin(x[i:i + 1]) for i in range(1, 5)]))


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("draft_len", [1, 2, 4, 7])
def test_lossless_equals_target_only_token_for_token(request, dtype, draft_len):
    engine = SpecDecoder(request.getfixturevalue(dtype))
    for seed in range(3):
        prompt = _ids(12, seed=10 + seed)[0].tolist()
        ar = engine.autoregressive(prompt, max_new_tokens=40)
        sd = engine.generate(prompt, "lossless", draft_len=draft_len, max_new_tokens=40)
        assert sd.token_ids == ar.token_ids, f"lossless at L={draft_len} left target-only output (seed {seed})"
        assert sd.stats.num_drafts < ar.stats.num_drafts or draft_len == 1 or sd.stats.num_accepted_tokens == 0


def test_kv_cache_grows_and_crops(int8):
    model = int8.draft
    cache = fast.KVCache(1, 2, 16, capacity=4)
    model2 = int8.target
    assert cache.capacity == 4
    cache.reserve(9)
    assert cache.capacity == 9 and len(cache.keys) == 1
    cache = model.new_cache()
    model.get_decoder()(_ids(10), past_key_values=cache)
    assert cache.get_seq_length() == 10
    cache.crop(-3)
    assert cache.get_seq_length() == 7
    cache.crop(5)
    assert cache.get_seq_length() == 5
    with pytest.raises(TypeError, match="own KV cache"):
        model2.get_decoder()(_ids(2), past_key_values=object())
    with pytest.raises(ValueError, match="one sequence"):
        model2.get_decoder()(torch.zeros(2, 3, dtype=torch.long))


def test_unsupported_models_are_refused_by_name(fp32):
    class Config:
        model_type = "gpt2"

    class Model:
        config = Config()

    assert fast.supported(fp32.target) is None
    assert "gpt2" in fast.supported(Model())
    with pytest.raises(ValueError, match="dtype int8 .* cannot run this model: model_type 'gpt2'"):
        fast.quantize(Model(), fast.calibration_ids(fp32.tokenizer))


def test_calibration_is_fixed_text_not_benchmark_items(fp32):
    ids = fast.calibration_ids(fp32.tokenizer)
    assert ids.shape[0] == 1 and 100 < ids.shape[1] <= 512
    assert torch.equal(ids, fast.calibration_ids(fp32.tokenizer))


def test_auto_dtype_prefers_the_fast_path_on_x86_cpus(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert auto_dtype("flags : fpu sse avx2 fma", cuda=False) == "int8"
    assert auto_dtype("flags : fpu sse avx2 avx512f avx512_bf16", cuda=False) == "int8", "not all of AVX-512's kernels"
    avx512 = "flags : fpu sse avx2 avx512f avx512bw avx512vl avx512dq avx512_bf16"
    assert auto_dtype(avx512, cuda=False) == "int4+int8"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert auto_dtype(avx512, cuda=False) == "int8", "ATen held to AVX2: its int4 GEMM is slower than int8's"
    assert auto_dtype("flags : fpu sse", cuda=False) == "fp32", "no fbgemm kernels without AVX2: the float dtype"
    assert auto_dtype("flags : fpu sse avx2", cuda=True) == "bf16"


def _saved_draft(tmp_path):
    """The tiny draft saved as a model directory, a loader of its float model, and the list each load appends to."""
    from workers.models.tiny import save_tiny_pair

    draft_dir, _ = save_tiny_pair(tmp_path / "pair", head_dim=16)
    loads: list[int] = []

    def load_float():
        from transformers import AutoModelForCausalLM

        loads.append(1)
        return AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32)

    return draft_dir, load_float, loads


def test_a_stored_conversion_loads_back_bit_identical_and_is_reused(fp32, tmp_path):
    """The pair cache keeps one conversion per model directory: loading it gives the same logits bit for bit, a
    second load reads it back without the float model, and other weights convert again."""
    draft_dir, load_float, loads = _saved_draft(tmp_path)
    calibration = fast.calibration_ids(fp32.tokenizer)
    store = tmp_path / "cache" / "int8" / "draft"
    first = fast_store.load_cached(draft_dir, store, calibration, load_float)
    again = fast_store.load_cached(draft_dir, store, calibration, load_float)
    assert len(loads) == 1, "the second load must read the store, not convert again"
    ids = _ids(20, seed=3)
    with torch.inference_mode():
        assert torch.equal(first(ids).logits, again(ids).logits)
    (draft_dir / "config.json").touch()  # the weights' directory changed: its store is stale
    fast_store.load_cached(draft_dir, store, calibration, load_float)
    assert len(loads) == 2


@pytest.fixture(scope="module")
def int4():
    return load_pair("tiny-random", dtype="int4+int8")


def test_the_4bit_draft_pair_keeps_int8s_target_and_is_a_dtype_of_its_own(int4, int8):
    assert int4.dtype is INT4_DRAFT and dtype_tag(int4.dtype) == "int4+int8" and dtype_tag("int4+int8") == "int4+int8"
    assert fast_path("int4+int8") and fast_path("int8") and not fast_path("bf16") and not fast_path("nonsense")
    layer = int4.draft.get_decoder().layers[0]
    assert all(isinstance(getattr(layer, n), fast.Q4Linear) for n in fast._Layer.NAMES)
    assert isinstance(int4.draft.get_output_embeddings(), fast.Q4Linear)
    assert isinstance(int4.target.get_output_embeddings(), fast.QLinear)
    ids = _ids(24, seed=3)
    with torch.inference_mode():
        assert torch.equal(int4.target(ids).logits, int8.target(ids).logits), "the target is int8's, bit for bit"
        assert not torch.equal(int4.draft(ids).logits, int8.draft(ids).logits)
    assert int4.draft.get_output_embeddings().weight.shape == (320, 64)


@torch.inference_mode()
def test_the_4bit_drafts_rows_do_not_depend_on_the_rows_beside_them(int4):
    model = int4.draft
    ids = _ids(30, seed=4)
    full = model.lm_head(model.get_decoder()(ids, past_key_values=model.new_cache()).last_hidden_state)[0]
    cache = model.new_cache()
    model.get_decoder()(ids[:, :5], past_key_values=cache)
    rows = [model.lm_head(model.get_decoder()(ids[:, j:j + 1], past_key_values=cache).last_hidden_state)[0, 0]
            for j in range(5, 30)]
    assert torch.equal(full[5:], torch.stack(rows))
    g = torch.Generator().manual_seed(5)
    lin = fast.Q4Linear.quantized(torch.randn(200, 96, generator=g) * 0.02)  # 200 rows: padded to sixteens inside
    x = torch.randn(300, 96, generator=g)
    y = lin(x)
    assert y.shape == (300, 200) and lin.group == 32
    for n in (1, 2, 15, 16, 17, 64, 299):
        assert torch.equal(lin(x[:n]), y[:n]), n


def test_a_4bit_rows_result_is_the_same_in_a_long_pass_at_the_real_drafts_widths():
    """Group 128 at the 0.5B draft's widths, a teacher-forced pass's row count (over a thousand), one and two
    threads: what replay's exactness on int4+int8 rests on."""
    g = torch.Generator().manual_seed(8)
    lin = fast.Q4Linear.quantized(torch.randn(1152, 896, generator=g) * 0.02)
    assert lin.group == 128
    x = torch.randn(1100, 896, generator=g)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            y = lin(x)
            assert torch.equal(torch.cat([lin(x[i:i + 1]) for i in range(0, 1100, 97)]), y[::97]), n
            assert torch.equal(lin(x[:333]), y[:333]), n
            assert torch.equal(lin(x.T.contiguous().T), y), "a strided input: the same numbers"
    finally:
        torch.set_num_threads(threads)


def test_4bit_weights_keep_the_least_error_clip_and_say_what_they_cannot_take():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(64, 256, generator=g) * 0.02
    w[3, 7] = 0.5  # an outlier: its group's range is what the clip search weighs
    lin = fast.Q4Linear.quantized(w)
    assert lin.group == 128
    err = (lin.weight - w).norm() / w.norm()
    assert err < 0.12, f"4-bit relative error {err:.3f}"
    x = torch.randn(4, 256, generator=g)
    torch.testing.assert_close(lin(x), x.bfloat16().float() @ lin.weight.T, atol=2e-3, rtol=2e-2)
    with pytest.raises(ValueError, match="divisible by one of"):
        fast.Q4Linear.quantized(torch.randn(16, 40))

    class Config:
        model_type, num_attention_heads, hidden_size, intermediate_size = "qwen2", 4, 64, 100

    assert "intermediate_size 100" in fast._q4_widths(Config())



def test_a_stored_4bit_conversion_loads_back_bit_identical_beside_the_int8_one(fp32, tmp_path):
    draft_dir, load_float, loads = _saved_draft(tmp_path)
    calibration = fast.calibration_ids(fp32.tokenizer)
    first = fast_store.load_cached(draft_dir, tmp_path / "int4" / "draft", calibration, load_float, bits=4)
    again = fast_store.load_cached(draft_dir, tmp_path / "int4" / "draft", calibration, load_float, bits=4)
    assert len(loads) == 1 and isinstance(again.lm_head, fast.Q4Linear)
    ids = _ids(20, seed=7)
    with torch.inference_mode():
        assert torch.equal(first(ids).logits, again(ids).logits)
    # an int8 store's meta has no "bits": stores written before 4-bit weights existed are still read
    fast_store.load_cached(draft_dir, tmp_path / "int8" / "draft", calibration, load_float)
    import json

    assert "bits" not in json.loads((tmp_path / "int8" / "draft" / "meta.json").read_text())
    meta = json.loads((tmp_path / "int4" / "draft" / "meta.json").read_text())
    assert meta["bits"] == 4 and meta["q4"]["groups"] == list(fast.Q4_GROUPS), "the recipe is part of what is matched"


def _qwen_shaped(hidden: int, intermediate: int, heads: int, layers: int = 2) -> torch.nn.Module:
    """A random Qwen2 at the real pair's widths (its vocabulary, heads, KV heads and MLP), few layers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=151_936, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                         max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1_000_000.0)
    torch.manual_seed(11)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # the attention biases Qwen2 has, non-zero as the real ones
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("which", ["target-int8", "draft-int4"])
def test_a_pass_of_300_rows_equals_one_token_steps_at_the_real_pairs_widths_at_one_thread(which):
    """What replay's exactness in confirmation rests on (``workers.replay.exact_for``: the fast path at one thread):
    a teacher-forced pass's rows equal, bit for bit, the one-token steps a live run makes, through every layer kind
    (attention over a growing cache, norms, the MLP, the >64-row activation path) and the vocabulary-wide head, at
    the 1.5B target's widths in int8 and the 0.5B draft's in 4 bits."""
    hidden, intermediate, heads, bits = (1536, 8960, 12, 8) if which == "target-int8" else (896, 4864, 14, 4)
    model = fast.quantize(_qwen_shaped(hidden, intermediate, heads), _ids(64, seed=2), bits=bits)
    ids = torch.randint(0, 151_936, (1, 300), generator=torch.Generator().manual_seed(12))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            decoder = model.get_decoder()
            full = model.lm_head(decoder(ids, past_key_values=model.new_cache()).last_hidden_state)[0]
            cache = model.new_cache()
            # a prompt's prefill (itself >64 rows), then 100 steps: each a one-row GEMM against the pass's 300-row one
            decoder(ids[:, :200], past_key_values=cache)
            steps = torch.stack([model.lm_head(decoder(ids[:, j:j + 1], past_key_values=cache).last_hidden_state)[0, 0]
                                 for j in range(200, 300)])
            assert torch.equal(full[200:], steps), "a pass's rows must equal one-token steps exactly"
            cache.crop(120)  # a rejected round's rows dropped, then a verify block of 6 over them
            block = model.lm_head(decoder(ids[:, 120:126], past_key_values=cache).last_hidden_state)[0]
            assert torch.equal(block, full[120:126])
    finally:
        torch.set_num_threads(threads)
