"""Values at the edges of a storage dtype: fields kept in a dtype that holds them, norms that do not overflow,
reconstructions that saturate instead of becoming Inf, and the checks a cache defers to avoid host syncs.

A codec stores a scale or norm in a 16-bit dtype (float16: at most 65504) as the papers count it; an input
beyond that range keeps that block's field in float32 (:func:`stored_in`): the cache's measured bytes grow
accordingly, ``bits_per_value`` stays the nominal count. Within :func:`deferred_range_checks` (a cache with
``check_finite="deferred"``) the field stays in the 16-bit dtype and whether it fits is left on the device for
the cache to read one forward later (no host sync per encode).
"""

import contextlib
from contextvars import ContextVar

import torch

_DEFERRED_RANGE_CHECKS: ContextVar[list | None] = ContextVar("kvcomp_deferred_range_checks", default=None)


@contextlib.contextmanager
def deferred_range_checks(verdicts: list):
    """Within this context, encodes store scale and zero in ``param_dtype`` without reading whether they
    fit (a host sync on a GPU) and append that device bool to ``verdicts`` for the caller to read later."""
    token = _DEFERRED_RANGE_CHECKS.set(verdicts)
    try:
        yield
    finally:
        _DEFERRED_RANGE_CHECKS.reset(token)


def checks_deferred() -> bool:
    """Whether range checks are deferred here (within :func:`deferred_range_checks`)."""
    return _DEFERRED_RANGE_CHECKS.get() is not None


def range_fits(fits: torch.Tensor) -> bool:
    """Whether a device bool ``fits`` holds: read on the host (a sync on a GPU), or, within
    :func:`deferred_range_checks`, left on the device for the cache to read later (then ``True``)."""
    verdicts = _DEFERRED_RANGE_CHECKS.get()
    if verdicts is None:
        return bool(fits)
    verdicts.append(fits)
    return True


def stored_in(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (finite, float32) as stored in ``dtype`` when every value stays finite there, else in float32: an
    input beyond ``dtype``'s range (float16: 65504) keeps a wider field, counted by the cache's measured bytes.
    Within :func:`deferred_range_checks` always ``dtype``, whether it fits left on the device."""
    stored = x.to(dtype)
    if dtype == x.dtype or range_fits(torch.isfinite(stored).all()):
        return stored
    return x


def stable_norm(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x.norm(dim=dim)`` (float32), and where that overflows (inputs beyond ~1e19), the norm of ``x`` scaled
    by its largest magnitude, scaled back: finite wherever the norm is."""
    x = x.float()
    norm = x.norm(dim=dim)
    peak = x.abs().amax(dim=dim, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.where(torch.isfinite(norm), norm, (x / peak).norm(dim=dim) * peak.squeeze(dim))


def saturated(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``, values beyond its largest finite one clamped to it (a float32 reconstruction of
    inputs near float16's max may overshoot it); NaN stays NaN."""
    if torch.finfo(dtype).max >= torch.finfo(x.dtype).max:
        return x.to(dtype)
    peak = torch.finfo(dtype).max
    return x.clamp(-peak, peak).to(dtype)
