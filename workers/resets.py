""":func:`resets_on_error`: a generation, or replay's teacher-forced pass, that fails part-way drops both models'
caches. Shared by the CPU engine (``workers.cpu_engine``) and replay (``workers.replay``), which the engine's
evaluation calls: here, so that replay need not import the engine back."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def resets_on_error(method: Callable[..., Any]) -> Callable[..., Any]:
    """A generation (or replay's teacher-forced pass) that fails part-way leaves caches whose ids may not match
    their contents: drop them so the next request starts clean (and the error still propagates). The wrapped
    callable takes the engine (a ``workers.cpu_engine.SpecDecoder``: ``target`` and ``draft`` with ``reset()``)
    first."""
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            self.target.reset()
            self.draft.reset()
            raise
    return wrapper
