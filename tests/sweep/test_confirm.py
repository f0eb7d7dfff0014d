"""The confirmation phase's bookkeeping on hand-made records: pairing with failures, the ordered
prefix the prune test looks at, ratio-of-sums speed, and the fixed sequence run lazily."""

from __future__ import annotations

import math

import pytest

from sweep.certificates import noise_floor_row
from sweep.confirm import Confirmation
from tests.workers.metrics.test_trial import rec
from workers.certify.decide import Candidate, drop_bound, first_prune
from workers.certify.exact import certify_paired
from workers.metrics.speed import speed_figures
from workers.results.evidence import (
    confirmation_pairs,
    confirmation_rows,
    ordered_prefix,
    paired,
    write_evidence,
)


def test_a_failed_item_counts_as_a_failure_in_the_arm_that_failed():
    ref = {"a": rec("a", 1.0), "b": rec("b", 1.0), "c": rec("c", math.nan, error="boom")}
    trial = {"a": rec("a", 1.0), "b": rec("b", math.nan, error="boom"), "c": rec("c", 1.0)}
    assert paired(ref, trial) == ([1.0, 1.0, 0.0], [1.0, 0.0, 1.0])


def test_looks_use_the_completed_prefix_of_the_fixed_order_not_completion_order():
    ref = {k: rec(k, 1.0) for k in "abcd"}
    done = {"a": rec("a", 1.0), "c": rec("c", 0.0), "d": rec("d", 0.0)}  # b still running
    assert ordered_prefix("abcd", ref, done) == ([1.0], [1.0]), "c and d wait until b is in"


def test_speed_is_a_ratio_of_sums_not_a_mean_of_ratios():
    # item a: 10 tokens in 1 s vs reference 10 in 2 s (2x); item b: 100 tokens in 10 s vs 100 in 10 s (1x)
    ref = {"a": rec("a", 1.0, tokens=10, verify_s=2.0), "b": rec("b", 1.0, tokens=100, verify_s=10.0)}
    trial = {"a": rec("a", 1.0, tokens=10, verify_s=1.0, draft_len=2), "b": rec("b", 1.0, tokens=100, verify_s=10.0,
                                                                                   draft_len=2)}
    s = speed_figures(trial, ref, cost_ratio=0.5, verify_factor=lambda _: 1.0)
    assert s["measured_per_answer"] == pytest.approx(12 / 11), "the mean of per-item ratios would say 1.5x"
    assert s["measured_per_token"] == pytest.approx((110 / 11) / (110 / 12))
    assert s["measured_per_answer_lo"] <= s["measured_per_answer"] <= s["measured_per_answer_hi"]
    assert s["speed_items"] == 2


def test_fixed_sequence_evaluates_lazily_and_reuses_a_candidate_across_budgets():
    ref = {f"i{k}": rec(f"i{k}", 1.0) for k in range(200)}
    # safe: identical to the reference; risky: loses 30% of the items
    outcomes = {"safe": {k: rec(k, 1.0) for k in ref},
                "risky": {k: rec(k, 0.0 if int(k[1:]) % 10 < 3 else 1.0) for k in ref}}
    calls = []

    def evaluate(c: Candidate, stop, n=None):
        calls.append(c.key)
        done = {}
        for k, r in outcomes[c.key].items():
            done[k] = r
            if stop(done):
                break
        return done

    conf = Confirmation(evaluate, ref, alpha=0.05, limit=3, order=list(ref))
    cands = [Candidate("safe", speed=1.2, search_drop=0.0, search_upper=0.02),
             Candidate("risky", speed=2.0, search_drop=0.01, search_upper=0.04)]
    cert = conf.certify(cands, 0.05)
    assert cert.certified and cert.chosen.key == "safe", "risky fails its confirmation, safe stands"
    assert [k for k, _, _ in cert.steps] == ["safe", "risky"] and [p for _, _, p in cert.steps] == [True, False]
    assert len(conf.records["risky"]) < 200, "a hopeless candidate stops early (anytime-valid futility)"
    conf.certify(cands, 0.2)
    assert calls == ["safe", "risky"], "each candidate is evaluated once across budgets"


def test_a_failed_reference_item_never_becomes_a_win_for_the_candidate():
    """Before: a failed target-only item scored 0, so a candidate right there 'won' it, and 5% failed
    references could cancel 5% real losses. Now the failed reference counts as right."""
    order = [f"i{k}" for k in range(200)]
    ref = {k: rec(k, math.nan, error="engine died") if int(k[1:]) < 10 else rec(k, 1.0) for k in order}
    trial = {k: rec(k, 0.0) if 10 <= int(k[1:]) < 20 else rec(k, 1.0) for k in order}  # right where ref failed
    a, b, counts = confirmation_pairs(order, ref, trial)
    assert sum(x - y for x, y in zip(a, b, strict=True)) == 10, "10 losses, no wins"
    assert counts["reference_failed"] == 10 and counts["candidate_failed"] == counts["candidate_missing"] == 0
    old_ref, old_trial = paired(ref, trial)
    assert sum(x - y for x, y in zip(old_ref, old_trial, strict=True)) == 0, "the old pairing netted them to zero"


def test_items_that_never_came_back_count_against_the_candidate():
    order = [f"i{k}" for k in range(100)]
    ref = {k: rec(k, 1.0) for k in order}
    trial = {k: rec(k, 1.0) for k in order[:80]}  # 20 items lost to a timeout or an actor
    a, b, counts = confirmation_pairs(order, ref, trial)
    assert len(a) == len(b) == 100 and sum(b) == 80 and counts["candidate_missing"] == 20
    assert len(paired(ref, trial)[0]) == 80, "the old pairing dropped them: n shrank, the drop stayed 0"


def test_a_candidate_stopped_for_futility_keeps_only_the_items_up_to_the_stop():
    order = [f"i{k}" for k in range(300)]
    ref = {k: rec(k, 1.0) for k in order}
    trial = {k: rec(k, 0.0 if int(k[1:]) % 2 else 1.0) for k in order}  # loses half: hopeless at 5%
    _, b, counts = confirmation_pairs(order, ref, trial, futility=(0.05, 0.05))
    fired = first_prune([1.0] * 300, [0.0 if k % 2 else 1.0 for k in range(300)], 0.05, 0.05)
    assert counts["kept"] == fired < 300 and sum(b) == sum(1 for k in range(fired) if k % 2 == 0)
    assert counts["candidate_missing"] == 300 - fired, "what finished after the stop is not evidence"


def test_futility_tests_the_largest_budget_whose_candidate_list_holds_the_candidate():
    ref = {f"i{k}": rec(f"i{k}", 1.0) for k in range(10)}
    conf = Confirmation(lambda c, stop, n=None: {}, ref, alpha=0.05, limit=2, order=list(ref))
    cands = [Candidate("safe", 1.1, 0.0, 0.01), Candidate("mid", 1.5, 0.015, 0.03),
             Candidate("fast", 2.0, 0.04, 0.06)]
    assert conf.plan_futility(cands, [0.01, 0.02, 0.05]) == {"safe": 0.05, "mid": 0.05}
    # "fast" is feasible only at 5%, where the limit of 2 keeps the two safer ones: it is never confirmed


def test_the_evidence_rows_recompute_the_certificate(tmp_path):
    import csv

    order = [f"i{k}" for k in range(120)]
    ref = {k: rec(k, math.nan, error="boom") if k == "i3" else rec(k, 1.0) for k in order}
    trial = {k: rec(k, 0.0 if k in ("i5", "i9") else 1.0) for k in order if k != "i7"}
    conf = Confirmation(lambda c, stop, n=None: trial, ref, alpha=0.05, limit=1, order=order)
    cert = conf.certify([Candidate("c", 1.5, 0.0, 0.01)], 0.1)
    write_evidence(tmp_path / "c.csv", conf.evidence["c"])
    with (tmp_path / "c.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 120 and {r["candidate"] for r in rows} == {"ok", "missing"}
    assert next(r for r in rows if r["item_id"] == "i3")["reference"] == "failed"
    assert next(r for r in rows if r["item_id"] == "i3")["reference_reason"].startswith("failed:"), "why, per arm"
    assert set(rows[0]) >= {"reference_answer", "candidate_answer", "reference_reason", "candidate_reason"}
    again = drop_bound([float(r["reference_score"]) for r in rows], [float(r["candidate_score"]) for r in rows])
    assert (again.losses, again.wins, again.n) == (3, 0, 120) == (cert.bound.losses, cert.bound.wins, cert.bound.n)
    assert certify_paired(again.losses, again.wins, again.n, 0.1, 0.05).p_value == cert.bound.p_value


def test_the_noise_floor_row_gives_discordance_a_two_sided_interval_and_the_items_budgets_need():
    ref = {f"i{k}": rec(f"i{k}", 1.0) for k in range(40)}
    lossless = {k: rec(k, 1.0) for k in ref}  # identical: zero discordance
    row = noise_floor_row(ref, lossless, 0.05, 5, budgets=[0.02, 0.05])
    assert row["discordance"] == 0.0 and row["drop_lo"] < 0.0 < row["drop_hi"] < 0.1
    assert row["items_needed.0.02"] > row["items_needed.0.05"] > 40, "zero seen in 40 items is not zero"


def test_a_failed_item_still_counts_its_time_so_a_rule_cannot_look_faster_by_failing():
    ref = {"a": rec("a", 1.0, tokens=10, verify_s=1.0), "b": rec("b", 1.0, tokens=10, verify_s=1.0)}
    fails_slowly = {"a": rec("a", 1.0, tokens=10, verify_s=0.5, draft_len=2),
                    "b": rec("b", math.nan, error="timeout", tokens=0, verify_s=0.0, draft_len=2)}
    fails_slowly["b"].wall_time_s = 30.0
    s = speed_figures(fails_slowly, ref, cost_ratio=0.5, verify_factor=lambda _: 1.0)
    assert s["speed_items"] == 2 and s["speed_failed_items"] == 1
    assert s["measured_per_answer"] < 0.1, "2 s of reference work vs 30.5 s spent"


def test_joint_alpha_is_shared_across_budgets_and_each_bound_is_kept_per_alpha():
    order = [f"i{k}" for k in range(300)]
    ref = {k: rec(k, 1.0) for k in order}
    trial = {k: rec(k, 0.0 if int(k[1:]) % 50 == 7 else 1.0) for k in order}  # loses 2%, spread out
    conf = Confirmation(lambda c, stop, n=None: trial, ref, alpha=0.05, limit=1, order=order)
    cand = [Candidate("c", 1.5, 0.0, 0.01)]
    per_budget, joint = conf.certify(cand, 0.05), conf.certify(cand, 0.05, alpha=0.05 / 3)
    assert per_budget.bound.p_value == joint.bound.p_value and joint.alpha == 0.05 / 3
    assert per_budget.bound.upper < joint.bound.upper, "the bound at alpha/3 is wider"
    assert per_budget.certified == (per_budget.bound.p_value <= 0.05)
    assert joint.certified == (joint.bound.p_value <= 0.05 / 3)


def test_group_sequential_confirmation_stops_at_the_first_look_that_certifies():
    """With two looks a clean candidate runs (and its reference is computed) only on look 1's items; its
    evidence is those items; a candidate that does not pass at look 1 runs on to every item."""
    ids = [f"i{k}" for k in range(80)]
    asked: list[int] = []

    def reference_upto(n: int):
        asked.append(n)
        return {k: rec(k, 1.0) for k in ids[:n]}

    outcomes = {"clean": {k: rec(k, 1.0) for k in ids},
                "late": {k: rec(k, 0.0 if int(k[1:]) < 3 else 1.0) for k in ids}}  # 3 lost among look 1's items
    runs: list[tuple[str, int]] = []

    def evaluate(c: Candidate, stop, n=None):
        runs.append((c.key, n))
        return {k: outcomes[c.key][k] for k in ids[:n]}

    clean = Candidate("clean", speed=1.5, search_drop=0.0, search_upper=0.05)
    conf = Confirmation(evaluate, reference_upto, alpha=0.05, limit=1, order=ids, looks=2)
    conf.plan_futility([clean], [0.2])
    cert = conf.certify([clean], 0.2)
    assert cert.certified and (cert.bound.look, cert.bound.looks, cert.bound.n) == (1, 2, 40)
    assert runs == [("clean", 40)] and asked == [40], "nothing past look 1 was run"
    assert conf.stopped == {"clean": 40} and len(conf.evidence["clean"]) == 40

    runs.clear()
    late = Candidate("late", speed=1.5, search_drop=0.0, search_upper=0.05)
    conf = Confirmation(evaluate, reference_upto, alpha=0.05, limit=1, order=ids, looks=2)
    conf.plan_futility([late], [0.2])
    cert = conf.certify([late], 0.2)
    assert runs == [("late", 40), ("late", 80)] and "late" not in conf.stopped
    assert cert.bound.look == 2 and cert.bound.n == 80 and len(conf.evidence["late"]) == 80


def test_the_evidence_says_how_each_candidate_record_was_made(tmp_path):
    import csv

    order = ["a", "b", "c"]
    ref = {k: rec(k, 1.0) for k in order}
    trial = {k: rec(k, 1.0) for k in order}
    trial["a"].replay, trial["b"].replay = "exact", "diverged@12"
    rows, counts = confirmation_rows(order, ref, trial)
    assert [r["candidate_made"] for r in rows] == ["replayed: exact", "replayed: diverged@12", "decoded in full"]
    assert counts["candidate_replayed"] == 2
    write_evidence(tmp_path / "e.csv", rows)
    with (tmp_path / "e.csv").open() as fh:
        assert [r["candidate_made"] for r in csv.DictReader(fh)][2] == "decoded in full"


def test_the_timed_full_decodes_check_the_records_they_time():
    from workers.metrics.speed import Timed, replay_check

    held = {k: rec(k, 1.0, ids=[[1, 2, 3]]) for k in "ab"}
    for r in held.values():
        r.replay = "exact"
    lossless = {k: rec(k, 1.0) for k in "ab"}
    reference = {k: rec(k, 1.0) for k in "ab"}

    def arms(cand):
        return Timed(([rec(k, 1.0) for k in "ab"], [rec(k, 1.0) for k in "ab"], cand))

    full = [rec(k, 1.0, ids=[[1, 2, 3]]) for k in "ab"]
    same = replay_check(arms(full), held, lossless, reference)
    assert (same["items"], same["replayed"], same["status"], same["identical"]) == (6, 2, "identical", True)
    full[1].output_token_ids = [[1, 2, 4]]
    full[0].num_accepted_tokens += 1
    off = replay_check(arms(full), held, lossless, reference)
    assert off["replayed_differ"] == ["candidate:a", "candidate:b"] and off["status"] == "replay differs"
    reference["a"].output_token_ids = [[9]]  # two full decodes that differ: noted, not replay's fault
    noted = replay_check(arms([rec(k, 1.0, ids=[[1, 2, 3]]) for k in "ab"]), held, lossless, reference)
    assert noted["full_differ"] == ["target-only:a"] and noted["status"] == "full decodes differ"
    one_side = [rec("a", 1.0, ids=[[1, 2, 3]]), rec("b", math.nan, error="boom")]
    assert replay_check(arms(one_side), held, lossless)["replayed_differ"] == ["candidate:b"]
    assert replay_check(Timed(None, error="lost"), held, lossless)["status"] == "unchecked"


def test_at_a_concurrency_measured_speed_is_output_tokens_over_each_arms_walls():
    """Concurrent requests overlap, so a record's own seconds are not its share of the server: with walls, measured
    speed is each arm's output tokens over its walls: every record's tokens, its scoring failed or not (a request that
    failed made none), and every item's time."""
    from workers.metrics.cost import CostModel
    from workers.metrics.speed import Timed, over_lossless

    held = {k: rec(k, 1.0, tokens=10) for k in "ab"}
    arms = tuple([rec(k, 1.0, tokens=10) for k in "ab"] for _ in range(3))
    arms[2][1] = rec("b", math.nan, tokens=0, error="RequestFailed: HTTP 500")  # a request that failed: no tokens
    out = over_lossless(held, held, held, 3, CostModel(0.4), Timed(arms, concurrency=4, walls=(4.0, 2.0, 1.0)))
    timed = out["vs_lossless"]["timed"]
    assert timed["concurrency"] == 4 and timed["items"] == 2
    assert timed["tokens_per_s"] == {"target_only": 5.0, "lossless": 10.0, "candidate": 10.0}
    assert out["vs_lossless"]["measured"] == pytest.approx(1.0) and out["vs_target_only"]["measured"] == pytest.approx(2.0)
    assert timed["in_flight"]["target_only"] == pytest.approx(sum(r.wall_time_s for r in arms[0]) / 4.0)
    # latency at that concurrency: a request's own seconds are a client's wait (p50 / p90 over the arm's items)
    lat = timed["latency"]["target_only"]
    assert lat["items"] == 2 and lat["ttft_p50_s"] == min(r.prefill_time_s for r in arms[0])
    assert lat["ttft_p90_s"] == max(r.prefill_time_s for r in arms[0])
    assert lat["tpot_p50_s"] == pytest.approx(min(r.decode_time_s / 9 for r in arms[0]))
    assert timed["latency"]["candidate"]["items"] == 1, "a failed request has no latency to state"
    # an arm that made no tokens at all (every request failed): no ratio, never a crash
    dead = ([rec(k, 1.0, tokens=10) for k in "ab"], [rec(k, math.nan, tokens=0, error="boom") for k in "ab"],
            [rec(k, 1.0, tokens=10) for k in "ab"])
    out = over_lossless(held, held, held, 3, CostModel(0.4), Timed(dead, concurrency=4, walls=(1.0, 1.0, 1.0)))
    assert math.isnan(out["vs_lossless"]["measured"]) and out["vs_target_only"]["measured"] == pytest.approx(1.0)


def test_under_the_coupled_sampler_only_the_standard_samplers_timed_items_are_stated():
    """Coupled records model the coupled sampler's speed (below a deployment's): the stated figure is the timed
    items' (standard sampler), the model on their counts where it agrees with the measurement; untimed, none."""
    from workers.metrics.cost import CostModel
    from workers.metrics.speed import Timed, over_lossless

    held = {k: rec(k, 1.0, tokens=10) for k in "ab"}
    untimed = over_lossless(held, held, held, 3, CostModel(0.4), None, coupled=True)
    for side in ("vs_lossless", "vs_target_only"):
        assert untimed[side]["modelled_sampler"] == "coupled" and untimed[side]["timed_sampler"] == "standard"
        assert math.isnan(untimed[side]["stated"]) and untimed[side]["stated_from"].startswith("none")
        assert math.isfinite(untimed[side]["modelled"]), "the coupled figure is kept, labelled, not stated"
    arms = tuple([rec(k, 1.0, tokens=10) for k in "ab"] for _ in range(3))
    timed = over_lossless(held, held, held, 3, CostModel(0.4), Timed(arms), Timed(arms), coupled=True)
    vl = timed["vs_lossless"]
    assert vl["stated"] in (vl["modelled_timed"], vl["measured"]) and math.isfinite(vl["stated"])
    assert timed["replay_check"]["status"] != "unchecked", "the coupled arms audit the records"
    plain = over_lossless(held, held, held, 3, CostModel(0.4), None)
    assert "modelled_sampler" not in plain["vs_lossless"] and plain["vs_lossless"]["stated"] == plain["vs_lossless"]["modelled"]


def test_a_certificate_never_stands_on_an_unaudited_or_contradicted_replay():
    from dataclasses import replace

    from sweep.audit import audit_withholds

    full, replayed = rec("a", 1.0), replace(rec("b", 1.0), replay="exact")
    audited = {"items": 3, "replayed": 1, "replayed_differ": [], "full_differ": []}
    assert audit_withholds(audited, {"a": full, "b": replayed}) is None
    assert audit_withholds({}, {"a": full}) is None, "nothing replayed: nothing to audit"
    reason = audit_withholds({"status": "unchecked", "items": 0}, {"a": full, "b": replayed})
    assert reason and "1 of its confirmation records were replayed" in reason and "--speed-items" in reason
    reason = audit_withholds({**audited, "replayed_differ": ["candidate:b"]}, {"b": replayed})
    assert reason and "candidate:b" in reason and "--replay off" in reason
    # the audit past the timed items owes max(30, 10%) of the replayed records (all, where fewer): a lost one withholds
    assert audit_withholds({**audited, "audit_wanted": 1, "audit_done": 1}, {"a": full, "b": replayed}) is None
    reason = audit_withholds({**audited, "audit_wanted": 30, "audit_done": 20}, {"a": full, "b": replayed})
    assert reason and "20 of the 30" in reason and "lost" in reason


def test_only_a_lost_audit_leaves_a_budget_undecided():
    """A certificate withheld for want of audit waits for it (the ledger is not told, a rerun finishes it); one whose
    replay a full decode contradicted, or one that needs no audit, is decided."""
    from dataclasses import replace

    from sweep.audit import audit_pending, audit_withholds

    full, replayed = rec("a", 1.0), replace(rec("b", 1.0), replay="exact")
    audited = {"items": 3, "replayed": 1, "replayed_differ": [], "full_differ": []}
    both = {"a": full, "b": replayed}
    assert audit_pending({**audited, "audit_wanted": 30, "audit_done": 20}, both)
    assert audit_pending({"status": "unchecked", "items": 0}, both)
    assert not audit_pending(audited, both), "audited in full: nothing pending"
    assert not audit_pending({**audited, "audit_wanted": 30, "audit_done": 20, "replayed_differ": ["candidate:b"]},
                             both), "a contradicted replay is decided, whatever else is missing"
    assert not audit_pending({}, {"a": full}), "nothing replayed"
    # a replay decided by the eager kernels after the fused ones failed, in this run: withheld, and made again on rerun
    eager = replace(replayed, fused_off="RuntimeError: no compiler")
    reason = audit_withholds(audited, {"a": full, "b": eager})
    assert reason and "eager kernels" in reason and audit_pending(audited, {"a": full, "b": eager})
    assert audit_withholds(audited, {"a": replace(full, fused_off="x"), "b": replayed}) is None, "a full decode is its own"


def test_a_refutation_after_a_futility_stop_rests_on_the_items_observed_not_the_booked_losses():
    """A candidate stopped for futility has every later item booked as lost for its certificate (which then
    certifies nothing); a refutation reads only what was observed. A candidate whose drop is about the budget is
    stopped at a larger budget's futility test yet never refuted at its own, and one that loses everything is."""
    order = [f"i{k}" for k in range(200)]
    ref = {k: rec(k, 1.0) for k in order}

    def evaluate_with(outcomes):
        def evaluate(c: Candidate, stop, n=None):
            done = {}
            for k in order[: n or len(order)]:
                done[k] = outcomes[k]
                if stop(done):
                    break
            return done
        return evaluate

    # loses 1 item in 12 (a drop of ~8%): hopeless at 2% after a while, but its drop is not shown above 5%
    near = {k: rec(k, 0.0 if int(k[1:]) % 12 == 0 else 1.0) for k in order}
    conf = Confirmation(evaluate_with(near), ref, alpha=0.05, limit=1, order=order)
    cand = [Candidate("near", speed=1.5, search_drop=0.0, search_upper=0.01)]
    conf.plan_futility(cand, [0.02], 0.05)
    cert = conf.certify(cand, 0.02)
    observed = len(conf.records["near"])
    assert not cert.certified and observed < 200, "stopped for futility"
    assert cert.refutation.n == observed and cert.verdict in ("refuted", "undecided")
    # every item lost: the futility stop is the refutation's betting half (the same test at the same level), so
    # it is refuted where it stopped, on those items alone, never on the 200 booked as lost
    lost = {k: rec(k, 0.0) for k in order}
    conf = Confirmation(evaluate_with(lost), ref, alpha=0.05, limit=1, order=order)
    cert = conf.certify([Candidate("lost", speed=2.0, search_drop=0.0, search_upper=0.01)], 0.05)
    assert cert.refutation.n == len(conf.records["lost"]) < 20
    assert cert.verdict == "refuted" and cert.refutation.method == "betting"
    assert cert.bound.n == 200 and cert.bound.losses == 200, "the certificate's evidence books every item lost"

    # a server-style look that runs whole (no early stop inside the look): the same outcomes refute
    def whole(c: Candidate, stop, n=None):
        return {k: lost[k] for k in order}

    conf = Confirmation(whole, ref, alpha=0.05, limit=1, order=order)
    cert = conf.certify([Candidate("lost", speed=2.0, search_drop=0.0, search_upper=0.01)], 0.05)
    assert cert.verdict == "refuted" and cert.refutation.method == "exact-unconditional"


@pytest.mark.parametrize("seed", range(3))
def test_a_futility_stop_is_the_refutation_of_the_budget_it_tested(seed):
    """The futility stop runs the refutation's betting half at the same level, against the largest budget whose
    list holds the candidate, on the same observed prefix: whenever it stops a candidate (no item failed), that
    budget is refuted, by the betting test at the item the stop fired on."""
    import random

    rng = random.Random(seed)
    order = [f"i{k}" for k in range(100)]
    ref = {k: rec(k, 1.0 if rng.random() < 0.8 else 0.0) for k in order}
    worse = rng.choice([0.25, 0.35, 0.5])  # the candidate's chance of losing an item the reference got right
    got = {k: rec(k, 0.0 if ref[k].score and rng.random() < worse else ref[k].score) for k in order}

    def evaluate(c: Candidate, stop, n=None):
        done = {}
        for k in order[: n or len(order)]:
            done[k] = got[k]
            if stop(done):
                break
        return done

    budgets = [0.02, 0.05]
    cand = [Candidate("c", speed=1.5, search_drop=0.0, search_upper=0.01)]
    conf = Confirmation(evaluate, ref, alpha=0.05, limit=1, order=order)
    assert conf.plan_futility(cand, budgets, 0.05) == {"c": 0.05}
    assert conf.futility_alpha == pytest.approx(0.025)
    cert = conf.certify(cand, 0.05)
    stopped = len(conf.records["c"]) < len(order)
    assert stopped, "each of these candidates loses far more than 5%"
    assert cert.verdict == "refuted" and not cert.certified
    # one look at 100 items, never reached after a stop: the betting half decides, at the item the stop fired on
    assert cert.refutation.method == "betting" and cert.refutation.n == len(conf.records["c"])
