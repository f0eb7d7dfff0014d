"""The decision checks of ``python -m jobs.results check``: ``design`` (the look plan again), ``steps`` (every step
of the fixed sequence from the evidence), ``order`` (the candidates' safest-first order from the search figures)
and ``family`` (a certificate made before the family, at the level its attempt gets)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from sweep.recheck.folder import FAILED, NOT_CHECKED, OK, Finding, Folder, close, pct, pval


class _NoEvidence(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _expected_alpha(f: Folder, c: dict[str, Any]) -> tuple[float, str]:
    """The level this budget's sequence is tested at, from sweep.json (``--joint``: its share) and the family the
    certificate names (``alpha * 2^-k``); the certificate's own alpha where there is no sweep.json."""
    if f.args is None or "alpha" not in f.args:
        return float(c["alpha"]), "the certificate's alpha (no sweep.json)"
    alpha, how = float(f.args["alpha"]), "--alpha"
    if f.args.get("joint"):
        alpha, how = alpha / len(f.cert["budgets"]), "--alpha / budgets (--joint)"
    number = (c.get("family") or {}).get("number")
    if number is not None:
        from workers.certify.family import family_alpha

        alpha, how = family_alpha(alpha, int(number)), f"{how} x 2^-{number} (attempt #{number} of its family)"
    return alpha, how


def check_design(f: Folder, budget: float, c: dict[str, Any]) -> tuple[Finding, Any, float]:
    """The look plan again, from sweep.json's N, looks and alpha (the recorded ones where there is none); returns
    the finding, the plan the steps are re-decided at and their alpha."""
    from workers.certify.sequential import RHO, LookPlan, look_plan

    alpha, alpha_how = _expected_alpha(f, c)
    design = c.get("sequential")
    problems = []
    if not close(float(c["alpha"]), alpha):
        problems.append(f"the certificate's alpha {c['alpha']:g} is not {alpha:g} ({alpha_how})")
    args = f.args or {}
    if not design:  # a certificate from before the looks: one fixed-n test on its evidence
        looks = int(args.get("looks", 1) or 1)
        first = (c.get("steps") or [{}])[0].get("candidate") or c.get("candidate")
        ev = f.evidence(first) if first else None
        n = len(ev.ids) if ev else int(c.get("n") or 1)
        plan = look_plan(max(n, 1), 1, alpha)
        if looks > 1:
            problems.append(f"sweep.json asks for {looks} looks, the certificate records no sequential design")
        text = f"one look (fixed n = {n}) at alpha {alpha:g}"
        return (Finding("design", FAILED, f"design DOES NOT RECOMPUTE: {'; '.join(problems)}", budget) if problems
                else Finding("design", OK, f"design recomputes: {text}", budget)), plan, alpha
    recorded = LookPlan(tuple(design["sizes"]), tuple(design["alphas"]), design["alpha"], design["rho"],
                        tuple(design["spent"]), design["budget"],
                        None if design.get("thresholds") is None else
                        tuple(-math.inf if z is None else z for z in design["thresholds"]))
    n = int(args.get("confirm_items") or 0) or int(c.get("confirm_items") or recorded.n)
    looks = int(args.get("looks", len(recorded.sizes)) or 1)
    if c.get("confirm_items") is not None and int(c["confirm_items"]) != n:
        problems.append(f"the certificate's confirm_items {c['confirm_items']} is not sweep.json's {n}")
    if not close(recorded.rho, RHO):
        problems.append(f"rho {recorded.rho:g} is not the sweep's {RHO:g}")
    again = look_plan(n, looks, alpha, RHO, budget)
    if not close(recorded.alpha, alpha):
        problems.append(f"the design's alpha {recorded.alpha:g} is not {alpha:g}")
    if recorded.sizes != again.sizes:
        problems.append(f"looks at {list(recorded.sizes)}, recomputed {list(again.sizes)}")
    elif not all(close(a, b) for a, b in zip(again.spent, recorded.spent, strict=True)):
        problems.append(f"alpha spent by each look {list(recorded.spent)}, recomputed {list(again.spent)}")
    # the looks' levels: the union bound's decide (exact); calibrated looks decide by the thresholds and only report
    # their fixed-n p-value at z_k as a nominal level, which the exact test's refinements move in the 5th digit
    elif not all(close(a, b, 1e-9 if again.thresholds is None else 1e-3)
                 for a, b in zip(again.alphas, recorded.alphas, strict=True)):
        problems.append(f"the looks' levels {list(recorded.alphas)}, recomputed {list(again.alphas)}")
    if not _same(again.thresholds, recorded.thresholds):
        problems.append(f"thresholds {design.get('thresholds')}, recomputed "
                        f"{None if again.thresholds is None else [round(z, 6) for z in again.thresholds]}")
    if (recorded.budget is None) != (again.budget is None) or (again.budget is not None
                                                               and not close(recorded.budget, again.budget)):
        problems.append(f"calibrated for budget {recorded.budget}, recomputed {again.budget}")
    how = "calibrated exactly" if again.thresholds is not None else "one look" if len(again.sizes) == 1 else "union bound"
    text = (f"look plan again from N {n}, {looks} look(s), alpha {alpha:g} ({alpha_how}) and budget {pct(budget)}: "
            f"looks at {', '.join(map(str, again.sizes))}, {how} (the recorded thresholds are not trusted)")
    if problems:
        return Finding("design", FAILED, f"design DOES NOT RECOMPUTE: {'; '.join(problems)}", budget), again, alpha
    return Finding("design", OK, f"design recomputes: {text}", budget), again, alpha


def _same(a: tuple[float, ...] | None, b: tuple[float, ...] | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return len(a) == len(b) and all(x == y or math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12) for x, y in zip(a, b, strict=True))


def _speed_of(f: Folder, key: str) -> float:
    """A candidate's search speed (the sweep's objective): frontier.json's, else its chosen file's; nan if neither."""
    cands, _, _ = f.search_candidates()
    for c in cands or ():
        if c.key == key:
            return c.speed
    s = f.chosen_search().get(key) or {}
    return float(s["speedup"]) if s.get("speedup") is not None else math.nan


def _bound_of(f: Folder, plan: Any, budget: float) -> Callable[[Any], Any]:
    """What ``sweep.confirm.Confirmation.certify`` does per candidate, on the folder's evidence instead of records:
    the deciding look of ``plan`` on the candidate's per-item outcomes."""
    from workers.certify.decide import sequential_bound

    def bound_of(c: Any) -> Any:
        ev = f.evidence(c.key)
        if ev is None:
            raise _NoEvidence(c.key)
        return sequential_bound(ev.ref, ev.cand, plan, budget)

    return bound_of


def _step_text(key: str, b: Any, passed: bool) -> str:
    return (f"{key} {'passed' if passed else 'failed'} at look {b.look} of {b.looks} (n {b.n}, lost {b.losses} / "
            f"won {b.wins}, p {pval(b.p_value)})")


def _withheld(c: dict[str, Any]) -> bool:
    """A certificate the test passed but the sweep withheld after it (the replay audit, or an earlier decision)."""
    return str(c.get("reason", "")).startswith("not certified")


def check_steps(f: Folder, budget: float, choice: dict[str, Any], plan: Any, alpha: float) -> tuple[Finding, dict[str, Any]]:
    """Every recorded step re-decided from its evidence, and the fixed sequence's stop and choice over them."""
    from workers.certify.decide import Candidate, fixed_sequence

    c = choice["certification"]
    recorded = c.get("steps") or []
    row: dict[str, Any] = {"budget": budget, "certified": False, "p_value": math.nan, "n": 0, "lost": None,
                           "won": None, "matches": False}
    if not recorded:
        if c.get("certified") or choice.get("certified"):
            return Finding("steps", FAILED, "certified with no tested step", budget), row
        row["matches"] = True
        return Finding("steps", OK, f"no candidate was tested ({c.get('reason', 'no reason recorded')})", budget), row
    keys = [s["candidate"] for s in recorded]
    missing = [k for k in keys if f.evidence(k) is None]
    if missing:
        return Finding("steps", FAILED, f"the evidence of {', '.join(missing)} (evidence/<candidate>.csv) is not in "
                                        "the folder", budget), row
    cands = [Candidate(k, _speed_of(f, k), math.nan, math.nan) for k in keys]
    cert = fixed_sequence(cands, _bound_of(f, plan, budget), budget, alpha)
    diffs = []
    got = [k for k, _, _ in cert.steps]
    if got != keys:
        diffs.append(f"the fixed sequence over the recorded candidates tests {', '.join(got)}, the certificate lists "
                     f"{', '.join(keys)}")
    for (key, b, passed), s in zip(cert.steps, recorded, strict=False):
        # what a step records is compared; a field it does not record states nothing (the verdict and the chosen
        # step's n and p are compared below whatever the steps record)
        wrong = [name for name, mine, field_ in (("passed", passed, "passed"), ("n", b.n, "n"), ("lost", b.losses, "losses"),
                                                 ("won", b.wins, "wins"), ("look", b.look, "look"))
                 if field_ in s and mine != s[field_]]
        if "p_value" in s and not close(b.p_value, s["p_value"]):
            wrong.append("p-value")
        if wrong:
            diffs.append(f"{key}: recomputed {_step_text(key, b, passed)}; the certificate differs in "
                         f"{', '.join(wrong)} (passed {s.get('passed')}, n {s.get('n')}, lost {s.get('losses')} / won "
                         f"{s.get('wins')}, p {pval(s.get('p_value'))}, look {s.get('look')})")
    passed_keys = [k for k, _, ok in cert.steps if ok]
    speeds_known = len(passed_keys) < 2 or all(math.isfinite(c_.speed) for c_ in cands if c_.key in passed_keys)
    shown = cert.chosen.key if cert.chosen is not None else cert.steps[0][0]
    certified = bool(cert.certified)
    recorded_certified = bool(c.get("certified"))
    if bool(choice.get("certified")) != recorded_certified:
        diffs.append(f"the chosen file says certified {choice.get('certified')}, its certification {c.get('certified')}")
    note = ""
    if certified and not recorded_certified and _withheld(c):
        note = f"; the test passed and the sweep withheld it after: {str(c['reason'])[:160]}"
    elif certified != recorded_certified:
        diffs.append(f"recomputed certified {certified}, the certificate says {recorded_certified}")
    if speeds_known and c.get("candidate") is not None and c["candidate"] != shown:
        diffs.append(f"the fixed sequence chooses {shown}, the certificate {c['candidate']}")
    if speeds_known and c.get("evidence") and c["evidence"] != f"evidence/{shown}.csv":
        diffs.append(f"the certificate's evidence is {c['evidence']}, the chosen step's is evidence/{shown}.csv")
    b = cert.bound
    if speeds_known and b is not None and (b.n != c.get("n") or not close(b.p_value, c.get("p_value"))):
        diffs.append(f"the certificate states n {c.get('n')}, p {pval(c.get('p_value'))}; its step recomputes n {b.n}, "
                     f"p {pval(b.p_value)}")
    row.update(certified=recorded_certified if note else certified, p_value=b.p_value, n=b.n, lost=b.losses,
               won=b.wins, matches=not diffs, shown=shown)
    head = (f"recomputed from the evidence: certified {row['certified']}, p = {pval(b.p_value)}, n = {b.n}, "
            f"lost {b.losses} / won {b.wins}")
    seq = "; ".join(_step_text(k, bb, ok) for k, bb, ok in cert.steps)
    if diffs:
        return Finding("steps", FAILED, f"{head}: DOES NOT MATCH the certificate: {'; '.join(diffs)}", budget), row
    choice_text = (f"the fixed sequence chooses {shown}" if cert.chosen is not None else
                   f"nothing passed; the certificate shows {shown}")
    if not speeds_known:
        return Finding("steps", NOT_CHECKED, f"{head}: every step matches the certificate ({seq}), but which of "
                       f"{', '.join(passed_keys)} the sequence chooses needs their search speeds, which the folder "
                       "lacks", budget), row
    return Finding("steps", OK, f"{head}: matches the certificate; {len(cert.steps)} step(s): {seq}; "
                                f"{choice_text}{note}", budget), row


def check_order(f: Folder, budget: float, choice: dict[str, Any], plan: Any, alpha: float) -> Finding:
    """The candidates' order from the search figures, and the fixed sequence over it on the evidence."""
    from workers.certify.decide import fixed_sequence, order_candidates

    c = choice["certification"]
    keys = [s["candidate"] for s in c.get("steps") or []]
    outlook = next((o for o in f.cert.get("outlook") or () if close(float(o.get("budget", -1)), budget)), None)
    if str(c.get("reason", "")).startswith("refused"):
        return Finding("order", NOT_CHECKED, "the ledger refused the attempt: no candidate was tested", budget)
    cands, where, problems = f.search_candidates()
    if cands is None:
        if outlook is not None and keys and outlook.get("candidate") not in (None, keys[0]):
            return Finding("order", FAILED, f"the outlook puts {outlook['candidate']} first, the steps {keys[0]}", budget)
        return Finding("order", NOT_CHECKED, f"{where} (tested: {', '.join(keys) or 'none'})", budget)
    if problems:
        return Finding("order", FAILED, "; ".join(problems), budget)
    limit = f.args.get("confirm_candidates")
    ordered = order_candidates(cands, budget, limit=None if limit is None else int(limit))
    order_text = ", ".join(x.key for x in ordered) or "none"
    if outlook is not None and outlook.get("candidate") != (ordered[0].key if ordered else None):
        return Finding("order", FAILED, f"the safest-first order ({order_text}) starts with "
                       f"{ordered[0].key if ordered else 'no candidate'}, the outlook with {outlook.get('candidate')}",
                       budget)
    try:
        cert = fixed_sequence(ordered, _bound_of(f, plan, budget), budget, alpha)
    except _NoEvidence as err:
        return Finding("order", FAILED, f"the safest-first order ({order_text}, --confirm-candidates {limit}) tests "
                       f"{err.key}, whose evidence is not in the folder; the certificate lists "
                       f"{', '.join(keys) or 'none'}", budget)
    got = [k for k, _, _ in cert.steps]
    if got != keys:
        return Finding("order", FAILED, f"the fixed sequence over the safest-first order ({order_text}, "
                       f"--confirm-candidates {limit}) tests {', '.join(got) or 'none'}; the certificate lists "
                       f"{', '.join(keys) or 'none'}", budget)
    shown = cert.chosen.key if cert.chosen is not None else (got[0] if got else None)
    if c.get("candidate") is not None and c["candidate"] != shown:
        return Finding("order", FAILED, f"over the safest-first order ({order_text}) the fixed sequence chooses "
                       f"{shown}, the certificate {c['candidate']}", budget)
    return Finding("order", OK, f"{order_text} is the safest-first order (order_candidates, --confirm-candidates "
                   f"{limit}) of the {where}, the search bound recomputed from lost / won / n; its fixed sequence "
                   f"tests {', '.join(got) or 'nothing'}, as the certificate does", budget)


def check_family(f: Folder, budget: float, choice: dict[str, Any], plan: Any, alpha: float) -> Finding:
    """A certificate made before the family (``workers.certify.family``) re-decided at the level the family gives its
    attempt (alpha x 2^-k, k its place in the ledger history): the same steps, at a look plan of that level."""
    from workers.certify.decide import Candidate, fixed_sequence
    from workers.certify.family import family_alpha
    from workers.certify.sequential import RHO, look_plan

    c = choice["certification"]
    number = (c.get("family") or {}).get("number")
    if number is not None:
        return Finding("family", OK, f"tested at attempt #{number}'s family level {alpha:.4g} (the design check "
                       "recomputes it)", budget)
    if not choice.get("certified"):
        return Finding("family", OK, "not certified: a smaller level certifies nothing more", budget)
    aid, attempt = f.attempt_of(c)
    if attempt is None:
        return Finding("family", NOT_CHECKED, f"attempt {aid or '(none named)'} is not in the ledger history, so its "
                       "place in the family is unknown", budget)
    keys = [s_["candidate"] for s_ in c.get("steps") or ()]
    if not keys or any(f.evidence(k) is None for k in keys):
        return Finding("family", NOT_CHECKED, "the steps' evidence is not all here (see the steps check)", budget)
    k = f.number(aid)
    level = family_alpha(alpha, k)
    at = look_plan(plan.n, len(plan.sizes), level, RHO, budget)
    cands = [Candidate(key, _speed_of(f, key), math.nan, math.nan) for key in keys]
    cert = fixed_sequence(cands, _bound_of(f, at, budget), budget, level)
    seq = "; ".join(_step_text(key, b, ok) for key, b, ok in cert.steps)
    head = (f"made before the family: attempt #{k} of its benchmark and pair in the ledger history, re-decided at "
            f"{alpha:g} x 2^-{k} = {level:.4g}")
    if not cert.certified:
        return Finding("family", FAILED, f"{head}: it does not stand ({seq})", budget)
    return Finding("family", OK, f"{head}: it stands ({seq}; the fixed sequence chooses {cert.chosen.key})", budget)
