"""Count the places where code would wait for a GPU: device-to-host reads and data-dependent shapes.

On a GPU each of these blocks the host until the device has caught up (``.item()``, ``int(t)``,
``.tolist()``, ``.cpu()``, ``nonzero``, boolean-mask indexing, ``unique``, ``repeat_interleave``
without an output size, ``masked_select``). Counting them on CPU tensors says how many the same code
would make on a GPU, without one:

    with HostSyncs() as syncs:
        decide_step(...)
    syncs.total, syncs.by_kind

Host-to-device copies block too: ``torch.tensor(host_list, device=cuda)`` (or ``as_tensor``) waits for the
copy, so each such call with an explicit device is counted (kind ``h2d``) wherever it runs; a pinned buffer
copied with ``non_blocking=True`` (:func:`to_device`) is not.

It is a count of call sites reached, not a timing; on CUDA, ``torch.cuda.set_sync_debug_mode`` is the
direct check.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that read device memory on the host or size their output from data
_SYNC_OPS = {
    "aten._local_scalar_dense.default": "item",  # .item(), int(t), float(t), bool(t)
    "aten.nonzero.default": "nonzero",  # also boolean-mask indexing
    "aten.masked_select.default": "masked_select",
    "aten._unique2.default": "unique",
    "aten.unique_consecutive.default": "unique",
    "aten.unique_dim.default": "unique",
    "aten.repeat_interleave.Tensor": "repeat_interleave",
    "aten.index.Tensor": None,  # counted only with a boolean index (it calls nonzero on GPUs)
}


class HostSyncs(TorchDispatchMode):
    """A dispatch mode that counts would-be host syncs (see the module docstring). ``.tolist()`` and
    ``.cpu()``/``.numpy()`` do not pass through dispatch on CPU tensors, so they are counted by wrapping
    the Tensor methods for the duration."""

    _WRAPPED = ("tolist", "cpu", "numpy")
    _FACTORIES = ("tensor", "as_tensor")  # host data to an explicit device: a blocking copy on a GPU

    def __init__(self) -> None:
        super().__init__()
        self.by_kind: Counter[str] = Counter()
        self._saved: dict[str, Any] = {}
        self._depth = 0

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        name = str(func)
        if name in _SYNC_OPS and self._depth == 0:
            kind = _SYNC_OPS[name]
            if kind is None:
                indices = args[1] if len(args) > 1 else ()
                if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                    self.by_kind["bool_index"] += 1
            else:
                self.by_kind[kind] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> HostSyncs:
        for method in self._WRAPPED:
            original = getattr(torch.Tensor, method)
            self._saved[method] = original

            def counted(t: torch.Tensor, *a: Any, _m: str = method, _f: Any = original, **k: Any) -> Any:
                if self._depth == 0:
                    self.by_kind[_m] += 1
                self._depth += 1
                try:
                    return _f(t, *a, **k)
                finally:
                    self._depth -= 1

            setattr(torch.Tensor, method, counted)
        for name in self._FACTORIES:
            factory = getattr(torch, name)
            self._saved["torch." + name] = factory

            def copied(data: Any, *a: Any, _f: Any = factory, **k: Any) -> Any:
                if self._depth == 0 and k.get("device") is not None and not isinstance(data, torch.Tensor):
                    self.by_kind["h2d"] += 1
                return _f(data, *a, **k)

            setattr(torch, name, copied)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for method, original in self._saved.items():
            if method.startswith("torch."):
                setattr(torch, method[len("torch."):], original)
            else:
                setattr(torch.Tensor, method, original)
        self._saved.clear()
        return super().__exit__(*exc)


def to_device(values: Any, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host values on ``device`` without the host waiting: on CUDA through a pinned buffer copied with
    ``non_blocking=True`` (the stream orders it before any kernel that reads it); elsewhere as they are."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t if device.type == "cpu" else t.to(device)
