"""Find the operations that make the host wait for a CUDA device, on any device (the CPU included).

On a GPU, ``torch.cuda.set_sync_debug_mode`` reports synchronising calls. Without one, :class:`HostSyncs`
records the torch operations that synchronise when their tensors are on a CUDA device: reading a value
on the host (``item()``, ``int(t)``, ``bool(t)``: ``_local_scalar_dense``), and operations whose output
shape depends on the data (``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing,
``repeat_interleave`` without ``output_size``, ``bincount``, ``equal``). Each is attributed to the
innermost frame of a ``kvcomp`` module on the stack (:attr:`HostSync.where`), or ``None`` when kvcomp is
not on the stack (transformers' own step); operations inside a Triton launch (the CPU interpreter's own
copies) are left out. It sees what goes through torch's dispatcher from Python: ``tensor.tolist()``,
copies to the host and synchronisation inside a C++ operator are not seen, so
``benchmarks/bench_decode_e2e.py`` counts with the debug mode on a GPU.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PACKAGE = Path(os.path.realpath(__file__)).parent.parent  # .../kvcomp
DATA_DEPENDENT = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
                  "bincount", "equal", "argwhere"}


@dataclass(frozen=True)
class HostSync:
    """One synchronising operation: its name and where kvcomp issued it (``file:line in function``)."""

    op: str
    where: str | None


def _synchronises(func, args, kwargs) -> bool:
    name = func._schema.name.split("::")[-1]
    if name in DATA_DEPENDENT:
        return True
    if name == "repeat_interleave":  # tensor repeats: the output length is their sum
        return func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
    if name in ("index", "index_put", "index_put_"):  # boolean masks as indices become nonzero()
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
    return False


def _origin() -> tuple[bool, str | None]:
    """``(inside a Triton launch, innermost kvcomp frame)`` of the current operation, from the modules on
    the stack. Operations inside a launch are the CPU interpreter's own (a launch on a GPU is
    asynchronous)."""
    frame, where = sys._getframe(2), None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module == "triton" or module.startswith("triton."):
            return True, None
        if where is None and module.startswith("kvcomp.") and module != __name__:
            path = Path(os.path.realpath(frame.f_code.co_filename))
            where = f"{path.relative_to(PACKAGE.parent) if PACKAGE in path.parents else path}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return False, where


class HostSyncs(TorchDispatchMode):
    """A context that records :class:`HostSync` s in :attr:`found` (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.found: list[HostSync] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _synchronises(func, args, kwargs):
            in_launch, where = _origin()
            if not in_launch:
                self.found.append(HostSync(func._schema.name.split("::")[-1], where))
        return func(*args, **kwargs)

    @property
    def in_kvcomp(self) -> list[HostSync]:
        """The synchronising operations kvcomp issued."""
        return [sync for sync in self.found if sync.where is not None]
