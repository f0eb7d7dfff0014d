"""The ledger on a team's Postgres: a real server started here (the machine's PostgreSQL binaries, a throwaway
cluster on 127.0.0.1), the same contract as on sqlite, and racing processes still never share an item."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from tests.workers.results.test_ledger import POOL, plan, race
from workers.results.ledger import AttemptLedger, LedgerRefusal


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def team_db(tmp_path_factory):
    """``scripts/team-db start DIR PORT`` as docs/usage.md shows it: the three stores' URLs, by name."""
    if not shutil.which("initdb") or not shutil.which("pg_ctl"):
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) on this machine")
    base = tmp_path_factory.mktemp("pg")
    if os.geteuid() == 0:  # the cluster belongs to the postgres user, who must reach its folder
        for folder in [base, *base.parents]:
            if folder == Path(folder.anchor):
                break
            os.chmod(folder, os.stat(folder).st_mode | 0o005)
    port = _free_port()
    out = subprocess.run(["bash", str(ROOT / "scripts" / "team-db"), "start", str(base), str(port)], check=True,
                         capture_output=True, text=True).stdout
    urls = dict(line.split(": ", 1) for line in out.splitlines())
    try:
        yield urls
    finally:
        subprocess.run(["bash", str(ROOT / "scripts" / "team-db"), "stop", str(base)], capture_output=True)


@pytest.fixture(scope="module")
def postgres(team_db):
    return team_db["ledger"]


def test_a_postgres_ledger_keeps_the_contract(postgres):
    ledger = AttemptLedger("gsm8k", "pair:pg", postgres)
    assert ledger.path.startswith("postgresql+psycopg://postgres@127.0.0.1")
    aid, items, earlier = ledger.open(plan(n=40), POOL, False, pair="p", dtype="fp32")
    assert items == POOL[:40] and earlier == [] and ledger.attempts()[aid]["number"] == 1
    with pytest.raises(LedgerRefusal, match="already used"):
        ledger.open(plan(study="s2", n=40), POOL, False, pair="p", dtype="fp32")
    ledger.decide(aid, 0.05, False, "not certified", 40)
    second, items2, _ = ledger.open(plan(study="s2", n=40), POOL, True, pair="p", dtype="fp32")
    assert items2 == POOL[40:80] and ledger.attempts()[second]["number"] == 2
    # the shipped history is in a team's ledger too
    shipped = AttemptLedger("gsm8k", "pair:160a47d7a09bd32b511d1dfcb7c21692", postgres)
    assert len(shipped.attempts()) == 4 and shipped.next_number() == 5


def test_attempts_racing_on_postgres_never_share_an_item(postgres, tmp_path):
    items = [i for _, got in race(postgres, 4, "q", tmp_path) for i in got]
    assert len(items) == 16 * 7 and len(set(items)) == len(items), "two racing attempts took one item"
