"""Device functions of block floats (:mod:`kvcomp.kernels.formats.block_float`): ``x = levels[code] * s_block``."""

import triton
import triton.language as tl

from kvcomp.kernels.formats.base import KernelFormat
from kvcomp.kernels.formats.block_float import BlockFloatArgs
from kvcomp.kernels.formats.tiles_triton import at
from kvcomp.kernels.formats.uniform_triton import codes, params


@triton.jit
def advance(a, C: tl.constexpr, b, h, D: tl.constexpr):
    return BlockFloatArgs(at(a.data, b, h), at(a.scales, b, h), a.levels)


@triton.jit
def _tile(a, C: tl.constexpr, t, t0, t_ok, c, c0, c_ok, D: tl.constexpr, BLOCK_T: tl.constexpr):
    BITS: tl.constexpr = C.BITS
    BLOCK: tl.constexpr = C.BLOCK
    ok = t_ok[:, None] & c_ok[None, :]
    ROW_BYTES: tl.constexpr = (D * BITS + 7) // 8
    code = codes(a.data.ptr, t[:, None] * ROW_BYTES, c[None, :], ok, BITS, ROW_BYTES)
    return tl.load(a.levels + code, mask=ok, other=0.0) * params(a.scales.ptr, 0, t, t0, t_ok, c, c0, c_ok, D, BLOCK,
                                                                  False, BLOCK_T)


@triton.jit
def halves(a, C: tl.constexpr, length, t, t0, t_ok, c, c_ok, D: tl.constexpr, BLOCK_T: tl.constexpr):
    return _tile(a, C, t, t0, t_ok, c, 0, c_ok, D, BLOCK_T), _tile(a, C, t, t0, t_ok, c + D // 2, D // 2, c_ok, D, BLOCK_T)


BLOCK_FLOAT = KernelFormat("block floats", advance, halves)
