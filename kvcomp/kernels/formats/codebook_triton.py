"""Device functions of codebook payloads (:mod:`kvcomp.kernels.formats.codebook`): gather each centroid entry, then
undo the normalisation."""

import torch
import triton
import triton.language as tl

from kvcomp.kernels.formats.base import KernelFormat
from kvcomp.kernels.formats.codebook import CodebookArgs
from kvcomp.kernels.formats.tiles_triton import at
from kvcomp.kernels.formats.uniform_triton import codes

TINY = tl.constexpr(torch.finfo(torch.float32).tiny)  # the least norm a unit-norm rescaling divides by (as in torch)


@triton.jit
def advance(a, C: tl.constexpr, b, h, D: tl.constexpr):
    scale, center = a.token_scale, a.token_center
    if C.TOKEN_SCALE:
        scale = at(scale, b, h)
    if C.TOKEN_CENTER:
        center = at(center, b, h)
    return CodebookArgs(at(a.data, b, h), a.codebooks + h * (D // C.GC) * C.CENTROIDS * (C.TL * C.CL), a.ch_scale + h * D,
                        a.ch_center + h * D, scale, center)


@triton.jit
def _tile(a, C: tl.constexpr, t, t_ok, c, c_ok, D: tl.constexpr, SCALED: tl.constexpr):
    """Payload tokens ``t`` x channels ``c`` as float32 (times the token scale where ``SCALED``)."""
    ok = t_ok[:, None] & c_ok[None, :]
    ROW_BYTES: tl.constexpr = ((D // C.CL) * C.CODE_BITS + 7) // 8
    code = codes(a.data.ptr, (t[:, None] // C.TL) * ROW_BYTES, (c // C.CL)[None, :], ok, C.CODE_BITS, ROW_BYTES)
    entry = (t % C.TL)[:, None] * C.CL + (c % C.CL)[None, :]
    centroid = (c // C.GC)[None, :] * C.CENTROIDS + code
    z = tl.load(a.codebooks + centroid * (C.TL * C.CL) + entry, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(a.ch_scale + c, mask=c_ok, other=0.0)[None, :]
    center = tl.load(a.ch_center + c, mask=c_ok, other=0.0)[None, :]
    if SCALED:
        s = s * tl.load(a.token_scale.ptr + t, mask=t_ok, other=0.0).to(tl.float32)[:, None]
    if C.TOKEN_CENTER:
        center = center + tl.load(a.token_center.ptr + t, mask=t_ok, other=0.0).to(tl.float32)[:, None]
    return z * s + center


@triton.jit
def halves(a, C: tl.constexpr, length, t, t0, t_ok, c, c_ok, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """``UNIT`` (vLLM's norm correction): each token's decoded vector is rescaled to unit norm over both halves, then
    times its token scale."""
    SCALED: tl.constexpr = C.TOKEN_SCALE and not C.UNIT
    lo = _tile(a, C, t, t_ok, c, c_ok, D, SCALED)
    hi = _tile(a, C, t, t_ok, c + D // 2, c_ok, D, SCALED)
    if C.UNIT:  # channels outside c_ok are 0
        norm = tl.sqrt(tl.sum(lo * lo, 1) + tl.sum(hi * hi, 1))
        factor = tl.load(a.token_scale.ptr + t, mask=t_ok, other=0.0).to(tl.float32) / tl.maximum(norm, TINY)
        lo = lo * factor[:, None]
        hi = hi * factor[:, None]
    return lo, hi


CODEBOOK = KernelFormat("codebook", advance, halves)
