"""Values at the edges of a storage dtype: fields kept in a dtype that holds them, norms that do not overflow,
reconstructions that saturate instead of becoming Inf, and the range checks a cache defers to avoid host syncs.

A codec stores a scale or norm in a 16-bit dtype (float16: at most 65504) as the papers count it; an input
beyond that range keeps that block's field in float32 (:func:`stored_in`): the cache's measured bytes grow
accordingly, ``bits_per_value`` stays the nominal count. Every encode gets ``range_checks`` from its request
(:class:`~kvcomp.codecs.base.Request`, the base of every scope's request type): None checks on the host at once;
a list (a cache with ``check_finite="deferred"``) keeps the field in the 16-bit dtype and gets the device bool
saying whether it fits, which the cache reads one forward later (no host sync per encode).
"""

import torch


def range_fits(fits: torch.Tensor, range_checks: list | None) -> bool:
    """Whether a device bool ``fits`` holds: read on the host (a sync on a GPU) when ``range_checks`` is None,
    else appended to it for the cache to read later (then ``True``)."""
    if range_checks is None:
        return bool(fits)
    range_checks.append(fits)
    return True


def stored_in(x: torch.Tensor, dtype: torch.dtype, range_checks: list | None) -> torch.Tensor:
    """``x`` (finite, float32) as stored in ``dtype`` when every value stays finite there, else in float32: an
    input beyond ``dtype``'s range (float16: 65504) keeps a wider field, counted by the cache's measured bytes.
    With a ``range_checks`` list always ``dtype``, whether it fits appended to the list (:func:`range_fits`)."""
    stored = x.to(dtype)
    if dtype == x.dtype or range_fits(torch.isfinite(stored).all(), range_checks):
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
