"""What every command-line entry point shares: bad input is one line, never a traceback."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable


def one_line_errors(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """Wrap a CLI ``main(argv) -> exit code``: a bad name or value (ValueError) or a missing or
    corrupt asset (AssetError) prints ``error: <what>`` naming the problem and exits 2."""

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        from workers.assets import AssetError

        try:
            return main(argv)
        except (ValueError, AssetError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2

    return wrapper
