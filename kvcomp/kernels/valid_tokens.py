"""The cached tokens each sequence attends to in one decode step (:class:`ValidTokens`): the step's mask, and the
spans of valid tokens the fused decode kernels read instead of it where they can
(:mod:`kvcomp.kernels.decode_attention_triton`)."""

from __future__ import annotations

from functools import cached_property

import torch


SPAN = 4  # int32 per sequence in :attr:`ValidTokens.spans`: first, stop, exact, (unused)


class ValidTokens:
    """The cached tokens each sequence attends to in one decode step, ``mask [B, L]`` (bool), made once per
    step and shared by every layer. The kernels read :attr:`spans`, and :attr:`as_bytes` (one byte per token) only
    for a sequence whose valid tokens are not one run."""

    def __init__(self, mask: torch.Tensor, spans: torch.Tensor | None = None):
        self.mask = mask
        self._spans = spans
        self._parts: dict[tuple, ValidTokens] = {}  # columns / without, made once for every layer of the step

    @cached_property
    def as_bytes(self) -> torch.Tensor:
        mask = self.mask
        if mask.dtype == torch.bool and mask.stride(-1) == 1:
            return mask.view(torch.uint8)
        return mask.to(torch.uint8).contiguous()

    @property
    def spans(self) -> torch.Tensor:
        """Per sequence, int32 ``[B, SPAN]``: ``first, stop, exact``, where every valid token lies in ``[first, stop)``
        and ``exact`` (1) says every token there is valid: the kernels skip the tiles outside the span and read the
        mask only where it is not exact. Made on the mask's device (no host sync): a left-padded, sliding-window or
        unpadded mask is one exact run; a sequence with no valid token an empty one."""
        if self._spans is None:
            mask = self.mask.bool()
            b, length = mask.shape
            index = torch.arange(length, device=mask.device)
            count = mask.sum(-1)
            first = torch.where(mask, index, length).amin(-1) if length else count
            stop = torch.where(mask, index + 1, 0).amax(-1) if length else count
            first = torch.where(count > 0, first, 0)
            exact = count == stop - first
            self._spans = torch.stack([first, stop, exact.long(), torch.zeros_like(count)], -1).to(torch.int32)
        return self._spans

    def columns(self, lo: int, hi: int) -> "ValidTokens":
        """The mask of cached tokens ``[lo, hi)`` (a payload's launch group), its spans derived from these; the same
        object for every layer (one copy per step into a CUDA-graph workspace)."""
        if ("in", lo, hi) not in self._parts:
            self._parts["in", lo, hi] = ValidTokens(self.mask[:, lo:hi], _kept_spans(self.spans, lo, hi, True))
        return self._parts["in", lo, hi]

    def without(self, lo: int, hi: int) -> "ValidTokens":
        """The mask of the cached tokens outside ``[lo, hi)``, the rest placed after ``lo`` (as :meth:`columns`)."""
        if ("out", lo, hi) not in self._parts:
            mask = torch.cat([self.mask[:, :lo], self.mask[:, hi:]], 1)
            self._parts["out", lo, hi] = ValidTokens(mask, _kept_spans(self.spans, lo, hi, False))
        return self._parts["out", lo, hi]


def _kept_spans(spans: torch.Tensor, lo: int, hi: int, inside: bool) -> torch.Tensor:
    """Spans after keeping only tokens ``[lo, hi)`` (``inside``) or only those outside: each bound ``x`` becomes the
    number of kept tokens before it, which keeps every kept valid token within the span and an exact span exact."""
    bounds = spans[:, :2]
    if inside:
        bounds = bounds.clamp(lo, hi) - lo
    else:
        bounds = torch.where(bounds <= lo, bounds, torch.where(bounds <= hi, lo, bounds - (hi - lo)))
    return torch.cat([bounds, spans[:, 2:]], 1)
