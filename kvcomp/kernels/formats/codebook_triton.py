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
    CENTROIDS: tl.constexpr = C.CENTROIDS
    CL: tl.constexpr = C.CL
    GC: tl.constexpr = C.GC
    TL: tl.constexpr = C.TL
    TOKEN_CENTER: tl.constexpr = C.TOKEN_CENTER
    TOKEN_SCALE: tl.constexpr = C.TOKEN_SCALE
    scale, center = a.token_scale, a.token_center
    if TOKEN_SCALE:
        scale = at(scale, b, h)
    if TOKEN_CENTER:
        center = at(center, b, h)
    return CodebookArgs(at(a.data, b, h), a.codebooks + h * (D // GC) * CENTROIDS * (TL * CL), a.ch_scale + h * D,
                        a.ch_center + h * D, scale, center)


@triton.jit
def _denormalized(z, a, C: tl.constexpr, t, t_ok, c, c_ok, SCALED: tl.constexpr):
    """Codebook values ``z`` (float32, tokens ``t`` x channels ``c``) times the channel (and, where ``SCALED``, the
    token) scale, plus the channel (and token) center."""
    TOKEN_CENTER: tl.constexpr = C.TOKEN_CENTER
    s = tl.load(a.ch_scale + c, mask=c_ok, other=0.0)[None, :]
    center = tl.load(a.ch_center + c, mask=c_ok, other=0.0)[None, :]
    if SCALED:
        s = s * tl.load(a.token_scale.ptr + t, mask=t_ok, other=0.0).to(tl.float32)[:, None]
    if TOKEN_CENTER:
        center = center + tl.load(a.token_center.ptr + t, mask=t_ok, other=0.0).to(tl.float32)[:, None]
    return z * s + center


@triton.jit
def _tile(a, C: tl.constexpr, t, t_ok, c, c_ok, D: tl.constexpr, SCALED: tl.constexpr):
    """Payload tokens ``t`` x channels ``c`` as float32 (times the token scale where ``SCALED``), one centroid entry
    gathered per value (chunks of one value: KVQuant's scalar centroids)."""
    CENTROIDS: tl.constexpr = C.CENTROIDS
    CL: tl.constexpr = C.CL
    CODE_BITS: tl.constexpr = C.CODE_BITS
    GC: tl.constexpr = C.GC
    TL: tl.constexpr = C.TL
    ok = t_ok[:, None] & c_ok[None, :]
    ROW_BYTES: tl.constexpr = ((D // CL) * CODE_BITS + 7) // 8
    code = codes(a.data.ptr, (t[:, None] // TL) * ROW_BYTES, (c // CL)[None, :], ok, CODE_BITS, ROW_BYTES)
    entry = (t % TL)[:, None] * CL + (c % CL)[None, :]
    centroid = (c // GC)[None, :] * CENTROIDS + code
    z = tl.load(a.codebooks + centroid * (TL * CL) + entry, mask=ok, other=0.0).to(tl.float32)
    return _denormalized(z, a, C, t, t_ok, c, c_ok, SCALED)


@triton.jit
def _field(a, C: tl.constexpr, byte, j: tl.constexpr, i, c0, D: tl.constexpr):
    """The centroid entries of field ``j`` of each byte ``i`` (channel ``c0 + PER_BYTE i + j``), as stored."""
    CENTROIDS: tl.constexpr = C.CENTROIDS
    CODE_BITS: tl.constexpr = C.CODE_BITS
    GC: tl.constexpr = C.GC
    c = c0 + i * (8 // CODE_BITS) + j
    code = (byte >> (j * CODE_BITS)) & ((1 << CODE_BITS) - 1)
    return tl.load(a.codebooks + (c // GC)[None, :] * CENTROIDS + code)


@triton.jit
def _scalar_tile(a, C: tl.constexpr, t, t_ok, c, C0: tl.constexpr, c_ok, D: tl.constexpr, SCALED: tl.constexpr):
    """As :func:`_tile`, for codes of 2 or 4 bits of one value each (KVQuant's scalar centroids) and a half of
    whole bytes: each row's bytes loaded once, contiguously, their fields gathered apart and interleaved in registers
    (``tl.join``: channel ``C0 + PER_BYTE i + j`` is field ``j`` of byte ``i``), where one gathered byte per code
    reads each byte ``PER_BYTE`` times."""
    CODE_BITS: tl.constexpr = C.CODE_BITS
    PER_BYTE: tl.constexpr = 8 // CODE_BITS
    ROW_BYTES: tl.constexpr = (D * CODE_BITS + 7) // 8
    HALF: tl.constexpr = c.shape[0]
    i = tl.arange(0, HALF // PER_BYTE)
    byte = tl.load(a.data.ptr + t[:, None] * ROW_BYTES + C0 // PER_BYTE + i[None, :], mask=t_ok[:, None],
                   other=0).to(tl.int32)
    f0 = _field(a, C, byte, 0, i, C0, D)
    f1 = _field(a, C, byte, 1, i, C0, D)
    if PER_BYTE == 2:
        z = tl.join(f0, f1)
    else:  # the first join's new axis weighs most: field j = 2 b + a sits at [..., b, a]
        z = tl.join(tl.join(f0, _field(a, C, byte, 2, i, C0, D)), tl.join(f1, _field(a, C, byte, 3, i, C0, D)))
    z = tl.where(t_ok[:, None], tl.reshape(z, (t.shape[0], HALF)).to(tl.float32), 0.0)
    return _denormalized(z, a, C, t, t_ok, c, c_ok, SCALED)


@triton.jit
def _chunk_tile(a, C: tl.constexpr, length, t, t0, t_ok, c, C0: tl.constexpr, c_ok, D: tl.constexpr,
                SCALED: tl.constexpr, BLOCK_T: tl.constexpr):
    """As :func:`_tile`, for chunks of several values (TemporalKV's tokens, ChannelKV's channels): each chunk's
    centroid read as one vector of ``TL x CL`` values (contiguous in its codebook), then laid out as tokens ``t`` x
    channels ``c`` (``c - C0`` an ``arange``). ``t0``: the tile's first token, a multiple of ``TL`` (the split kernel's
    tiles start at multiples of ``BLOCK_T`` from the payload's first token)."""
    CENTROIDS: tl.constexpr = C.CENTROIDS
    CL: tl.constexpr = C.CL
    CODE_BITS: tl.constexpr = C.CODE_BITS
    GC: tl.constexpr = C.GC
    TL: tl.constexpr = C.TL
    CHANNELS: tl.constexpr = c.shape[0]
    ROW_BYTES: tl.constexpr = ((D // CL) * CODE_BITS + 7) // 8
    tl.static_assert(C0 % CL == 0, "a half of the channels must hold whole chunks")
    chunk = t0 // TL + tl.arange(0, BLOCK_T // TL)  # the tile's chunks of tokens x its chunks of channels
    k = C0 // CL + tl.arange(0, CHANNELS // CL)
    k_ok = k * CL < C0 + D // 2
    stored = (chunk * TL < length)[:, None] & k_ok[None, :]
    code = codes(a.data.ptr, chunk[:, None] * ROW_BYTES, k[None, :], stored, CODE_BITS, ROW_BYTES)
    centroid = (k * CL // GC)[None, :] * CENTROIDS + code  # (a chunk not stored reads code 0: a centroid that exists)
    z = tl.load(a.codebooks + (centroid * (TL * CL))[:, :, None] + tl.arange(0, TL * CL)[None, None, :],
                mask=k_ok[None, :, None], other=0.0)
    z = tl.permute(tl.reshape(z, (BLOCK_T // TL, CHANNELS // CL, TL, CL)), (0, 2, 1, 3))
    z = tl.where(t_ok[:, None] & c_ok[None, :], tl.reshape(z, (BLOCK_T, CHANNELS)).to(tl.float32), 0.0)
    return _denormalized(z, a, C, t, t_ok, c, c_ok, SCALED)


@triton.jit
def halves(a, C: tl.constexpr, length, t, t0, t_ok, c, c_ok, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """``UNIT`` (vLLM's norm correction): each token's decoded vector is rescaled to unit norm over both halves, then
    times its token scale."""
    TOKEN_SCALE: tl.constexpr = C.TOKEN_SCALE
    UNIT: tl.constexpr = C.UNIT
    SCALED: tl.constexpr = TOKEN_SCALE and not UNIT
    if C.TL * C.CL > 1:
        lo = _chunk_tile(a, C, length, t, t0, t_ok, c, 0, c_ok, D, SCALED, BLOCK_T)
        hi = _chunk_tile(a, C, length, t, t0, t_ok, c + D // 2, D // 2, c_ok, D, SCALED, BLOCK_T)
    elif (C.CODE_BITS == 2 or C.CODE_BITS == 4) and c.shape[0] == D // 2 and (D // 2) % (8 // C.CODE_BITS) == 0:
        lo = _scalar_tile(a, C, t, t_ok, c, 0, c_ok, D, SCALED)
        hi = _scalar_tile(a, C, t, t_ok, c + D // 2, D // 2, c_ok, D, SCALED)
    else:
        lo = _tile(a, C, t, t_ok, c, c_ok, D, SCALED)
        hi = _tile(a, C, t, t_ok, c + D // 2, c_ok, D, SCALED)
    if UNIT:  # channels outside c_ok are 0
        norm = tl.sqrt(tl.sum(lo * lo, 1) + tl.sum(hi * hi, 1))
        factor = tl.load(a.token_scale.ptr + t, mask=t_ok, other=0.0).to(tl.float32) / tl.maximum(norm, TINY)
        lo = lo * factor[:, None]
        hi = hi * factor[:, None]
    return lo, hi


CODEBOOK = KernelFormat("codebook", advance, halves)
