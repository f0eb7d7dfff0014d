"""workers/results/scope.py: what a certificate covers, and which deployment settings leave it behind."""

from __future__ import annotations

import pytest

from workers.results.scope import changes, check_scope, covers, same_dtype, same_pair

CHOICE = {"policy": "kl_judge", "params": {"threshold": 0.3}, "draft_len": 5, "pair": "qwen2.5-coder-0.5b+1.5b",
          "dtype": "fp32", "engine": "cpu", "benchmark": "gsm8k", "certified": True,
          "decode": {"temperature": 0.0, "seed": 0, "shots": 8, "max_new_tokens": 192}}


def test_covers_names_the_certified_conditions():
    assert covers(CHOICE) == {"benchmark": "gsm8k", "pair": "qwen2.5-coder-0.5b+1.5b", "dtype": "fp32",
                              "draft_len": 5, "drafter": "draft_model", "engine": "cpu", "temperature": 0.0,
                              "shots": 8, "max_new_tokens": 192}
    assert covers({"policy": "lossless"}) == {"drafter": "draft_model"}  # a hand-written file records little


def test_the_same_settings_spelled_otherwise_are_no_change():
    assert changes(CHOICE, pair="qwen2.5-coder-0.5b+1.5b", dtype="float32", draft_len=5, drafter="draft_model",
                   engine="cpu") == []
    assert changes(CHOICE) == []  # nothing given: the choice's own
    assert same_dtype("bf16", "BFloat16") and same_dtype("torch.float32", "fp32") and not same_dtype("bf16", "fp16")
    assert same_dtype("int4", "int4") and not same_dtype("int4", "bf16")  # unknown: compared as text
    assert changes({k: v for k, v in CHOICE.items() if k != "engine"}, engine="vllm") == []  # unrecorded: unknown


def test_each_change_is_named(tmp_path):
    found = changes(CHOICE, pair=f"{tmp_path}/a+{tmp_path}/b", dtype="bf16", draft_len=4, drafter="eagle3",
                    engine="vllm", cache_dir=str(tmp_path))
    assert [f.split(" ")[0] for f in found] == ["pair", "dtype", "draft", "drafter", "engine"], found
    assert "draft length 4 (certified: 5)" in found and "dtype bf16 (certified: fp32)" in found


def test_a_pair_that_cannot_be_resolved_here_is_another_pair_not_a_crash(tmp_path):
    """The shipped pair named in a choice without a fingerprint, on a machine where it is not fetched: the
    directories cannot be compared, so an override naming directories is a change (a one-line refusal later),
    never an AssetError."""
    assert not same_pair("qwen2.5-coder-0.5b+1.5b", f"{tmp_path}/a+{tmp_path}/b", None, str(tmp_path / "empty"))
    assert not same_pair("qwen2.5-coder-0.5b+1.5b", f"{tmp_path}/a+{tmp_path}/b", "pair:0123", str(tmp_path))
    assert same_pair("qwen2.5-coder-0.5b+1.5b", "qwen2.5-coder-0.5b+1.5b", None, str(tmp_path / "empty"))


def test_check_scope_refuses_in_one_line_or_reports_when_allowed():
    found = ["dtype bf16 (certified: fp32)"]
    with pytest.raises(ValueError) as info:
        check_scope(CHOICE, "sweep s budget 0.05", found, allow_uncertified=False)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("sweep s budget 0.05 is certified for pair qwen2.5-coder-0.5b+1.5b, "
                                              "dtype fp32, draft_len 5, the pair's draft model, the cpu engine, and "
                                              "this changes dtype bf16 (certified: fp32)")
    assert check_scope(CHOICE, "x", found, allow_uncertified=True) == {"certified": False,
                                                                      "outside_certificate": found}
    assert check_scope({**CHOICE, "certified": False}, "x", found, allow_uncertified=False) == {}  # nothing to keep
    assert check_scope(CHOICE, "x", [], allow_uncertified=False) == {}
    with pytest.raises(ValueError, match=r"is certified for the pair's draft model, and this changes"):
        check_scope({"policy": "lossless", "certified": True}, "x", found, allow_uncertified=False)


def test_a_coupled_certificate_covers_the_standard_sampler_only_for_a_rule_that_decides_on_the_distributions():
    from workers.results.scope import ran_inside

    sampled = {**CHOICE, "decode": {**CHOICE["decode"], "temperature": 0.7, "top_k": 20, "top_p": 0.8,
                                    "sampler": "coupled"}}
    kl = covers(sampled)
    assert kl["sampler"] == "coupled" and kl["transfers_to_standard"] is True
    assert changes(sampled) == []  # the KL judge decides on (p, q) alone: served as certified
    assert ran_inside({"certified": True, "covers": kl}, True, 0.7, 20, 0.8)
    token = {**sampled, "policy": "top_k", "params": {"k": 3}}
    assert covers(token)["transfers_to_standard"] is False
    assert [c.split(" (")[0] for c in changes(token)] == ["the standard sampler"]
    assert not ran_inside({"certified": True, "covers": covers(token)}, True, 0.7, 20, 0.8)
    with pytest.raises(ValueError, match="looks at the token drawn"):
        check_scope(token, "the rule", changes(token), allow_uncertified=False)
    assert "sampler" not in covers(CHOICE), "a standard-sampler certificate's scope is what it was"
