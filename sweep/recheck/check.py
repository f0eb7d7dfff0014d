"""Every check of a results folder, in print order: what ``python -m jobs.results check`` runs (the checks
themselves: :mod:`sweep.recheck.decisions`, :mod:`sweep.recheck.items`, :mod:`sweep.recheck.audit`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sweep.recheck.audit import check_audit
from sweep.recheck.decisions import check_design, check_family, check_order, check_steps
from sweep.recheck.folder import FAILED, OK, Folder, Verification
from sweep.recheck.items import check_chosen, check_disjoint, check_frontier, check_ledger, check_pool

# the checks of each budget, in print order (the folder's ``frontier`` follows them)
CHECKS = ("steps", "order", "design", "pool", "disjoint", "audit", "ledger", "family", "chosen")


def verify(folder: Path, history: Path | None = None) -> Verification:
    """Every check of ``folder`` against the ledger history ``history`` (default: the shipped one)."""
    from workers.results.scope import withdrawn

    folder = Path(folder)
    f = Folder(folder, history)
    out = Verification(folder, superseded=withdrawn(folder))
    for key, choice in f.choices:
        c = choice["certification"]
        budget = float(choice["budget"])
        design, plan, alpha = check_design(f, budget, c)
        steps, row = check_steps(f, budget, choice, plan, alpha)
        pool, front = check_pool(f, budget, c)
        disjoint, apart = check_disjoint(f, budget, c)
        replay_check = (f.chosen_file(key) or choice).get("replay_check")  # the chosen file's, which Serve reads
        found = [steps, check_order(f, budget, choice, plan, alpha), design, pool, disjoint,
                 check_audit(f, budget, choice, replay_check, plan), check_ledger(f, budget, choice),
                 check_family(f, budget, choice, plan, alpha), check_chosen(f, key, budget, choice)]
        out.findings += found
        row.update(key=key, design_matches=design.status == OK, pool_front=front, disjoint=apart,
                   checks={x.check: x.status for x in found}, ok=all(x.status != FAILED for x in found))
        out.budgets.append(row)
    out.findings.append(check_frontier(f))
    return out


def recompute(folder: Path, history: Path | None = None) -> list[dict[str, Any]]:
    """Per budget: its chosen (or first) step recomputed from the evidence (budget, certified, p_value, n, lost, won),
    whether every step matches the certificate (``matches``), whether the design recomputes (``design_matches``),
    whether the items are the pool front by the ledger (``pool_front``) and apart from the search (``disjoint``;
    those two None where the folder cannot tell), each check's status (``checks``) and ``ok``: no check of the
    budget failed. :func:`verify` has the findings themselves."""
    return verify(folder, history).budgets
