"""jobs/serve.py: the policy comes from a sweep's MLflow run, a chosen-policy file or flags; a Serve
config file rebuilds the same app; bad sources are one-line errors before Ray starts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from jobs import serve as serve_job

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> tuple[Path, dict]:
    from jobs import sweep as sweep_job

    root = tmp_path_factory.mktemp("serve-sweep")
    base = ["--benchmark", "gsm8k", "--pair", "tiny-random", "--dtype", "fp32", "--items", "4", "--max-new-tokens", "6",
            "--actors", "1", "--cpus-per-actor", "0.5", "--budgets", "0.05,0.9", "--policies", "kl_judge,top_k",
            "--draft-len", "2,3", "--cost-ratio", "0.4", "--trials", "2", "--runs-root", str(root)]
    assert sweep_job.main(base) == 0
    (meta,) = root.glob("sweeps/*/sweep.json")
    return root, json.loads(meta.read_text())


def test_policy_from_a_sweep_run_id_and_budget(swept):
    root, meta = swept
    run_id = meta["parent_run_id"]
    # The tiny pair gets (almost) every GSM8K item wrong in both arms: no discordant items, so 4
    # confirmation items bound the drop well below 90% but nowhere near 5%.
    settings = serve_job.settings_from({"from_sweep": {"run_id": run_id, "budget": "90%"}, "runs_root": str(root)})
    chosen = json.loads(next(root.glob("sweeps/*/report/chosen-budget-0.9.json")).read_text())
    assert chosen["certified"] is True and settings.source["certified"] is True
    assert (settings.policy, settings.params, settings.draft_len) == (chosen["policy"], chosen["params"], chosen["draft_len"])
    assert (settings.pair, settings.dtype) == ("tiny-random", "fp32")  # the pair the sweep calibrated
    src = settings.source
    assert src["kind"] == "sweep" and src["run_id"] == run_id and src["budget"] == 0.9 and src["trial"] == chosen["trial"]
    # the CLI path, through the sweep's run directory
    args = serve_job.build_parser().parse_args(["--from-sweep", run_id, "--budget", "0.9",
                                                "--run-dir", str(next(root.glob("sweeps/*")))])
    assert serve_job.settings_from(serve_job.args_to_spec(args)).policy == chosen["policy"]
    # or the run directory itself, as jobs.export_rule takes it
    args = serve_job.build_parser().parse_args(["--from-sweep", str(next(root.glob("sweeps/*"))), "--budget", "0.9"])
    by_dir = serve_job.settings_from(serve_job.args_to_spec(args))
    assert by_dir.policy == chosen["policy"] and by_dir.source["run_id"] == run_id
    # what the certificate covers is in the source (/v1/policy); the same pair and dtype given again keep it
    assert src["covers"] == {"benchmark": "gsm8k", "pair": "tiny-random", "dtype": "fp32", "engine": "cpu",
                             "draft_len": chosen["draft_len"], "drafter": "draft_model", "temperature": 0.0,
                             "shots": chosen["decode"]["shots"], "max_new_tokens": 6}
    from workers.models.identity import pair_fingerprint

    assert chosen["pair_fingerprint"] == pair_fingerprint("tiny-random")  # what the certificate ledger keys on
    sweep = {"from_sweep": {"run_id": run_id, "budget": "90%"}, "runs_root": str(root)}
    assert serve_job.settings_from({**sweep, "pair": "tiny-random", "dtype": "fp32"}).source["certified"] is True


@pytest.mark.parametrize("override,change", [
    ({"dtype": "bf16"}, "dtype bf16 (certified: fp32)"),
    ({"pair": "qwen2.5-coder-0.5b+1.5b"}, "pair qwen2.5-coder-0.5b+1.5b (certified: tiny-random)"),
    ({"engine": "vllm", "vllm": {"speculative_method": "eagle3"}}, "drafter eagle3"),
    ({"engine": "vllm"}, "engine vllm (certified: cpu"),
])
def test_an_override_outside_the_certificate_is_refused_unless_allowed(swept, override, change):
    """The certified budget's pair, dtype and drafter are what it covers: another one is refused, naming it,
    before anything starts; allowed, the policy says it is not certified and why."""
    root, meta = swept
    sweep = {"from_sweep": {"run_id": meta["parent_run_id"], "budget": "90%"}, "runs_root": str(root)}
    with pytest.raises(ValueError, match=r"certified for pair tiny-random, dtype fp32.*" + re.escape(change)):
        serve_job.settings_from({**sweep, **override})
    if "engine" in override:
        return  # allowed, it would go on to start a vLLM engine
    settings = serve_job.settings_from({**sweep, **override, "allow_uncertified": True})
    assert settings.source["certified"] is False and settings.source["outside_certificate"] == [change]


def test_an_uncertified_budget_is_refused_unless_allowed(swept, capsys):
    root, meta = swept
    run_id = meta["parent_run_id"]
    chosen = json.loads(next(root.glob("sweeps/*/report/chosen-budget-0.05.json")).read_text())
    cert = chosen["certification"]
    assert chosen["certified"] is False and cert["bound"] > 0.05
    assert {"alpha", "n", "discordance", "confirm_split", "items_needed", "steps"} <= set(cert)
    with pytest.raises(ValueError, match=r"NOT certified: its drop bound .* on n=4 confirmation items.*--allow-uncertified"):
        serve_job.settings_from({"from_sweep": {"run_id": run_id, "budget": 0.05}, "runs_root": str(root)})
    assert serve_job.main(["--from-sweep", run_id, "--budget", "5%", "--runs-root", str(root)]) == 2
    err = capsys.readouterr().err
    assert "NOT certified" in err and "Traceback" not in err
    settings = serve_job.settings_from({"from_sweep": {"run_id": run_id, "budget": 0.05}, "runs_root": str(root),
                                        "allow_uncertified": True})
    assert settings.policy == chosen["policy"] and settings.source["certified"] is False
    # the chosen-policy file says the same, so a file source is refused the same way
    path = next(root.glob("sweeps/*/report/chosen-budget-0.05.json"))
    with pytest.raises(ValueError, match="NOT certified"):
        serve_job.settings_from({"policy_file": str(path)})
    # the MLflow tags carry the certificate
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{next(root.glob('sweeps/*/mlflow.db'))}")
    tags = mlflow.get_run(run_id).data.tags
    assert tags["certified.0.05"] == "false" and tags["certified.0.9"] == "true"
    tag = json.loads(tags["chosen.0.05"])
    assert tag["certified"] is False and tag["n"] == 4 and tag["alpha"] == 0.025  # the first attempt of its family: 0.05 x 2^-1


def test_sweep_source_errors_are_clear(swept, capsys):
    root, meta = swept
    with pytest.raises(ValueError, match="no chosen policy for budget 0.03"):
        serve_job.settings_from({"from_sweep": {"run_id": meta["parent_run_id"], "budget": 0.03}, "runs_root": str(root)})
    with pytest.raises(ValueError, match="no sweep under"):
        serve_job.settings_from({"from_sweep": {"run_id": "0" * 32, "budget": 0.05}, "runs_root": str(root)})
    with pytest.raises(ValueError, match="one source"):
        serve_job.settings_from({"from_sweep": {"run_id": meta["parent_run_id"], "budget": 0.05}, "policy": "top_k",
                                 "runs_root": str(root)})


def test_a_serve_config_cannot_claim_a_certificate():
    """source records where the policy came from; given as a setting it would mark a flags rule certified."""
    with pytest.raises(ValueError, match="source is not a setting"):
        serve_job.settings_from({"policy": "lossless", "source": {"kind": "sweep", "certified": True,
                                                                  "covers": {"temperature": 0.0}}})


def test_a_superseded_policy_file_is_refused_unless_allowed(tmp_path):
    path = tmp_path / "chosen-budget-0.05.json"
    path.write_text(json.dumps({"policy": "kl_judge", "params": {"threshold": 0.3}, "draft_len": 3,
                                "pair": "tiny-random", "dtype": "fp32", "certified": True,
                                "certification": {"certified": True, "bound": 0.04, "n": 40}}))
    assert serve_job.settings_from({"policy_file": str(path)}).source["certified"] is True
    (tmp_path / "SUPERSEDED.md").write_text("# Superseded: its items were used twice\n")
    with pytest.raises(ValueError, match=r"NOT certified: its certificate is superseded \(Superseded: its items"):
        serve_job.settings_from({"policy_file": str(path)})
    source = serve_job.settings_from({"policy_file": str(path), "allow_uncertified": True}).source
    assert source["certified"] is False and source["superseded"].startswith("Superseded: its items were used twice")


def test_policy_file_and_flags(tmp_path):
    path = tmp_path / "chosen.json"
    path.write_text(json.dumps({"policy": "dropmatch", "params": {"k": 4, "p_drop": 0.2}, "draft_len": 4,
                                "pair": "tiny-random", "dtype": "fp32"}))
    s = serve_job.settings_from({"policy_file": str(path)})
    assert (s.policy, s.params, s.draft_len, s.pair, s.source["kind"]) == ("dropmatch", {"k": 4, "p_drop": 0.2}, 4,
                                                                          "tiny-random", "file")
    assert serve_job.settings_from({"policy": "off"}).policy is None
    path.write_text(json.dumps({"policy": "dropmatch", "params": {"p_drop": 2}}))
    with pytest.raises(ValueError, match="p_drop"):
        serve_job.settings_from({"policy_file": str(path)})
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        serve_job.settings_from({"policy_file": str(path)})


@pytest.mark.parametrize("argv,words", [
    (["--policy", "kl_jduge"], "unknown policy"),
    (["--policy", "kl_judge", "--param", "threshold=-2"], "threshold"),
    (["--budget", "0.02"], "--from-sweep"),
    (["--from-sweep", "abc"], "--budget"),
    (["--from-sweep", "abc", "--budget", "7"], "--budget"),
    (["--pair", "nope"], "unknown pair"),
    (["--dtype", "fp8"], "dtype"),
    (["--replicas", "0"], "num_replicas"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--policy-file", "/no/such.json"], "No such file"),
    (["--kv-cache-gb", "2"], "add --engine vllm"),
    (["--engine", "vllm", "--kv-cache-gb", "0"], "--kv-cache-gb must be > 0"),
    (["--max-num-batched-tokens", "512"], "add --engine vllm"),
    (["--engine", "vllm", "--max-num-batched-tokens", "8", "--max-num-seqs", "16"], "must be >= max_num_seqs"),
    (["--engine", "vllm", "--max-num-seqs", "0"], "max_num_seqs must be an integer >= 1"),
    (["--speculative-method", "eagle3"], "add --engine vllm"),
    (["--api-key-env", "SPECTUNE_TEST_UNSET_KEY"], "--api-key-env SPECTUNE_TEST_UNSET_KEY: that environment variable "
                                                   "is not set"),
    (["--api-key-env", "sk-abc.123"], "api_key_env must name an environment variable"),
])
def test_bad_cli_input_is_one_line_before_ray(argv, words, capsys, monkeypatch):
    monkeypatch.delenv("SPECTUNE_TEST_UNSET_KEY", raising=False)
    assert serve_job.main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and err.count("\n") == 1


def test_written_serve_config_is_valid_and_builds_the_app(tmp_path):
    from ray.serve.schema import ServeDeploySchema

    out = tmp_path / "serve.yaml"
    assert serve_job.main(["--pair", "tiny-random", "--dtype", "fp32", "--policy", "top_k", "--param", "k=3",
                           "--draft-len", "3", "--port", "8123", "--write-config", str(out)]) == 0
    config = yaml.safe_load(out.read_text())
    ServeDeploySchema.model_validate(config)
    app = config["applications"][0]
    assert app["import_path"] == "jobs.serve:app_builder" and config["http_options"]["host"] == "127.0.0.1"
    settings = serve_job.settings_from(app["args"])
    assert (settings.policy, settings.params, settings.draft_len) == ("top_k", {"k": 3}, 3)
    assert serve_job.app_builder(app["args"]) is not None


@pytest.mark.parametrize("host,key,warned", [("0.0.0.0", None, True), ("10.1.2.3", None, True),
                                             ("0.0.0.0", "SPECTUNE_KEY", False), ("127.0.0.1", None, False),
                                             ("::1", None, False), ("localhost", None, False)])
def test_binding_beyond_loopback_without_a_key_warns_and_the_key_travels_by_name(tmp_path, capsys, host, key,
                                                                                   warned):
    out = tmp_path / "serve.yaml"
    assert serve_job.main(["--pair", "tiny-random", "--dtype", "fp32", "--host", host, "--write-config", str(out),
                           *(["--api-key-env", key] if key else [])]) == 0
    err = capsys.readouterr().err
    assert ("warning: --host" in err and "--api-key-env" in err and "TLS" in err) is warned, err
    args = yaml.safe_load(out.read_text())["applications"][0]["args"]
    assert args.get("api_key_env") == key  # the variable's name: the key is read where a replica runs
    assert serve_job.settings_from(args).api_key_env == key


def test_a_replica_reads_its_key_from_its_environment_and_never_runs_open(monkeypatch):
    from cluster.openai_api import ApiError, check_api_key

    settings = serve_job.settings_from({"pair": "tiny-random", "dtype": "fp32", "api_key_env": "SPECTUNE_TEST_KEY"})
    monkeypatch.delenv("SPECTUNE_TEST_KEY", raising=False)
    with pytest.raises(ValueError, match="SPECTUNE_TEST_KEY: that environment variable is not set"):
        settings.api_key()
    monkeypatch.setenv("SPECTUNE_TEST_KEY", " ")
    with pytest.raises(ValueError, match="empty"):
        settings.api_key()
    monkeypatch.setenv("SPECTUNE_TEST_KEY", "sk-1")
    assert settings.api_key() == "sk-1"
    assert serve_job.settings_from({"pair": "tiny-random", "dtype": "fp32"}).api_key() is None
    check_api_key(None, None)  # no key asked for: everything passes
    check_api_key("sk-1", "Bearer sk-1")
    for header, code in ((None, None), ("Bearer ", None), ("Basic sk-1", None), ("Bearer sk-2", "invalid_api_key")):
        with pytest.raises(ApiError) as info:
            check_api_key("sk-1", header)
        assert (info.value.status, info.value.code) == (401, code) and "sk-2" not in info.value.message
