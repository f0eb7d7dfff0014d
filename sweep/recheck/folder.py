"""Reading a results folder and the ledger history for ``python -m jobs.results check``: the folder's files and
the history read once (:class:`Folder`), the evidence CSVs, what a check finds (:class:`Finding`) and everything
found in a folder (:class:`Verification`), and the small formatting helpers the checks share."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OK, FAILED, NOT_CHECKED = "ok", "FAILED", "not checked"
SUPERSEDED_EXIT = 3  # a withdrawn folder: not a failed check, but nothing to rely on either


def evidence_rows(path: Path) -> tuple[list[str], list[float], list[float]]:
    """(item ids, reference scores, candidate scores) of an evidence CSV, in its order."""
    ev = read_evidence(path)
    return ev.ids, ev.ref, ev.cand


@dataclass(frozen=True)
class Evidence:
    ids: list[str]
    ref: list[float]
    cand: list[float]
    made: list[str] | None  # how each candidate record was made (``replayed: ...`` / ``decoded in full``), if said
    rows: list[dict[str, str]] = field(default_factory=list)  # the CSV's rows as read (sweep.audit reads them so)


def read_evidence(path: Path) -> Evidence:
    with path.open() as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        made = "candidate_made" in (reader.fieldnames or ())
    return Evidence([r["item_id"] for r in rows], [float(r["reference_score"]) for r in rows],
                     [float(r["candidate_score"]) for r in rows], [r["candidate_made"] for r in rows] if made else None,
                     rows)


@dataclass(frozen=True)
class Finding:
    """One check's outcome: ``status`` is ``ok``, ``FAILED`` or ``not checked``; ``budget`` None for the folder."""

    check: str
    status: str
    text: str
    budget: float | None = None

    def line(self) -> str:
        where = f"budget {self.budget * 100:g}%: " if self.budget is not None else ""
        return f"{where}{self.check}: {self.status}: {self.text}"


@dataclass
class Verification:
    """Everything ``check`` found in a folder: the findings in print order, the superseded note (title, path) or
    None, and per budget the chosen step's recomputed figures (``recompute``'s rows)."""

    folder: Path
    findings: list[Finding] = field(default_factory=list)
    superseded: tuple[str, Path] | None = None
    budgets: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failed(self) -> list[Finding]:
        return [f for f in self.findings if f.status == FAILED]

    def exit_code(self) -> int:
        if self.superseded is not None:
            return SUPERSEDED_EXIT
        return 1 if self.failed or not self.budgets else 0

    def lines(self) -> list[str]:
        out = []
        if self.superseded is not None:
            out.append(f"superseded: {self.superseded[0]} (see {self.superseded[1]}): its certificates are withdrawn, "
                       "so it is reported as superseded, not as a failed check; the checks below are for the record")
        out += [f.line() for f in self.findings]
        counts = {s: sum(f.status == s for f in self.findings) for s in (OK, FAILED, NOT_CHECKED)}
        verdict = ("SUPERSEDED" if self.superseded is not None else "no certificate to check" if not self.budgets
                   else "FAILED: " + ", ".join(sorted({(f"budget {f.budget * 100:g}% " if f.budget is not None else "")
                                                       + f.check for f in self.failed})) if self.failed else "ok")
        out.append(f"check: {counts[OK]} ok, {counts[FAILED]} failed, {counts[NOT_CHECKED]} not checked: {verdict}")
        return out


def close(a: Any, b: Any, rel: float = 1e-9) -> bool:
    """Equal as recorded figures: None and nan alike, floats within a relative 1e-9."""
    def nan(x: Any) -> bool:
        return x is None or (isinstance(x, float) and math.isnan(x))

    if nan(a) or nan(b):
        return nan(a) and nan(b)
    return a == b or math.isclose(float(a), float(b), rel_tol=rel, abs_tol=1e-12)


def pct(budget: float) -> str:
    return f"{budget * 100:g}%"


def pval(value: float | None) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4g}"


class Folder:
    """What one results folder and the ledger history hold, read once."""

    def __init__(self, folder: Path, history: Path | None) -> None:
        from workers.results.history import history_path, read_rows
        from workers.results.ledger import combine

        self.folder = folder
        self.cert = json.loads((folder / "certification.json").read_text())
        meta = folder / "sweep.json"
        self.args: dict[str, Any] | None = json.loads(meta.read_text()).get("args") if meta.is_file() else None
        listed = folder / "search_items.txt"
        self.search_ids: list[str] | None = listed.read_text().split() if listed.is_file() else None
        front = folder / "frontier.json"
        self.frontier: dict[str, Any] | None = json.loads(front.read_text()) if front.is_file() else None
        self.history = Path(history) if history is not None else history_path()
        self.rows = read_rows(self.history)
        self.attempts = combine(self.rows)  # attempt id -> opened row, decided rows, used items: in history order
        self._evidence: dict[str, Evidence | None] = {}
        self._pool: list[str] | None = None
        self._sample: list[str] | None = None
        self._search: tuple[list[Any] | None, str, list[str]] | None = None

    # -- the folder ---------------------------------------------------------------------------------

    def evidence(self, key: str) -> Evidence | None:
        if key not in self._evidence:
            path = self.folder / "evidence" / f"{key}.csv"
            self._evidence[key] = read_evidence(path) if path.is_file() else None
        return self._evidence[key]

    @property
    def choices(self) -> list[tuple[str, dict[str, Any]]]:
        return list(self.cert["budgets"].items())

    def chosen_file(self, key: str) -> dict[str, Any] | None:
        """``chosen-budget-<b>.json`` of budget ``key`` (as certification.json keys it), or None."""
        path = self.folder / f"chosen-budget-{key}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def chosen_search(self) -> dict[str, dict[str, Any]]:
        """candidate key -> the search figures a chosen file records for it (``search``)."""
        out = {}
        for _, choice in self.choices:
            if choice.get("trial") is not None and isinstance(choice.get("search"), dict):
                out[f"trial-{choice['trial']}"] = choice["search"]
        return out

    def benchmark(self) -> Any:
        from workers.benchmarks import get_benchmark

        return get_benchmark(self.args["benchmark"])

    def pool(self) -> list[str]:
        """The confirmation pool's item ids in its fixed order, without this study's search items."""
        if self._pool is None:
            bench = self.benchmark()
            searched = set(self.search_ids or ())
            search = [it for it in bench.items(split="search") if it.id in searched]
            self._pool = [it.id for it in bench.confirmation_pool(search)[0]]
        return self._pool

    def search_sample(self) -> list[str]:
        """The sweep's search sample again, from sweep.json's benchmark, --items and --subset-seed (as export writes
        search_items.txt)."""
        if self._sample is None:
            self._sample = [it.id for it in self.benchmark().items(limit=self.args["items"] or None,
                                                                   seed=self.args.get("subset_seed"), split="search")]
        return self._sample

    # -- the ledger history -------------------------------------------------------------------------

    def attempt_of(self, c: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
        """(the certificate's attempt id, its attempt in the history or None). A certificate made before the ledger
        names none: its attempt is the one whose study names this folder."""
        aid = c.get("attempt")
        if aid:
            return aid, self.attempts.get(aid)
        named = [a for a in self.attempts.values() if f"docs/results/{self.folder.name}" in str(a.get("study", ""))]
        return (named[0]["attempt"], named[0]) if named else (None, None)

    def earlier(self, aid: str) -> list[dict[str, Any]]:
        """The attempts opened before ``aid`` in the history on its ledger key (benchmark and pair)."""
        keys, mine = list(self.attempts), self.attempts[aid]
        return [a for a in (self.attempts[k] for k in keys[: keys.index(aid)])
                if (a.get("benchmark"), a.get("pair_id")) == (mine.get("benchmark"), mine.get("pair_id"))]

    def number(self, aid: str) -> int:
        """``aid``'s place in its family (its benchmark and pair's attempts): the number its opened row records, else
        the next in the history's order, as a ledger numbers the shipped history when it imports it."""
        mine, numbers = self.attempts[aid], {}
        for a in self.attempts.values():
            if (a.get("benchmark"), a.get("pair_id")) != (mine.get("benchmark"), mine.get("pair_id")):
                continue
            given = (a.get("family") or {}).get("number")
            numbers[a["attempt"]] = int(given) if given is not None else max(numbers.values(), default=0) + 1
        return numbers[aid]

    # -- the search ---------------------------------------------------------------------------------

    def search_candidates(self) -> tuple[list[Any] | None, str, list[str]]:
        """(the search's candidates as the sweep builds them, or None; where from, or why not; disagreements between
        frontier.json's trial rows and the chosen files' search figures)."""
        if self._search is None:
            self._search = self._search_candidates()
        return self._search

    def _search_candidates(self) -> tuple[list[Any] | None, str, list[str]]:
        from sweep.certificates import candidates_from
        from workers.certify.decide import drop_bound_from_counts

        if self.args is None:
            return None, "no sweep.json: the objective, alpha and --confirm-candidates are unknown", []
        if self.frontier is None or not self.frontier.get("trials"):
            return None, "no frontier.json trial rows: the search's other trials are not in this folder", []
        column = {"vs-best-lossless": "vs_best_lossless", "vs-ar": "vs_target_only"}.get(
            self.args.get("objective", "vs-ar"))
        if column is None:
            return None, f"frontier.json's trial rows do not hold the objective {self.args.get('objective')!r}", []
        alpha = float(self.args.get("alpha", 0.05))
        rows, unknown = [], []
        for r in self.frontier["trials"]:
            lost, won, n = r.get("lost"), r.get("won"), r.get("items")
            if r.get("state") == "COMPLETE" and None in (lost, won, n):
                unknown.append(f"trial-{r['trial']}")
                continue
            upper = drop_bound_from_counts(int(lost), int(won), int(n), alpha).upper if None not in (lost, won, n) \
                else math.nan
            rows.append({"trial": r["trial"], "state": r.get("state"), "speedup": r.get(column, math.nan),
                         "accuracy_drop": r.get("drop"), "accuracy_drop_upper": upper,
                         "discordance": r.get("discordance", math.nan)})
        if unknown:
            return None, f"frontier.json lacks lost / won / items for {', '.join(unknown)}", []
        candidates = candidates_from(_Rows(rows))
        by_key = {c.key: c for c in candidates}
        problems = []
        for key, s in self.chosen_search().items():
            c = by_key.get(key)
            if c is None:
                problems.append(f"{key}, a chosen candidate, is not a complete trial of frontier.json")
                continue
            for name, mine, theirs in (("speed", c.speed, s.get("speedup")), ("drop", c.search_drop, s.get("accuracy_drop")),
                                       ("search bound", c.search_upper, s.get("accuracy_drop_upper"))):
                if theirs is not None and not close(mine, theirs, 1e-6):
                    problems.append(f"{key}'s {name} from frontier.json is {mine:.6g}, its chosen file says {theirs:.6g}")
        return candidates, f"{len(candidates)} complete trials of frontier.json", problems


class _Rows(list):
    """Trial rows as the sweep's trials frame offers them to ``candidates_from``."""

    def iter_rows(self, named: bool = True) -> Any:
        return iter(self)
