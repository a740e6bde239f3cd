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
def fma(a, b, c):
    """``a * b + c`` rounded once, as a GPU's ``FFMA`` (Triton's CPU interpreter rounds the float32 product first; there
    it is formed in float64, where a product of two float32 numbers is exact)."""
    if INTERPRETED:
        out = (a.to(tl.float64) * b + c.to(tl.float64)).to(tl.float32)
    else:
        out = tl.fma(a, b, c)
    return out


# pi / 2 in three float32 parts (each the float32 nearest what the parts before it leave), and 2 / pi
PIO2_1, PIO2_2, PIO2_3 = tl.constexpr(1.5707963705062866), tl.constexpr(-4.371138828673793e-08), tl.constexpr(-1.7763568394002505e-15)
TWO_OVER_PI = tl.constexpr(0.6366197466850281)
# sin r = r + SIN3 r^3 + SIN5 r^5 + SIN7 r^7, cos r = 1 - r^2 / 2 + COS4 r^4 + COS6 r^6 + COS8 r^8 on |r| <= pi / 4: least squares
# on 2,000 Chebyshev nodes (relative to sin, absolute for cos), float32 error <= 4.4e-8 (sin) and 7.3e-8 (cos)
SIN3, SIN5, SIN7 = tl.constexpr(-0.16666653752326965), tl.constexpr(0.00833214819431305), tl.constexpr(-0.00019513932056725025)
COS4, COS6, COS8 = tl.constexpr(0.04166664555668831), tl.constexpr(-0.0013887342065572739), tl.constexpr(2.4435852537862957e-05)


@triton.jit
def cos_sin(x):
    """``cos x`` and ``sin x`` of float32 ``x`` (RoPE angles, ``|x|`` up to about 1e6) with one reduction for both:
    ``x = k pi/2 + r``, ``|r| <= pi/4``, by three fused multiply-adds (Cody and Waite), polynomials in ``r`` (:data:`SIN3`,
    :data:`COS4`) and the quadrant ``k mod 4``. ``tl.cos`` and ``tl.sin`` reduce twice and branch per value to
    libdevice's path for huge arguments: about three times the instructions (``tools/kernel_model.py``)."""
    k = tl.floor(x * TWO_OVER_PI + 0.5)
    r = fma(-k, PIO2_1, x)
    r = fma(-k, PIO2_2, r)
    r = fma(-k, PIO2_3, r)
    r2 = r * r
    s = r + r * r2 * (SIN3 + r2 * (SIN5 + r2 * SIN7))
    c = 1.0 - 0.5 * r2 + r2 * r2 * (COS4 + r2 * (COS6 + r2 * COS8))
    quadrant = k.to(tl.int32) & 3  # x = r + k pi/2: cos x, sin x = (cos r, sin r) turned k quarter turns
    swap = (quadrant & 1) == 1
    cos = tl.where(swap, s, c)
    sin = tl.where(swap, c, s)
    cos = tl.where((quadrant == 1) | (quadrant == 2), -cos, cos)
    sin = tl.where(quadrant >= 2, -sin, sin)
    return cos, sin


@triton.jit
def row_scores(q, k, rows, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
    """``q [BLOCK_R, C] . k [BLOCK_T, C]^T`` one query row at a time: each row's products are a
    ``[BLOCK_T, C]`` tile reduced in registers, so the live products do not grow with the query rows
    (a ``[BLOCK_R, BLOCK_T, C]`` broadcast needs twice the registers per token, see
    ``tools/kernel_resources.py``)."""
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


@triton.jit
def field_major(f):
    """``[R, N, W]`` from a tuple of ``N`` (1, 2, 4 or 8) tensors ``[R, W]``: field ``j`` at ``[:, j, :]``, joined in
    registers (``tl.join`` adds a register axis; the first join's new axis weighs most) and permuted."""
    N: tl.constexpr = len(f)
    if N == 1:
        x = f[0][:, :, None]
    elif N == 2:
        x = tl.join(f[0], f[1])
    elif N == 4:
        x = tl.reshape(tl.join(tl.join(f[0], f[2]), tl.join(f[1], f[3])), (f[0].shape[0], f[0].shape[1], 4))
    else:
        x = tl.reshape(tl.join(tl.join(tl.join(f[0], f[4]), tl.join(f[2], f[6])),
                               tl.join(tl.join(f[1], f[5]), tl.join(f[3], f[7]))), (f[0].shape[0], f[0].shape[1], 8))
    return tl.permute(x, (0, 2, 1))
