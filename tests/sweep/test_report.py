"""sweep.report: the frontier of a study resumed with its search done (no trial runs in that process) still has its
lossless table, read from the reference stores; the int4+int8 frontier's page lost it so."""

from __future__ import annotations

from argparse import Namespace
from types import SimpleNamespace

from sweep.references import References, RefKey
from sweep.report import frontier_of
from sweep.settings import Settings
from tests.workers.metrics.test_frontier import rec
from workers.benchmarks.base import Item
from workers.metrics.cost import CostModel


def test_a_resumed_study_that_only_reports_keeps_its_lossless_table(tmp_path):
    args = Namespace(dtype="int8", replay="auto", engine="cpu", pair="tiny-random", cpus_per_actor=1,
                     trial_timeout=None)
    settings = Settings(args=args, bench=SimpleNamespace(key="gsm8k", ref="gsm8k"), budgets=[0.05],
                        families=["kl_judge"], draft_len=(2, 3), enqueue=[], ranges={}, search_overrides=None,
                        decode={"temperature": 0.0, "seed": 0, "shots": 0, "max_new_tokens": 8})
    items = [Item(id=i, index=n, turns=("q",), reference="1") for n, i in enumerate(("a", "b"))]
    refs = References(settings, tmp_path, workers=[], items=items)  # no actors: nothing may be decoded
    # what the study's first process left in the shared reference stores: target-only and lossless at L 2 and 3
    for spec, made in ((refs.target_only_spec(), lambda i: rec(i, 8, 8, 0, 0, 0, draft_len=0)),
                       (refs.lossless_spec(2), lambda i: rec(i, 8, 4, 8, 4, 8, draft_len=2)),
                       (refs.lossless_spec(3), lambda i: rec(i, 8, 3, 9, 5, 9, draft_len=3))):
        store = refs.store(spec)
        for it in items:
            store.append(made(it.id))
    state = SimpleNamespace(settings=settings, refs=refs, cost=CostModel(0.25), profile={})
    assert not refs.has(RefKey.lossless(2)) and not refs.has(RefKey.target_only())
    data = frontier_of(state, None, {}, None)  # a resumed process's cache is empty: the stores are read
    assert [r["draft_len"] for r in data["lossless"]] == [0, 2, 3]
    assert all(r["items"] == 2 for r in data["lossless"])
    assert data["best_lossless"]["draft_len"] == 3  # 8 / (3 + 0.25 * 9) against 8 / (4 + 0.25 * 8) and target-only 1
    assert data["ceiling"] and data["ceiling_best"] > 1
