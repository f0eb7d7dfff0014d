"""The sweep's options through jsonargparse: a ``--config`` file sets any flag, flags after it override
it, a ``search_space:`` block narrows the rules' knob ranges (checked against each rule's bounds), bad
keys and values are one line naming the key, and the effective config dumps and parses back the same."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from jobs.sweep_args import effective_config, parse_args
from sweep.settings import parse_settings

BASE = ["--pair", "tiny-random", "--dtype", "fp32", "--policies", "kl_judge,top_k"]


def config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return str(path)


def test_config_keys_override_the_defaults(tmp_path):
    cfg = config(tmp_path, "trials: 7\nconfirm-items: 30\nmax_new_tokens: 64\nbudgets: [0.02, 0.1]\ndraft-len: 4\n"
                           "joint: true\nsubset-seed: file\nenqueue: kl_judge:threshold=0.5\n")
    args = parse_args(["--config", cfg])
    assert isinstance(args, argparse.Namespace) and args.items == 200, "untouched flags keep their defaults"
    assert (args.trials, args.confirm_items, args.max_new_tokens) == (7, 30, 64), "dashes or underscores"
    assert (args.budgets, args.draft_len) == ("0.02,0.1", "4"), "a YAML list or a number: the flag's text"
    assert args.joint is True and args.subset_seed is None
    assert args.enqueue == ["kl_judge:threshold=0.5"], "one rule or a list"


def test_flags_after_the_config_override_it_and_before_it_do_not(tmp_path):
    cfg = config(tmp_path, "trials: 7\nitems: 12\nenqueue: [kl_judge:threshold=0.5]\n")
    after = parse_args(["--config", cfg, "--trials", "3", "--enqueue", "top_k:k=4"])
    assert (after.trials, after.items) == (3, 12)
    assert after.enqueue == ["kl_judge:threshold=0.5", "top_k:k=4"], "--enqueue adds to the file's rules"
    before = parse_args(["--trials", "3", "--config", cfg])
    assert before.trials == 7, "jsonargparse applies --config where it stands"
    assert parse_args(["--config", cfg, "--joint", "--search-only", "false"]).joint is True


@pytest.mark.parametrize(("text", "message"), [
    ("colour: blue\n", "Option 'colour' is not accepted"),
    ("trials: many\n", 'Parser key "trials": Expected a <class \'int\'>. Got value: many'),
    ("alpha: [0.05]\n", 'Parser key "alpha"'),
    ("joint: 3\n", 'Parser key "joint"'),
    ("subset-seed: soon\n", "Parser key \"subset_seed\": expected an integer seed or 'file', got 'soon'"),
    ("budgets: {low: 0.1}\n", 'Parser key "budgets": expected a comma-separated list'),
    ("enqueue: [3]\n", 'Parser key "enqueue"'),
    ("objective: fastest\n", 'Parser key "objective": \'fastest\' not among choices'),
    ("search_space: [kl_judge]\n", 'Parser key "search_space"'),
])
def test_a_bad_key_or_value_is_one_line_naming_it(tmp_path, text, message):
    with pytest.raises(ValueError) as err:
        parse_args(["--config", config(tmp_path, text)])
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_bad_flag_is_a_value_error_too():
    for argv, message in ((["--trials", "x"], '"trials"'), (["--subset-seed", "x"], "--subset-seed"),
                          (["--server-config", "{fly: 4}"], "--server-config: not valid JSON"),
                          (["--extra-body", "[1]"], "--extra-body: expected a JSON object"),
                          (["--colour", "blue"], "unrecognized arguments: --colour")):
        with pytest.raises(ValueError, match=message):
            parse_args(argv)


def test_search_space_narrows_the_rules_ranges_within_their_bounds(tmp_path):
    block = "  kl_judge:\n    threshold: {low: 0.1, high: 0.5, log: true}\n    confidence: [0.6, 0.8]\n"
    s = parse_settings(parse_args([*BASE, "--config", config(tmp_path, "search_space:\n" + block)]))
    threshold, confidence = s.ranges["kl_judge"]["threshold"], s.ranges["kl_judge"]["confidence"]
    assert (threshold.low, threshold.high, threshold.log, confidence.low, confidence.high) == (0.1, 0.5, True, 0.6, 0.8)
    assert s.ranges["top_k"] == parse_settings(parse_args(BASE)).ranges["top_k"], "other rules keep theirs"
    assert parse_args(["--config", config(tmp_path, "search:\n" + block)]).search_space == s.search_overrides, \
        "search: is the same key"
    for both in ("search:\n" + block + "search_space:\n" + block, "confirm-items: 3\nconfirm_items: 4\n"):
        with pytest.raises(ValueError, match="are the same option; give it once"):
            parse_args(["--config", config(tmp_path, both)])  # jsonargparse would keep the last one, silently
    flag = parse_args([*BASE, "--search-space", "{kl_judge: {confidence: [0.6, 0.8]}, top_k: {k: [1, 128]}}"])
    assert flag.search_space == {"kl_judge": {"confidence": [0.6, 0.8]}, "top_k": {"k": [1, 128]}}
    k = parse_settings(flag).ranges["top_k"]["k"]
    assert (k.low, k.high, k.integer) == (1, 128, True), "wider than the rule's own range, within what it accepts"
    for bad, message in (("confidence: [0.5, 1.5]", "search_space: kl_judge.confidence: 1.5 is not a value kl_judge accepts"),
                         ("threshold: {low: -1.0, high: 0.5, log: false}", "search_space: kl_judge.threshold: -1.0 is not a value kl_judge"),
                         ("threshold: [0.5, 0.1]", "search_space: kl_judge.threshold: need numbers low < high"),
                         ("nope: [1, 2]", "search_space: kl_judge.nope: not a searched knob")):
        args = parse_args([*BASE, "--config", config(tmp_path, f"search_space:\n  kl_judge:\n    {bad}\n")])
        with pytest.raises(ValueError, match=message.replace(".", r"\.")):
            parse_settings(args)


def test_a_json_flag_is_an_object_from_a_flag_or_a_config_file(tmp_path):
    args = parse_args(["--server-config", '{"rejection_sample_method": "fly", "fly_window_size": 4}'])
    assert args.server_config == {"rejection_sample_method": "fly", "fly_window_size": 4}
    again = parse_args(["--config", config(tmp_path, effective_config(args))])
    assert again.server_config == args.server_config and again.extra_body is None


def test_the_effective_config_parses_back_the_same(tmp_path):
    cfg = config(tmp_path, "trials: 7\nbudgets: [0.02, 0.1]\nsubset-seed: file\nmax-new-tokens: 64\n"
                           "enqueue: [kl_judge:threshold=0.5]\nsearch_space:\n  kl_judge:\n    confidence: [0.6, 0.8]\n")
    args = parse_args([*BASE, "--config", cfg, "--joint", "--enqueue", "top_k:k=4"])
    parse_settings(args)
    dumped = tmp_path / "config.yaml"
    dumped.write_text(effective_config(args))
    again = parse_args(["--config", str(dumped)])
    assert {**vars(again), "config": None} == {**vars(args), "config": None}
    assert again.subset_seed is None and again.max_new_tokens == 64 and again.cost_ratio is None


def test_a_verify_factor_is_positive_and_part_of_the_study_identity():
    from sweep.settings import study_name

    with pytest.raises(ValueError, match="--verify-factor must be > 0"):
        parse_settings(parse_args([*BASE, "--verify-factor", "0"]))
    plain, fixed = (study_name(parse_settings(parse_args([*BASE, *extra]))) for extra in ([], ["--verify-factor", "1.2"]))
    assert plain != fixed, "a fixed v changes every modelled speed: another study"


def test_the_draft_length_and_dtype_defaults_follow_the_engine():
    """The vLLM engine fixes L when it starts and runs on GPU workers: its defaults are one L and bf16 (never the
    driver's CPU dtype); the CPU engine searches 1..12 in this machine's fastest dtype."""
    from workers.models.pair import auto_dtype

    cpu = parse_settings(parse_args([*BASE, "--dtype", "auto"]))
    assert cpu.draft_len == (1, 12) and cpu.args.dtype == auto_dtype()
    vllm = parse_settings(parse_args([*BASE, "--engine", "vllm", "--dtype", "auto", "--cost-ratio", "0.3"]))
    assert vllm.draft_len == (5, 5) and vllm.args.dtype == "bf16"
    with pytest.raises(ValueError, match="fixes the draft length when it starts"):
        parse_settings(parse_args([*BASE, "--engine", "vllm", "--draft-len", "2,6", "--cost-ratio", "0.3"]))
    with pytest.raises(ValueError, match="--draft-len must be LO,HI integers"):
        parse_settings(parse_args([*BASE, "--draft-len", "a,b"]))


def test_a_sweep_on_a_server_names_its_pair_and_needs_c():
    """--engine openai: the pair is the id the user states (the ledger keys on it), the dtype the server's; c
    cannot be timed from outside; a server's flags without --engine openai are refused."""
    on = ["--engine", "openai", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--pair-id", "my-pair"]
    s = parse_settings(parse_args([*BASE, *on, "--cost-ratio", "0.4"]))
    assert (s.args.pair, s.args.dtype, s.draft_len) == ("my-pair", "server", (1, 12))
    with pytest.raises(ValueError, match="needs --cost-ratio"):
        parse_settings(parse_args([*BASE, *on]))
    with pytest.raises(ValueError, match="needs --base-url, --model and --pair-id"):
        parse_settings(parse_args([*BASE, "--engine", "openai", "--cost-ratio", "0.4"]))
    with pytest.raises(ValueError, match="go with --engine openai"):
        parse_settings(parse_args([*BASE, "--base-url", "http://127.0.0.1:9/v1"]))
    other = parse_settings(parse_args([*BASE, *on[:2], "--base-url", "http://127.0.0.1:10/v1", *on[4:], "--cost-ratio", "0.4"]))
    from sweep.settings import study_name

    assert study_name(other) != study_name(s), "another server is another study"


@pytest.mark.slow
@pytest.mark.parametrize("command", [["jobs/sweep.py"], ["-m", "jobs.evaluate"], ["-m", "jobs.plan"],
                                     ["-m", "jobs.serve"]], ids=["sweep", "evaluate", "plan", "serve"])
def test_help_names_every_type_in_words(command):
    """--help as a person runs it: every flag's type is words (jsonargparse would print a ``type`` function
    as ``<function comma_list at 0x...>``, and a flag with choices as its own wrapper)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "COLUMNS": "10000"}  # one line a flag: argparse wraps help text anywhere, even at a "-"
    got = subprocess.run([sys.executable, *command, "--help"], cwd=root, capture_output=True, text=True,
                         timeout=300, env=env)
    assert got.returncode == 0, got.stderr
    text = " ".join(got.stdout.split())
    assert "usage:" in text
    for leak in ("<function", "<class", " at 0x", "<lambda>"):
        assert leak not in text, leak
    if command == ["jobs/sweep.py"]:
        assert "--budgets BUDGETS accuracy-drop budgets, comma separated (type: comma-separated list," in text
        assert "(type: int or 'file', default: 0)" in text and "(type: str, default: cpu)" in text
