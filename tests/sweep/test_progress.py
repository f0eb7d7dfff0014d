"""The live progress line: items, items/s, tokens/s and ETA; in place on a terminal, throttled in a log."""

from __future__ import annotations

import io
from types import SimpleNamespace

from sweep.progress import Progress


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_output_is_throttled_but_always_ends_with_the_final_count():
    out = io.StringIO()
    bar = Progress("trial 3", total=5, stream=out, every_s=3600)
    for _ in range(5):
        bar.update(SimpleNamespace(tokens=10, failed=False))
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, "first item and last item only, with a one-hour throttle"
    assert "5/5 items" in lines[-1] and "items/s" in lines[-1] and "tok/s" in lines[-1] and "ETA" in lines[-1]


def test_terminal_redraws_in_place_and_counts_failures_and_resumed_items():
    out = Tty()
    bar = Progress("confirm trial-1", total=4, done=2, stream=out, extra="search best ≤5%: 1.40x")
    bar.update(SimpleNamespace(tokens=3, failed=True))
    bar.close("stopped early: the bound rules it out")
    text = out.getvalue()
    assert "\r" in text and "3/4 items" in text and "1 failed" in text and "≤5%: 1.40x" in text
    assert text.rstrip().endswith("stopped early: the bound rules it out")
