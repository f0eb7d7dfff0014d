"""Certification statistics: coverage of each bound at small n, the early-stop rule's error under
repeated looks, and the whole search -> confirm selection procedure simulated with known true drops
(no models). Right/wrong coverage is computed exactly (summing trinomial probabilities over every
outcome), so it carries no Monte Carlo error; the rest is seeded Monte Carlo with 3-SE margins."""

from __future__ import annotations

import functools
import json
import math
import random

import pytest
import torch

from workers.certify.decide import (
    ALPHA,
    Candidate,
    DropBound,
    drop_bound,
    drop_bound_from_counts,
    first_prune,
    fixed_sequence,
    items_needed,
    order_candidates,
    prune_test,
    split_ids,
)
from workers.certify.exact import METHOD as EXACT
from workers.certify.exact import certify_paired

GRID = [(0.0, 0.0), (0.02, 0.0), (0.05, 0.03), (0.1, 0.1), (0.2, 0.05)]  # (p_loss, p_win)


def mc_margin(reps: int, alpha: float = ALPHA) -> float:
    return 3.0 * math.sqrt(alpha * (1 - alpha) / reps)


@functools.cache
def upper_table(n: int) -> dict[tuple[int, int], float]:
    return {(x, y): drop_bound_from_counts(x, y, n).upper for x in range(n + 1) for y in range(n + 1 - x)}


def exact_coverage(n: int, p_loss: float, p_win: float) -> float:
    """P(true drop <= upper) summed over every (losses, wins) outcome of n paired items."""
    drop, p_tie = p_loss - p_win, 1.0 - p_loss - p_win
    lf = [math.lgamma(k + 1) for k in range(n + 1)]

    def log_p(p: float, k: int) -> float:
        return 0.0 if k == 0 else (k * math.log(p) if p > 0 else -math.inf)

    covered = 0.0
    for (x, y), upper in upper_table(n).items():
        if upper >= drop - 1e-12:
            covered += math.exp(lf[n] - lf[x] - lf[y] - lf[n - x - y] + log_p(p_loss, x) + log_p(p_win, y)
                                + log_p(p_tie, n - x - y))
    return covered


def paired_binary(rng: random.Random, p_loss: float, p_win: float, n: int) -> tuple[list[float], list[float]]:
    ref, trial = [], []
    for _ in range(n):
        u = rng.random()
        if u < p_loss:
            ref.append(1.0), trial.append(0.0)
        elif u < p_loss + p_win:
            ref.append(0.0), trial.append(1.0)
        else:
            same = float(rng.random() < 0.7)
            ref.append(same), trial.append(same)
    return ref, trial


# --- bounds -----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 5, 24])
def test_binary_bound_covers_the_true_drop_at_small_n(n):
    for p_loss, p_win in GRID:
        cov = exact_coverage(n, p_loss, p_win)
        assert cov >= 1 - ALPHA - 1e-9, (
            f"n={n}, p_loss={p_loss}, p_win={p_win}: the upper bound covers the true drop with probability "
            f"{cov:.4f} < {1 - ALPHA} (exact sum over all outcomes, no sampling error)")


@pytest.mark.parametrize("n", [5, 24])
def test_exact_small_n_bound_covers_everywhere_not_only_on_the_grid(n):
    worst = min((exact_coverage(n, i / 14, j / 14), i / 14, j / 14)
                for i in range(15) for j in range(15 - i) if i + j < 14 or (i, j) == (0, 0))
    assert worst[0] >= 1 - ALPHA - 1e-9, f"n={n}: exact coverage {worst[0]:.4f} at (p_loss, p_win)={worst[1:]}"


def test_zero_discordant_items_give_a_positive_bound_that_shrinks_with_n():
    uppers = [drop_bound([1.0] * n, [1.0] * n).upper for n in (1, 5, 24, 100, 1000)]
    assert all(u > 0 for u in uppers), f"no flip seen is not proof of no drop: {uppers}"
    assert uppers == sorted(uppers, reverse=True) and uppers[-1] < uppers[0] / 50, uppers
    # a rule losing 2% with no wins at n = 24 is covered (the old bootstrap's bound missed it 61% of the time)
    assert exact_coverage(24, 0.02, 0.0) >= 1 - ALPHA


def bounded_pair(rng: random.Random) -> tuple[float, float]:
    """Scores in [0, 1]: the trial loses a Beta share of the reference half the time and closes a
    Beta share of the gap to 1 the other half. True drop = .5 E[r](1-E[v]) - .5 E[1-r](1-E[w])."""
    ref = rng.betavariate(5, 2)
    if rng.random() < 0.5:
        return ref, ref * rng.betavariate(8, 1)
    return ref, 1 - (1 - ref) * rng.betavariate(12, 1)


BOUNDED_TRUE_DROP = 0.5 * (5 / 7) * (1 / 9) - 0.5 * (2 / 7) * (1 / 13)


@pytest.mark.parametrize("n", [1, 5, 24, 100])
def test_bounded_score_bound_covers_the_true_drop_without_normality(n):
    rng, reps, misses = random.Random(n), 1500, 0
    for _ in range(reps):
        ref, trial = zip(*(bounded_pair(rng) for _ in range(n)), strict=True)
        bound = drop_bound(ref, trial)
        assert bound.method == "betting"
        misses += bound.upper < BOUNDED_TRUE_DROP
    assert misses / reps <= ALPHA + mc_margin(reps), (
        f"n={n}: betting bound missed the true drop {BOUNDED_TRUE_DROP:.4f} in {misses}/{reps} samples; "
        f"above alpha + 3 SE, which chance explains with probability < 0.2%")


def test_betting_bound_also_covers_skewed_right_wrong_scores():
    rng, reps, misses = random.Random(7), 1500, 0
    for _ in range(reps):
        ref, trial = paired_binary(rng, 0.2, 0.05, 24)
        misses += drop_bound(ref, trial, binary=False).upper < 0.15
    assert misses / reps <= ALPHA + mc_margin(reps), f"{misses}/{reps} misses"


def test_betting_bound_is_the_same_on_its_python_and_torch_paths(monkeypatch):
    import workers.certify.bounds as cb

    rng = random.Random(3)
    ref, trial = zip(*(bounded_pair(rng) for _ in range(300)), strict=True)
    python = drop_bound(ref, trial).upper
    monkeypatch.setattr(cb, "_TORCH_FROM", 1)
    assert drop_bound(ref, trial).upper == pytest.approx(python, abs=1e-5)


# --- early stopping ---------------------------------------------------------------------------


@pytest.mark.parametrize("p_loss,p_win,budget", [(0.1, 0.05, 0.05), (0.03, 0.01, 0.02)])
def test_prune_false_prune_rate_at_the_boundary_is_within_alpha_under_every_look(p_loss, p_win, budget):
    rng, reps = random.Random(11), 1500
    pruned = sum(first_prune(*paired_binary(rng, p_loss, p_win, 200), budget) is not None for _ in range(reps))
    assert pruned / reps <= ALPHA + mc_margin(reps), (
        f"true drop == budget {budget}: pruned {pruned}/{reps} runs looking after every item up to 200; "
        f"the anytime-valid test allows alpha, and 3 SE above it is chance with probability < 0.2%")


def test_prune_test_after_every_record_agrees_with_the_first_crossing():
    rng = random.Random(5)
    for _ in range(20):
        ref, trial = paired_binary(rng, 0.2, 0.05, 60)
        looks = [prune_test(ref[:t], trial[:t], 0.05) for t in range(1, 61)]
        first = first_prune(ref, trial, 0.05)
        assert looks == [first is not None and t >= first for t in range(1, 61)], (first, looks)


def test_prune_stops_a_clearly_bad_rule_soon():
    rng, reps = random.Random(13), 400
    stops = [first_prune(*paired_binary(rng, 0.3, 0.05, 200), 0.05) for _ in range(reps)]
    hit = sorted(s for s in stops if s is not None)
    assert len(hit) / reps >= 0.9 and hit[len(hit) // 2] <= 80, (
        f"true drop 0.25 vs budget 0.05: pruned {len(hit)}/{reps} within 200 items, median at {hit[len(hit) // 2]}")


# --- the whole selection procedure ------------------------------------------------------------

TRUE_DROPS = [0.15 * i / 9 for i in range(10)]
DISCORDANCE = [0.1 + 0.1 * i / 9 for i in range(10)]  # 0.10 .. 0.20, always >= the drop
SPEEDS = [1.0 + 0.1 * i for i in range(10)]  # faster with larger drop


def draw_counts(gen: torch.Generator, sweeps: int, n: int) -> torch.Tensor:
    """[sweeps, 10, 2] (losses, wins) per candidate: multinomial draws of n paired items
    (candidates drawn independently; in a sweep they share items, which only correlates them)."""
    p_loss = torch.tensor([(d + t) / 2 for d, t in zip(DISCORDANCE, TRUE_DROPS, strict=True)], dtype=torch.float64)
    p_win = torch.tensor([(d - t) / 2 for d, t in zip(DISCORDANCE, TRUE_DROPS, strict=True)], dtype=torch.float64)
    total = torch.full((sweeps, 10), float(n), dtype=torch.float64)
    losses = torch.binomial(total, p_loss.expand(sweeps, 10), generator=gen)
    wins = torch.binomial(total - losses, (p_win / (1 - p_loss)).expand(sweeps, 10), generator=gen)
    return torch.stack([losses, wins], dim=-1).long()


@functools.cache
def search_bound(losses: int, wins: int, n: int) -> DropBound:
    """The search side only orders candidates, and fixed-sequence testing is valid for any order fixed
    before confirmation: a normal-theory bound stands in for the sweep's exact one (0.5 s each at n = 2,000)."""
    drop, d = (losses - wins) / n, (losses + wins) / n
    upper = drop + 1.645 * math.sqrt(max(d - drop * drop, 1.0 / n) / n)
    return DropBound("normal", ALPHA, n, drop, upper, losses, wins, d, d)


def confirm_bound(losses: int, wins: int, n: int) -> DropBound:
    """What the sweep hands fixed_sequence, less the reported upper bound: the decision is the exact test's."""
    d = (losses + wins) / n
    return DropBound(EXACT, ALPHA, n, (losses - wins) / n, math.nan, losses, wins, d, d)


def simulate(n_items: int, budget: float, sweeps: int, seed: int) -> tuple[float, float, float]:
    """Share of sweeps whose chosen rule truly exceeds the budget: (certified procedure, old
    point-estimate rule), and the certified procedure's certification rate."""
    gen = torch.Generator().manual_seed(seed)
    n_search, n_confirm = n_items // 2, n_items - n_items // 2
    search, confirm, full = (draw_counts(gen, sweeps, n_search).tolist(), draw_counts(gen, sweeps, n_confirm).tolist(),
                             draw_counts(gen, sweeps, n_items).tolist())
    bad_new = bad_old = certified = 0
    for s in range(sweeps):
        cands = []
        for i, (x, y) in enumerate(search[s]):
            b = search_bound(x, y, n_search)
            cands.append(Candidate(f"trial-{i}", SPEEDS[i], b.drop, b.upper, {"i": i}))
        ordered = order_candidates(cands, budget)
        cert = fixed_sequence(ordered, lambda c, s=s: confirm_bound(*confirm[s][c.payload["i"]], n_confirm), budget)
        certified += cert.certified
        bad_new += cert.certified and TRUE_DROPS[cert.chosen.payload["i"]] > budget + 1e-12
        # the old rule: every item, point estimate <= budget, fastest wins, no confirmation
        feasible = [i for i, (x, y) in enumerate(full[s]) if (x - y) / n_items <= budget]
        bad_old += bool(feasible) and TRUE_DROPS[max(feasible, key=SPEEDS.__getitem__)] > budget + 1e-12
    return bad_new / sweeps, bad_old / sweeps, certified / sweeps


# N = 24 and larger N at b = 5%, and a budget just under a candidate's true drop (0.0333 under 3.33%).
# The decision's own level is held by exact enumeration (test_exact.py); this checks the procedure
# around it: search ordering, fixed-sequence confirmation, the fastest passed candidate chosen.
@pytest.mark.parametrize("n_items,budget,sweeps", [(24, 0.05, 3000), (400, 0.05, 2000), (2000, 0.06, 1500),
                                                   (2000, 0.0333, 2000)])
def test_certified_choice_exceeds_its_budget_at_most_alpha_and_the_old_rule_does_not(n_items, budget, sweeps):
    bad_new, bad_old, certified = simulate(n_items, budget, sweeps, seed=n_items)
    margin = mc_margin(sweeps)
    assert bad_new <= ALPHA + margin, (
        f"N={n_items}, b={budget}: the certified choice's true drop exceeded b in {bad_new:.3f} of {sweeps} sweeps "
        f"(alpha {ALPHA}, 3 SE {margin:.3f}); chance explains that with probability < 0.2%")
    assert bad_old > ALPHA + 3 * margin, (
        f"N={n_items}, b={budget}: the old point-estimate rule exceeded b in only {bad_old:.3f} of sweeps; "
        f"the comparison is meant to show it fails")
    if n_items >= 2000:
        assert certified > 0.5, f"N={n_items}: certified in only {certified:.2f} of sweeps; the test has no power"


# --- procedure pieces -------------------------------------------------------------------------


def bound(upper: float, n: int = 100, drop: float = 0.0, d: float = 0.1) -> DropBound:
    return DropBound("betting", ALPHA, n, drop, upper, int(n * (d + drop) / 2), int(n * (d - drop) / 2), d, d)


def cand(key: str, speed: float, upper: float, drop: float = 0.0) -> Candidate:
    return Candidate(key, speed, drop, upper)


def test_fixed_sequence_stops_at_the_first_failure_and_never_evaluates_past_it():
    ordered = [cand("a", 1.0, 0.01), cand("b", 1.2, 0.02), cand("c", 1.5, 0.03), cand("d", 2.0, 0.04)]
    uppers = {"a": 0.01, "b": 0.03, "c": 0.09, "d": 0.0}
    called = []

    def bound_of(c: Candidate) -> DropBound:
        called.append(c.key)
        return bound(uppers[c.key])

    cert = fixed_sequence(ordered, bound_of, 0.05)
    assert called == ["a", "b", "c"], "d comes after the first failure (c): evaluating it wastes a confirmation run"
    assert cert.certified and cert.chosen.key == "b" and cert.bound.upper == 0.03
    assert [(k, p) for k, _, p in cert.steps] == [("a", True), ("b", True), ("c", False)]
    assert cert.items_needed is None and "b" in cert.reason
    json.dumps(cert.to_dict())


def test_fixed_sequence_chooses_the_fastest_passed_and_reports_the_plan_when_none_passes():
    cert = fixed_sequence([cand("a", 1.3, 0.01), cand("b", 1.2, 0.02)], lambda c: bound(0.01), 0.05)
    assert cert.chosen.key == "a", "a passed and is faster than b"
    failed = fixed_sequence([cand("a", 1.0, 0.01)], lambda c: bound(0.07, n=200, drop=0.0, d=0.1), 0.02)
    assert not failed.certified and failed.chosen is None and failed.bound.upper == 0.07
    assert failed.items_needed == items_needed(0.1, 0.02, 0.0) and str(failed.items_needed) in failed.reason
    hopeless = fixed_sequence([cand("a", 1.0, 0.01)], lambda c: bound(0.2, drop=0.1), 0.05)
    assert hopeless.items_needed is None and "no sample size" in hopeless.reason


def test_fixed_sequence_with_no_candidate_is_not_certified():
    cert = fixed_sequence([], lambda c: pytest.fail("nothing to evaluate"), 0.05)
    assert not cert.certified and cert.chosen is None and cert.bound is None and cert.steps == []
    assert "no candidate" in cert.reason
    assert json.loads(json.dumps(cert.to_dict()))["certified"] is False


def test_order_candidates_keeps_the_feasible_pareto_front_safest_first():
    cands = [cand("fast-unsafe", 3.0, 0.20, drop=0.08),  # infeasible at 0.05
             cand("slow-safe", 1.0, 0.02, drop=0.0),
             cand("dominated", 1.1, 0.06, drop=0.03),  # mid is faster and safer
             cand("mid", 1.5, 0.04, drop=0.01),
             cand("fast", 2.0, 0.09, drop=0.05),  # exactly at the budget: feasible
             cand("twin-b", 1.5, 0.04, drop=0.01),  # ties with mid: neither dominates; key breaks the tie
             cand("edge", 2.5, 0.10, drop=0.05 + 1e-10)]  # within the 1e-9 tolerance
    ordered = order_candidates(cands, 0.05)
    assert [c.key for c in ordered] == ["slow-safe", "mid", "twin-b", "fast", "edge"], [c.key for c in ordered]
    assert [c.key for c in order_candidates(cands, 0.05, limit=2)] == ["slow-safe", "mid"]
    assert order_candidates(cands, -0.01) == []


def test_split_ids_is_disjoint_covering_deterministic_and_stable_when_items_are_added():
    ids = [f"item-{i}" for i in range(1000)]
    search, confirm = split_ids(ids, seed=3)
    assert set(search).isdisjoint(confirm) and sorted(search + confirm) == sorted(ids)
    assert search == [i for i in ids if i in set(search)], "input order is kept inside each part"
    assert 420 < len(search) < 580, f"{len(search)} of 1000 in search at fraction 0.5 (> 5 SE off)"
    assert split_ids(ids, seed=3) == (search, confirm) and split_ids(ids, seed=4) != (search, confirm)
    more_s, more_c = split_ids(ids[::-1] + [f"new-{i}" for i in range(50)], seed=3)
    assert set(search) <= set(more_s) and set(confirm) <= set(more_c), "adding items moved existing ones"
    small, _ = split_ids(ids, seed=3, fraction=0.2)
    assert 120 < len(small) < 280


def test_items_needed_follows_the_normal_plan():
    assert items_needed(0.1, 0.02) == pytest.approx(6.18 * 0.1 / 0.02**2, rel=0.01)  # ~1,546
    assert items_needed(0.1, 0.01) == pytest.approx(6.18 * 0.1 / 0.01**2, rel=0.01)  # ~6,183
    assert items_needed(0.15, 0.05, drop=0.02) == pytest.approx(6.18 * 0.15 / 0.03**2, rel=0.02)
    assert items_needed(0.1, 0.02, drop=0.02) is None and items_needed(0.1, 0.02, drop=0.03) is None
    assert items_needed(0.1, 0.02, power=0.9) > items_needed(0.1, 0.02) > items_needed(0.1, 0.02, alpha=0.1)


def test_planned_n_gives_roughly_the_planned_power():
    n = items_needed(0.1, 0.03)
    gen = torch.Generator().manual_seed(0)
    losses = torch.binomial(torch.full((600,), float(n)), torch.full((600,), 0.05), generator=gen)
    wins = torch.binomial(n - losses, torch.full((600,), 0.05 / 0.95), generator=gen)
    power = sum(certify_paired(int(x), int(y), n, 0.03, ALPHA).certified for x, y in zip(losses, wins, strict=True)) / 600
    assert 0.7 <= power <= 0.9, f"planned 80% power at n={n}, simulated {power:.2f}"


@pytest.mark.parametrize("call,message", [
    (lambda: drop_bound([1.0, 0.0], [1.0]), "paired"),
    (lambda: drop_bound([1.5], [1.0]), "outside [0, 1]"),
    (lambda: drop_bound([math.nan], [1.0]), "outside [0, 1]"),
    (lambda: drop_bound([1.0], [1.0], alpha=1.0), "alpha"),
    (lambda: drop_bound([1.0], [1.0], alpha=0.0), "alpha"),
    (lambda: drop_bound([0.5], [1.0], binary=True), "binary"),
    (lambda: drop_bound_from_counts(3, 2, 4), "counts"),
    (lambda: prune_test([1.0], [1.0, 0.0], 0.05), "paired"),
    (lambda: prune_test([1.0], [1.0], 1.5), "budget"),
    (lambda: items_needed(0.1, 0.0), "budget"),
    (lambda: items_needed(1.2, 0.02), "discordance"),
    (lambda: items_needed(0.1, 0.02, power=1.0), "power"),
    (lambda: split_ids(["a", "a"], 0), "twice"),
    (lambda: split_ids(["a"], 0, fraction=1.0), "fraction"),
])
def test_bad_input_raises_a_value_error_naming_it(call, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call()


def test_empty_input_is_an_uninformative_bound():
    for b in (drop_bound([], []), drop_bound([], [], binary=False)):
        assert b.n == 0 and b.upper == 1.0 and math.isnan(b.drop) and math.isnan(b.discordance)
        assert b.to_dict()["drop"] is None


def test_an_uncertified_budget_is_planned_from_the_search_not_from_the_failed_confirmation():
    """A candidate that failed its confirmation did so partly by bad luck; planning from its confirmation
    drop would promise 'never' or an inflated n. The search's discordance and drop are the plan's inputs."""
    c = Candidate("t", 1.5, 0.0, 0.02, search_discordance=0.1)
    cert = fixed_sequence([c], lambda _: bound(upper=0.09, n=100, drop=0.06, d=0.12), 0.05)
    assert not cert.certified and cert.items_needed == items_needed(0.1, 0.05, 0.0)
    assert "search discordance 0.100" in cert.reason
