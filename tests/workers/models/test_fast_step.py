"""The scripted layers (workers.models.fast_step): bit-identical to the eager layers in every output and every cache
write, in one-token steps and passes of several rows, as the cache grows, is cropped and is reallocated, at one and
two threads, for the 4-bit draft and both int8 models; built only for layers whose linears are all of one kind;
turned off by its switch, which refuses a value it does not know."""

from __future__ import annotations

import pytest
import torch

from workers.models import fast, fast_step
from workers.models.pair import load_pair


@pytest.fixture(scope="module")
def int4():
    return load_pair("tiny-random", dtype="int4+int8")


@pytest.fixture(scope="module")
def int8():
    return load_pair("tiny-random", dtype="int8")


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _small_cache(decoder) -> fast.KVCache:
    """A cache that reallocates after 8 positions: steps past it write into new tensors."""
    return fast.KVCache(len(decoder.layers), decoder.kv_heads, decoder.head_dim, capacity=8)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("model", ["int4 draft", "int8 draft", "int8 target"])
@torch.inference_mode()
def test_the_scripted_layers_are_bit_identical_to_the_eager_ones(request, model, threads):
    dtype, role = model.split()
    pair = request.getfixturevalue(dtype)
    decoder = (pair.draft if role == "draft" else pair.target).get_decoder()
    ids = _ids(90, seed=threads)
    eager, scripted = _small_cache(decoder), _small_cache(decoder)
    # a prefill of 3, one-token steps, a rejected round cropped away, blocks of 2, 6 and 50 rows (catch-up, verify,
    # a prompt); then a 70-row prefill: past the int8 linears' 64-row scratch
    spans = [(0, 3)] + [(j, j + 1) for j in range(3, 40)] + ["crop"] + [(31, 33), (33, 39), (39, 40), (40, 90)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for span in spans:
            if span == "crop":
                eager.crop(31), scripted.crop(31)
                continue
            pos, rows = eager.length, ids[:, span[0]:span[1]]
            decoder.scripted = False
            a = decoder(rows, past_key_values=eager).last_hidden_state
            decoder.scripted = True
            b = decoder(rows, past_key_values=scripted).last_hidden_state
            assert torch.equal(a, b), (span, pos)
            end = pos + rows.shape[1]
            for i in range(len(decoder.layers)):
                assert torch.equal(eager.keys[i][:, :end], scripted.keys[i][:, :end]), (span, i)
                assert torch.equal(eager.values[i][:, :end], scripted.values[i][:, :end]), (span, i)
        long = _ids(70, seed=7)
        decoder.scripted = False
        a = decoder(long, past_key_values=_small_cache(decoder)).last_hidden_state
        decoder.scripted = True
        assert torch.equal(a, decoder(long, past_key_values=_small_cache(decoder)).last_hidden_state), "70 rows"
    finally:
        torch.set_num_threads(before)
        decoder.scripted = True
    assert isinstance(decoder._scripted, fast_step.ScriptedLayers), "the passes above ran scripted"
    assert decoder._scripted.four == (dtype == "int4" and role == "draft")
    assert scripted.capacity > 8 and scripted.length == 90, "the cache was reallocated while stepping"


def test_it_is_built_for_layers_of_one_linear_kind_only(int4, int8):
    from types import SimpleNamespace

    four, eight = list(int4.draft.get_decoder().layers), list(int8.draft.get_decoder().layers)
    assert fast_step.ScriptedLayers.for_layers(four).four and not fast_step.ScriptedLayers.for_layers(eight).four
    assert len(fast_step.ScriptedLayers.for_layers(four).packed4) == 4 * len(four)
    assert fast_step.ScriptedLayers.for_layers([]) is None
    mixed = SimpleNamespace(qkv=four[0].qkv, o=eight[0].o, gate_up=four[0].gate_up, down=four[0].down)
    assert fast_step.ScriptedLayers.for_layers([mixed] + four[1:]) is None
    with pytest.raises(TypeError, match="all 4-bit or all int8"):
        fast_step.ScriptedLayers([mixed] + four[1:])


def test_the_switch_turns_it_off_and_refuses_what_it_does_not_know(int4, monkeypatch):
    layers = list(int4.draft.get_decoder().layers)
    monkeypatch.setenv(fast_step.ENV, "0")
    assert fast_step.ScriptedLayers.for_layers(layers) is None
    monkeypatch.setenv(fast_step.ENV, "yes")
    with pytest.raises(ValueError, match="SPECTUNE_SCRIPTED_STEP must be 0 or 1, got 'yes'"):
        fast_step.ScriptedLayers.for_layers(layers)
    monkeypatch.setenv(fast_step.ENV, "1")
    assert fast_step.ScriptedLayers.for_layers(layers) is not None


def test_an_engine_refuses_a_bad_switch_before_decoding(int4, monkeypatch):
    from workers.cpu_engine import SpecDecoder

    monkeypatch.setenv(fast_step.ENV, "on")
    with pytest.raises(ValueError, match="SPECTUNE_SCRIPTED_STEP must be 0 or 1, got 'on'"):
        SpecDecoder(int4)


def _qwen(heads: int, kv_heads: int, head_dim: int, bits: int) -> fast.Int8CausalLM:
    """A small random Qwen2 (biases on q/k/v, none on o, as the real pair), rebuilt on the fast path."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=256, hidden_size=heads * head_dim, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(3)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return fast.quantize(model, _ids(40, seed=9), bits=bits)


# no GQA (kv heads = heads); and GQA with a q/k/v width of 360, not a multiple of 16 (the 4-bit GEMM's padded rows)
@pytest.mark.parametrize("shape", [(2, 2, 32), (8, 1, 36)], ids=["no-gqa", "gqa-padded"])
@pytest.mark.parametrize("bits", [4, 8])
@torch.inference_mode()
def test_biases_no_gqa_and_padded_widths_are_bit_identical_too(shape, bits):
    model = _qwen(*shape, bits=bits)
    decoder = model.get_decoder()
    layer = decoder.layers[0]
    assert layer.qkv.bias is not None and layer.o.bias is None
    assert (layer.kv_heads == layer.heads) == (shape[0] == shape[1])
    ids = _ids(24, seed=bits)
    out = {}
    for scripted in (False, True):
        decoder.scripted = scripted
        cache = model.new_cache()
        rows = [decoder(ids[:, :10], past_key_values=cache).last_hidden_state[0]]
        rows += [decoder(ids[:, j:j + 1], past_key_values=cache).last_hidden_state[0] for j in range(10, 24)]
        out[scripted] = torch.cat(rows)
    assert isinstance(decoder._scripted, fast_step.ScriptedLayers)
    assert torch.equal(out[False], out[True])


@torch.inference_mode()
def test_a_model_scripted_in_one_thread_decodes_the_same_in_another(int8):
    """A Serve replica loads its pair in one thread and answers in others: the int8 linears' scratch rows are
    per thread."""
    import threading

    decoder = int8.target.get_decoder()
    ids = _ids(30, seed=11)
    expected = decoder(ids, past_key_values=decoder.new_cache()).last_hidden_state
    got = {}

    def run() -> None:
        with torch.inference_mode():
            got["out"] = decoder(ids, past_key_values=decoder.new_cache()).last_hidden_state

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert isinstance(decoder._scripted, fast_step.ScriptedLayers) and torch.equal(got["out"], expected)


@torch.inference_mode()
def test_a_scripted_model_can_still_be_copied_and_pickled(int4):
    import copy
    import pickle

    model = int4.draft
    ids = _ids(12, seed=12)
    first = model.get_decoder()(ids, past_key_values=model.new_cache()).last_hidden_state
    assert isinstance(model.get_decoder()._scripted, fast_step.ScriptedLayers)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert twin.get_decoder()._scripted is None, "scripted again at its first pass"
        again = twin.get_decoder()(ids, past_key_values=twin.new_cache()).last_hidden_state
        assert torch.equal(again, first) and isinstance(twin.get_decoder()._scripted, fast_step.ScriptedLayers)
