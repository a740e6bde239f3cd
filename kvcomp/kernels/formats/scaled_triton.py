"""Device functions of natively loaded values times a scale (:mod:`kvcomp.kernels.formats.scaled`)."""

import triton
import triton.language as tl

from kvcomp.kernels.formats.base import KernelFormat
from kvcomp.kernels.formats.scaled import ScaledArgs
from kvcomp.kernels.formats.tiles_triton import at


@triton.jit
def advance(a, C: tl.constexpr, b, h, D: tl.constexpr):
    TOKEN_SCALE: tl.constexpr = C.TOKEN_SCALE
    scale = a.scale
    if TOKEN_SCALE:
        scale = at(a.scale, b, h)
    return ScaledArgs(at(a.data, b, h), scale)


@triton.jit
def _tile(a, C: tl.constexpr, t, t_ok, c, c_ok, D: tl.constexpr):
    """float8 or int8 values (the pointer's element type) times a per-token or per-tensor scale."""
    TOKEN_SCALE: tl.constexpr = C.TOKEN_SCALE
    x = tl.load(a.data.ptr + t[:, None] * D + c[None, :], mask=t_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
    if TOKEN_SCALE:
        x = x * tl.load(a.scale.ptr + t, mask=t_ok, other=0.0).to(tl.float32)[:, None]
    else:
        x = x * tl.load(a.scale).to(tl.float32)
    return x


@triton.jit
def halves(a, C: tl.constexpr, length, t, t0, t_ok, c, c_ok, D: tl.constexpr, BLOCK_T: tl.constexpr):
    return _tile(a, C, t, t_ok, c, c_ok, D), _tile(a, C, t, t_ok, c + D // 2, c_ok, D)


SCALED = KernelFormat("float8 / int8 x scale", advance, halves)
