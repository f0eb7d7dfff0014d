"""Where the certificate ledger's rows live: a SQL database, the same kind of store as Optuna's and MLflow's.

``sqlite:///<folder>/ledger.db`` on one machine (the default folder is ``$SPECTUNE_LEDGER``, else
``<asset cache>/ledger``); any SQLAlchemy URL for a team (``postgresql+psycopg://user@host/db``): two sweeps on
two machines then share one ledger, and Postgres, unlike sqlite on a network file system, keeps its
constraints across machines. Three tables:

- ``ledger_rows``: every ``opened`` and ``decided`` row (:mod:`workers.results.ledger`), as JSON, with its
  benchmark, pair and attempt; one ``opened`` row per attempt and one ``decided`` row per (attempt, budget), by a
  uniqueness constraint, and a row imported twice (same content) is kept once;
- ``ledger_claims``: (benchmark, pair, item) -> the attempt that took it. The primary key is what makes an item
  confirm once: two attempts racing from two processes or machines cannot both insert a claim on one item, so
  the second's transaction fails and it chooses again (or is refused);
- ``ledger_numbers``: (benchmark, pair, number) -> attempt: the attempt's place in its family
  (:mod:`workers.certify.family`), unique for the same reason.

The shipped history (:mod:`workers.results.history`) is imported into every store when it is opened, and so are
the JSON-lines ledgers of earlier versions found in a sqlite store's folder (``*.jsonl``): each file once, by its
content's sha256. Knows rows, items and attempts; nothing about models, Ray or MLflow.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from workers.results.history import KNOWN, combine, parse_lines

__all__ = ["DB_NAME", "LEDGER_ENV", "Store", "ledger_root", "ledger_url", "parse_lines", "shown", "store"]

LEDGER_ENV = "SPECTUNE_LEDGER"
DB_NAME = "ledger.db"


def ledger_root() -> Path:
    """``$SPECTUNE_LEDGER`` (a folder), else ``<asset cache>/ledger`` (``$SPECTUNE_CACHE`` moves the asset cache)."""
    given = os.environ.get(LEDGER_ENV)
    if given and "://" not in given:
        return Path(given).expanduser().resolve()
    from workers.models.assets import cache_root

    return cache_root() / "ledger"


def ledger_url(given: str | os.PathLike[str] | None = None) -> str:
    """The ledger's SQLAlchemy URL: ``given`` (a URL, or a folder for a sqlite file in it), else
    ``$SPECTUNE_LEDGER`` (either), else a sqlite file in :func:`ledger_root`."""
    text = os.fspath(given) if given is not None else os.environ.get(LEDGER_ENV, "")
    if "://" in text:
        return text
    folder = Path(text).expanduser().resolve() if text else ledger_root()
    return f"sqlite:///{folder / DB_NAME}"


def shown(url: str) -> str:
    """The URL as a log line may show it (a password hidden)."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - a URL SQLAlchemy cannot parse is refused where it is opened
        return url


def row_digest(row: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(row, sort_keys=True).encode()).hexdigest()


def budget_key(row: dict[str, Any]) -> str:
    return str(float(row["budget"])) if row.get("event") == "decided" and row.get("budget") is not None else ""


class Store:
    """One ledger database (one URL), shared by every (benchmark, pair) it holds. Use :func:`store`."""

    def __init__(self, url: str) -> None:
        import sqlalchemy as sa

        self.url = url
        try:
            parsed = sa.engine.make_url(url)
        except Exception as err:  # noqa: BLE001 - any unparsable URL is the user's input, said as such
            raise ValueError(f"the ledger URL {url!r} is not a SQLAlchemy URL ({err})") from None
        self.sqlite = parsed.get_backend_name() == "sqlite"
        if self.sqlite and parsed.database and not parsed.database.endswith(".db"):
            raise ValueError(f"the ledger URL {url!r}: a sqlite ledger is a .db file")
        self.folder: Path | None = None
        kwargs: dict[str, Any] = {}
        if self.sqlite:
            if not parsed.database or parsed.database == ":memory:":
                raise ValueError(f"the ledger URL {url!r} names no sqlite file: a ledger must outlive the process")
            self.folder = Path(parsed.database).expanduser().resolve().parent
            self.folder.mkdir(parents=True, exist_ok=True)
            kwargs["connect_args"] = {"timeout": 120}
        try:
            self.engine = sa.create_engine(url, **kwargs)
        except Exception as err:  # noqa: BLE001 - a missing driver or a bad option: one line naming the URL
            raise ValueError(f"cannot open the ledger at {shown(url)}: {type(err).__name__}: {err}") from None
        if self.sqlite:
            @sa.event.listens_for(self.engine, "connect")
            def _no_implicit_begin(dbapi_conn: Any, _record: Any) -> None:
                dbapi_conn.isolation_level = None  # the driver's own BEGIN is replaced by the one below

            @sa.event.listens_for(self.engine, "begin")
            def _begin_immediate(conn: Any) -> None:
                conn.exec_driver_sql("BEGIN IMMEDIATE")  # a writer takes the file's write lock before it reads

        meta = sa.MetaData()
        self.rows_t = sa.Table(
            "ledger_rows", meta,
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("benchmark", sa.String(200), nullable=False),
            sa.Column("pair_id", sa.String(300), nullable=False),
            sa.Column("attempt", sa.String(100), nullable=False),
            sa.Column("event", sa.String(20), nullable=False),
            sa.Column("budget", sa.String(40), nullable=False),
            sa.Column("digest", sa.String(64), nullable=False, unique=True),
            sa.Column("source", sa.String(500), nullable=False),
            sa.Column("body", sa.Text, nullable=False),
            sa.UniqueConstraint("benchmark", "pair_id", "attempt", "event", "budget", name="one_row_per_event"))
        self.claims_t = sa.Table(
            "ledger_claims", meta,
            sa.Column("benchmark", sa.String(200), primary_key=True),
            sa.Column("pair_id", sa.String(300), primary_key=True),
            sa.Column("item", sa.String(300), primary_key=True),
            sa.Column("attempt", sa.String(100), nullable=False))
        self.numbers_t = sa.Table(
            "ledger_numbers", meta,
            sa.Column("benchmark", sa.String(200), primary_key=True),
            sa.Column("pair_id", sa.String(300), primary_key=True),
            sa.Column("number", sa.Integer, primary_key=True, autoincrement=False),
            sa.Column("attempt", sa.String(100), nullable=False))
        self.imports_t = sa.Table(
            "ledger_imports", meta,
            sa.Column("sha256", sa.String(64), primary_key=True),
            sa.Column("source", sa.String(500), nullable=False))
        try:
            meta.create_all(self.engine)
        except Exception as err:  # noqa: BLE001 - no server, no permission, a locked file: said in one line
            raise ValueError(f"cannot open the ledger at {shown(url)}: {type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else ''}") from None
        self._lock = threading.Lock()

    # -- reading ---------------------------------------------------------------------------------

    def rows(self, benchmark: str, pair_id: str) -> list[dict[str, Any]]:
        """The rows of one (benchmark, pair), in the order they were written."""
        import sqlalchemy as sa

        t = self.rows_t
        with self.engine.connect() as conn:
            got = conn.execute(sa.select(t.c.body).where(t.c.benchmark == benchmark, t.c.pair_id == pair_id)
                               .order_by(t.c.id)).scalars().all()
        return [json.loads(body) for body in got]

    def all_rows(self) -> list[dict[str, Any]]:
        import sqlalchemy as sa

        with self.engine.connect() as conn:
            got = conn.execute(sa.select(self.rows_t.c.body).order_by(self.rows_t.c.id)).scalars().all()
        return [json.loads(body) for body in got]

    def numbers(self, benchmark: str, pair_id: str) -> dict[str, int]:
        """attempt -> its number in the family."""
        import sqlalchemy as sa

        t = self.numbers_t
        with self.engine.connect() as conn:
            got = conn.execute(sa.select(t.c.attempt, t.c.number).where(t.c.benchmark == benchmark,
                                                                      t.c.pair_id == pair_id)).all()
        return {a: int(n) for a, n in got}

    def claims(self, benchmark: str, pair_id: str) -> dict[str, str]:
        """item -> the attempt holding it."""
        import sqlalchemy as sa

        t = self.claims_t
        with self.engine.connect() as conn:
            got = conn.execute(sa.select(t.c.item, t.c.attempt).where(t.c.benchmark == benchmark,
                                                                    t.c.pair_id == pair_id)).all()
        return dict(got)

    # -- writing ---------------------------------------------------------------------------------

    def _row_values(self, row: dict[str, Any], source: str) -> dict[str, Any]:
        return {"benchmark": str(row["benchmark"]), "pair_id": str(row["pair_id"]), "attempt": str(row["attempt"]),
                "event": str(row["event"]), "budget": budget_key(row), "digest": row_digest(row), "source": source,
                "body": json.dumps(row)}

    def open_attempt(self, row: dict[str, Any], number: int, items: Sequence[str]) -> None:
        """In one transaction: the ``opened`` row, the attempt's number and a claim on each of ``items``.
        ``sqlalchemy.exc.IntegrityError`` where another attempt holds an item or the number (nothing written)."""
        import sqlalchemy as sa

        key = {"benchmark": row["benchmark"], "pair_id": row["pair_id"]}
        with self.engine.begin() as conn:
            conn.execute(sa.insert(self.rows_t), [self._row_values(row, "local")])
            conn.execute(sa.insert(self.numbers_t), [{**key, "number": number, "attempt": row["attempt"]}])
            if items:
                conn.execute(sa.insert(self.claims_t), [{**key, "item": i, "attempt": row["attempt"]} for i in items])

    def add_row(self, row: dict[str, Any], source: str = "local") -> bool:
        """One row; False where the row (or another for the same event) is there already."""
        import sqlalchemy as sa
        from sqlalchemy.exc import IntegrityError

        try:
            with self.engine.begin() as conn:
                conn.execute(sa.insert(self.rows_t), [self._row_values(row, source)])
        except IntegrityError:
            return False
        return True

    def release(self, benchmark: str, pair_id: str, attempt: str, items: Iterable[str]) -> None:
        """Free the claims ``attempt`` holds on ``items`` (a group-sequential attempt that stopped early never
        evaluated them)."""
        import sqlalchemy as sa

        items = list(items)
        if not items:
            return
        t = self.claims_t
        with self.engine.begin() as conn:
            for start in range(0, len(items), 500):
                conn.execute(sa.delete(t).where(t.c.benchmark == benchmark, t.c.pair_id == pair_id,
                                                t.c.attempt == attempt, t.c.item.in_(items[start:start + 500])))

    def _claim_quietly(self, benchmark: str, pair_id: str, attempt: str, items: Iterable[str],
                       number: int | None) -> None:
        """An imported attempt's claims and number, each where no one holds it (an imported attempt can overlap a
        local one: both are in the rows, and ``check`` reports it)."""
        import sqlalchemy as sa
        from sqlalchemy.exc import IntegrityError

        key = {"benchmark": benchmark, "pair_id": pair_id}
        with self.engine.connect() as conn:
            held = set(conn.execute(sa.select(self.claims_t.c.item).where(
                self.claims_t.c.benchmark == benchmark, self.claims_t.c.pair_id == pair_id)).scalars().all())
            numbered = conn.execute(sa.select(self.numbers_t.c.number, self.numbers_t.c.attempt).where(
                self.numbers_t.c.benchmark == benchmark, self.numbers_t.c.pair_id == pair_id)).all()
        todo = [i for i in dict.fromkeys(items) if i not in held]
        try:
            with self.engine.begin() as conn:
                if todo:
                    conn.execute(sa.insert(self.claims_t), [{**key, "item": i, "attempt": attempt} for i in todo])
                if number is not None and attempt not in {a for _, a in numbered}:
                    taken = {n for n, _ in numbered}
                    while number in taken:
                        number += 1
                    conn.execute(sa.insert(self.numbers_t), [{**key, "number": number, "attempt": attempt}])
        except IntegrityError:  # a racing importer did the same: what it wrote is what was wanted
            pass

    def import_rows(self, rows: Iterable[dict[str, Any]], source: str) -> int:
        """Rows from elsewhere (the shipped history, an old JSON-lines ledger, a carried archive): each kept once;
        every attempt they open gets its number (next in its family, in the rows' order) and claims the items it
        used where no attempt holds them. Returns the rows added."""
        rows = [r for r in rows if isinstance(r, dict) and {"benchmark", "pair_id", "attempt", "event"} <= set(r)]
        added = [r for r in rows if self.add_row(r, source)]
        keys = dict.fromkeys((r["benchmark"], r["pair_id"]) for r in added)
        for bench, pair in keys:
            attempts = combine(self.rows(bench, pair))
            have = self.numbers(bench, pair)
            nxt = max(have.values(), default=0) + 1
            touched = {r["attempt"] for r in added if (r["benchmark"], r["pair_id"]) == (bench, pair)}
            for aid, a in attempts.items():
                if aid not in touched:
                    continue
                self._claim_quietly(bench, pair, aid, a["used"], None if aid in have else nxt)
                if aid not in have:
                    nxt = max(self.numbers(bench, pair).values(), default=nxt) + 1
        return len(added)

    def import_file(self, path: Path, source: str | None = None) -> int:
        """A JSON-lines file of ledger rows, once per content (lines that are not JSON objects are skipped: a
        line torn by a crash). Returns the rows added."""
        import sqlalchemy as sa
        from sqlalchemy.exc import IntegrityError

        blob = path.read_bytes()
        sha = hashlib.sha256(blob).hexdigest()
        with self.engine.connect() as conn:
            if conn.execute(sa.select(self.imports_t.c.sha256).where(self.imports_t.c.sha256 == sha)).first():
                return 0
        added = self.import_rows(parse_lines(blob.decode(errors="replace").splitlines()), source or str(path))
        try:
            with self.engine.begin() as conn:
                conn.execute(sa.insert(self.imports_t), [{"sha256": sha, "source": source or str(path)}])
        except IntegrityError:
            pass
        return added


_STORES: dict[str, Store] = {}
_STORES_LOCK = threading.Lock()


def store(url: str) -> Store:
    """The store at ``url``, opened once per process, with the shipped history and the folder's old JSON-lines
    ledgers imported (each file once)."""
    with _STORES_LOCK:
        got = _STORES.get(url)
        if got is not None and got.folder is not None and not (got.folder / DB_NAME).is_file():
            got.engine.dispose()  # its file was removed (a test, a user starting afresh): open a new one
            got = None
        if got is None:
            got = _STORES[url] = Store(url)
        got.import_file(KNOWN, "shipped")
        if got.folder is not None:
            for path in sorted(got.folder.glob("*.jsonl")):
                got.import_file(path, f"jsonl:{path.name}")
        return got
