"""Device helpers shared by the split kernel and the formats' device functions."""

import os

import triton
import triton.language as tl

from kvcomp.kernels.formats.base import Strided

# Triton's CPU interpreter (read, as Triton reads it, when kernels are defined)
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def at(x, b, h):
    """A :class:`~kvcomp.kernels.formats.base.Strided` tensor advanced to sequence ``b`` and head ``h`` (int64)."""
    return Strided(x.ptr + b * x.s_b + h * x.s_h, x.s_b, x.s_h)


@triton.jit
def operand(x, OPERAND: tl.constexpr):
    """``x`` as a ``tl.dot`` operand of type ``OPERAND``, rounded to nearest even as a GPU's conversion rounds (Triton's
    CPU interpreter truncates a float32 cast to bfloat16, a bias that grows with the reduction; it is rounded first)."""
    if INTERPRETED and OPERAND == tl.bfloat16:
        u = x.to(tl.float32).to(tl.uint32, bitcast=True)
        x = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(OPERAND)


@triton.jit
def dot(a, b):
    """``tl.dot(a, b)`` of :func:`operand` operands, float32 accumulation. Triton's CPU interpreter multiplies bfloat16
    operands as their raw ``uint16`` bits (3.6 and 3.9: products ~1e9 off); there they are multiplied as the float32
    numbers they hold, the products a GPU's bf16 MMA forms."""
    if INTERPRETED and a.dtype == tl.bfloat16:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def row_scores(q, k, rows, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
    """``q [BLOCK_R, C] . k [BLOCK_T, C]^T`` one query row at a time: each row's products are a
    ``[BLOCK_T, C]`` tile reduced in registers, so the live products do not grow with the query rows
    (a ``[BLOCK_R, BLOCK_T, C]`` broadcast needs twice the registers per token, see
    ``scripts/kernel_resources.py``)."""
    s = tl.zeros((BLOCK_R, BLOCK_T), dtype=tl.float32)
    for r in tl.static_range(BLOCK_R):
        pick = rows[:, None] == r
        q_r = tl.sum(tl.where(pick, q, 0.0), 0)
        s = tl.where(pick, tl.sum(k * q_r[None, :], 1)[None, :], s)
    return s


@triton.jit
def row_values(p, v, rows, BLOCK_R: tl.constexpr, C: tl.constexpr):
    """``p [BLOCK_R, BLOCK_T] @ v [BLOCK_T, C]`` one query row at a time (see :func:`row_scores`)."""
    out = tl.zeros((BLOCK_R, C), dtype=tl.float32)
    for r in tl.static_range(BLOCK_R):
        pick = rows[:, None] == r
        p_r = tl.sum(tl.where(pick, p, 0.0), 0)
        out = tl.where(pick, tl.sum(p_r[:, None] * v, 0)[None, :], out)
    return out
