"""Device functions of sign bits (:mod:`kvcomp.kernels.formats.sketch`): QJL's sketched keys scored from their bits,
and sign bits times a norm read as values."""

import triton
import triton.language as tl

from kvcomp.kernels.formats.base import KernelFormat
from kvcomp.kernels.formats.sketch import Outliers, SketchArgs
from kvcomp.kernels.formats.tiles_triton import at, row_scores


@triton.jit
def signs(packed, row, row_bytes, m, ok):
    """``+-1`` float32 ``[rows, sketch rows m]`` from sign bits packed 8 per byte (bit ``m % 8`` of byte ``m // 8``)."""
    byte = tl.load(packed + row[:, None] * row_bytes + m[None, :] // 8, mask=ok, other=0).to(tl.int32)
    return ((byte >> (m[None, :] % 8)) & 1).to(tl.float32) * 2.0 - 1.0


@triton.jit
def advance(a, C: tl.constexpr, b, h, D: tl.constexpr):
    N_OUT: tl.constexpr = C.N_OUT
    outliers = a.outliers
    if N_OUT > 0:
        o = a.outliers
        outliers = Outliers(o.projection, at(o.signs, b, h), at(o.norm, b, h), at(o.channels, b, h), o.scale)
    return SketchArgs(at(a.signs, b, h), at(a.norm, b, h), at(a.y, b, h), a.scale, outliers)


@triton.jit
def query(q_ptr, rows, row_ok, qk_scale, a, C: tl.constexpr, D: tl.constexpr, DOT: tl.constexpr, OPERAND: tl.constexpr):
    """``y = S q`` of the program's query rows, ``[BLOCK_R, M_PAD]`` (zero past ``M``), loaded once per program."""
    M: tl.constexpr = C.M
    M_PAD: tl.constexpr = C.M_PAD
    m = tl.arange(0, M_PAD)
    return tl.load(a.y.ptr + rows[:, None] * M + m[None, :], mask=row_ok[:, None] & (m < M)[None, :], other=0.0)


@triton.jit
def scores(y, q_ptr, R, rows, row_ok, qk_scale, a, C: tl.constexpr, length, t, t0, t_ok,
           D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, DOT: tl.constexpr):
    """Logits ``[BLOCK_R, BLOCK_T]`` of QJL's sign-sketched keys (:mod:`kvcomp.kernels.qjl_scores`):
    ``sqrt(pi/2)/m ||k_in|| <S q - u_g, sign(S k_in)> + sqrt(pi/2)/m_o ||k_out|| <u_g[:m_o], sign(S_{:m_o} k_out)>``
    with ``y = S q`` precomputed per query (:func:`query`) and ``u_g = S[:, O_g] q_{O_g}`` built here from ``N_OUT`` columns
    of ``S`` for the tile's group (tiles never straddle a group: ``BLOCK_T`` divides ``GROUP`` and tiles
    end at multiples of ``BLOCK_T`` from the payload's first token). Sketch rows are padded to ``M_PAD``, a
    power of two, and the padding contributes nothing (``y = 0``, ``S = 0``, no sign bits). Scored on the register
    path whatever ``DOT``."""
    GROUP: tl.constexpr = C.GROUP
    M: tl.constexpr = C.M
    M_OUT: tl.constexpr = C.M_OUT
    M_PAD: tl.constexpr = C.M_PAD
    N_OUT: tl.constexpr = C.N_OUT
    m = tl.arange(0, M_PAD)
    m_ok = m < M
    ok = t_ok[:, None] & m_ok[None, :]
    sign = signs(a.signs.ptr, t, M // 8, m, ok)  # [BLOCK_T, M_PAD]
    if N_OUT > 0:
        o = a.outliers
        group = t0 // GROUP
        u = tl.zeros((BLOCK_R, M_PAD), dtype=tl.float32)
        for i in tl.static_range(N_OUT):
            channel = tl.load(o.channels.ptr + group * N_OUT + i).to(tl.int32)
            q_c = tl.load(q_ptr + rows * D + channel, mask=row_ok, other=0.0).to(tl.float32)
            u += q_c[:, None] * tl.load(o.projection + m * D + channel, mask=m_ok, other=0.0)[None, :]
        y = y - u
    inlier = tl.load(a.norm.ptr + t, mask=t_ok, other=0.0).to(tl.float32)
    s = row_scores(y, sign, rows, BLOCK_R, BLOCK_T) * (a.scale * inlier)[None, :]  # padded rows: y = 0
    if N_OUT > 0:
        first_rows = m < M_OUT
        sign = tl.where(first_rows[None, :], signs(o.signs.ptr, t, M_OUT // 8, m, ok & first_rows[None, :]), 0.0)
        outlier = tl.load(o.norm.ptr + t, mask=t_ok, other=0.0).to(tl.float32)
        s += row_scores(u, sign, rows, BLOCK_R, BLOCK_T) * (o.scale * outlier)[None, :]
    return s * qk_scale


@triton.jit
def advance_signs(a, C: tl.constexpr, b, h, D: tl.constexpr):
    return at(a[0], b, h), at(a[1], b, h)


@triton.jit
def _sign_tile(a, t, t_ok, c, c_ok, D: tl.constexpr):
    ok = t_ok[:, None] & c_ok[None, :]
    return signs(a[0].ptr, t, D // 8, c, ok) * tl.load(a[1].ptr + t, mask=t_ok, other=0.0).to(tl.float32)[:, None]


@triton.jit
def sign_halves(a, C: tl.constexpr, length, t, t0, t_ok, c, c_ok, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """Sign bits times a per-token norm (TurboQuant-prod's value sketch, read in the sketch's basis)."""
    return _sign_tile(a, t, t_ok, c, c_ok, D), _sign_tile(a, t, t_ok, c + D // 2, c_ok, D)


SKETCH = KernelFormat("sign sketch", advance, scores=scores, query=query)
SIGNS = KernelFormat("signs", advance_signs, sign_halves)
