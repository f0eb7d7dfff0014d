"""The vLLM engine on vLLM-CPU with the tiny pair (head_dim 64: vLLM's CPU attention rejects 16).

Runs only in .vllm-venv (tests/conftest.py); `make test` runs it there. One vLLM engine (separate
engine-core process, as in production) serves the module; every rule's calls are traced by the
plugin so the tests can replay them through ``policies`` on the very tensors vLLM handed over. The
fault-injection tests (missing inputs, engine deaths) have their own engine: tests/workers/vllm/test_faults.py;
the start-up checks and TP = 2 start theirs: tests/workers/vllm/test_engine_start.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from policies import get_spec, make_policy, verify
from policies.core import VerifyBatch
from tests.workers.vllm.pair import PROMPTS, SETTINGS, L, clear, randomness, replay, traces
from workers.models.tiny import tiny_random_pair
from workers.vllm.engine import VLLMDecoder
from workers.vllm.rules import RULE_FILE_ENV
from workers.vllm.settings import VLLMSettings, engine_counters

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def engine(tiny_dirs, trace_dir):
    eng = VLLMDecoder(tiny_dirs, VLLMSettings(**SETTINGS))
    yield eng
    eng.close()


def test_startup_check_saw_the_rule(engine):
    assert engine.rule_file.exists() and os.environ[RULE_FILE_ENV] == str(engine.rule_file)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_lossless_equals_cpu_engine_and_target_only(engine, cpu_engine, prompt):
    n = 48
    vllm_spec = engine.generate(prompt, "lossless", draft_len=L, max_new_tokens=n)
    cpu_spec = cpu_engine.generate(prompt, "lossless", draft_len=L, max_new_tokens=n)
    cpu_ar = cpu_engine.autoregressive(prompt, max_new_tokens=n)
    vllm_ar = engine.autoregressive(prompt, max_new_tokens=n)
    assert vllm_spec.token_ids == cpu_ar.token_ids, "vLLM + lossless rule = target-only greedy (CPU engine)"
    assert cpu_spec.token_ids == cpu_ar.token_ids
    assert vllm_ar.token_ids == cpu_ar.token_ids, "vLLM target-only = CPU target-only"
    assert vllm_spec.finish_reason == cpu_ar.finish_reason
    st = vllm_spec.stats
    assert st.num_drafts > 0 and st.num_draft_tokens == L * st.num_drafts
    assert sum(st.accepted_per_position) == st.num_accepted_tokens
    assert st.num_generated == len(vllm_spec.token_ids)
    # Same rule, same logits: the same acceptances as the CPU engine, round for round, up to the
    # last round (the CPU engine drafts fewer tokens when the budget is nearly spent).
    assert abs(st.num_accepted_tokens - cpu_spec.stats.num_accepted_tokens) <= L


RULES = ["kl_judge", "top_k", "typical", "target_entropy", "draft_entropy", "relaxed_topk", "dropmatch", "fly"]


@pytest.mark.parametrize("name", RULES)
def test_each_rule_inside_vllm_decides_as_policies(engine, trace_dir, name):
    clear(trace_dir)
    policy = make_policy(name, **get_spec(name).example)
    prompt = PROMPTS[0]
    gen = engine.generate(prompt, policy, draft_len=L, max_new_tokens=40)
    calls = traces(trace_dir)
    assert calls, "the plugin traced no verify step: vLLM did not call spectune's rule"
    emitted: list[int] = []
    for call in calls:
        assert call["spec"]["policy"] == name
        # 1) the plugin's flat path, replayed on the recorded tensors, gives what vLLM received
        assert torch.equal(replay(policy, call).output_token_ids, call["output_token_ids"])
        # 2) the per-request reference (policies.verify on a [1, L] batch) decides the same
        n = int(call["num_draft_tokens"][0])
        row = [t for t in call["output_token_ids"][0].tolist() if t != -1]
        if n == 0:  # a step where the request drafted nothing (its budget was nearly spent)
            assert row == [int(call["bonus_token_ids"][0])]
            emitted += row
            continue
        batch = VerifyBatch(
            draft_token_ids=call["draft_token_ids"][:n].long().unsqueeze(0),
            draft_logits=None if call["draft_logits"] is None else call["draft_logits"][:n].unsqueeze(0),
            target_logits=torch.cat([call["target_logits"][:n], call["target_logits"][n - 1:n]]).unsqueeze(0),
            target_hidden=None if call["target_hidden"] is None else
            torch.cat([call["target_hidden"][:n], call["target_hidden"][n - 1:n]]).unsqueeze(0),
            lm_head_weight=call["lm_head_weight"], lm_head_bias=call["lm_head_bias"], temperature=0.0,
            **{k: v.rows(0, 1) if k == "streams" else v for k, v in randomness(call).items()})
        ref = verify(policy, batch)
        k = int(ref.num_accepted[0])
        assert row[:k] == batch.draft_token_ids[0, :k].tolist()
        assert len(row) == k + 1, f"{name}: vLLM-side acceptance {len(row) - 1} != policies {k}"
        if k < n:
            assert row[k] == int(ref.output_token_ids[0, k]), "recovered token = policies' emission"
        else:
            assert row[k] == int(call["bonus_token_ids"][0]), "all accepted: vLLM's bonus token"
        emitted += row
    # 3) vLLM emitted exactly what the rule returned (the prefill step is a call with no drafts)
    assert gen.token_ids == emitted[:len(gen.token_ids)]
    assert gen.stats.num_accepted_tokens == sum(
        len([t for t in c["output_token_ids"][0].tolist() if t != -1]) - 1 for c in calls)


def test_a_lenient_rule_accepts_more_than_lossless(engine):
    lenient = make_policy("kl_judge", threshold=8.0)
    got = {name: sum(engine.generate(p, pol, draft_len=L, max_new_tokens=40).stats.num_accepted_tokens
                     for p in PROMPTS) for name, pol in (("lossless", "lossless"), ("kl_judge", lenient))}
    assert got["kl_judge"] > got["lossless"], got


def test_the_rule_switches_back(engine, cpu_engine):
    engine.generate(PROMPTS[1], make_policy("top_k", k=8), draft_len=L, max_new_tokens=30)
    again = engine.generate(PROMPTS[1], "lossless", draft_len=L, max_new_tokens=30)
    assert again.token_ids == cpu_engine.autoregressive(PROMPTS[1], max_new_tokens=30).token_ids


def test_stop_strings_like_the_cpu_engine(engine, cpu_engine):
    ref = cpu_engine.autoregressive(PROMPTS[0], max_new_tokens=40)
    # a printable ASCII byte a few tokens in (the tiny tokenizer is byte-level; random bytes are often
    # not valid UTF-8 and the two detokenizers may render those differently)
    i = next(i for i, t in enumerate(ref.token_ids) if 33 <= t <= 126)  # its first occurrence
    stop = chr(ref.token_ids[i])
    got = engine.generate(PROMPTS[0], "lossless", draft_len=L, max_new_tokens=40, stop=[stop])
    want = cpu_engine.generate(PROMPTS[0], "lossless", draft_len=L, max_new_tokens=40, stop=[stop])
    assert got.finish_reason == want.finish_reason == "stop"
    assert stop not in got.text and stop not in want.text
    assert got.token_ids == want.token_ids == ref.token_ids[:i + 1], "up to the token that completes the stop"


def test_refusals_name_the_problem(engine):
    with pytest.raises(ValueError, match="started with draft length 4"):
        engine.generate(PROMPTS[0], "lossless", draft_len=5)
    with pytest.raises(ValueError, match="trace=True"):
        engine.generate(PROMPTS[0], "lossless", draft_len=L, trace=True)
    with pytest.raises(ValueError, match="unknown policy"):
        engine.generate(PROMPTS[0], "nope", draft_len=L)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([10_000], "lossless", draft_len=L)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        VLLMSettings(tensor_parallel_size=0)


def test_the_sweep_item_path_runs_on_vllm(engine):
    """What a PairWorker does per item, on the vLLM engine: chat prompt, stop strings, scoring, stats."""
    from workers.benchmarks import get_benchmark
    from workers.evaluation import TARGET_ONLY, DecodeSpec, evaluate_item

    bench = get_benchmark("gsm8k")
    item = bench.items(limit=1)[0]
    settings = dict(temperature=0.0, seed=0, max_new_tokens=24, shots=0)
    ref = evaluate_item(engine, bench, item, DecodeSpec.make(TARGET_ONLY, **settings))
    rec = evaluate_item(engine, bench, item, DecodeSpec.make("lossless", {}, L, **settings),
                        reference_outputs=ref.outputs)
    assert rec.error is None and ref.error is None, (rec.error, ref.error)
    assert rec.outputs == ref.outputs, "greedy lossless = target-only on the benchmark path too"
    assert rec.num_drafts > 0 and rec.num_draft_tokens == L * rec.num_drafts
    assert ref.num_drafts == ref.target_forwards == ref.tokens


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_lossless_inside_vllm_keeps_the_target_distribution(engine, temperature):
    """T > 0 on vLLM-CPU, whose own T > 0 rejection path is broken (docs/assets.md): the plugin's rule reads
    raw logits and applies the temperature itself. The second generated token goes through the rule
    (drafted, verified, accepted or recovered); its empirical distribution over 2,000 seeds must match
    the target's exact marginal as closely as 2,000 exact draws do."""
    from vllm import SamplingParams

    pair, prompt, n = tiny_random_pair(torch.float32, head_dim=64), PROMPTS[0], 2000
    vocab = pair.target.config.vocab_size
    with torch.no_grad():
        p1 = torch.softmax(pair.target(torch.tensor([prompt])).logits[0, -1].double() / temperature, -1)
        nxt = pair.target(torch.tensor([prompt + [x] for x in range(vocab)])).logits[:, -1].double()
        p2 = p1 @ torch.softmax(nxt / temperature, -1)
    engine._set_rule(make_policy("lossless"))
    params = [SamplingParams(temperature=temperature, max_tokens=4, seed=s, ignore_eos=True) for s in range(n)]
    outs = engine.llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    second = torch.bincount(torch.tensor([o.outputs[0].token_ids[1] for o in outs]), minlength=vocab).double()
    g = torch.Generator().manual_seed(0)
    floor = [_tv(torch.bincount(torch.multinomial(p2.float(), n, replacement=True, generator=g),
                                minlength=vocab).double(), p2) for _ in range(20)]
    mean = sum(floor) / len(floor)
    assert _tv(second, p2) <= 1.4 * mean, (_tv(second, p2), mean)


def test_native_mode_hands_verification_back_to_vllm(engine, cpu_engine):
    """policy "vllm-native": vLLM's own rejection sampler decides (the A/B baseline of jobs.bench.vllm_engine);
    greedy lossless is the same either way, and the plugin reports which one ran."""
    from workers.vllm.rules import NATIVE, seen_rules

    want = cpu_engine.autoregressive(PROMPTS[2], max_new_tokens=30).token_ids
    assert engine.generate(PROMPTS[2], NATIVE, draft_len=L, max_new_tokens=30).token_ids == want
    assert any(r["policy"] == NATIVE for r in seen_rules(engine.rule_file))
    assert engine.generate(PROMPTS[2], "lossless", draft_len=L, max_new_tokens=30).token_ids == want


def test_bench_vllm_prints_the_side_by_side_table(tiny_dirs, tmp_path, capsys):
    from jobs.bench import vllm_engine as bench_vllm

    code = bench_vllm.main(["--pair", tiny_dirs, "--dtype", "fp32", "--items", "1", "--max-new-tokens", "8",
                            "--rounds", "1", "--draft-len", str(L), "--gpu-memory-utilization", "0.1",
                            "--target-only-memory-utilization", "0.1",
                            "--max-model-len", "512", "--enforce-eager", "--runs-root", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    for row in ("| target-only |", "| lossless (vLLM's rule) |", "| lossless (spectune's, in vLLM) |", "| dropmatch",
                "| kl_judge"):
        assert row in out
    assert list((tmp_path / "bench").glob("vllm-*.md"))
    assert bench_vllm.main(["--rounds", "0"]) == 2
    assert "--rounds must be >= 1" in capsys.readouterr().err


def test_bench_batch_tabulates_cpu_b1_vllm_b1_and_batched(tiny_dirs, tmp_path, capsys):
    """jobs.bench.batch: the CPU engine (a child process) and vLLM at batch 1 and batched, per rule; every
    item decoded and scored in each mode, and the raw rows written."""
    import json

    from jobs.bench import batch as bench_batch

    code = bench_batch.main(["--pair", tiny_dirs, "--dtype", "fp32", "--items", "3", "--b1-items", "1", "--shots", "0",
                             "--max-new-tokens", "8", "--draft-len", str(L), "--kv-cache-gb", "0.125",
                             "--max-model-len", "512", "--enforce-eager", "--runs-root", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| ")]
    summary = {c[0]: c for c in cells if len(c) == 7 and c[0] != "config"}
    assert list(summary) == ["target-only", "lossless (vLLM's rule)", "lossless (spectune's)",
                             'dropmatch {"criterion": "js", "k": 5, "p_drop": 0.3}', 'kl_judge {"threshold": 0.5}']
    for label, row in summary.items():
        assert float(row[2]) > 0 and float(row[3]) > 0, row  # vLLM batch 1 and batched
        assert (row[1] == "—") == (label == "lossless (vLLM's rule)"), row  # the CPU engine has no vLLM rule
    detail = [c for c in cells if len(c) == 12 and c[0] != "engine"]
    assert len(detail) == 4 + 5 + 5
    assert all(c[3] == ("3 (0)" if c[1] == "batched 3" else "1 (0)") and int(c[4]) > 0 for c in detail), detail
    (raw,) = (tmp_path / "bench").glob("batch-*.json")
    assert len(json.loads(raw.read_text())["rows"]) == 14


# -- both cores on CPU -----------------------------------------------------------------------------------

def test_the_engine_binds_vllm_threads_to_this_process_cpus(engine):
    """VLLM_CPU_OMP_THREADS_BIND from the CPUs this process may use (vLLM's default reserves one core
    for its scheduler); a user's value is kept (unit-tested in tests/workers/vllm/test_cpu_binding.py)."""
    from workers.vllm.settings import CPU_BIND_ENV, cpu_thread_binding

    assert engine.cpu_binding == os.environ[CPU_BIND_ENV]
    (worker,) = engine.worker_env()
    assert worker["VLLM_CPU_OMP_THREADS_BIND"] == engine.cpu_binding, "the worker process inherited it"
    if engine.cpu_binding == cpu_thread_binding():  # not a value the user set
        n = len(os.sched_getaffinity(0))
        assert worker["OMP_NUM_THREADS"] == str(n) and worker["torch_threads"] == n, worker
    # vLLM-CPU steps may take minutes: the step timeout (vLLM's 300 s) is raised unless the user set it
    from workers.vllm.settings import CPU_STEP_TIMEOUT_S, STEP_TIMEOUT_ENV

    assert worker[STEP_TIMEOUT_ENV] == engine._setup.step_timeout == os.environ[STEP_TIMEOUT_ENV]
    assert int(worker[STEP_TIMEOUT_ENV]) >= CPU_STEP_TIMEOUT_S or "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS" in os.environ



# -- batched evaluation -------------------------------------------------------------------------------

def test_a_batch_decodes_like_single_requests_with_per_request_stats(engine, cpu_engine):
    n = 40
    before = engine_counters(engine.llm)
    batch = engine.generate_batch(PROMPTS, "lossless", draft_len=L, max_new_tokens=n)
    after = engine_counters(engine.llm)
    singles = [engine.generate(p, "lossless", draft_len=L, max_new_tokens=n) for p in PROMPTS]
    refs = engine.autoregressive_batch(PROMPTS, max_new_tokens=n)
    for prompt, got, single, ref in zip(PROMPTS, batch, singles, refs, strict=True):
        want = cpu_engine.autoregressive(prompt, max_new_tokens=n).token_ids
        assert got.token_ids == single.token_ids == ref.token_ids == want, "batched = per item = target-only"
        st = got.stats
        assert st.num_drafts > 0 and sum(st.accepted_per_position) == st.num_accepted_tokens
        assert st.num_generated == len(got.token_ids) and st.wall_time_s > 0 and st.decode_time_s >= 0
        assert (st.num_drafts, st.num_accepted_tokens) == (single.stats.num_drafts, single.stats.num_accepted_tokens)
    for field in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert sum(getattr(g.stats, field) for g in batch) == after[field] - before[field], field
    per_pos = [a - b for a, b in zip(after["per_pos"], before["per_pos"] or [0] * L, strict=False)]
    assert [sum(g.stats.accepted_per_position[i] for g in batch) for i in range(L)] == per_pos[:L]


def test_the_target_only_engine_never_asks_for_the_rule(engine):
    """The reference (target-only) engine has no drafts to judge: its steps neither read the rule file nor
    share it (no per-step broadcast under TP); the speculative engine's steps do."""
    from workers.vllm.engine import REFERENCE, SPECULATIVE

    engine.autoregressive_batch(PROMPTS, max_new_tokens=12)
    engine.generate(PROMPTS[0], "lossless", draft_len=L, max_new_tokens=12)
    (ref,) = engine.worker_env(REFERENCE)
    (spec,) = engine.worker_env(SPECULATIVE)
    assert ref["rule_lookups"] == 0 and ref["rule_file_reads"] == 0, ref
    assert spec["rule_lookups"] > 0 and spec["rule_file_reads"] > 0, spec
    with pytest.raises(ValueError, match="which must be"):
        engine.worker_env("draft")
    # the memory report a GPU run records per engine (docs/gpu.md): on a CPU build no device peak to hold
    report = engine.memory_report()
    assert set(report["engines"]) == {SPECULATIVE, REFERENCE} and report["device_total_bytes"] is None
    for entry in report["engines"].values():
        assert entry["worker_max_reserved_bytes"] == [None] and 0 < entry["gpu_memory_utilization"] <= 1
        assert "within_plan" not in entry


def test_a_bad_request_fails_alone_in_a_batch(engine):
    out = engine.generate_batch([PROMPTS[0], [10_000], [7] * 600], "lossless", draft_len=L, max_new_tokens=8)
    assert out[0].token_ids and "outside the vocabulary" in str(out[1]) and "max_model_len" in str(out[2])


def test_evaluate_items_batches_the_shard_with_the_same_records(engine):
    from workers.benchmarks import get_benchmark
    from workers.evaluation import TARGET_ONLY, DecodeSpec, evaluate_item

    bench = get_benchmark("gsm8k")
    items = bench.items(limit=3)
    settings = dict(temperature=0.0, seed=0, max_new_tokens=16, shots=0)
    refs = engine.evaluate_items(bench, items, DecodeSpec.make(TARGET_ONLY, **settings))
    outs = {r.item_id: r.outputs for r in refs}
    spec = DecodeSpec.make("lossless", {}, L, **settings)
    batched = engine.evaluate_items(bench, items, spec, outs)
    single = [evaluate_item(engine, bench, item, spec, outs[item.id]) for item in items]
    for b, s, r in zip(batched, single, refs, strict=True):
        assert b.error is None and b.item_id == s.item_id
        assert b.outputs == s.outputs == r.outputs and b.score == s.score
        assert (b.num_drafts, b.num_accepted_tokens, b.accepted_per_position) == \
            (s.num_drafts, s.num_accepted_tokens, s.accepted_per_position)
        assert b.lossless_fallback_steps == 0 and r.num_drafts == r.tokens
    bad = engine.evaluate_items(bench, items[:2], DecodeSpec.make("lossless", {}, L + 1, **settings))
    assert all("started with draft length" in (r.error or "") for r in bad)


def test_near_max_model_len_a_rule_that_needs_q_survives(engine):
    """vLLM stops drafting (and drops cached draft probabilities) as a request nears max_model_len."""
    prompt = [(7 * i) % 300 + 3 for i in range(SETTINGS["max_model_len"] - 12)]
    (gen,) = engine.generate_batch([prompt], make_policy("kl_judge", threshold=0.5), draft_len=L, max_new_tokens=32)
    assert gen.finish_reason == "length" and 0 < len(gen.token_ids) <= 12


# -- per-request rules -------------------------------------------------------------------------------

def test_each_request_carries_its_own_rule(engine, cpu_engine, trace_dir):
    """Rules travel in SamplingParams.extra_args; one step decides each group of requests by its rule."""
    clear(trace_dir)
    n = 32
    rules = ["lossless", make_policy("top_k", k=8), {"policy": "kl_judge", "params": {"threshold": 0.0}, "seed": 3}]
    gens = engine.generate_batch(PROMPTS, rules, draft_len=L, max_new_tokens=n)
    for i in (0, 2):  # relaxations off: target-only greedy
        assert gens[i].token_ids == cpu_engine.autoregressive(PROMPTS[i], max_new_tokens=n).token_ids
    alone = engine.generate(PROMPTS[1], make_policy("top_k", k=8), draft_len=L, max_new_tokens=n)
    assert gens[1].token_ids == alone.token_ids, "a request's own rule decides as that rule would alone"
    assert gens[1].stats.num_accepted_tokens == alone.stats.num_accepted_tokens
    assert gens[1].stats.num_accepted_tokens > gens[0].stats.num_accepted_tokens
    decided = {c["spec"]["policy"] for c in traces(trace_dir) if c["req_ids"]}
    assert {"lossless", "top_k", "kl_judge"} <= decided
    with pytest.raises(ValueError, match="threshold"):
        engine.generate_batch(PROMPTS[:1], [{"policy": "kl_judge", "params": {"threshold": -1}}], draft_len=L)
    with pytest.raises(ValueError, match="per-request rule"):
        engine.generate_batch(PROMPTS[:1], ["vllm-native"], draft_len=L)


def test_keyed_draws_make_a_random_rule_reproducible_in_any_batch(engine):
    """DropMatch draws dropout masks; keyed by (rule seed, request seed, position), a request decides
    the same alone, again, and next to other requests."""
    rule = {"policy": "dropmatch", "params": {"criterion": "naive", "p_drop": 0.5, "k": 2}, "seed": 11}
    (alone,) = engine.generate_batch([PROMPTS[0]], [rule], draft_len=L, max_new_tokens=32)
    (again,) = engine.generate_batch([PROMPTS[0]], [rule], draft_len=L, max_new_tokens=32)
    mixed = engine.generate_batch([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [rule, "lossless", rule], draft_len=L,
                                  max_new_tokens=32)
    for got in (again, mixed[0]):
        assert got.token_ids == alone.token_ids
        assert got.stats.accepted_per_position == alone.stats.accepted_per_position


def test_one_engine_at_a_time_switches_and_decodes_the_same(tiny_dirs, engine, cpu_engine):
    """vLLM-CPU's default: the reference engine starts only after the speculative one stopped, and back;
    outputs are those of the engine that keeps both up."""
    assert VLLMSettings().one_engine_at_a_time is None and engine.exclusive is False
    eng = VLLMDecoder(tiny_dirs, VLLMSettings(**{**SETTINGS, "one_engine_at_a_time": None}))
    try:
        assert eng.exclusive is True  # auto on vLLM-CPU
        prompt = PROMPTS[0]
        ar = eng.autoregressive(prompt, max_new_tokens=12)
        assert eng._llm is None and eng._reference is not None and eng.engine_switches == 1
        spec = eng.generate(prompt, "lossless", draft_len=L, max_new_tokens=12)
        assert eng._reference is None and eng._llm is not None and eng.engine_switches == 2
        assert spec.token_ids == ar.token_ids == cpu_engine.autoregressive(prompt, max_new_tokens=12).token_ids
        assert spec.stats.num_drafts > 0
    finally:
        eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate(PROMPTS[0], "lossless", draft_len=L, max_new_tokens=4)
