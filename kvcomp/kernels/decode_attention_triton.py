"""Triton kernels: decode attention reading packed K/V payloads (reference: :mod:`kvcomp.kernels.decode_attention`).

Flash-decoding in two kernels:

1. ``_split_kernel``: one program per (batch x KV head, slice of tokens). It loads the ``n_rep`` query
   heads of its KV head once, then for each tile of at most ``BLOCK_T`` tokens decodes K and V *in registers*
   (dense load, packed-int dequantization, codebook gather + denormalisation, or a float8 / int8 load times its
   scale; keys of pre-RoPE codecs rotated by their position), and updates an online softmax (base-2 exponentials). It writes
   the slice's normalised partial output and its log-sum-exp.
2. ``_merge_kernel``: combines the partials of all slices per query head,
   ``out = sum_s 2^(lse_s - m) out_s / sum_s 2^(lse_s - m)``.

A decode step is therefore two launches per layer (a payload stored in a rotated basis or less an offset adds its
own split launches and small matmuls: :func:`launch_groups`; a key offset's score ``q . R_p c`` is added in the
payload's tiles from the token's position, a value offset to the payload's partial outputs; TurboQuant-prod's
residual sketch adds its score ``sqrt(pi/2)/d ||r|| <S q, sign(S r)>`` to each key's, and its values' sketch is
weighted in launches of their own over the same keys, whose partial outputs are taken back by ``S`` and added).

One launch of the split kernel reads every segment of a step: per stream, up to three full-precision
pieces (sinks, tail and, under ``exact_prefill``, the fresh token: separate tensors, each with its own
pointer and strides) and one encoded payload. The kernel is compiled per (key format, value format): each payload's
format (:mod:`kvcomp.kernels.formats`) passes its device functions as a compile-time argument and only the tensors
and strides it reads as a named tuple; a stream's pieces are a tuple of as many as the launch has. Each
tile lies within one piece of each stream (tiles lie on a grid of ``BLOCK_T`` tokens from the first payload token,
cut at piece and slice boundaries, so that a payload's tile starts at a whole number of its chunks), and a scalar
branch per tile and stream picks the
piece's decoder; a cache with more payloads per stream gets one launch per run of segments that fits
(:func:`~kvcomp.kernels.decode_plan.plan_decode`: planned once per step, run per layer, in a workspace kept across
steps). Everything that changes with the cache length (segment bounds, lengths, slot counts, the mask's and the
position ids' strides) is in the launch's row of bounds, which the plan copies to the device once per step and the
kernel reads: a growing cache never recompiles a kernel, and no argument of a launch changes with it. Strides are
specialised: they stay multiples of 16 as buffers grow (multiples of head_dim), which lets the compiler prove aligned
vector loads. Every tensor is advanced to the program's sequence and head once, in
int64, so no offset overflows at a large batch x context. The step's attention mask comes with one span per
sequence (:attr:`~kvcomp.kernels.valid_tokens.ValidTokens.spans`, made on the device once per step): a program's
slice is cut to its sequence's span, and the mask (one byte per cached token and sequence) is read per token only
where the span is not exact, so any mask runs in the kernel and nothing about it is checked on the host.

Query heads per KV head (GQA's ``R``) are few (4 on Llama-3-8B, 8 on 70B), below an MMA tile; scores and
``P V`` are still ``tl.dot`` products over the query rows padded to 16 (on operands of the query's type, TF32 for
float32: :data:`OPERANDS`), with 4 warps and 32-token tiles, 128 for payloads read without a per-group table (:func:`default_tile`),
and registers per thread as the payloads cap them (:meth:`~kvcomp.kernels.formats.PayloadReader.register_cap`); packed
ints and natively read payloads in narrow tiles take 2 warps where the grid gives a multiprocessor eight programs or
more (:func:`_launch_shape`: predicted, not measured).
Measured on an H200 and an H100 (``benchmarks/sweep_decode_kernel.py``), that is the fastest configuration tried for
codebook payloads and, at batch 1, for packed ints; KIVI-2 at batch 16 x 32K ran faster with one register-path
warp (2.14 ms against 3.12 on the H200) but slower at batch 1. QJL's sketched keys take the ``tl.dot`` path too, the
signs as exact bfloat16 operands against two-part ``y`` (:func:`~kvcomp.kernels.formats.sketch_triton.dot_scores`),
predicted 4.8 ms at 16 x 32K against 10.9 for the register path (one query row at a time, each a ``[BLOCK_T, C]``
product reduced in registers: :func:`~kvcomp.kernels.formats.tiles_triton.row_scores`) by ``tools/kernel_model.py``;
not measured. Channels are processed as two halves ``[0, D/2)`` and
``[D/2, D)``, which is what RoPE pairs: ``k_lo' = k_lo cos - k_hi sin``, ``k_hi' = k_hi cos + k_lo sin`` (both from one
argument reduction: :func:`~kvcomp.kernels.formats.tiles_triton.cos_sin`).

Packed ints are read in their stored layout: each byte of a tile once, its ``8 / bits`` fields scored
against the matching query sub-vectors (:func:`~kvcomp.kernels.formats.uniform_triton.packed_scores`) or weighted into a
field-major accumulator (:func:`~kvcomp.kernels.formats.uniform_triton.packed_values`: on ``tl.dot`` one product per
field where each token is one group, on the register path one query row at a time). Codes of
3, 5, 6 or 7 bits, which straddle bytes, are unpacked per tile from the two bytes each may span (:func:`~kvcomp.kernels.formats.uniform_triton.codes`).
Codebook codes of 2 or 4 bits are read by whole bytes the same way, and a codebook chunk of several values (TemporalKV's
tokens, ChannelKV's channels) is gathered as one vector (:mod:`kvcomp.kernels.formats.codebook_triton`).

Each launch shares the tiles of its token range out evenly over its slices (+-1 tile), and the slice count fills
whole waves of the GPU's multiprocessors where the range is long enough
(:func:`~kvcomp.kernels.decode_plan._splits`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvcomp.kernels import Launch, launch_device
from kvcomp.kernels import decode_plan
from kvcomp.kernels import valid_tokens
from kvcomp.kernels.valid_tokens import ValidTokens
from kvcomp.kernels.decode_graphs import DecodeGraphs
from kvcomp.kernels.decode_plan import DecodePlans
from kvcomp.kernels.formats import CallQuery, PayloadReader, RotaryPositions, Segment, segment_length
from kvcomp.kernels.formats.base import Strided, stored, unrotated
from kvcomp.kernels.formats.kernels_triton import kernel_format, residual_format
from kvcomp.kernels.formats.tiles_triton import at, cos_sin, dot, field_major, operand, row_scores, row_values

ROUNDING = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
LOG2E = 1.4426950408889634
# Launch defaults, measured on an H200 and an H100 (BENCHMARKS.md, "Launch configurations of the fused decode
# kernel", benchmarks/sweep_decode_kernel.py): 4 warps per split program (2 for some payloads on a crowded grid, predicted:
# :func:`_launch_shape`); ``tl.dot`` for scores and P V (QJL's sketched keys too: predicted, see the module
# docstring); 32-token tiles, or 128 where every payload is read without a per-group table (:func:`default_tile`).
# 16 warps with 16-token tiles on the register path are 3-10x slower: their per-tile reductions cross 16 warps.
WARPS = 4
TILE = 32
WIDE_TILE = 128
# ``tl.dot``'s operands (``operands``; accumulation is float32 either way), by default the query's type, as
# FlashAttention's: bf16 or fp16 MMAs for a bf16 or fp16 model, TF32 for float32. Measured on an H200
# (``benchmarks/sweep_decode_kernel.py``): bf16 operands against TF32 at 16 x 32K, KIVI-2 1.62x and KIVI-4 1.56x
# faster, the codebook formats 1.05-1.11x, with the same error against the float64 reference; the static model
# predicted KIVI-2's 1.68x from the halved shared-memory staging of the operands.
OPERANDS = {"float32": tl.float32, "bfloat16": tl.bfloat16, "float16": tl.float16}
QUERY_OPERANDS = {torch.bfloat16: "bfloat16", torch.float16: "float16"}  # the default by query dtype; else float32
# where a launch's row of bounds holds what (decode_plan.ROW)
LO, HI, TILES, SLOT0, SLOTS, VALID_S_B, POS_S_B, K_FIRST, K_LENGTH, V_FIRST, V_LENGTH, K_LOWS, K_CUTS, V_LOWS, V_CUTS = (
    tl.constexpr(getattr(decode_plan, name)) for name in ("LO", "HI", "TILES", "SLOT0", "SLOTS", "VALID_S_B", "POS_S_B",
                                                           "K_FIRST", "K_LENGTH", "V_FIRST", "V_LENGTH", "K_LOWS",
                                                           "K_CUTS", "V_LOWS", "V_CUTS"))
SPAN = tl.constexpr(valid_tokens.SPAN)  # int32 per sequence in the step's spans (ValidTokens.spans)


@triton.jit
def _dense(ptr, g, g_ok, c, c_ok, D: tl.constexpr):
    """Cached tokens ``g`` x channels ``c`` of a full-precision piece as float32, zero outside ``g_ok``
    (``ptr``: where cached token 0 of the program's sequence and head would lie; tokens ``D`` apart)."""
    return tl.load(ptr + g[:, None] * D + c[None, :], mask=g_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def _dense_pick(which, d0, d1, d2, g, g_ok, c, c_ok, D: tl.constexpr):
    """:func:`_dense` of full-precision piece ``which`` (0-2) of a stream (sinks, tail, fresh token: separate tensors)."""
    if which == 0:
        x = _dense(d0, g, g_ok, c, c_ok, D)
    elif which == 1:
        x = _dense(d1, g, g_ok, c, c_ok, D)
    else:
        x = _dense(d2, g, g_ok, c, c_ok, D)
    return x


@triton.jit
def _pieces_at(pieces, bounds, LOWS: tl.constexpr, b, h, D: tl.constexpr):
    """A stream's full-precision pieces (:class:`~kvcomp.kernels.formats.base.Strided`, one to three) as pointers to
    where cached token 0 of sequence ``b`` and head ``h`` would lie (each less its first cached token, row ``LOWS``
    of ``bounds``); the absent ones alias the first (:func:`_piece` never picks them)."""
    d0 = at(pieces[0], b, h).ptr - tl.load(bounds + LOWS) * D
    d1 = d0
    d2 = d0
    if len(pieces) > 1:
        d1 = at(pieces[1], b, h).ptr - tl.load(bounds + LOWS + 1) * D
    if len(pieces) > 2:
        d2 = at(pieces[2], b, h).ptr - tl.load(bounds + LOWS + 2) * D
    return d0, d1, d2


@triton.jit
def _cuts(bounds, CUTS: tl.constexpr, N: tl.constexpr, hi):
    """The ``N`` cuts between a stream's segments in the launch (row ``CUTS`` of ``bounds``); the absent ones at ``hi``."""
    cut1 = hi
    cut2 = hi
    cut3 = hi
    if N > 0:
        cut1 = tl.load(bounds + CUTS)
    if N > 1:
        cut2 = tl.load(bounds + CUTS + 1)
    if N > 2:
        cut3 = tl.load(bounds + CUTS + 2)
    return cut1, cut2, cut3


@triton.jit
def _piece(g0, cut1, cut2, cut3, hi, ENCODED: tl.constexpr):
    """Which piece of a stream holds cached token ``g0`` and where it ends: the stream's pieces in the launch
    lie in token order, separated at ``cut1 < cut2 < cut3`` (unused cuts: ``hi``); piece ``ENCODED`` is its
    payload (returned as 3), the others its full-precision pieces 0-2 in order. Few live registers: three
    bounds per stream."""
    position = (g0 >= cut1).to(tl.int32) + (g0 >= cut2).to(tl.int32) + (g0 >= cut3).to(tl.int32)
    stop = tl.where(position == 0, cut1, tl.where(position == 1, cut2, tl.where(position == 2, cut3, hi)))
    which = tl.where(position == ENCODED, 3, position - (position > ENCODED).to(tl.int32))
    return which, tl.maximum(stop, g0 + 1)


@triton.jit
def _scores(q_lo, q_hi, k_lo, k_hi, rows, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, DOT: tl.constexpr,
            OPERAND: tl.constexpr):
    """Logits ``[BLOCK_R, BLOCK_T]`` (log2 units) of key halves: ``tl.dot`` on ``OPERAND`` operands (float32
    accumulation), or in registers, one query row at a time."""
    if DOT:
        s = (dot(operand(q_lo, OPERAND), tl.trans(operand(k_lo, OPERAND)))
             + dot(operand(q_hi, OPERAND), tl.trans(operand(k_hi, OPERAND))))
    else:
        s = row_scores(q_lo, k_lo, rows, BLOCK_R, BLOCK_T) + row_scores(q_hi, k_hi, rows, BLOCK_R, BLOCK_T)
    return s


@triton.jit
def _weighted(acc_lo, acc_hi, alpha, p, v_lo, v_hi, rows, BLOCK_R: tl.constexpr, HALF_PAD: tl.constexpr, DOT: tl.constexpr,
              OPERAND: tl.constexpr):
    """The head_dim-layout accumulator halves rescaled by ``alpha`` plus ``P V`` (``tl.dot`` on ``OPERAND`` operands,
    float32 accumulation, as FlashAttention's ``P V``)."""
    if DOT:
        p = operand(p, OPERAND)
        acc_lo = acc_lo * alpha[:, None] + dot(p, operand(v_lo, OPERAND))
        acc_hi = acc_hi * alpha[:, None] + dot(p, operand(v_hi, OPERAND))
    else:
        acc_lo = acc_lo * alpha[:, None] + row_values(p, v_lo, rows, BLOCK_R, HALF_PAD)
        acc_hi = acc_hi * alpha[:, None] + row_values(p, v_hi, rows, BLOCK_R, HALF_PAD)
    return acc_lo, acc_hi


@triton.jit
def _dense_scores(
    which, d0, d1, d2, q_lo, q_hi, rows, g, g_ok, c, c_ok,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, DOT: tl.constexpr, OPERAND: tl.constexpr,
):
    """Logits of a tile of full-precision keys (piece ``which``)."""
    k_lo = _dense_pick(which, d0, d1, d2, g, g_ok, c, c_ok, D)
    k_hi = _dense_pick(which, d0, d1, d2, g, g_ok, c + D // 2, c_ok, D)
    return _scores(q_lo, q_hi, k_lo, k_hi, rows, BLOCK_R, BLOCK_T, DOT, OPERAND)


@triton.jit
def _dense_weighted(
    acc_lo, acc_hi, alpha, p, which, d0, d1, d2, rows, g, g_ok, c, c_ok,
    D: tl.constexpr, BLOCK_R: tl.constexpr, HALF_PAD: tl.constexpr, DOT: tl.constexpr, OPERAND: tl.constexpr,
):
    """:func:`_weighted` of a tile of full-precision values (piece ``which``)."""
    v_lo = _dense_pick(which, d0, d1, d2, g, g_ok, c, c_ok, D)
    v_hi = _dense_pick(which, d0, d1, d2, g, g_ok, c + D // 2, c_ok, D)
    return _weighted(acc_lo, acc_hi, alpha, p, v_lo, v_hi, rows, BLOCK_R, HALF_PAD, DOT, OPERAND)


@triton.jit
def _dense_field(which, d0, d1, d2, p, rows, g, g_ok, i, j: tl.constexpr, D: tl.constexpr, PER_BYTE: tl.constexpr,
                 BLOCK_R: tl.constexpr, DOT: tl.constexpr):
    """``P V_j`` of channels ``PER_BYTE i + j`` of a full-precision piece (``p``: an operand already on ``tl.dot``)."""
    v = _dense_pick(which, d0, d1, d2, g, g_ok, i * PER_BYTE + j, i < D // PER_BYTE, D)
    if DOT:
        out = dot(p, operand(v, p.dtype))
    else:
        out = row_values(p, v, rows, BLOCK_R, D // PER_BYTE)
    return out


@triton.jit
def _dense_fields(
    which, d0, d1, d2, p, rows, g, g_ok,
    D: tl.constexpr, BITS: tl.constexpr, BLOCK_R: tl.constexpr, DOT: tl.constexpr, OPERAND: tl.constexpr,
):
    """``P V`` of full-precision values into the field-major accumulator of values read in their stored layout
    (:attr:`~kvcomp.kernels.formats.base.KernelFormat.fields`: the few full-precision tokens of such a stream)."""
    P: tl.constexpr = 8 // BITS
    i = tl.arange(0, D // P)
    if DOT:
        p = operand(p, OPERAND)
    if P == 1:
        out = field_major((_dense_field(which, d0, d1, d2, p, rows, g, g_ok, i, 0, D, P, BLOCK_R, DOT),))
    elif P == 2:
        out = field_major((_dense_field(which, d0, d1, d2, p, rows, g, g_ok, i, 0, D, P, BLOCK_R, DOT),
                           _dense_field(which, d0, d1, d2, p, rows, g, g_ok, i, 1, D, P, BLOCK_R, DOT)))
    elif P == 4:
        out = field_major((_dense_field(which, d0, d1, d2, p, rows, g, g_ok, i, 0, D, P, BLOCK_R, DOT),
                           _dense_field(which, d0, d1, d2, p, rows, g, g_ok, i, 1, D, P, BLOCK_R, DOT),
                           _dense_field(which, d0, d1, d2, p, rows, g, g_ok, i, 2, D, P, BLOCK_R, DOT),
                           _dense_field(which, d0, d1, d2, p, rows, g, g_ok, i, 3, D, P, BLOCK_R, DOT)))
    else:
        out = field_major((_dense_field(which, d0, d1, d2, p, rows, g, g_ok, i, 0, D, P, BLOCK_R, DOT),
                           _dense_field(which, d0, d1, d2, p, rows, g, g_ok, i, 1, D, P, BLOCK_R, DOT),
                           _dense_field(which, d0, d1, d2, p, rows, g, g_ok, i, 2, D, P, BLOCK_R, DOT),
                           _dense_field(which, d0, d1, d2, p, rows, g, g_ok, i, 3, D, P, BLOCK_R, DOT),
                           _dense_field(which, d0, d1, d2, p, rows, g, g_ok, i, 4, D, P, BLOCK_R, DOT),
                           _dense_field(which, d0, d1, d2, p, rows, g, g_ok, i, 5, D, P, BLOCK_R, DOT),
                           _dense_field(which, d0, d1, d2, p, rows, g, g_ok, i, 6, D, P, BLOCK_R, DOT),
                           _dense_field(which, d0, d1, d2, p, rows, g, g_ok, i, 7, D, P, BLOCK_R, DOT)))
    return out


@triton.jit
def _rotate(lo, hi, positions, inv_freq, rope_scaling, g, g_ok, c, c_ok, ROUND: tl.constexpr):
    """RoPE of the two channel halves at the positions of cached tokens ``g`` (``positions``: the program's
    sequence); cos/sin rounded to the model's dtype like the rotary embedding's output (ROUND 1: bfloat16,
    2: float16)."""
    pos = tl.load(positions + g, mask=g_ok, other=0).to(tl.float32)
    angle = pos[:, None] * tl.load(inv_freq + c, mask=c_ok, other=0.0)[None, :]
    cos, sin = cos_sin(angle)
    cos, sin = cos * rope_scaling, sin * rope_scaling
    if ROUND == 1:
        cos, sin = cos.to(tl.bfloat16).to(tl.float32), sin.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        cos, sin = cos.to(tl.float16).to(tl.float32), sin.to(tl.float16).to(tl.float32)
    return lo * cos - hi * sin, hi * cos + lo * sin


@triton.jit
def _masked(valid_ptr, g, g_ok):
    """``g_ok`` and the step's mask of tokens ``g`` (a sequence whose span is not exact)."""
    return g_ok & (tl.load(valid_ptr + g, mask=g_ok, other=0) != 0)


@triton.jit
def _split_kernel(
    q_ptr, part_ptr, lse_ptr, bounds, H, R, unit, qk_scale,
    k_pieces, k, v_pieces, v, valid, rope, offset, residual,
    D: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
    K_FORMAT: tl.constexpr, K: tl.constexpr, K_AT: tl.constexpr, PACKED_K: tl.constexpr,
    V_FORMAT: tl.constexpr, V: tl.constexpr, V_AT: tl.constexpr, PACKED_V: tl.constexpr,
    ROPE: tl.constexpr, ROUND: tl.constexpr, DOT: tl.constexpr, OPERAND: tl.constexpr, RESIDUAL_FORMAT: tl.constexpr,
    RESIDUAL: tl.constexpr,
):
    """One slice of one launch's tokens for one (sequence, KV head). Per stream: its full-precision pieces
    (``*_pieces``), and its payload's arguments (``k`` / ``v``), format (``*_FORMAT``: device functions, ``None``
    where the launch reads no payload of the stream), constants (``K`` / ``V``) and position among the stream's
    segments (``*_AT``); ``PACKED_*``: the payload read in its stored layout. ``bounds``: the launch's row of token
    bounds (:data:`~kvcomp.kernels.decode_plan.ROW`). ``valid``: ``(mask,)`` or ``()``; ``rope``: ``(positions,
    inv_freq, scaling)`` of pre-RoPE keys (``ROPE``) or of a key offset, or ``()``; ``offset``: ``(query, c)`` of keys
    stored less a rotated offset, or ``()``; ``residual``: the sign sketch of the keys' residual, its format and
    constants (``RESIDUAL_FORMAT``, ``RESIDUAL``), or ``()`` and ``None``.

    Each tile branches at run time on the piece of each stream that holds it, also where a stream in the launch is its
    payload alone (always the payload): the branch keeps the scheduler from interleaving the key and the value tile,
    which Triton 3.6 compiles with fewer spills (``tools/kernel_resources.py``: EDEN-2, 128-token tiles, 136 bytes per
    thread against 788 straight-line; NVFP4 0 against 404)."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    h = bh % H
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    lo = tl.load(bounds + LO)
    hi = tl.load(bounds + HI)
    tiles = tl.load(bounds + TILES)
    splits = tl.num_programs(1)  # the launch's tiles of ``unit`` tokens, shared out evenly (+-1 tile)
    split_lo = lo + (split * tiles // splits) * unit
    split_hi = tl.minimum(lo + ((split + 1) * tiles // splits) * unit, hi)

    # every tensor advanced to this program's sequence and head once (int64 offsets)
    q_ptr += bh * R * D
    K_CUTS_N: tl.constexpr = len(k_pieces) + (K_FORMAT is not None) - 1
    V_CUTS_N: tl.constexpr = len(v_pieces) + (V_FORMAT is not None) - 1
    if len(k_pieces) > 0:
        k_d0, k_d1, k_d2 = _pieces_at(k_pieces, bounds, K_LOWS, b64, h, D)
    if len(v_pieces) > 0:
        v_d0, v_d1, v_d2 = _pieces_at(v_pieces, bounds, V_LOWS, b64, h, D)
    k_cut1, k_cut2, k_cut3 = _cuts(bounds, K_CUTS, K_CUTS_N, hi)
    v_cut1, v_cut2, v_cut3 = _cuts(bounds, V_CUTS, V_CUTS_N, hi)
    k_first = 0
    if K_FORMAT is not None:
        k = K_FORMAT.advance(k, K, b64, h64, D)
        k_first = tl.load(bounds + K_FIRST)
        k_length = tl.load(bounds + K_LENGTH)
    if V_FORMAT is not None:
        v = V_FORMAT.advance(v, V, b64, h64, D)
        v_first = tl.load(bounds + V_FIRST)
        v_length = tl.load(bounds + V_LENGTH)
    if RESIDUAL_FORMAT is not None:  # keys plus the sign sketch of their residual (TurboQuant-prod)
        residual = RESIDUAL_FORMAT.advance(residual, RESIDUAL, b64, h64, D)
    if len(rope) > 0:
        positions = rope[0] + b64 * tl.load(bounds + POS_S_B)
    if len(valid) > 0:  # the sequence's span of valid tokens: the slice's tiles outside it skipped
        valid_ptr = valid[0] + b64 * tl.load(bounds + VALID_S_B)
        span = valid[1] + b * SPAN
        split_lo = tl.maximum(split_lo, tl.load(span))
        split_hi = tl.minimum(split_hi, tl.load(span + 1))
        inexact = tl.load(span + 2) == 0  # the mask is read per token

    rows = tl.arange(0, BLOCK_R)
    row_ok = rows < R
    c = tl.arange(0, HALF_PAD)
    c_ok = c < D // 2
    q_at = q_ptr + rows[:, None] * D + c[None, :]
    q_mask = row_ok[:, None] & c_ok[None, :]
    q_lo = tl.load(q_at, mask=q_mask, other=0.0).to(tl.float32) * qk_scale
    q_hi = tl.load(q_at + D // 2, mask=q_mask, other=0.0).to(tl.float32) * qk_scale
    if len(offset) > 0:  # a rotated key offset: the query as the model made it (q_ptr: rotated with the payload) and c
        q0_at = offset[0] + bh * R * D + rows[:, None] * D + c[None, :]
        q0_lo = tl.load(q0_at, mask=q_mask, other=0.0).to(tl.float32) * qk_scale
        q0_hi = tl.load(q0_at + D // 2, mask=q_mask, other=0.0).to(tl.float32) * qk_scale
        off_lo = tl.load(offset[1] + h * D + c, mask=c_ok, other=0.0)
        off_hi = tl.load(offset[1] + h * D + D // 2 + c, mask=c_ok, other=0.0)

    if PACKED_K:  # what the key format's scores read of the query, once
        k_query = K_FORMAT.query(q_ptr, rows, row_ok, qk_scale, k, K, D, DOT, OPERAND)
    if RESIDUAL_FORMAT is not None:
        r_query = RESIDUAL_FORMAT.query(q_ptr, rows, row_ok, qk_scale, residual, RESIDUAL, D, DOT, OPERAND)

    m_i = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if PACKED_V:  # field-major: [r, j, i] is channel V_PER_BYTE * i + j
        V_BITS: tl.constexpr = V.BITS
        V_PER_BYTE: tl.constexpr = 8 // V_BITS
        acc = tl.zeros((BLOCK_R, V_PER_BYTE, D // V_PER_BYTE), dtype=tl.float32)
    else:
        acc_lo = tl.zeros((BLOCK_R, HALF_PAD), dtype=tl.float32)
        acc_hi = tl.zeros((BLOCK_R, HALF_PAD), dtype=tl.float32)
    # tiles start at multiples of BLOCK_T from the first payload token (the keys', else the values'): a tile of either
    # payload starts at a multiple of its chunks (decode_launches checks the values' where both streams have one)
    align = k_first % BLOCK_T
    if K_FORMAT is None and V_FORMAT is not None:
        align = v_first % BLOCK_T
    g0 = split_lo
    while g0 < split_hi:  # one tile per iteration, within one piece of each stream: its tokens [g0, end)
        k_which, k_stop = _piece(g0, k_cut1, k_cut2, k_cut3, hi, K_AT)
        v_which, v_stop = _piece(g0, v_cut1, v_cut2, v_cut3, hi, V_AT)
        start = g0 - (g0 + BLOCK_T - align) % BLOCK_T
        end = tl.minimum(tl.minimum(split_hi, start + BLOCK_T), tl.minimum(k_stop, v_stop))
        g = start + tl.arange(0, BLOCK_T)
        g_ok = (g >= g0) & (g < end)
        if len(valid) > 0:
            if inexact:  # the step's attention mask, one byte per cached token (any pattern: no host check)
                g_ok = _masked(valid_ptr, g, g_ok)
        if K_FORMAT is None:  # no encoded keys in this launch
            s = _dense_scores(k_which, k_d0, k_d1, k_d2, q_lo, q_hi, rows, g, g_ok, c, c_ok, D, BLOCK_R, BLOCK_T, DOT,
                              OPERAND)
        elif k_which == 3:  # the encoded payload (a run-time branch even in a stream of the payload alone)
            t = g - k_first
            if PACKED_K:  # scored in the stored layout
                s = K_FORMAT.scores(k_query, q_ptr, R, rows, row_ok, qk_scale, k, K, k_length, t, start - k_first, g_ok,
                                    D, BLOCK_R, BLOCK_T, DOT)
            else:
                k_lo, k_hi = K_FORMAT.halves(k, K, k_length, t, start - k_first, g_ok, c, c_ok, D, BLOCK_T)
                if ROPE:
                    k_lo, k_hi = _rotate(k_lo, k_hi, positions, rope[1], rope[2], g, g_ok, c, c_ok, ROUND)
                s = _scores(q_lo, q_hi, k_lo, k_hi, rows, BLOCK_R, BLOCK_T, DOT, OPERAND)
            if RESIDUAL_FORMAT is not None:  # + sqrt(pi/2)/d ||r|| <S q, sign(S r)>, S q of the model's query
                s += RESIDUAL_FORMAT.scores(r_query, q_ptr, R, rows, row_ok, qk_scale, residual, RESIDUAL, k_length,
                                            t, start - k_first, g_ok, D, BLOCK_R, BLOCK_T, DOT)
            if len(offset) > 0:  # + q . R_p c: the offset rotated to each token's position, scored with the model's query
                o_lo, o_hi = _rotate(tl.zeros((BLOCK_T, HALF_PAD), tl.float32) + off_lo[None, :],
                                     tl.zeros((BLOCK_T, HALF_PAD), tl.float32) + off_hi[None, :],
                                     positions, rope[1], rope[2], g, g_ok, c, c_ok, ROUND)
                s += _scores(q0_lo, q0_hi, o_lo, o_hi, rows, BLOCK_R, BLOCK_T, DOT, OPERAND)
        elif len(k_pieces) > 0:  # a full-precision piece
            s = _dense_scores(k_which, k_d0, k_d1, k_d2, q_lo, q_hi, rows, g, g_ok, c, c_ok, D, BLOCK_R, BLOCK_T, DOT,
                              OPERAND)
        else:  # never: the stream is its payload alone (see the kernel's docstring)
            s = tl.zeros((BLOCK_R, BLOCK_T), tl.float32)
        s = tl.where(g_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_FORMAT is None:  # no encoded values in this launch
            acc_lo, acc_hi = _dense_weighted(acc_lo, acc_hi, alpha, p, v_which, v_d0, v_d1, v_d2, rows, g, g_ok, c, c_ok,
                                             D, BLOCK_R, HALF_PAD, DOT, OPERAND)
        elif v_which == 3:  # the encoded payload
            t = g - v_first
            if PACKED_V:  # weighted in the stored layout
                acc = acc * alpha[:, None, None] + V_FORMAT.fields(p, rows, v, V, t, g_ok, D, BLOCK_R, BLOCK_T, DOT,
                                                                          OPERAND)
            else:
                v_lo, v_hi = V_FORMAT.halves(v, V, v_length, t, start - v_first, g_ok, c, c_ok, D, BLOCK_T)
                acc_lo, acc_hi = _weighted(acc_lo, acc_hi, alpha, p, v_lo, v_hi, rows, BLOCK_R, HALF_PAD, DOT, OPERAND)
        elif len(v_pieces) == 0:  # never: the stream is its payload alone
            pass
        elif PACKED_V:  # a full-precision piece, into the field-major accumulator
            acc = acc * alpha[:, None, None] + _dense_fields(v_which, v_d0, v_d1, v_d2, p, rows, g, g_ok, D, V_BITS, BLOCK_R, DOT,
                                                                 OPERAND)
        else:
            acc_lo, acc_hi = _dense_weighted(acc_lo, acc_hi, alpha, p, v_which, v_d0, v_d1, v_d2, rows, g, g_ok, c, c_ok,
                                             D, BLOCK_R, HALF_PAD, DOT, OPERAND)
        m_i = m_new
        g0 = end

    filled = l_i > 0
    inv_l = 1.0 / tl.where(filled, l_i, 1.0)
    slot = bh * tl.load(bounds + SLOTS) + tl.load(bounds + SLOT0) + split
    if PACKED_V:  # the field-major accumulator written to the head_dim layout
        field = tl.arange(0, V_PER_BYTE)[None, :, None]
        byte = tl.arange(0, D // V_PER_BYTE)[None, None, :]
        out_at = part_ptr + (slot * R + rows[:, None, None]) * D + byte * V_PER_BYTE + field
        tl.store(out_at, acc * inv_l[:, None, None], mask=row_ok[:, None, None])
    else:
        out_at = part_ptr + (slot * R + rows[:, None]) * D + c[None, :]
        tl.store(out_at, acc_lo * inv_l[:, None], mask=q_mask)
        tl.store(out_at + D // 2, acc_hi * inv_l[:, None], mask=q_mask)
    tl.store(lse_ptr + slot * R + rows, tl.where(filled, m_i + tl.log2(tl.where(filled, l_i, 1.0)), float("-inf")), mask=row_ok)


def _interpreted_scalars_index() -> None:
    """Let Triton 3.6's CPU interpreter run :func:`_merge_kernel`'s ``range(tl.load(slots))``: a scalar loaded in an
    interpreted kernel is a one-element array, which that interpreter converts with ``int(array)``, refused by numpy
    2.4 for an array of one dimension ("only 0-dimensional arrays can be converted"). Its index becomes the element,
    as later interpreters (3.9) do; compiled kernels, and an interpreter without ``_patch_lang_tensor``, are
    unaffected."""
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "indexes_elements", False):
        return

    def patch_indexing_the_element(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch_indexing_the_element.indexes_elements = True
    interpreter._patch_lang_tensor = patch_indexing_the_element


_interpreted_scalars_index()


@triton.jit
def _merge_kernel(part_ptr, lse_ptr, out_ptr, slots, R, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """``out = sum_s 2^(lse_s - m) out_s / sum_s 2^(lse_s - m)`` over the step's slots (``slots``: their count, on the
    device)."""
    bh = tl.program_id(0)
    num_slots = tl.load(slots)
    rows = tl.arange(0, BLOCK_R)
    row_ok = rows < R
    cols = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (cols < D)[None, :]
    m = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
    for s in range(num_slots):
        m = tl.maximum(m, tl.load(lse_ptr + (bh * num_slots + s) * R + rows, mask=row_ok, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    weight = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for s in range(num_slots):
        slot = bh * num_slots + s
        w = tl.exp2(tl.load(lse_ptr + slot * R + rows, mask=row_ok, other=float("-inf")) - m)
        acc += w[:, None] * tl.load(part_ptr + (slot * R + rows[:, None]) * D + cols[None, :], mask=mask, other=0.0)
        weight += w
    out = acc / tl.where(weight > 0, weight, 1.0)[:, None]
    tl.store(out_ptr + (bh * R + rows[:, None]) * D + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _buffer_view(piece: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A full-precision piece ``[B, H, T, D]`` as the kernel reads it, and the tokens it starts after: where the piece
    is a view that starts ``shift`` tokens into its buffer (a tail moving along its buffer as tokens leave it), the
    view from the buffer's first token, so that its address does not change from step to step (the plan's row of
    bounds carries the shift: :meth:`~kvcomp.kernels.decode_plan.DecodePlan.rows`); tokens ``D`` apart."""
    stride, shape = piece.stride(), piece.shape
    if stride[3] != 1 or not (shape[2] == 1 or stride[2] == shape[3]):
        return piece.contiguous(), 0
    offset = piece.storage_offset()
    if not offset or stride[2] != shape[3] or offset >= stride[1] or offset % stride[2]:  # at the buffer's start, or
        return piece, 0  # not along sequence 0, head 0's tokens
    shift = offset // stride[2]
    return piece.as_strided(shape, stride, offset - shift * stride[2]), shift


def _pieces(segments: list[Segment]) -> tuple[dict, tuple]:
    """A stream's full-precision pieces as the kernel reads them (:func:`_buffer_view`), by segment index, and each
    segment's shift (0 for a payload)."""
    views = {i: _buffer_view(s) for i, s in enumerate(segments) if isinstance(s, torch.Tensor)}
    return {i: view for i, (view, _) in views.items()}, tuple(views[i][1] if i in views else 0 for i in range(len(segments)))


def _stream_args(prefix: str, segments: list[Segment], indices: tuple, query: CallQuery, pieces_of: dict) -> dict:
    """Kernel arguments of one stream's segments ``indices`` (in token order; at most :data:`~kvcomp.kernels.decode_plan.MAX_DENSE`
    full-precision pieces and one encoded payload): ``{prefix}_pieces``, ``{prefix}`` and the compile-time
    ``{PREFIX}_FORMAT``, ``{PREFIX}``, ``{PREFIX}_AT`` (their bounds: the launch's row,
    :meth:`~kvcomp.kernels.decode_plan.DecodePlan.rows`); ``pieces_of``: the stream's full-precision pieces as the
    kernel reads them, by segment index (:func:`_buffer_view`)."""
    pieces, args, constants, functions, payload_at = [], (), None, None, 4  # the payload's position (4: none)
    for position, index in enumerate(indices):
        segment = segments[index]
        if isinstance(segment, torch.Tensor):
            piece = pieces_of[index]  # (_buffer_view)
            pieces.append(Strided(piece, *piece.stride()[:2]))
            continue
        payload_at = position
        args, constants = segment.kernel_args(query)
        functions = kernel_format(segment)
    upper = prefix.upper()
    return {f"{prefix}_pieces": tuple(pieces), prefix: args, f"{upper}_FORMAT": functions, upper: constants,
            f"{upper}_AT": payload_at}


def _own_launches(segments: list[Segment]) -> bool:
    """Whether a payload among ``segments`` wraps another (read in launch groups of its own: :func:`launch_groups`)."""
    return any(not isinstance(s, torch.Tensor) and s.own_launches for s in segments)


def _kv_heads(segment: Segment) -> int:
    return segment.kv_heads if isinstance(segment, PayloadReader) else segment.shape[1]


def default_tile(segments: list[Segment], narrow: bool = False) -> int:
    """Tokens per tile by default: :data:`WIDE_TILE` where each payload is packed ints, a block float or codes of
    one shared codebook, which an H100 sweep (``benchmarks/sweep_decode_kernel.py``) measured 1.3-1.7x faster at
    16 x 32K (KVarN, vLLM's int4 and NVFP4, EDEN-2, TurboQuant k3v4; KIVI-2 unchanged at 1 and 16 x 32K and 1 x 4K);
    else :data:`TILE`, which per-group codebooks (TemporalKV, ChannelKV, KVQuant: 0.3-0.6x with 128) and QJL's sketches need, and
    which float8 and int8 payloads keep (not measured with 128). A launch that rotates keys or their offset in
    registers (the angles of every token of a tile), or scores a residual sketch (a ``[tokens, d]`` tile of signs), keeps
    :data:`TILE` too (``narrow``): EDEN-2 with ``center`` spills 744 B per thread at 128 tokens under Triton 3.6, 16 B
    at 32 (``tools/kernel_resources.py``)."""
    wide = all(isinstance(s, torch.Tensor) or s.wide_tile for s in segments)
    return WIDE_TILE if wide and not narrow else TILE


def _tile_tokens(block_tokens: int, *segments: Segment, dot: bool) -> int:
    """Tokens per tile of one launch: at most what each payload allows
    (:meth:`~kvcomp.kernels.formats.PayloadReader.tile_limit`: a per-channel group of packed ints, a QJL group)."""
    for segment in segments:
        block_tokens = segment.tile_limit(block_tokens, dot)
    return block_tokens


def _check_chunks(tile: int, keys: PayloadReader | None, key_first: int, values: PayloadReader | None,
                  value_first: int) -> None:
    """A launch's tiles start at multiples of ``tile`` tokens from its key payload's first token (else its value
    payload's): each payload's chunks (:attr:`~kvcomp.kernels.formats.PayloadReader.chunk_tokens`) must divide the
    tile, and the value payload's its offset from the key payload."""
    for payload in (keys, values):
        if payload is not None and tile % payload.chunk_tokens:
            raise ValueError(f"decode kernel: {tile}-token tiles hold no whole number of a payload's "
                             f"{payload.chunk_tokens}-token chunks; choose block_tokens a multiple of them")
    if keys is not None and values is not None and (value_first - key_first) % values.chunk_tokens:
        raise ValueError(f"decode kernel: the value payload starts {value_first - key_first} tokens after the key "
                         f"payload, not a multiple of its {values.chunk_tokens}-token chunks")


def _register_cap(payloads: list[PayloadReader], tile: int, num_warps: int, per_multiprocessor: int) -> int:
    """The registers per thread a ``tl.dot`` launch of these payloads is capped at: the least of their own caps
    (:meth:`~kvcomp.kernels.formats.PayloadReader.register_cap`), 0 (none) where one has none, the launch reads no
    payload, or its grid gives a multiprocessor (``per_multiprocessor`` programs, the busiest's) no more programs than
    it holds at any register count (two of 4 warps at 255): there the cap could only spill. On the H200 the cap cost
    TemporalKV-2 0.209 against 0.177 ms of device time at 1 x 32K (two programs per multiprocessor) and saved 2.488 ->
    1.870 at 16 x 32K (``benchmarks/sweep_decode_kernel.py``)."""
    caps = [payload.register_cap(tile <= TILE, num_warps) for payload in payloads]
    return min(caps) if caps and all(caps) and _crowded(per_multiprocessor, num_warps) else 0


def _launch_shape(payloads: list[PayloadReader], tile: int, per_multiprocessor: int, num_warps: int | None,
                  registers: int | None, dot: bool) -> tuple[int, int]:
    """Warps per program and the register cap (0: none) of one launch whose grid gives the busiest multiprocessor
    ``per_multiprocessor`` programs: ``num_warps`` where given, else the payloads' own warps where they agree and
    those programs fill the multiprocessor with sixteen warps of theirs or more
    (:meth:`~kvcomp.kernels.formats.PayloadReader.crowded_warps`: 2 for packed ints and natively read payloads in
    narrow tiles, eight programs or more at batch 16 x 32K; a multiprocessor holding fewer programs hides less of each
    warp's latency with fewer warps: KIVI-2 at 16 x 4K, three programs each, is predicted 0.132 ms with 2 warps against
    0.119 with 4), else :data:`WARPS`; then ``registers`` where given, else the payloads' cap (:func:`_register_cap`).
    The register path takes the register file's share of a program (ptxas in Triton 3.6 otherwise settles on 64 and
    spills)."""
    if num_warps is None:
        wanted = {payload.crowded_warps(tile <= TILE) for payload in payloads} if dot else set()
        few = wanted.pop() if len(wanted) == 1 else 0
        num_warps = few if few and per_multiprocessor * few >= 16 else WARPS
    if not dot:
        return num_warps, min(255, 65536 // (32 * num_warps))
    return num_warps, registers if registers is not None else _register_cap(payloads, tile, num_warps, per_multiprocessor)


def _crowded(per_multiprocessor: int, num_warps: int) -> bool:
    """Whether a multiprocessor is given more programs of ``num_warps`` warps than it holds at 255 registers."""
    return per_multiprocessor > max(1, 65536 // (256 * 32 * num_warps))


def _boundaries(segments: list[Segment]) -> list[int]:
    bounds = [0]
    for segment in segments:
        bounds.append(bounds[-1] + segment_length(segment))
    return bounds


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU interpreter: a few slices, so that tests exercise the merge


@dataclass
class CallShape:
    """A call's sizes: sequences ``b``, query heads ``hq``, head_dim ``d``, KV heads ``h`` and query rows per KV head
    ``r``; ``q``: its query as ``[B, H, R, D]``."""

    b: int
    hq: int
    d: int
    h: int
    r: int
    q: torch.Tensor


@dataclass
class LaunchOptions:
    """How a call's split launches are shaped: ``tl.dot`` or the register path, query rows per program, tokens per tile
    of the plan, warps (``None``: each launch's by its payloads and grid, :func:`_launch_shape`) and ``tl.dot``'s
    operands (a key of :data:`OPERANDS`)."""

    dot: bool
    block_r: int
    block_tokens: int
    num_warps: int | None
    operands: str


@dataclass
class StreamLayout:
    """One stream's segments as the plan and the kernel see them: their boundaries, which of them are payloads, and
    its full-precision pieces as the kernel reads them, by segment index (:func:`_buffer_view`)."""

    bounds: list
    encoded: tuple
    pieces: dict


@dataclass
class CallBuffers:
    """The device tensors a call's split launches write and read besides its streams (``None`` where the plan has no
    launch): the workspace's partial outputs and log-sum-exps for it, the step's rows of bounds (copied once per step),
    and ``common``, what every launch reads (the step's mask, the rotation's positions, a key offset)."""

    partial: torch.Tensor | None
    lse: torch.Tensor | None
    bounds: torch.Tensor | None
    common: dict


@dataclass
class CallSetup:
    """What one call fixes before its launches' arguments (:func:`call_setup`): its sizes, launch options, streams,
    plan and buffers, and the rotary positions of its encoded keys (pre-RoPE) or of their offset."""

    shape: CallShape
    options: LaunchOptions
    keys: StreamLayout
    values: StreamLayout
    plan: decode_plan.DecodePlan
    buffers: CallBuffers
    rotary: RotaryPositions | None

    @property
    def pieces(self) -> tuple[dict, dict]:
        """Each stream's full-precision pieces as the kernel reads them (:attr:`StreamLayout.pieces`)."""
        return self.keys.pieces, self.values.pieces


def call_setup(query, key_segments, value_segments, valid, step: DecodePlans, region: int = 0, key_rope=None,
               num_splits=None, block_tokens=None, dot=None, num_warps=None, operands=None, key_offset=None,
               key_residual=None) -> CallSetup:
    """The part of :func:`decode_launches` done per call whether or not its launches are built (its options as
    there): checks, launch options, the step's plan (made once per step), the scratch and the step's bounds and mask on
    the device."""
    b, hq, d = query.shape
    if d % 2:
        raise ValueError(f"decode kernel: head_dim={d} must be even")
    operands = operands or QUERY_OPERANDS.get(query.dtype, "float32")
    if operands not in OPERANDS:
        raise ValueError(f"decode kernel: operands={operands!r}; choose one of {sorted(OPERANDS)}")
    if _own_launches(key_segments + value_segments):
        raise ValueError("decode kernel: a rotated, offset or residual-sketch payload takes its own launches "
                         "(decode_attention_triton)")
    if key_rope is not None and key_offset is not None:
        raise ValueError("decode kernel: keys are pre-RoPE (key_rope) or carry a rotated offset (key_offset), not both")
    h = _kv_heads(key_segments[0])
    r = hq // h
    q = query.reshape(b, h, r, d).contiguous()
    device = query.device
    if any(not isinstance(segment, torch.Tensor) and segment.values_only for segment in key_segments):
        raise ValueError("decode kernel: sign bits are read as values, or as a key payload's residual (key_residual)")
    if dot is None:
        dot = True
    block_r = max(16, triton.next_power_of_2(r)) if dot else triton.next_power_of_2(r)
    block_tokens = block_tokens or default_tile(key_segments + value_segments,
                                                key_rope is not None or key_offset is not None or key_residual is not None)
    key_bounds, value_bounds = _boundaries(key_segments), _boundaries(value_segments)
    if key_bounds[-1] != value_bounds[-1]:
        raise ValueError(f"decode kernel: {key_bounds[-1]} cached keys but {value_bounds[-1]} values")
    key_encoded = tuple(not isinstance(s, torch.Tensor) for s in key_segments)
    value_encoded = tuple(not isinstance(s, torch.Tensor) for s in value_segments)
    plan = step.plan(tuple(key_bounds), key_encoded, tuple(value_bounds), value_encoded, b * h, _multiprocessors(device),
                     block_tokens, num_splits)
    shape, launch_options = CallShape(b, hq, d, h, r, q), LaunchOptions(dot, block_r, block_tokens, num_warps, operands)
    if plan.slots == 0:  # nothing cached: no launch (the caller's output is zeros)
        return CallSetup(shape, launch_options, StreamLayout(key_bounds, key_encoded, {}),
                         StreamLayout(value_bounds, value_encoded, {}), plan, CallBuffers(None, None, None, {}), None)
    partial, lse = step.workspace.scratch(device, region, b * h, plan.slots, r, d)
    common = {}  # what every launch of the step reads besides its streams
    valid_s_b = pos_s_b = 0
    if isinstance(valid, torch.Tensor):
        valid = ValidTokens(valid.to(device))
    if valid is not None and step.workspace.graphs is not None:  # at the same address each step
        common["valid"] = step.mask(device, valid.as_bytes, valid.spans)
    elif valid is not None:
        common["valid"] = (valid.as_bytes.to(device), valid.spans.to(device))
    if valid is not None:
        valid_s_b = common["valid"][0].stride(0)
    rotary = key_rope if key_offset is None else key_offset[2]  # encoded keys of pre-RoPE codecs, or their offset
    if rotary is not None:
        positions = rotary.positions.to(device, torch.int32)  # the cache's position ids, read in place
        positions = positions if positions.stride(-1) == 1 else positions.contiguous()
        common["rope"] = (positions, rotary.inv_freq.to(device, torch.float32).contiguous(), float(rotary.scaling))
        pos_s_b = positions.stride(0)
    if key_offset is not None:  # the payload's rotation (the model's query is derived per call) and c
        common["offset"] = (key_offset[0], key_offset[1].to(device, torch.float32).contiguous())
    (key_pieces, key_shifts), (value_pieces, value_shifts) = _pieces(key_segments), _pieces(value_segments)
    shifts = (key_shifts, value_shifts) if any(key_shifts) or any(value_shifts) else ((), ())
    bounds = step.bounds(plan, device, region, valid_s_b, pos_s_b, shifts)
    return CallSetup(shape, launch_options, StreamLayout(key_bounds, key_encoded, key_pieces),
                     StreamLayout(value_bounds, value_encoded, value_pieces), plan, CallBuffers(partial, lse, bounds, common),
                     rotary)


def decode_launches(
    query: torch.Tensor,
    key_segments: list[Segment],
    value_segments: list[Segment],
    scale: float,
    valid: torch.Tensor | ValidTokens | None = None,
    key_rope: RotaryPositions | None = None,
    num_splits: int | None = None,
    block_tokens: int | None = None,
    dot: bool | None = None,
    num_warps: int | None = None,
    operands: str | None = None,
    key_offset: tuple[torch.Tensor | None, torch.Tensor, RotaryPositions] | None = None,
    key_residual: tuple[torch.Tensor | None, torch.Tensor, PayloadReader] | None = None,
    step: DecodePlans | None = None,
    region: int = 0,
    registers: int | None = None,
) -> tuple[torch.Tensor, list[Launch]]:
    """The output buffer and the launches of :func:`decode_attention_triton`, without running them
    (``tools/kernel_resources.py`` compiles them for a GPU that need not be present). ``key_rope``: the
    rotation of encoded keys of pre-RoPE codecs. ``num_splits``: slices per launch (default:
    :func:`~kvcomp.kernels.decode_plan._splits`, whole waves over the GPU's multiprocessors). ``dot``: ``tl.dot`` for
    scores and ``P V`` (default; ``False``: the register path, one query row at a time); ``block_tokens``: tokens per tile (default by format, :func:`default_tile`; fewer where a
    payload's groups need it, :func:`_tile_tokens`); ``num_warps``: warps per split program (default: :data:`WARPS`, or
    the payloads' fewer where the grid crowds the multiprocessors, :func:`_launch_shape`; on the register path a
    program may take the register file's share of its warps); ``operands``: ``tl.dot``'s operands, a
    key of :data:`OPERANDS` (default: the query's type, :data:`QUERY_OPERANDS`); ``registers``: a cap per thread on the
    ``tl.dot`` path (default: the payloads' own where the grid crowds the multiprocessors, :func:`_register_cap`; 0: none).
    ``key_offset``: ``(rotation, c, positions)`` of encoded keys stored less a pre-RoPE offset ``c [H, D]`` rotated to
    each token's position (``positions``: of this launch's tokens from 0), whose score ``q . R_p c`` the kernel adds;
    ``key_residual``: ``(rotation, S, signs)`` of encoded keys plus the sign sketch of their residual (TurboQuant-prod),
    whose score against ``y = S q`` the kernel adds. Both against the model's query ``q``: ``query rotation``, where
    ``query`` here is rotated with the payload by ``rotation^T``, else ``query`` (derived per call: ``CallQuery``).
    ``step``: the forward's :class:`~kvcomp.kernels.decode_plan.DecodePlans` (its plan, made once for every layer,
    and its workspace, whose scratch region ``region`` takes the partial outputs; default: a step of its own).
    Only the slice counts depend on
    the device (its multiprocessors): ``tools/kernel_resources.py`` compiles the launches of CPU tensors for sm_90."""
    step = step or DecodePlans()
    setup = call_setup(query, key_segments, value_segments, valid, step, region, key_rope, num_splits, block_tokens, dot,
                       num_warps, operands, key_offset, key_residual)
    if setup.plan.slots == 0:
        return torch.zeros_like(query), []
    out, launches, _ = setup_launches(setup, query.dtype, key_segments, value_segments, scale, key_rope, key_residual,
                                      registers, merge=True)
    return out, launches


def setup_launches(setup: CallSetup, dtype: torch.dtype, key_segments, value_segments, scale: float, key_rope,
                   key_residual, registers: int | None, merge: bool) -> tuple[torch.Tensor | None, list[Launch], CallQuery]:
    """The output buffer and the launches of a call (:func:`decode_launches`) from its :class:`CallSetup`, and the
    call's query with what its payloads derived from it; without ``merge``, the split launches alone and no output
    (a launch group's, whose partial outputs are merged with the other groups')."""
    shape, options, buffers, plan, rotary = setup.shape, setup.options, setup.buffers, setup.plan, setup.rotary
    b, hq, d, h, r, q = shape.b, shape.hq, shape.d, shape.h, shape.r, shape.q
    dot, block_r, block_tokens, num_warps, operands = (options.dot, options.block_r, options.block_tokens,
                                                       options.num_warps, options.operands)
    key_bounds, key_encoded, value_bounds, value_encoded = (setup.keys.bounds, setup.keys.encoded, setup.values.bounds,
                                                            setup.values.encoded)
    partial, lse, bounds, common = buffers.partial, buffers.lse, buffers.bounds, buffers.common
    half_pad = max(16, triton.next_power_of_2(d // 2)) if dot else triton.next_power_of_2(d // 2)
    call_query = CallQuery(q)  # the call's query, and what payloads derive from it (QJL's S q), for all its launches
    launches = []
    for i, planned in enumerate(plan.launches):
        keys = next((key_segments[j] for j in planned.keys if key_encoded[j]), None)  # the launch's payloads, if any
        values = next((value_segments[j] for j in planned.values if value_encoded[j]), None)
        encoded = [s for s in (keys, values) if s is not None]
        tile = _tile_tokens(block_tokens, *encoded, dot=dot)
        per_multiprocessor = -(-b * h * planned.splits // _multiprocessors(q.device))
        warps, cap = _launch_shape(encoded, tile, per_multiprocessor, num_warps, registers, dot)
        _check_chunks(tile, keys, next((key_bounds[j] for j in planned.keys if key_encoded[j]), 0), values,
                      next((value_bounds[j] for j in planned.values if value_encoded[j]), 0))
        args = dict(q_ptr=q, part_ptr=partial, lse_ptr=lse, bounds=bounds[i], H=h, R=r, unit=block_tokens,
                    qk_scale=scale * LOG2E, valid=common.get("valid", ()), rope=(), offset=(), residual=(),
                    **_stream_args("k", key_segments, planned.keys, call_query, setup.keys.pieces),
                    **_stream_args("v", value_segments, planned.values, call_query, setup.values.pieces),
                    D=d, HALF_PAD=half_pad, BLOCK_R=block_r, BLOCK_T=tile, DOT=dot,
                    OPERAND=OPERANDS[operands],
                    PACKED_K=keys is not None and keys.packed_scores(d, dot) and key_rope is None,
                    PACKED_V=values is not None and values.packed_values(d, dot)
                    and not ((keys is not None and keys.sign_scores or key_residual is not None) and block_r > 4),
                    ROPE=keys is not None and key_rope is not None, ROUND=0, RESIDUAL_FORMAT=None, RESIDUAL=None, num_warps=warps, **({"maxnreg": cap} if cap else {}))
        if keys is not None:  # what only encoded keys read: their rotation or offset, their residual's sketch
            args.update({name: common[name] for name in ("rope",) if name in common})
            if "offset" in common:  # the query as the model made it, and c
                rotation, c = common["offset"]
                model = call_query.derived(("model query", id(c)), lambda q, rotation=rotation: (unrotated(q, rotation),))
                args["offset"] = (model[0], c)
            args["ROUND"] = ROUNDING.get(rotary.dtype, 0) if rotary is not None else 0
            if key_residual is not None:
                rotation, projection, signs = key_residual
                args["residual"], args["RESIDUAL"] = signs.residual_args(call_query, rotation, projection)
                args["RESIDUAL_FORMAT"] = residual_format(signs)
        launches.append(Launch(_split_kernel, (b * h, planned.splits), args))
    if not merge:
        return None, launches, call_query
    out = torch.empty(b, hq, d, device=q.device, dtype=dtype)  # the merge writes every row
    launches.append(_merge_launch(partial, lse, out, bounds[0, decode_plan.SLOTS:], r, block_r))
    return out, launches, call_query


def _merge_launch(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, slots: torch.Tensor, r: int,
                  block_r: int) -> Launch:
    """The merge of a call's slices: ``partial`` ``[B*H, slots, R, D]`` and ``lse`` into ``out``, ``slots`` the
    device-side count of slots used (one program per KV head of each sequence)."""
    d = partial.shape[-1]
    return Launch(_merge_kernel, (partial.shape[0],), dict(part_ptr=partial, lse_ptr=lse, out_ptr=out, slots=slots, R=r,
                                                          D=d, BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(d)))


def decode_attention_triton(query: torch.Tensor, key_segments: list[Segment], value_segments: list[Segment], scale: float,
                            valid: torch.Tensor | ValidTokens | None = None, **options) -> torch.Tensor:
    """Same contract as :func:`~kvcomp.kernels.decode_attention.decode_attention_reference`: ``valid``
    ``[B, L]`` (bool, any pattern; ``None``: every cached token), or the step's
    :class:`~kvcomp.kernels.valid_tokens.ValidTokens`: each sequence's tiles outside its span are skipped, and the
    mask is read per token only where the span is not exact.
    ``options`` (``key_rope``, ``num_splits``, ``block_tokens``, ``dot``, ``num_warps``, ``operands``, ``step``): see
    :func:`decode_launches`.
    A payload that wraps another (:attr:`~kvcomp.kernels.formats.PayloadReader.own_launches`: rotated, offset,
    residual sketch) is read in its own launches (:func:`_with_payload_group`; ``key_rope`` then gives the positions of
    a rotated key offset)."""
    if _own_launches(key_segments + value_segments):
        return _with_payload_group(query, key_segments, value_segments, scale, valid, **options)
    step = options.get("step")
    if step is not None and step.workspace.graphs is not None:
        return _graphed(step.workspace.graphs, query, key_segments, value_segments, scale, valid, **options)
    out, launches = decode_launches(query, key_segments, value_segments, scale, valid, **options)
    with launch_device(query.device):
        for launch in launches:
            launch()
    return out


def _graphed(graphs: DecodeGraphs, query, key_segments, value_segments, scale, valid, step, region=0, registers=None,
             **options) -> torch.Tensor:
    """A call under CUDA graphs (:mod:`~kvcomp.kernels.decode_graphs`; ``options`` of :func:`decode_launches`): its
    setup always (the step's plan, bounds and mask on the device), its launches' arguments only where no graph of the
    same inputs replays."""
    setup = call_setup(query, key_segments, value_segments, valid, step, region, **options)
    if setup.plan.slots == 0:
        return torch.zeros_like(query)
    return _graphed_launches(graphs, setup, key_segments, value_segments, scale, options, registers, region, merge=True)


def _graphed_launches(graphs: DecodeGraphs, setup: CallSetup, key_segments, value_segments, scale, options, registers,
                      region, merge: bool) -> torch.Tensor | None:
    """The launches of a call's ``setup`` under CUDA graphs: replayed by the call's inputs where a graph of them was
    captured, else built and run (captured the second time they read the same tensors); with the merge and its output
    (``merge``), or the split launches alone, whose partial outputs stay in the setup's scratch (a launch group's)."""
    encoded = [s for s in key_segments + value_segments if not isinstance(s, torch.Tensor)]  # (pieces: setup.pieces)
    buffers, q = setup.buffers, setup.shape.q
    inputs = (encoded, setup.pieces, scale, options, registers, region, buffers.partial, buffers.lse, buffers.bounds,
              buffers.common)
    with launch_device(q.device):
        key = graphs.inputs_key(q, inputs)
        replayed = graphs.replay(key, q)
        if replayed is not None:
            return replayed.out
        out, launches, call_query = setup_launches(setup, q.dtype, key_segments, value_segments, scale,
                                                   options.get("key_rope"), options.get("key_residual"), registers, merge)
        return graphs.run(launches, call_query, out, key, inputs)


@dataclass
class LaunchGroup:
    """The segments one group of split launches reads, and what is done to their partial outputs: ``rotation`` un-rotates
    them, ``offset`` (a value offset ``c_v`` ``[H, D]``) is added to them; ``options`` of :func:`decode_launches`.
    ``adds``: the group reads the previous group's keys in the same slices (the same log-sum-exps) and its partial
    outputs are added to that group's (a value residual's sketch)."""

    query: torch.Tensor
    keys: list[Segment]
    values: list[Segment]
    valid: ValidTokens | None
    rotation: torch.Tensor | None
    offset: torch.Tensor | None
    options: dict
    adds: bool = False


def _with_payload_group(query, key_segments, value_segments, scale, valid, key_rope=None, step=None, **options) -> torch.Tensor:
    """Attention over a cache whose payload is stored in a rotated basis, less an offset or with a residual sketch
    (:func:`launch_groups`): the payload's partial outputs are un-rotated (``@ rotation_v``) where its values are and get
    a value offset's ``c_v`` (each a softmax average), and a values' sketch group's outputs, taken back to the values'
    basis, are added to them slice by slice; one merge combines all slices (their log-sum-exps do not depend on the
    basis). Under CUDA graphs (the step's workspace) each group's split launches are captured and replayed as a call's
    are (:func:`_graphed_launches`); the rotations, offsets and the merge run as they are."""
    b, hq, d = query.shape
    partials, lses, merged, sliced = [], [], None, None
    with launch_device(query.device):
        step = step or DecodePlans()
        for region, group in enumerate(launch_groups(query, key_segments, value_segments, valid, key_rope, options)):
            setup = _group_partials(group, scale, step, region)
            if setup is None:  # nothing of this group cached
                continue
            merged = setup
            partial = setup.buffers.partial
            h = partial.shape[0] // b
            if group.rotation is not None:  # [B*H, slots, R, D] by each KV head's rotation ([D, D] or [1 or H, D, D])
                rotation = group.rotation.float().reshape(-1, 1, d, d)
                partial = (partial.view(b, h, *partial.shape[1:]) @ rotation).view(partial.shape)
            if group.offset is not None:  # each slot's output is a softmax average: + c_v of its KV head
                c_v = group.offset.float().to(partial.device).view(1, h, 1, 1, d)
                partial = (partial.view(b, h, *partial.shape[1:]) + c_v).view(partial.shape)
            slices = [(planned.splits, setup.options.block_tokens) for planned in setup.plan.launches]  # (the token counts)
            if group.adds:  # the same keys and slices as the previous group: its share of the same softmax
                if slices != sliced:
                    raise ValueError("decode kernel: a value sketch's launches must slice the payload as its keys'")
                partials[-1] = partials[-1] + partial
                continue
            partials.append(partial)
            sliced = slices
            lses.append(setup.buffers.lse)
        if merged is None:  # nothing cached
            return torch.zeros_like(query)
        out = torch.empty_like(query)  # the merge writes every row
        partial, lse = torch.cat(partials, 1), torch.cat(lses, 1)
        _merge_launch(partial, lse, out, step.count(query.device, 0, partial.shape[1]), merged.shape.r, merged.options.block_r)()
    return out


def _group_partials(group: LaunchGroup, scale: float, step: DecodePlans, region: int) -> CallSetup | None:
    """Run a launch group's split launches into the step's scratch region ``region`` (replayed from a CUDA graph where
    the step's workspace captures them); returns the group's setup (its partial outputs, log-sum-exps and plan), or
    ``None`` where the group has nothing cached."""
    options = dict(group.options)
    registers = options.pop("registers", None)
    setup = call_setup(group.query, group.keys, group.values, group.valid, step, region, **options)
    if setup.plan.slots == 0:
        return None
    if step.workspace.graphs is not None:
        _graphed_launches(step.workspace.graphs, setup, group.keys, group.values, scale, options, registers, region,
                          merge=False)
    else:
        _, launches, _ = setup_launches(setup, setup.shape.q.dtype, group.keys, group.values, scale, options.get("key_rope"),
                                        options.get("key_residual"), registers, merge=False)
        for launch in launches:
            launch()
    return setup


def launch_groups(query, key_segments, value_segments, valid=None, key_rope=None, options=None) -> list[LaunchGroup]:
    """The launch groups of a cache whose payload is stored in a rotated basis or less an offset: one segment of the
    keys and one of the values over the same tokens, either or both wrapped (vLLM's TurboQuant presets rotate only the
    keys), as ``OffsetReader(ResidualSketchReader(RotatedReader(...)))`` where all are present (``center``;
    TurboQuant-prod), each wrapper saying what it adds (:meth:`~kvcomp.kernels.formats.PayloadReader.unwrap`,
    :class:`~kvcomp.kernels.formats.base.Wrapped`). First the payload's, which takes the query rotated
    (``q rotation_k^T``) where its keys are rotated and adds a key offset's score (``key_rope``: every cached token's
    position) and a residual sketch's; then the values' residual sketch over the same keys, if any (``adds``); then, if
    any, the other segments', which take the query as it is (``tools/kernel_resources.py`` compiles the first)."""
    options = options or {}
    at = {i for segments in (key_segments, value_segments) for i, s in enumerate(segments) if _own_launches([s])}
    key_bounds, value_bounds = _boundaries(key_segments), _boundaries(value_segments)
    i = min(at)
    if len(at) != 1 or i >= min(len(key_segments), len(value_segments)) or key_bounds[i: i + 2] != value_bounds[i: i + 2]:
        raise ValueError("decode kernel: a rotated or offset payload must be one post-RoPE segment of the keys and of the "
                         "values, over the same tokens")
    lo, hi = key_bounds[i], key_bounds[i + 1]
    (keys, key_wrapped), (values, value_wrapped) = stored(key_segments[i]), stored(value_segments[i])
    key_offset, value_offset = key_wrapped.offset, value_wrapped.offset
    if key_offset is not None and not key_wrapped.offset_rotated or value_offset is not None and value_wrapped.offset_rotated:
        raise ValueError("decode kernel: a key offset is rotated to each token's position, a value offset is not")
    if (key_rope is None) != (key_offset is None):
        raise ValueError("decode kernel: a rotated payload's keys are post-RoPE; key_rope gives the positions of a "
                         "key offset, and only of one")
    key_sketch, value_sketch = key_wrapped.sketch, value_wrapped.sketch
    key_rotation, value_rotation = key_wrapped.rotation, value_wrapped.rotation
    b, hq, d = query.shape
    h = _kv_heads(keys)
    rotated = query
    if key_rotation is not None:
        rotated = (query.view(b, h, hq // h, d).float() @ key_rotation.transpose(-1, -2).float()).view(b, hq, d)
    payload_options = dict(options)
    if key_offset is not None:
        if key_rope.first != lo:
            raise ValueError(f"decode kernel: key_rope starts at cached token {key_rope.first}, the payload at {lo}")
        positions = key_rope.positions[:, lo:hi]  # the payload's tokens, from 0
        payload_options["key_offset"] = (key_rotation, key_offset,
                                         RotaryPositions(positions, 0, key_rope.inv_freq, key_rope.scaling, key_rope.dtype))
    if key_sketch is not None:  # scored against y = S q of the model's query, which each call derives from its own
        payload_options["key_residual"] = (key_rotation, key_sketch.projection.to(query.device, torch.float32),
                                           key_sketch.residual)
    if isinstance(valid, torch.Tensor):
        valid = ValidTokens(valid)
    payload_valid = None if valid is None else valid.columns(lo, hi)
    if value_sketch is not None:  # both groups slice the payload alike: one tile size for both
        narrow = key_offset is not None or key_sketch is not None
        payload_options["block_tokens"] = (payload_options.get("block_tokens")
                                           or default_tile([keys, values, value_sketch.residual], narrow))
    groups = [LaunchGroup(rotated, [keys], [values], payload_valid, value_rotation, value_offset, payload_options)]
    if value_sketch is not None:  # the values' residual sketch, in its basis, over the same keys
        groups.append(LaunchGroup(rotated, [keys], [value_sketch.residual], payload_valid, value_sketch.basis, None,
                                  payload_options, adds=True))
    rest = (key_segments[:i] + key_segments[i + 1:], value_segments[:i] + value_segments[i + 1:])
    if rest[0]:
        groups.append(LaunchGroup(query, *rest, None if valid is None else valid.without(lo, hi),
                                  None, None, options))
    return groups


def payload_launch_inputs(query, key_segments, value_segments, valid, key_rope, options) -> tuple:
    """``(query, keys, values, valid, key_rope, options)`` of :func:`decode_launches` for the launches that read the
    payload: the payload group's (:func:`launch_groups`) where it is rotated or stored less an offset, else as given
    (``tools/kernel_resources.py`` and ``tools/kernel_model.py`` compile them)."""
    if not _own_launches(key_segments + value_segments):
        return query, key_segments, value_segments, valid, key_rope, options
    group = launch_groups(query, key_segments, value_segments, valid, key_rope, options)[0]
    return group.query, group.keys, group.values, group.valid, None, group.options
