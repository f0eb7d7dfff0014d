"""The sweep end to end on the tiny pair with 2 actors on a local Ray: study, MLflow parent and
nested runs, report artifacts, chosen policy per budget; resume without redoing trials."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--benchmark", "gsm8k", "--pair", "tiny-random", "--dtype", "fp32", "--items", "6", "--max-new-tokens", "8",
        "--actors", "2", "--budgets", "0.05,0.2", "--policies", "kl_judge,top_k", "--draft-len", "2,4",
        "--cost-ratio", "0.4", "--min-items-to-prune", "4"]


def sweep(tmp_path: Path, *extra: str) -> dict:
    from jobs import sweep as sweep_job

    run_dir = tmp_path / "sweep"
    rc = sweep_job.main([*BASE, "--runs-root", str(tmp_path), "--run-dir", str(run_dir), *extra])
    assert rc == 0
    return json.loads((run_dir / "sweep.json").read_text())


def trials(run_dir: Path):
    import optuna

    meta = json.loads((run_dir / "sweep.json").read_text())
    study = optuna.load_study(study_name=meta["study"], storage=f"sqlite:///{run_dir / 'optuna.db'}")
    return study.get_trials(deepcopy=False)


def test_sweep_writes_study_runs_report_and_choice_then_resumes(tmp_path):
    meta = sweep(tmp_path, "--trials", "3")
    run_dir = tmp_path / "sweep"
    finished = [t for t in trials(run_dir) if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(finished) == 3
    assert all("accuracy" in t.user_attrs for t in finished)
    report = run_dir / "report"
    for name in ("pareto.png", "budget_table.md", "report.md", "trials.parquet"):
        assert (report / name).is_file() and (report / name).stat().st_size > 0, name
    chosen = json.loads((report / "chosen-budget-0.2.json").read_text())
    assert chosen["pair"] == "tiny-random" and "policy" in chosen
    # every budget says whether it is certified, with its evidence from the confirmation split
    for budget in ("0.05", "0.2"):
        c = json.loads((report / f"chosen-budget-{budget}.json").read_text())
        cert = c["certification"]
        # the sweep's first attempt on this pair: tested at 0.05 x 2^-1
        assert isinstance(c["certified"], bool) and cert["alpha"] == 0.025 and "held-apart items: gsm8k/" in cert["confirm_split"]
        assert sum(cert["confirm_sources"].values()) == 6 and cert["attempt"]
        if cert["steps"]:
            first = cert["steps"][0]
            assert first["passed"] == (first["p_value"] <= 0.025), "certified means the exact test rejects"
            assert first["passed"] == (first["upper"] <= float(budget) + 1e-4), "and its bound agrees"
            assert c["certified"] == any(step["passed"] for step in cert["steps"])
            # judged on every confirmation item, with failures reported by arm
            assert first["n"] == 6 and first["reference_failed"] == 0 and "candidate_missing" in first
            assert c["noise_floor"]["draft_len"] == c["draft_len"] and c["noise_floor"]["items"] == 6
    assert c["split"]["search"].startswith("gsm8k train") and "noise floor" in (report / "certification.md").read_text()
    confirm_dirs = list((run_dir / "confirm").glob("*/records.jsonl"))
    assert confirm_dirs, "candidates were evaluated on the confirmation pool"
    confirm_items = {json.loads(line)["item_id"] for d in confirm_dirs for line in d.read_text().splitlines()}
    trial_items = {json.loads(line)["item_id"] for d in (run_dir / "trials").glob("*/records.jsonl")
                   for line in d.read_text().splitlines()}
    assert trial_items and all(i.startswith("gsm8k/train/") for i in trial_items), "the search never sees test items"
    assert confirm_items and confirm_items.isdisjoint(trial_items), "nor does it see a confirmation item"
    # the pool: every item held apart from the 6-item search sample (test rows and unused train rows)
    whole = json.loads((report / "certification.json").read_text())
    assert whole["pool"]["pool"] == 1319 + 7465 - 6 and whole["pool"]["pool_sources"] == {
        "gsm8k/test": 1319, "gsm8k/train": 7465 - 6} and whole["pool"]["confirm_used"] == 6
    # per-item evidence beside the certificates, recomputing each step's counts
    for budget in ("0.05", "0.2"):
        cert = json.loads((report / f"chosen-budget-{budget}.json").read_text())["certification"]
        for step in cert["steps"]:
            rows = (report / "evidence" / f"{step['candidate']}.csv").read_text().splitlines()[1:]
            lost = sum(float(r.split(",")[1]) > float(r.split(",")[2]) for r in rows)
            assert (len(rows), lost) == (step["n"], step["losses"])
    timing = [json.loads(line) for line in (run_dir / "timing.jsonl").read_text().splitlines()]
    assert [t["trial"] for t in timing] == sorted(t.number for t in finished)
    for t in timing:  # where each trial's time went
        assert t["actors"] == 2 and 0 < t["generation_s"] and t["dispatch_overhead_s"] >= 0 <= t["bookkeeping_s"]
        assert t["items_per_s"] == pytest.approx(t["items"] / t["trial_wall_s"])
        assert t["tokens"] > 0 and t["tokens_per_s"] == pytest.approx(t["tokens"] / t["trial_wall_s"])
        assert t["load_1m"] >= 0 and t["cpus"] >= 1

    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["spectune-sweeps"], output_format="list")
    parent = [r for r in runs if r.info.run_id == meta["parent_run_id"]][0]
    nested = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(nested) == 3
    assert all("search.speedup_vs_ar_modelled" in r.data.metrics for r in nested)
    confirmed = [r for r in nested if r.data.tags.get("confirmed") == "true"]
    assert confirmed and all("confirm.accuracy_drop_upper" in r.data.metrics for r in confirmed)
    assert any(k.startswith("chosen.") for k in parent.data.tags)
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(parent.info.run_id)}
    assert {"report", "chosen", "config.yaml"} <= artifacts
    # the effective config (flags and files merged, as resolved): --config it again and it is the same study
    from jobs.sweep_args import parse_args
    from sweep.settings import parse_settings, study_name

    again = parse_args(["--config", str(run_dir / "config.yaml")])
    assert (again.trials, again.run_dir, again.policies) == (3, str(run_dir), "kl_judge,top_k")
    assert study_name(parse_settings(again)) == meta["study"]
    evidence = [a.path for a in mlflow.MlflowClient().list_artifacts(parent.info.run_id, "report/evidence")]
    assert evidence and all(p.endswith(".csv") for p in evidence), "per-item evidence is in MLflow too"
    assert parent.data.params["split.pool"] == str(1319 + 7465 - 6)

    first_steps = {b: json.loads((report / f"chosen-budget-{b}.json").read_text())["certification"]["steps"]
                   for b in ("0.05", "0.2")}
    # Rerun with a larger target: the 3 finished trials are kept, 2 more are run, same parent run.
    numbers_before = {t.number for t in finished}
    meta2 = sweep(tmp_path, "--trials", "5")
    assert meta2["parent_run_id"] == meta["parent_run_id"]
    # the tiny pair is calibrated afresh at each start: the resumed study keeps the calibration its trials were
    # scored with
    assert meta["profile"]["cost_ratio"] > 0 and meta2["profile"] == meta["profile"]
    # timed at the context the search items decode at: their median prompt plus half of --max-new-tokens (8)
    from workers.benchmarks import get_benchmark
    from workers.evaluation import DecodeSpec, prompt_lengths
    from workers.models.calibrate import workload_context
    from workers.models.tiny import tiny_tokenizer

    bench = get_benchmark("gsm8k")
    lengths = prompt_lengths(tiny_tokenizer(), bench, bench.items(limit=6, seed=0, split="search"),
                             DecodeSpec(max_new_tokens=8))
    assert meta["profile"]["context"] == workload_context(lengths, 8) > 0
    after = [t for t in trials(run_dir) if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(after) == 5 and numbers_before <= {t.number for t in after}
    nested = [r for r in mlflow.search_runs(experiment_names=["spectune-sweeps"], output_format="list")
              if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(nested) == 5, "finished trials are not redone or re-logged"
    assert "\ntrials: 5\n" in (run_dir / "config.yaml").read_text(), "the rerun's options"
    assert "\ntrials: 3\n" in (run_dir / "config.prev.yaml").read_text(), "and the ones before"
    # the rerun's confirmation is a new attempt wherever the candidates changed: refused on the same items
    for budget in ("0.05", "0.2"):
        c = json.loads((report / f"chosen-budget-{budget}.json").read_text())
        reason = c["certification"]["reason"]
        assert reason.startswith("refused: ") or c["certification"]["steps"] == first_steps[budget], reason
    import os

    ledger = Path(os.environ["SPECTUNE_LEDGER"]) / "ledger.db"  # with the asset cache, not the runs root
    assert ledger.is_file() and not list(tmp_path.rglob("attempts")) and not list(tmp_path.rglob("ledger.db"))
    from workers.models.identity import pair_fingerprint
    from workers.results.ledger import AttemptLedger

    rows = AttemptLedger("gsm8k", pair_fingerprint("tiny-random"), ledger.parent).rows()
    assert rows[0]["event"] == "opened" and len(rows[0]["items"]) == 6


def test_interrupted_trial_is_redone_with_its_params(tmp_path):
    # the search alone (--search-only): the redo is the study's, and no confirmation is needed to see it
    sweep(tmp_path, "--trials", "1", "--search-only")
    run_dir = tmp_path / "sweep"
    import optuna

    meta = json.loads((run_dir / "sweep.json").read_text())
    study = optuna.load_study(study_name=meta["study"], storage=f"sqlite:///{run_dir / 'optuna.db'}")
    # a trial a killed driver left RUNNING; its params are pinned so the family and its knobs agree
    study.enqueue_trial({"family": "top_k", "top_k.k": 13, "draft_len": 2})
    stale = study.ask({"family": optuna.distributions.CategoricalDistribution(["kl_judge", "top_k"]),
                       "top_k.k": optuna.distributions.IntDistribution(2, 64, log=True),
                       "draft_len": optuna.distributions.IntDistribution(2, 4)})
    assert stale.number == 1 and stale.params == {"family": "top_k", "top_k.k": 13, "draft_len": 2}
    sweep(tmp_path, "--trials", "2", "--search-only")
    states = {t.number: t for t in trials(run_dir)}
    seen = {n: (t.state.name, t.params, t.user_attrs.get("resumed_from")) for n, t in states.items()}
    assert states[1].state.name == "FAIL", seen
    redo = [t for t in states.values() if t.user_attrs.get("resumed_from") == 1]
    assert len(redo) == 1 and redo[0].state.name in ("COMPLETE", "PRUNED"), seen
    assert redo[0].params == stale.params, seen


def test_bad_arguments_are_clear_errors(tmp_path, capsys):
    from jobs import sweep as sweep_job

    for bad, msg in ((["--policies", "kl_jduge"], "unknown policy"), (["--budgets", "2"], "--budgets"),
                     (["--draft-len", "5,2"], "--draft-len"), (["--benchmark", "nope"], "unknown benchmark"),
                     (["--pair", "nope"], "unknown pair"), (["--alpha", "0.7"], "--alpha"),
                     (["--confirm-items", "-1"], "--confirm-items"), (["--confirm-candidates", "0"], "--confirm"),
                     (["--looks", "0"], "--looks"),
                     (["--engine", "vllm", "--draft-len", "3", "--max-num-seqs", "0"], "max_num_seqs"),
                     (["--engine", "vllm", "--draft-len", "3", "--kv-cache-gb", "0"], "--kv-cache-gb"),
                     (["--engine", "vllm", "--draft-len", "3", "--vllm-python", "/nonexistent/python"],
                      "not an executable"),
                     (["--top-p", "0.9"], "--temperature 0"), (["--temperature", "0.7", "--top-p", "0"], "--top-p"),
                     (["--temperature", "0.7", "--top-k", "-2"], "--top-k"),
                     (["--engine", "vllm", "--draft-len", "3", "--temperature", "0.7", "--top-k", "20"],
                      "--engine vllm cannot sample"),
                     (["--sampler", "coupled"], "--temperature 0"),
                     (["--sampler", "gumbel", "--temperature", "0.7"], "--sampler must be one of standard, coupled"),
                     (["--engine", "vllm", "--draft-len", "3", "--temperature", "0.7", "--sampler", "coupled"],
                      "--engine vllm draws its own tokens")):
        assert sweep_job.main([*BASE, "--runs-root", str(tmp_path), *bad]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err


def test_subset_seed_takes_file_order_or_a_seed():
    """'file' = the first N items in the benchmark's order (the items jobs.bench.quality uses, so the
    cached references are shared); an integer = a seeded order; anything else names the flag."""
    from jobs.sweep import build_parser

    parser = build_parser()
    assert parser.parse_args(["--subset-seed", "file"]).subset_seed is None
    assert parser.parse_args(["--subset-seed", "7"]).subset_seed == 7
    with pytest.raises(SystemExit):
        parser.parse_args(["--subset-seed", "bogus"])


def test_a_resumed_study_does_not_replay_its_first_suggestions():
    """Same seed, fresh process: without an offset the sampler's RNG restarts and the first random
    suggestions repeat trials the study already holds."""
    import optuna

    from sweep.settings import make_sampler

    def first_suggestions(existing: int, n: int = 3) -> list[float]:
        study = optuna.create_study(sampler=make_sampler(0, existing, 10))
        return [study.ask().suggest_float("x", 0.0, 1.0) for _ in range(n)]

    assert first_suggestions(0) == first_suggestions(0), "seeded: reproducible"
    assert not set(first_suggestions(0)) & set(first_suggestions(2)), "resumed: new suggestions"


def test_enqueue_names_the_study_parameters_and_validates():
    """--enqueue warm-starts a study with known settings (e.g. the Table 6 winners); knobs not given
    take the rule's defaults, so the trial is exactly make_policy(name, **given)."""
    from sweep.settings import enqueued_params

    got = enqueued_params("kl_judge:threshold=0.5", ["dropmatch", "kl_judge"], (3, 8))
    assert got == {"family": "kl_judge", "kl_judge.threshold": 0.5, "kl_judge.confidence": 0.9, "draft_len": 3}
    assert enqueued_params("top_k:k=4,draft_len=5", ["top_k"], (5, 5)) == {"top_k.k": 4}
    for bad, msg in (("kl_judge:thresh=1", "unknown parameter"), ("typical", "not among the searched"),
                     ("top_k:k=4,draft_len=9", "draft_len")):
        with pytest.raises(ValueError, match=msg):
            enqueued_params(bad, ["kl_judge", "top_k"], (3, 8))


def test_the_vllm_actors_python_is_found_and_checked(tmp_path, monkeypatch):
    """vLLM pins its own transformers, so on CPU it lives in .vllm-venv and the sweep's actors run there
    (Ray's py_executable); a Python without vllm, or with another Ray, is refused by name."""
    import sys

    from workers.engines import VLLM_PYTHON_ENV, vllm_python

    monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)
    with pytest.raises(ValueError, match="does not import ray and vllm"):
        vllm_python(sys.executable)  # the main environment has no vllm
    local = Path(__file__).resolve().parents[2] / ".vllm-venv" / "bin" / "python"
    if local.is_file():  # `make test` builds it first
        assert vllm_python() == str(local)
        monkeypatch.setenv(VLLM_PYTHON_ENV, sys.executable)
        with pytest.raises(ValueError, match=sys.executable):
            vllm_python()
    else:
        with pytest.raises(ValueError, match="make vllm-env"):
            vllm_python()
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\nexit 3\n")
    script.chmod(0o755)
    with pytest.raises(ValueError, match="does not import"):
        vllm_python(str(script))


def test_joint_is_part_of_the_study_identity():
    from jobs import sweep as sweep_job
    from sweep.settings import parse_settings, study_name

    names = []
    for extra in ([], ["--joint"], ["--looks", "3"], ["--search-only"], ["--skip-noise-floor"]):
        args = sweep_job.build_parser().parse_args([*BASE, *extra])
        names.append(study_name(parse_settings(args)))
    assert len({names[0], names[1], names[2]}) == 3, "--joint and --looks change what is certified"
    assert names[3] == names[4] == names[0], "stopping after the search or skipping the noise floor does not"


def test_search_only_then_a_group_sequential_confirmation(tmp_path):
    """--search-only confirms nothing; the same command without it resumes the study and confirms with
    two looks: the certificate records the design and its evidence holds the items up to the stop."""
    extra = ("--trials", "1", "--looks", "2", "--confirm-items", "8", "--policies", "kl_judge")
    meta = sweep(tmp_path, *extra, "--search-only")
    report = tmp_path / "sweep" / "report"
    assert (report / "report.md").is_file() and not list(report.glob("chosen-budget-*.json"))
    assert sweep(tmp_path, *extra)["parent_run_id"] == meta["parent_run_id"]
    assert len([t for t in trials(tmp_path / "sweep") if t.state.name in ("COMPLETE", "PRUNED")]) == 1
    # the resumed process ran no trial: its frontier still has lossless at L 0 and every L, from the stores
    frontier = json.loads((report / "frontier.json").read_text())
    assert [r["draft_len"] for r in frontier["lossless"]] == [0, 2, 3, 4] and frontier["lossless"][0]["items"] == 6
    assert frontier["best_lossless"]["draft_len"] is not None and frontier["ceiling"]
    for budget in ("0.05", "0.2"):
        cert = json.loads((report / f"chosen-budget-{budget}.json").read_text())["certification"]
        seq = cert["sequential"]
        # the first attempt of its family: its looks spend 0.05 x 2^-1
        assert seq["sizes"] == [4, 8] and len(seq["alphas"]) == 2 and seq["spent"][-1] == 0.025
        assert cert["family"]["number"] == 1 and cert["family"]["level"] == 0.025
        if cert["steps"]:
            step = cert["steps"][0]
            assert step["looks"] == 2 and step["n"] == seq["sizes"][step["look"] - 1]
            rows = (report / cert["evidence"]).read_text().strip().splitlines()[1:]
            assert len(rows) == (seq["stopped_at"] or 8)


def test_a_config_file_sets_the_flags_and_the_command_line_wins(tmp_path):
    from jobs.sweep_args import parse_args
    from sweep.settings import parse_settings, study_name

    args = parse_args(["--config", str(ROOT / "examples" / "sweep.yaml"), "--trials", "5", "--pair", "tiny-random"])
    assert (args.trials, args.budgets, args.looks, args.confirm_items) == (5, "0.02,0.05,0.1", 4, 2000)
    assert args.enqueue == ["kl_judge:threshold=0.5,confidence=0.9"] and args.pair == "tiny-random"
    s = parse_settings(args)
    assert (s.ranges["kl_judge"]["threshold"].low, s.ranges["kl_judge"]["threshold"].log) == (0.02, True)
    assert s.ranges["dropmatch"]["criterion"].choices == ("js",)
    plain = parse_args(["--config", str(ROOT / "examples" / "sweep.yaml"), "--pair", "tiny-random"])
    plain.search_space = None
    assert study_name(s) != study_name(parse_settings(plain)), "the ranges are part of the identity"


def test_search_ranges_from_the_config_are_what_optuna_samples():
    import optuna

    from sweep.space import search_ranges, suggest

    ranges = search_ranges(["kl_judge"], {"kl_judge": {"threshold": [0.2, 0.3], "confidence": [0.6, 0.61]}})
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        _, params, _ = suggest(study.ask(), ["kl_judge"], (5, 5), ranges)
        assert 0.2 <= params["threshold"] <= 0.3 and 0.6 <= params["confidence"] <= 0.61


@pytest.mark.parametrize(("text", "message"), [
    ("colour: blue\n", "Option 'colour' is not accepted"),
    ("trials: many\n", 'Parser key "trials"'),
    ("joint: 3\n", 'Parser key "joint"'),
    ("search_space:\n  top_k:\n    k: [1, 9]\n", "'top_k' is not among the searched --policies"),
    ("search_space:\n  kl_judge:\n    threshold: [1.0, 0.1]\n", "search_space: kl_judge.threshold: need numbers low < high"),
    ("search:\n  kl_judge:\n    confidence: [0.5, 1.5]\n", "1.5 is not a value kl_judge accepts"),  # search: = search_space:
    ("search_space:\n  kl_judge:\n    nope: [1, 2]\n", "not a searched knob"),
    ("search_space:\n  kl_judge: [0.1, 0.5]\n", 'Parser key "search_space"'),
    ("- a list\n", "Unexpected config"),
])
def test_a_bad_config_is_one_line_naming_the_key(tmp_path, capsys, text, message):
    from jobs import sweep as sweep_job

    cfg = tmp_path / "sweep.yaml"
    cfg.write_text(text)
    assert sweep_job.main([*BASE, "--policies", "kl_judge", "--runs-root", str(tmp_path), "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err and "Traceback" not in err, err


def test_a_sweep_over_a_task_file_on_a_jsonl_searches_confirms_and_writes_flips(tmp_path):
    """A user's own data: a JSONL and a task file written here, the tiny pair, search and confirmation;
    each trial and each confirmed candidate writes flips.parquet, logged to MLflow beside the target-only
    records it was paired with, and the report's flips.md shows the flipped items."""
    import mlflow
    import polars as pl

    rows = [{"qid": f"q{i:02d}", "question": f"What is {i} plus {i % 7}?", "answer": str(i + i % 7)} for i in range(40)]
    (tmp_path / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = tmp_path / "arith.yaml"
    task.write_text("name: arith\ndata: items.jsonl\nid: qid\nprompt: \"Q: {question}\\nA:\"\nreference: answer\n"
                    "scorer: numeric\nmax_new_tokens: 8\n")
    from jobs import sweep as sweep_job

    run_dir = tmp_path / "sweep"
    rc = sweep_job.main(["--benchmark", str(task), "--pair", "tiny-random", "--dtype", "fp32", "--items", "6",
                         "--actors", "2", "--budgets", "0.2", "--policies", "kl_judge,top_k", "--draft-len", "2,3",
                         "--cost-ratio", "0.4", "--trials", "2", "--confirm-items", "6",
                         "--runs-root", str(tmp_path), "--run-dir", str(run_dir)])
    assert rc == 0
    trial_flips = sorted((run_dir / "trials").glob("*/flips.parquet"))
    confirm_flips = sorted((run_dir / "confirm").glob("*/flips.parquet"))
    assert len(trial_flips) == 2 and confirm_flips, "every trial and every confirmed candidate"
    for path in trial_flips + confirm_flips:
        frame = pl.read_parquet(path)
        assert frame.height == 6 and all(i.startswith("arith/q") for i in frame["item_id"])
        assert set(frame["flip"]) <= {"lost", "won", "same"}
        assert (frame["diverged"] == (frame["divergence"] >= 0)).all()
    search_ids = set(pl.read_parquet(trial_flips[0])["item_id"])
    assert search_ids.isdisjoint(pl.read_parquet(confirm_flips[0])["item_id"]), "the two splits stay apart"
    report = run_dir / "report"
    assert "[flips.md](flips.md)" in (report / "report.md").read_text()
    page = (report / "flips.md").read_text()
    assert page.count("## trial ") == 2 and "## confirmation: " in page and "n = 6:" in page
    meta = json.loads((run_dir / "sweep.json").read_text())
    mlflow.set_tracking_uri(f"sqlite:///{run_dir / 'mlflow.db'}")
    client = mlflow.MlflowClient()
    children = client.search_runs([client.get_run(meta["parent_run_id"]).info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{meta['parent_run_id']}'")
    logged = {r.info.run_name: {f.path for f in client.list_artifacts(r.info.run_id)} |
              {f.path for f in client.list_artifacts(r.info.run_id, "reference")} |
              {f.path for d in ("confirm", "confirm/reference") for f in client.list_artifacts(r.info.run_id, d)}
              for r in children}
    assert len(logged) == 2 and all({"flips.parquet", "records.parquet", "reference/records.parquet"} <= a
                                    for a in logged.values())
    assert any("confirm/flips.parquet" in a and "confirm/reference/records.parquet" in a for a in logged.values())


def test_on_the_int8_path_a_replayed_sweep_certifies_on_the_evidence_full_decoding_gives(tmp_path, monkeypatch):
    """Replay inside confirmation (int8, where it is exact by construction) against --replay off on the same
    study: the same candidates, the same per-item outcomes, and the evidence says how each record was made; the
    timed full decodes agree with the replayed records they time."""
    extra = ("--dtype", "int8", "--trials", "2", "--confirm-items", "8", "--policies", "kl_judge",
             "--enqueue", "kl_judge:threshold=3,confidence=1,draft_len=3", "--speed-items", "2")
    evidence, checked = {}, 0
    for mode in ("auto", "off"):
        monkeypatch.setenv("SPECTUNE_LEDGER", str(tmp_path / f"ledger-{mode}"))
        sweep(tmp_path / mode, *extra, "--replay", mode)
        report = tmp_path / mode / "sweep" / "report"
        evidence[mode] = {p.name: p.read_text().strip().splitlines() for p in sorted((report / "evidence").glob("*.csv"))}
        for budget in ("0.05", "0.2"):
            chosen = json.loads((report / f"chosen-budget-{budget}.json").read_text())
            check = chosen.get("replay_check")
            if check:
                assert check["identical"] and check["items"] > 0, check
                assert (check["replayed"] > 0) is (mode == "auto"), check
                # beyond the 2 timed items, every other replayed record of the candidate is decoded in full (at 8
                # items, fewer than the audit's minimum); decoded in full, nothing needs it
                assert (check["extra_items"] > 0) is (mode == "auto"), check
                assert len(set(check["candidate_items"])) == len(check["candidate_items"]) > 2 or mode == "off", check
                checked += 1
    assert checked, "a chosen candidate was timed, and its timing checked its records"
    assert evidence["auto"] and evidence["auto"].keys() == evidence["off"].keys()
    for name, rows in evidence["auto"].items():
        header = rows[0].split(",")
        made = header.index("candidate_made")

        def outcome(line: str, made=made) -> list[str]:
            return line.split(",")[:made]  # item, scores, statuses, divergence

        assert [outcome(r) for r in rows[1:]] == [outcome(r) for r in evidence["off"][name][1:]], name
        assert any(",replayed: " in r for r in rows[1:]), "confirmation replayed on the int8 path"
        assert all(",decoded in full," in r for r in evidence["off"][name][1:] if ",ok," in r)


def test_usage_truncated_sampling_sweep_runs_as_written(tmp_path, monkeypatch):
    """docs/usage.md's --top-k/--top-p command, run as written (the runs root in a scratch folder): the study is
    another than the untruncated one's and the chosen rule's file records the truncation beside the temperature."""
    import shlex

    from jobs import sweep as sweep_job

    page = (Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text()
    line = next(ln for ln in page.splitlines() if ln.startswith(".venv/bin/python jobs/sweep.py") and "--top-p" in ln)
    argv = shlex.split(line)
    assert argv[:2] == [".venv/bin/python", "jobs/sweep.py"]
    monkeypatch.setenv("SPECTUNE_RUNS", str(tmp_path))
    assert sweep_job.main(argv[2:]) == 0
    chosen = json.loads(next(tmp_path.glob("**/report/chosen-budget-0.2.json")).read_text())
    assert chosen["decode"] == {"temperature": 0.7, "seed": 0, "shots": 0, "max_new_tokens": 8, "top_k": 20,
                                "top_p": 0.9}
    from jobs.sweep_args import parse_args
    from sweep.settings import parse_settings, study_name

    plain = list(argv[2:])
    cut = plain.index("--top-k")
    del plain[cut:cut + 4]
    assert study_name(parse_settings(parse_args(argv[2:]))) == chosen["sweep"]
    assert study_name(parse_settings(parse_args(plain))) != chosen["sweep"]


def test_usage_coupled_sampling_sweep_runs_as_written(tmp_path, monkeypatch):
    """docs/usage.md's --sampler coupled sweep, as written: every arm coupled (the chosen file says so), lossless at
    every L replayed from one pass with nothing decoded, the certificate's timed arms sampled with the standard
    sampler and the coupled records audited against full coupled decodes."""
    import shlex

    from jobs import sweep as sweep_job
    from workers.results.store import RecordStore

    page = (Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text()
    line = next(ln for ln in page.splitlines() if ln.startswith(".venv/bin/python jobs/sweep.py") and "--sampler" in ln)
    argv = shlex.split(line)
    monkeypatch.setenv("SPECTUNE_RUNS", str(tmp_path))
    assert sweep_job.main(argv[2:]) == 0
    chosen = json.loads(next(tmp_path.glob("**/report/chosen-budget-0.2.json")).read_text())
    assert chosen["decode"]["sampler"] == "coupled" and chosen["decode"]["top_k"] == 20
    from workers.results.scope import covers

    assert covers(chosen)["sampler"] == "coupled"
    from policies import make_policy, traits

    declared = traits(make_policy(chosen["policy"], **chosen["params"])).decides_on_distributions
    assert covers(chosen)["transfers_to_standard"] is declared
    vl = chosen["vs_lossless"]
    assert vl["modelled_sampler"] == "coupled" and vl["timed_sampler"] == "standard" and vl["timed"]["items"] == 3
    assert chosen["replay_check"]["status"] == "identical", chosen["replay_check"]
    lossless = sorted(d.name.split("-")[1] for d in tmp_path.glob("references/*/gsm8k/lossless-L*") if d.is_dir())
    assert lossless == ["L1", "L2", "L3"], lossless
    records = [r for d in tmp_path.glob("references/*/gsm8k/lossless-L*") for r in RecordStore(d).load().values()]
    assert len(records) >= 18 and {r.replay for r in records} == {"exact"}, {r.replay for r in records}
