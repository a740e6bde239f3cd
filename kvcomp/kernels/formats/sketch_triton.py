"""Device functions of sign bits (:mod:`kvcomp.kernels.formats.sketch`): QJL's sketched keys scored from their bits,
and sign bits times a norm read as values."""

import triton
import triton.language as tl

from kvcomp.kernels.formats.base import KernelFormat
from kvcomp.kernels.formats.sketch import Outliers, SketchArgs
from kvcomp.kernels.formats.tiles_triton import at, dot, row_scores


@triton.jit
def signs(packed, row, row_bytes, m, ok):
    """``+-1`` float32 ``[rows, sketch rows m]`` from sign bits packed 8 per byte (bit ``m % 8`` of byte ``m // 8``)."""
    byte = tl.load(packed + row[:, None] * row_bytes + m[None, :] // 8, mask=ok, other=0).to(tl.int32)
    return ((byte >> (m[None, :] % 8)) & 1).to(tl.float32) * 2.0 - 1.0


@triton.jit
def sign_bits(packed, row, row_bytes, ok, BLOCK_M: tl.constexpr, m0):
    """``+-1`` bfloat16 ``[rows, BLOCK_M]`` of sketch rows ``m0 ..`` from sign bits packed 8 per byte (bit ``m % 8`` of
    byte ``m // 8``; past the row's ``row_bytes``, -1), a ``tl.dot`` operand: each byte loaded once and its bits spread
    in registers, each to bfloat16's sign bit."""
    i = m0 // 8 + tl.arange(0, BLOCK_M // 8)
    byte = tl.load(packed + row[:, None] * row_bytes + i[None, :], mask=ok[:, None] & (i < row_bytes)[None, :],
                   other=0).to(tl.int32)
    bit = (byte[:, :, None] << (15 - tl.arange(0, 8))[None, None, :]) & 0x8000
    sign = (bit ^ 0xBF80).to(tl.int16).to(tl.bfloat16, bitcast=True)  # -1.0 (0xBF80), turned +1.0 by a set bit
    return tl.reshape(sign, (row.shape[0], BLOCK_M))


@triton.jit
def advance(a, C: tl.constexpr, b, h, D: tl.constexpr):
    N_OUT: tl.constexpr = C.N_OUT
    outliers = a.outliers
    if N_OUT > 0:
        o = a.outliers
        outliers = Outliers(o.projection, o.columns_hi, o.columns_lo, at(o.signs, b, h), at(o.norm, b, h),
                            at(o.channels, b, h), o.scale)
    y_at = b * a.y.s_b + h * a.y.s_h  # y's parts are laid out as y
    return SketchArgs(at(a.signs, b, h), at(a.norm, b, h), at(a.y, b, h), a.y_hi + y_at, a.y_lo + y_at, a.scale,
                      outliers)


@triton.jit
def query(q_ptr, rows, row_ok, qk_scale, a, C: tl.constexpr, D: tl.constexpr, DOT: tl.constexpr, OPERAND: tl.constexpr):
    """``y = S q`` of the program's query rows, ``[BLOCK_R, M_PAD]`` (zero past ``M``), loaded once per program on the
    register path; ``()`` on the ``tl.dot`` path, which reads its bfloat16 parts per tile (:func:`scores`)."""
    M: tl.constexpr = C.M
    M_PAD: tl.constexpr = C.M_PAD
    m = tl.arange(0, M_PAD)
    if DOT:
        y = ()
    else:
        y = tl.load(a.y.ptr + rows[:, None] * M + m[None, :], mask=row_ok[:, None] & (m < M)[None, :], other=0.0)
    return y


@triton.jit
def _split_dot(hi_ptr, lo_ptr, at, ok, b):
    """``(hi + lo) @ b`` of two bfloat16 parts (:func:`~kvcomp.kernels.formats.sketch.bf16_parts`) loaded at ``at`` and an
    exact bfloat16 ``b``, float32 accumulation."""
    hi = tl.load(hi_ptr + at, mask=ok, other=0.0)
    lo = tl.load(lo_ptr + at, mask=ok, other=0.0)
    return dot(hi, b) + dot(lo, b)


@triton.jit
def _stack(a, C: tl.constexpr, row0, R, channel_ptr, k, FIRST: tl.constexpr):
    """Where row ``k`` of a stacked ``tl.dot`` operand reads its bfloat16 parts (:func:`dot_scores`), and whether it
    reads any: below ``FIRST``, query rows ``row0 ..`` of ``y``'s high part, then of its low part (``C.ROWS`` each);
    from ``FIRST``, the group's outlier columns of ``S`` (rows of ``S^T``; their channels at ``channel_ptr``), high then
    low (``N_OUT`` each). Also each row's outlier channel, -1 for a row of ``y``."""
    ROWS: tl.constexpr = C.ROWS
    M: tl.constexpr = C.M
    N_OUT: tl.constexpr = C.N_OUT
    o = a.outliers
    j = k - FIRST  # rows of S^T from here
    in_y = k < FIRST
    column_ok = (j >= 0) & (j < 2 * N_OUT)
    channel = tl.where(column_ok, tl.load(channel_ptr + j % N_OUT, mask=column_ok, other=0).to(tl.int32), -1)
    row = row0 + k % ROWS
    at = tl.where(in_y, row * M, channel.to(tl.int64) * M)
    low = tl.where(in_y, k >= ROWS, j >= N_OUT)
    parts = tl.where(low, tl.where(in_y, a.y_lo, o.columns_lo), tl.where(in_y, a.y_hi, o.columns_hi)) + at
    return parts, in_y & (row < R) | column_ok, channel


@triton.jit
def _coefficients(q_ptr, row0, R, k, channel, BLOCK_R: tl.constexpr, ROWS: tl.constexpr, FIRST: tl.constexpr,
                  D: tl.constexpr, SIGN: tl.constexpr):
    """``[BLOCK_R, len(k)]`` float32 weights of a stacked operand's rows (:func:`_stack`) in each query row's logit: 1 for
    that row's two parts of ``y``, ``SIGN q_c`` for both parts of outlier channel ``c``'s column of ``S``."""
    r = tl.arange(0, BLOCK_R)
    row_ok = (r < ROWS) & (row0 + r < R)
    kk = k[None, :]
    own = ((kk == r[:, None]) | (kk == r[:, None] + ROWS)) & (kk < FIRST) & row_ok[:, None]
    q = tl.load(q_ptr + (row0 + r)[:, None] * D + channel[None, :], mask=row_ok[:, None] & (channel >= 0)[None, :],
                other=0.0).to(tl.float32)
    return tl.where(own, 1.0, SIGN * q)


@triton.jit
def dot_scores(q_ptr, row0, R, a, C: tl.constexpr, t, t0, t_ok, D: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_T: tl.constexpr):
    """:func:`scores` on tensor cores, before ``qk_scale``, for query rows ``row0 .. row0 + BLOCK_R`` (of ``R``): chunks
    of ``CHUNK`` sketch rows, each chunk's signs an exact bfloat16 operand against bfloat16 parts
    (:func:`~kvcomp.kernels.formats.sketch.bf16_parts`) of ``y = S q`` and of the group's outlier columns of ``S`` (rows
    of ``S^T``), read per tile from L1 (an operand held for the program would take a warp's registers). ``u_g`` enters
    by associativity, ``<u_g, sign> = q_{O_g} . <S[:, O_g], sign>``, so that every product over the sketch's rows has
    the signs on one side. With outliers the parts are stacked in one operand per sketch (:func:`_stack`: ``y``'s two
    parts for the program's ``C.ROWS`` query rows, then the columns' two parts), filling the tensor cores' 16-row tiles
    that 4 query rows (Llama-3's) alone would mostly pad, and a float32 product with each row's weights
    (:func:`_coefficients`) adds them into the logits. Also the score kernel's (:mod:`kvcomp.kernels.qjl_scores_triton`)."""
    GROUP: tl.constexpr = C.GROUP
    M: tl.constexpr = C.M
    M_OUT: tl.constexpr = C.M_OUT
    M_PAD: tl.constexpr = C.M_PAD
    N_OUT: tl.constexpr = C.N_OUT
    ROWS: tl.constexpr = C.ROWS
    IN_PAD: tl.constexpr = C.IN_PAD
    OUT_PAD: tl.constexpr = C.OUT_PAD
    CHUNK: tl.constexpr = 128 if M_PAD > 128 else M_PAD
    inlier = tl.load(a.norm.ptr + t, mask=t_ok, other=0.0).to(tl.float32)
    if N_OUT == 0:  # y's two parts against the signs
        rows = row0 + tl.arange(0, BLOCK_R)
        s = tl.zeros((BLOCK_R, BLOCK_T), dtype=tl.float32)
        for c in tl.static_range(M_PAD // CHUNK):
            m = c * CHUNK + tl.arange(0, CHUNK)
            sign = tl.trans(sign_bits(a.signs.ptr, t, M // 8, t_ok, CHUNK, c * CHUNK))  # [CHUNK, BLOCK_T]
            s += _split_dot(a.y_hi, a.y_lo, rows[:, None] * M + m[None, :], (rows < R)[:, None] & (m < M)[None, :], sign)
        s = s * (a.scale * inlier)[None, :]
    else:
        o = a.outliers
        channels = o.channels.ptr + (t0 // GROUP) * N_OUT
        k_in = tl.arange(0, IN_PAD)
        k_out = tl.arange(0, OUT_PAD)
        in_at, in_ok, in_channel = _stack(a, C, row0, R, channels, k_in, 2 * ROWS)
        out_at, out_ok, out_channel = _stack(a, C, row0, R, channels, k_out, 0)
        acc_in = tl.zeros((IN_PAD, BLOCK_T), dtype=tl.float32)  # each stacked row . sign(S k_in)
        acc_out = tl.zeros((OUT_PAD, BLOCK_T), dtype=tl.float32)  # each stacked column . sign(S_{:m_o} k_out)
        for c in tl.static_range(M_PAD // CHUNK):
            m = c * CHUNK + tl.arange(0, CHUNK)
            sign = tl.trans(sign_bits(a.signs.ptr, t, M // 8, t_ok, CHUNK, c * CHUNK))
            parts = tl.load(in_at[:, None] + m[None, :], mask=in_ok[:, None] & (m < M)[None, :], other=0.0)
            acc_in += dot(parts, sign)
            if c * CHUNK < M_OUT:
                sign = tl.trans(sign_bits(o.signs.ptr, t, M_OUT // 8, t_ok, CHUNK, c * CHUNK))
                parts = tl.load(out_at[:, None] + m[None, :], mask=out_ok[:, None] & (m < M_OUT)[None, :], other=0.0)
                acc_out += dot(parts, sign)
        outlier = tl.load(o.norm.ptr + t, mask=t_ok, other=0.0).to(tl.float32)
        weights = _coefficients(q_ptr, row0, R, k_in, in_channel, BLOCK_R, ROWS, 2 * ROWS, D, -1.0)
        s = tl.dot(weights, acc_in, input_precision="ieee") * (a.scale * inlier)[None, :]
        weights = _coefficients(q_ptr, row0, R, k_out, out_channel, BLOCK_R, ROWS, 0, D, 1.0)
        s += tl.dot(weights, acc_out, input_precision="ieee") * (o.scale * outlier)[None, :]
    return s


@triton.jit
def scores(y, q_ptr, R, rows, row_ok, qk_scale, a, C: tl.constexpr, length, t, t0, t_ok,
           D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, DOT: tl.constexpr):
    """Logits ``[BLOCK_R, BLOCK_T]`` of QJL's sign-sketched keys (:mod:`kvcomp.kernels.qjl_scores`):
    ``sqrt(pi/2)/m ||k_in|| <S q - u_g, sign(S k_in)> + sqrt(pi/2)/m_o ||k_out|| <u_g[:m_o], sign(S_{:m_o} k_out)>``
    with ``y = S q`` precomputed per query (:func:`query`) and ``u_g = S[:, O_g] q_{O_g}`` from ``N_OUT`` columns of ``S``
    for the tile's group (tiles never straddle a group: ``BLOCK_T`` divides ``GROUP`` and tiles
    end at multiples of ``BLOCK_T`` from the payload's first token). Sketch rows are padded to ``M_PAD``, a
    power of two, and the padding contributes nothing (``y = 0``, ``S = 0``). On the ``tl.dot`` path:
    :func:`dot_scores`; on the register path ``u_g`` is built per tile and each query row scored in turn."""
    GROUP: tl.constexpr = C.GROUP
    M: tl.constexpr = C.M
    M_OUT: tl.constexpr = C.M_OUT
    M_PAD: tl.constexpr = C.M_PAD
    N_OUT: tl.constexpr = C.N_OUT
    if DOT:
        s = dot_scores(q_ptr, 0, R, a, C, t, t0, t_ok, D, BLOCK_R, BLOCK_T)
    else:
        m = tl.arange(0, M_PAD)
        m_ok = m < M
        inlier = tl.load(a.norm.ptr + t, mask=t_ok, other=0.0).to(tl.float32)
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
