"""Finiteness checks of one cache layer (:class:`~kvcomp.cache.CompressedCache`'s ``check_finite``)."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from kvcomp.errors import ConfigError, NonFiniteKVError
from kvcomp.stages.uniform_quantizer import deferred_range_checks

CHECK_FINITE = (True, False, "deferred")
T = TypeVar("T")


def finite(key_states: torch.Tensor, value_states: torch.Tensor) -> torch.Tensor:
    """Device bool: no NaN/Inf in the K/V (sums of finite K/V cannot overflow float32)."""
    return torch.isfinite(key_states.sum(dtype=torch.float32) + value_states.sum(dtype=torch.float32))


def _span(first: int, count: int) -> str:
    return f"{first}..{first + count - 1}"


class DeviceFlag:
    """Device bools read later without stalling the stream: on a GPU they are copied into pinned host memory
    behind an event, and reading waits for that event only (not for work queued after it)."""

    def __init__(self, flag: torch.Tensor):
        self.event = None
        if flag.device.type == "cuda":
            self.host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
            self.host.copy_(flag, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = flag

    def read(self) -> list[bool]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.reshape(-1).tolist()


class FiniteChecks:
    """``mode=True``: NaN/Inf in incoming K/V raise :class:`NonFiniteKVError` at once (a host sync per layer on a
    GPU); ``"deferred"``: the verdict, and those of uniform/KIVI's and HIGGS' scale ranges, stay on the device
    and are read one forward later (no sync); ``False``: never checked."""

    def __init__(self, mode: bool | str, layer_idx: int):
        if mode not in CHECK_FINITE:
            raise ConfigError(f"unknown check_finite {mode!r}; valid choices: True, False, 'deferred'")
        self.mode, self.layer_idx = mode, layer_idx
        self.pending: tuple[DeviceFlag, int, int] | None = None  # deferred verdicts, first position, count

    def around(self, key_states: torch.Tensor, value_states: torch.Tensor, first: int, store: Callable[[], T]) -> T:
        """``store()`` (which stores the forward's K/V from cache position ``first`` on), checked by the mode."""
        if self.mode != "deferred":
            if self.mode:
                self._check_incoming(key_states, value_states, first)
            return store()
        self.raise_pending()  # the previous forward's verdicts, long computed
        ranges = []
        with deferred_range_checks(ranges):
            out = store()
        self.pending = (DeviceFlag(torch.stack([finite(key_states, value_states), *ranges])), first, key_states.shape[2])
        return out

    def _check_incoming(self, key_states: torch.Tensor, value_states: torch.Tensor, first: int) -> None:
        if not finite(key_states, value_states):
            kind = "keys" if not torch.isfinite(key_states).all() else "values"
            raise NonFiniteKVError(f"layer {self.layer_idx}: NaN or Inf in incoming {kind} "
                                   f"(cache positions {_span(first, key_states.shape[2])})")

    def raise_pending(self) -> None:
        """Read the verdicts of the last forward under ``"deferred"``: NaN/Inf in the incoming K/V, and
        quantization parameters that overflowed their storage dtype (uniform/KIVI, HIGGS). They were copied to
        the host without waiting, so reading them one forward later costs no sync."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        verdicts, positions = pending[0].read(), _span(pending[1], pending[2])
        if not verdicts[0]:
            raise NonFiniteKVError(f"layer {self.layer_idx}: NaN or Inf in the keys or values of an earlier forward "
                                   f"(cache positions {positions}; check_finite='deferred' reports it one forward late)")
        if not all(verdicts[1:]):
            raise NonFiniteKVError(
                f"layer {self.layer_idx}: a quantization group's scale or zero overflowed its storage dtype "
                f"(cache positions {positions}; reported one forward late by check_finite='deferred'): "
                "set codec.param_dtype=float32 (HIGGS, AQUA-KV: codec.scale_dtype=float32), or use check_finite=True "
                "(uniform/KIVI then fall back to float32 per block)")
