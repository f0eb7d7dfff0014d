"""jobs/export_rule.py: a sweep's chosen rule as a rule file and the exact ``vllm serve`` command; and the
plugin's reading of a per-request rule sent as a JSON string in ``vllm_xargs`` (what a stock ``vllm serve``
can carry). Main environment, no vLLM (tests/workers/vllm/test_vllm_serve_cli.py serves it for real)."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest

from jobs import export_rule

RULE = {"policy": "kl_judge", "params": {"threshold": 0.3}}


def chosen(pair: str, certified: bool | None = True, **extra) -> dict:
    out = {**RULE, "draft_len": 3, "pair": pair, "dtype": "fp32", "budget": 0.05, **extra}
    if certified is not None:
        out["certified"] = certified
        out["certification"] = {"certified": certified, "bound": 0.04 if certified else 0.2, "n": 40,
                                "reason": "test", "items_needed": None if certified else 400}
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    from workers.models.tiny import save_tiny_pair

    return save_tiny_pair(tmp_path_factory.mktemp("tiny"), head_dim=16, draft_vocab=288)  # a narrower draft


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = export_rule.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_chosen_file_gives_the_rule_file_and_the_exact_command(tmp_path, pair, capsys):
    from workers.vllm.rules import RULE_FILE_ENV, rule_digest

    draft, target = pair
    path = tmp_path / "chosen.json"
    path.write_text(json.dumps(chosen(f"{draft}+{target}", decode={"seed": 7})))
    rc, out, err = run(capsys, "--chosen", str(path), "--out", str(tmp_path / "r" / "rule.json"), "--json", "--port",
                       "8123", "--cpu", "--kv-cache-gb", "1", "--max-model-len", "256", "--enforce-eager")
    assert rc == 0, err
    res = json.loads(out)
    rule = {**RULE, "seed": 7}
    assert json.loads((tmp_path / "r" / "rule.json").read_text()) == rule == res["rule"]
    assert res["digest"] == rule_digest(rule)
    assert res["env"][RULE_FILE_ENV] == str((tmp_path / "r" / "rule.json").resolve())
    assert res["env"]["VLLM_USE_V2_MODEL_RUNNER"] == "0" and res["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" in res["env"] and res["env"]["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "3600"
    argv = res["argv"]
    assert argv[:3] == ["vllm", "serve", str(target.resolve())]
    opt = {argv[i]: argv[i + 1] for i in range(3, len(argv) - 1) if argv[i].startswith("--")}
    assert opt["--dtype"] == "float32" and opt["--port"] == "8123" and opt["--max-model-len"] == "256"
    assert opt["--generation-config"] == "vllm", "not the model's generation_config.json (top_p 0.8, top_k 20)"
    assert "--enforce-eager" in argv
    assert json.loads(opt["--speculative-config"]) == {
        "method": "draft_model", "model": str(draft.resolve()), "num_speculative_tokens": 3,
        "draft_tensor_parallel_size": 1, "draft_sample_method": "probabilistic"}
    assert json.loads(opt["--hf-overrides"]) == {"spectune_draft_width": 288}  # the draft is padded in vLLM
    # the printed command is the environment + argv, shell-quoted
    words = shlex.split(res["command"])
    assert words[:len(res["env"])] == [f"{k}={v}" for k, v in res["env"].items()]
    assert words[len(res["env"]):] == argv
    # the curl request carries the rule as a JSON string the plugin reads back
    from workers.vllm.rules import parse_rule_arg

    body = json.loads(shlex.split(res["curl"])[-1])
    assert isinstance(body["vllm_xargs"]["spectune_rule"], str)
    assert parse_rule_arg(body["vllm_xargs"]["spectune_rule"]) == rule
    # the human form prints the same command
    rc, text, _ = run(capsys, "--chosen", str(path), "--out", str(tmp_path / "r" / "rule.json"), "--port", "8123",
                      "--cpu", "--kv-cache-gb", "1", "--max-model-len", "256", "--enforce-eager")
    assert rc == 0 and res["command"] in text.splitlines() and res["curl"] in text.splitlines()


def test_an_eagle3_head_is_checked_and_named_in_the_command(tmp_path, pair, capsys):
    """--speculative-method eagle3: the pair's draft directory is an EAGLE-3 head, checked against the target
    (workers.models.eagle.check_head_dir) and named in vLLM's speculative config, no padding override."""
    from workers.models.eagle import save_tiny_eagle3_head

    _, target = pair
    head = save_tiny_eagle3_head(tmp_path / "head", target, draft_ids=list(range(200)))
    path = tmp_path / "chosen.json"
    path.write_text(json.dumps(chosen(f"{head}+{target}")))
    rc, _, err = run(capsys, "--chosen", str(path), "--out", str(tmp_path / "rule.json"), "--speculative-method",
                     "eagle3")  # a certificate made with the draft model says nothing of a head's drafts
    assert rc == 2 and "drafter eagle3" in err and "--allow-uncertified" in err and not (tmp_path / "rule.json").exists()
    rc, out, err = run(capsys, "--chosen", str(path), "--out", str(tmp_path / "rule.json"), "--json",
                       "--speculative-method", "eagle3", "--allow-uncertified")
    assert rc == 0, err
    assert json.loads(out)["source"]["certified"] is False
    argv = json.loads(out)["argv"]
    opt = {argv[i]: argv[i + 1] for i in range(3, len(argv) - 1) if argv[i].startswith("--")}
    assert json.loads(opt["--speculative-config"])["method"] == "eagle3" and "--hf-overrides" not in opt
    assert json.loads(opt["--speculative-config"])["model"] == str(head.resolve())
    rc, _, err = run(capsys, "--chosen", str(path), "--out", str(tmp_path / "rule.json"))  # a head is no draft model
    assert rc == 2 and "Traceback" not in err


def test_from_sweep_by_budget_and_the_budgets_present(tmp_path, pair, capsys):
    draft, target = pair
    run_dir = tmp_path / "sweep"
    (run_dir / "report").mkdir(parents=True)
    (run_dir / "report" / "chosen-budget-0.02.json").write_text(json.dumps(chosen(f"{draft}+{target}")))
    (run_dir / "report" / "chosen-budget-0.1.json").write_text(json.dumps(chosen(f"{draft}+{target}")))
    rc, out, err = run(capsys, "--from-sweep", str(run_dir), "--budget", "2%", "--json")
    assert rc == 0, err
    assert json.loads(out)["rule_file"] == str(run_dir.resolve() / "export" / "rule-0.02.json")
    assert (run_dir / "export" / "rule-0.02.json").is_file()
    rc, _, err = run(capsys, "--from-sweep", str(run_dir), "--budget", "0.05")
    assert rc == 2 and "no chosen rule for budget 0.05" in err and "budgets present: 0.02, 0.1" in err
    # by the sweep's parent run id, under --runs-root
    root = tmp_path / "runs"
    (root / "sweeps").mkdir(parents=True)
    (root / "sweeps" / "s1").symlink_to(run_dir, target_is_directory=True)
    (run_dir / "sweep.json").write_text(json.dumps({"parent_run_id": "abc123"}))
    rc, out, err = run(capsys, "--from-sweep", "abc123", "--budget", "0.1", "--runs-root", str(root), "--json")
    assert rc == 0, err
    rc, _, err = run(capsys, "--from-sweep", "nope", "--budget", "0.1", "--runs-root", str(root))
    assert rc == 2 and "neither a directory nor the parent run id" in err
    rc, _, err = run(capsys, "--from-sweep", str(run_dir))
    assert rc == 2 and "needs --budget" in err


def test_uncertified_choices_are_refused_unless_allowed(tmp_path, pair, capsys):
    draft, target = pair
    for name, certified, why in (("no.json", False, "NOT certified"), ("old.json", None, "says nothing about certif")):
        path = tmp_path / name
        path.write_text(json.dumps(chosen(f"{draft}+{target}", certified=certified)))
        rc, _, err = run(capsys, "--chosen", str(path), "--out", str(tmp_path / "rule.json"))
        assert rc == 2 and why in err and "--allow-uncertified" in err
        assert not (tmp_path / "rule.json").exists()
        rc, out, err = run(capsys, "--chosen", str(path), "--out", str(tmp_path / "rule.json"), "--allow-uncertified")
        assert rc == 0 and "NOT certified" in out, err
        (tmp_path / "rule.json").unlink()


def test_a_superseded_certificate_is_not_exported_as_one(tmp_path, pair, capsys):
    """A SUPERSEDED.md beside a chosen file (a results folder) or above its report/ withdraws its certificate."""
    draft, target = pair
    for folder in (tmp_path / "results", tmp_path / "run" / "report"):
        folder.mkdir(parents=True)
        path = folder / "chosen-budget-0.05.json"
        path.write_text(json.dumps(chosen(f"{draft}+{target}")))
        rc, out, err = run(capsys, "--chosen", str(path), "--out", str(tmp_path / "rule.json"), "--json")
        assert rc == 0 and json.loads(out)["source"]["certified"] is True, err
        (tmp_path / "rule.json").unlink()
        note = (folder if folder.name != "report" else folder.parent) / "SUPERSEDED.md"
        note.write_text("# Superseded: a second attempt on used items\n\nwhy, at length\n")
        rc, _, err = run(capsys, "--chosen", str(path), "--out", str(tmp_path / "rule.json"))
        assert rc == 2 and "superseded (Superseded: a second attempt on used items; see " in err, err
        assert "--allow-uncertified" in err and err.count("\n") == 1 and not (tmp_path / "rule.json").exists()
        rc, out, err = run(capsys, "--chosen", str(path), "--out", str(tmp_path / "rule.json"), "--json",
                           "--allow-uncertified")
        assert rc == 0 and json.loads(out)["source"]["certified"] is False, err
        (tmp_path / "rule.json").unlink()


def test_an_override_outside_the_certificate_is_refused_unless_allowed(tmp_path, pair, capsys):
    """A certificate covers its pair, dtype, draft length and drafter: overriding one of them is refused
    (naming it), or with --allow-uncertified exported as not certified, the change named; the same pair
    spelled another way is the same pair."""
    draft, target = pair
    path = tmp_path / "chosen.json"
    path.write_text(json.dumps(chosen(f"{draft}+{target}", benchmark="gsm8k", decode={"temperature": 0.0})))
    other, link = tmp_path / "other", tmp_path / "link"
    shutil.copytree(target, other)  # another directory: other weights as far as anyone can tell from here
    link.symlink_to(target, target_is_directory=True)  # the same directory
    for flags, change in ((["--dtype", "bf16"], "dtype bf16 (certified: fp32)"),
                          (["--draft-len", "4"], "draft length 4 (certified: 3)"),
                          (["--pair", f"{draft}+{other}"], "pair ")):
        rc, _, err = run(capsys, "--chosen", str(path), "--out", str(tmp_path / "rule.json"), *flags)
        assert rc == 2 and change in err and "--allow-uncertified" in err and err.count("\n") == 1, (flags, err)
        assert not (tmp_path / "rule.json").exists()
        rc, out, err = run(capsys, "--chosen", str(path), "--out", str(tmp_path / "rule.json"), "--json",
                           "--allow-uncertified", *flags)
        assert rc == 0, err
        source = json.loads(out)["source"]
        assert source["certified"] is False and any(change in c for c in source["outside_certificate"])
        rc, text, _ = run(capsys, "--chosen", str(path), "--out", str(tmp_path / "rule.json"), "--allow-uncertified",
                          *flags)
        assert "NOT certified" in text and "outside its certificate: " in text
        (tmp_path / "rule.json").unlink()
    # the certified settings, however spelled, stay certified and say what the certificate covers
    for flags in ([], ["--dtype", "fp32", "--draft-len", "3"], ["--pair", f"{draft}/+{link}"]):
        rc, out, err = run(capsys, "--chosen", str(path), "--out", str(tmp_path / "rule.json"), "--json", *flags)
        assert rc == 0, (flags, err)
        source = json.loads(out)["source"]
        assert source["certified"] is True and "outside_certificate" not in source
        assert source["covers"] == {"benchmark": "gsm8k", "pair": f"{draft}+{target}", "dtype": "fp32",
                                    "draft_len": 3, "drafter": "draft_model", "temperature": 0.0}
    rc, text, _ = run(capsys, "--chosen", str(path), "--out", str(tmp_path / "rule.json"))
    assert "# its certificate covers: benchmark gsm8k" in text and "temperature 0.0" in text
    # where the choice records the pair's fingerprint (sweeps do), a copy of the same weights is the same pair
    from workers.models.identity import pair_fingerprint

    path.write_text(json.dumps(chosen(f"{draft}+{target}", pair_fingerprint=pair_fingerprint(f"{draft}+{target}"))))
    rc, out, err = run(capsys, "--chosen", str(path), "--out", str(tmp_path / "rule.json"), "--json", "--pair",
                       f"{draft}+{other}")
    assert rc == 0 and json.loads(out)["source"]["certified"] is True, err
    weights = next(p for p in other.iterdir() if p.suffix == ".safetensors")
    data = bytearray(weights.read_bytes())
    data[-4:] = b"\x11\x22\x33\x44"  # other weights
    weights.write_bytes(bytes(data))
    rc, _, err = run(capsys, "--chosen", str(path), "--out", str(tmp_path / "rule.json"), "--pair", f"{draft}+{other}")
    assert rc == 2 and f"pair {draft}+{other}" in err, err
    # a certificate made on the CPU engine does not cover vLLM's decoding; one made on vLLM does
    for engine, rc_wanted in (("cpu", 2), ("vllm", 0)):
        path.write_text(json.dumps(chosen(f"{draft}+{target}", engine=engine)))
        rc, _, err = run(capsys, "--chosen", str(path), "--out", str(tmp_path / f"{engine}.json"))
        assert rc == rc_wanted and ("engine vllm (certified: cpu" in err) == (engine == "cpu"), err


def test_unservable_choices_are_one_line_errors(tmp_path, pair, capsys):
    draft, target = pair
    cases = [(chosen("tiny-random"), "built in memory"),
             (chosen(f"{draft}+{target}", params={"no_such_param": 1}), "does not build"),
             (chosen(f"{draft}+{target}", draft_len=None), "no draft length"),
             (chosen(f"{draft}+{target}", dtype="int4"), "no vLLM equivalent"),
             (chosen(f"{target}+{draft}"), "only 288")]  # draft wider than target
    for i, (choice, why) in enumerate(cases):
        path = tmp_path / f"c{i}.json"
        path.write_text(json.dumps(choice))
        rc, _, err = run(capsys, "--chosen", str(path), "--out", str(tmp_path / f"r{i}.json"))
        assert rc == 2 and why in err and err.count("\n") == 1, (why, err)
    (tmp_path / "bad.json").write_text("{")
    rc, _, err = run(capsys, "--chosen", str(tmp_path / "bad.json"))
    assert rc == 2 and "not valid JSON" in err


# -- the plugin's side: a rule as a JSON string in extra_args --------------------------------------------------


def test_a_rule_string_is_read_like_the_rule_dict():
    from workers.vllm.rules import REQUEST_RULES, parse_rule_arg
    from workers.vllm.step import _InvalidRule

    as_dict = {**RULE, "seed": 1}
    text = json.dumps(as_dict)
    assert parse_rule_arg(text) == parse_rule_arg(as_dict) == as_dict
    assert parse_rule_arg('{"policy": "lossless"}') == {"policy": "lossless", "params": {}, "seed": 0}
    a, b = REQUEST_RULES.get(text), REQUEST_RULES.get(as_dict)
    assert a.digest == b.digest and a.spec == b.spec and a.policy.name == "kl_judge"
    for bad in ("not json", '"kl_judge"', '{"params": {}}', '{"policy": "vllm-native"}',
                '{"policy": "kl_judge", "params": {"no_such_param": 1}}', '{"policy": "kl_judge", "params": [1]}',
                '{"policy": "kl_judge", "seed": "x"}', "", 3):
        got = REQUEST_RULES.get(bad)
        assert isinstance(got.policy, _InvalidRule) and got.digest == "invalid", bad
    with pytest.raises(ValueError, match="not JSON"):
        parse_rule_arg("not json")


def test_the_plugin_reads_a_request_rule_string_once_per_step():
    from types import SimpleNamespace

    from workers.vllm.plugin import STEP, _read_request_rules
    from workers.vllm.rules import rule_digest
    from workers.vllm.step import _InvalidRule

    def state(rule):
        return SimpleNamespace(sampling_params=SimpleNamespace(seed=None, extra_args=None if rule is None else
                                                               {"spectune_rule": rule}), num_computed_tokens=3)

    text = json.dumps({**RULE, "seed": 1})
    runner = SimpleNamespace(requests={"a": state(text), "b": state("{oops"), "c": state(None),
                                       "d": state({**RULE, "seed": 1})})
    _read_request_rules(runner, ["a", "b", "c", "d"])
    try:
        a, b, c, d = STEP.rules
        assert a.digest == d.digest == rule_digest({**RULE, "seed": 1}) and a.spec["seed"] == 1
        assert isinstance(b.policy, _InvalidRule) and c is None  # c: the rule file's rule
    finally:
        STEP.rules = STEP.request_seeds = STEP.positions = None


def test_a_hand_written_rule_file_gets_the_same_command_and_says_no_certificate_covers_it(tmp_path, pair, capsys):
    """--rule FILE: a rule alone (no sweep, no certificate), with the pair and draft length it runs at; the server
    reads that very file. A hand-written chosen file is told apart from a sweep's old one."""
    draft, target = pair
    rule_file = tmp_path / "mine.json"
    rule_file.write_text(json.dumps({**RULE, "seed": 3}))
    rc, out, err = run(capsys, "--rule", str(rule_file), "--pair", f"{draft}+{target}", "--draft-len", "4", "--json",
                       "--dtype", "fp32")
    assert rc == 0, err
    res = json.loads(out)
    assert res["rule_file"] == str(rule_file.resolve()) and res["rule"] == {**RULE, "seed": 3}
    assert res["source"]["hand_written"] is True and res["source"]["certified"] is None
    assert json.loads(res["speculative_config"] and res["argv"][res["argv"].index("--speculative-config") + 1])[
        "num_speculative_tokens"] == 4
    launch = shlex.split(res["launch"])
    assert launch[:3] == ["python", "-m", "jobs.vllm_serve"] and launch[launch.index("--rule") + 1] == res["rule_file"]
    rc, text, _ = run(capsys, "--rule", str(rule_file), "--pair", f"{draft}+{target}", "--draft-len", "4", "--dtype", "fp32")
    assert rc == 0 and "a hand-written rule: no certificate covers it" in text and res["command"] in text.splitlines()
    assert "sweep from before" not in text
    rc, _, err = run(capsys, "--rule", str(rule_file), "--pair", f"{draft}+{target}")
    assert rc == 2 and "--draft-len" in err
    (tmp_path / "chosen.json").write_text(json.dumps({**RULE, "draft_len": 4, "pair": f"{draft}+{target}"}))
    rc, _, err = run(capsys, "--chosen", str(tmp_path / "chosen.json"))
    assert rc == 2 and "a hand-written choice" in err and "--rule FILE" in err and "sweep from before" not in err
    rc, _, err = run(capsys, "--rule", str(tmp_path / "chosen.json"), "--pair", f"{draft}+{target}", "--draft-len", "4")
    assert rc == 2 and "a sweep's choice is no rule file" in err
