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
