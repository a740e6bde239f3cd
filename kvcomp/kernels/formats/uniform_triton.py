"""Device functions of packed ints (:mod:`kvcomp.kernels.formats.uniform`): ``x = code * scale + zero``, decoded
per tile or read in the stored layout."""

import triton
import triton.language as tl

from kvcomp.kernels.formats.base import KernelFormat
from kvcomp.kernels.formats.tiles_triton import INTERPRETED, at, dot, field_major, fma, operand, row_values
from kvcomp.kernels.formats.uniform import UniformArgs, UniformConstants

# Two codes of a 32-bit word, one per 16-bit half, as a bf16x2 / f16x2 pair: ``w & MASK | MAGIC`` (MASK: a code's
# bits in each half) puts each code in the low mantissa bits of 128 (bf16) or 1024 (fp16), exact; subtracting the magic
# leaves the codes, and one fused multiply-add per pair applies the scales and zero-points (pairs packed as the codes:
# ``$3``, ``$4``). Four instructions per two values, where a code's shift, mask, int-to-float conversion, float32 FMA
# and half a packing conversion take five or more per value (static model, ``tools/kernel_model.py``).
_PAIR_ASM = "{ .reg .b32 t, m; lop3.b32 t, $2, MASK, MAGIC, 0xea; mov.b32 m, MAGIC; sub.rn.TYPE t, t, m; " \
            "fma.rn.TYPE t, t, $3, $4; mov.b32 {$0, $1}, t; }"
PAIR_BF16_4 = tl.constexpr(_PAIR_ASM.replace("MASK", "0x000f000f").replace("MAGIC", "0x43004300").replace("TYPE", "bf16x2"))
PAIR_F16_4 = tl.constexpr(_PAIR_ASM.replace("MASK", "0x000f000f").replace("MAGIC", "0x64006400").replace("TYPE", "f16x2"))
PAIR_F16_2 = tl.constexpr(_PAIR_ASM.replace("MASK", "0x00030003").replace("MAGIC", "0x64006400").replace("TYPE", "f16x2"))
PAIR_BF16_2 = tl.constexpr(_PAIR_ASM.replace("MASK", "0x00030003").replace("MAGIC", "0x43004300").replace("TYPE", "bf16x2"))


@triton.jit
def codes(data, row, index, ok, BITS: tl.constexpr, ROW_BYTES: tl.constexpr):
    """Code ``index`` of rows starting at byte ``row`` of a little-endian bit stream of ``BITS``-bit codes
    (:func:`~kvcomp.stages.packing.pack_bits`): one byte where codes fill bytes (1, 2, 4, 8 bits), else the two
    bytes a code may straddle (3, 5, 6, 7 bits; the second only where the row has one)."""
    if 8 % BITS == 0:  # (index // PER_BYTE, not index * BITS // 8: the compiler keeps fewer registers)
        PER_BYTE: tl.constexpr = 8 // BITS
        byte = tl.load(data + row + index // PER_BYTE, mask=ok, other=0).to(tl.int32)
        shift = (index % PER_BYTE) * BITS
    else:
        first = index * BITS // 8
        byte = tl.load(data + row + first, mask=ok, other=0).to(tl.int32)
        byte = byte | (tl.load(data + row + first + 1, mask=ok & (first + 1 < ROW_BYTES), other=0).to(tl.int32) << 8)
        shift = index * BITS % 8
    return (byte >> shift) & ((1 << BITS) - 1)


@triton.jit
def params(ptr, length, t, t0, t_ok, c, c0, c_ok, D: tl.constexpr, GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr,
           BLOCK_T: tl.constexpr):
    """Packed ints' scale or zero of each value of a tile as float32 ``[BLOCK_T, C]``: per-channel groups of ``GROUP``
    tokens (``[T/G, D]``) or per-token groups of ``GROUP`` channels (``[T, D/G]``). Where the tile spans at most two
    groups (per-channel groups when ``BLOCK_T <= GROUP``; per-token groups when a half of the channels holds at most
    two) each parameter is loaded once per tile and selected per token or channel in registers, instead of one
    gathered load per value."""
    if PER_CHANNEL and BLOCK_T <= GROUP:  # one or two rows of per-channel parameters
        first = t0 // GROUP
        second_ok = c_ok & (tl.zeros_like(c) + first + 1 < length // GROUP)
        p = tl.where((t // GROUP == first)[:, None], tl.load(ptr + first * D + c, mask=c_ok, other=0.0).to(tl.float32)[None, :],
                     tl.load(ptr + (first + 1) * D + c, mask=second_ok, other=0.0).to(tl.float32)[None, :])
    elif not PER_CHANNEL and (D // 2 <= GROUP or D // 2 == 2 * GROUP):  # two columns of per-token parameters
        param = t * (D // GROUP) + c0 // GROUP
        second_ok = t_ok & (tl.zeros_like(t) + c0 // GROUP + 1 < D // GROUP)
        p = tl.where((c // GROUP == c0 // GROUP)[None, :], tl.load(ptr + param, mask=t_ok, other=0.0).to(tl.float32)[:, None],
                     tl.load(ptr + param + 1, mask=second_ok, other=0.0).to(tl.float32)[:, None])
    else:  # a gathered load per value
        if PER_CHANNEL:
            param = (t[:, None] // GROUP) * D + c[None, :]
        else:
            param = t[:, None] * (D // GROUP) + c[None, :] // GROUP
        p = tl.load(ptr + param, mask=t_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
    return p


@triton.jit
def revealed(stored):
    """The scale and zero term ``-z s`` of float32 scales hiding their zero-point ``z`` in their 4 low mantissa bits
    (vLLM's int4: :func:`~kvcomp.kernels.formats.uniform.hide_zero`)."""
    bits = stored.to(tl.int32, bitcast=True)
    scale = (bits & -16).to(tl.float32, bitcast=True)
    return scale, -(bits & 15).to(tl.float32) * scale


@triton.jit
def advance(a, C: tl.constexpr, b, h, D: tl.constexpr):
    MULTIPLIER: tl.constexpr = C.MULTIPLIER
    multiplier = a.multiplier
    if MULTIPLIER > 0:
        multiplier = at(a.multiplier, b, h)
    offset = b * a.param_s_b + h * a.param_s_h
    return UniformArgs(at(a.data, b, h), a.scale + offset, a.zero + offset, a.param_s_b, a.param_s_h, multiplier)


@triton.jit
def _dequantized(a, C: tl.constexpr, code, length, t, t0, t_ok, c, c0, c_ok, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """Codes ``[len(t), len(c)]`` of tokens ``t`` x channels ``c`` (of the half starting at ``c0``) as float32. The
    multiplier (KVarN's normaliser) lies along the other axis than the parameters: per token, or per channel every
    ``C.MULTIPLIER`` tokens."""
    GROUP: tl.constexpr = C.GROUP
    MULTIPLIER: tl.constexpr = C.MULTIPLIER
    PER_CHANNEL: tl.constexpr = C.PER_CHANNEL
    if C.HIDDEN_ZERO:
        scale, zero = revealed(params(a.scale, length, t, t0, t_ok, c, c0, c_ok, D, GROUP, PER_CHANNEL, BLOCK_T))
        x = code.to(tl.float32) * scale + zero
    else:
        x = (code.to(tl.float32) * params(a.scale, length, t, t0, t_ok, c, c0, c_ok, D, GROUP, PER_CHANNEL, BLOCK_T)
             + params(a.zero, length, t, t0, t_ok, c, c0, c_ok, D, GROUP, PER_CHANNEL, BLOCK_T))
    if MULTIPLIER > 0:
        x = x * params(a.multiplier.ptr, length, t, t0, t_ok, c, c0, c_ok, D, MULTIPLIER, not PER_CHANNEL, BLOCK_T)
    return x


@triton.jit
def _field(a, C: tl.constexpr, byte, j: tl.constexpr, length, t, t0, t_ok, i, c0, D: tl.constexpr,
           BLOCK_T: tl.constexpr):
    """Field ``j`` of bytes ``i`` of a half's rows (channels ``c0 + PER_BYTE i + j``), dequantised."""
    BITS: tl.constexpr = C.BITS
    PER_BYTE: tl.constexpr = 8 // BITS
    c = c0 + i * PER_BYTE + j
    return _dequantized(a, C, (byte >> (j * BITS)) & ((1 << BITS) - 1), length, t, t0, t_ok, c, c0, c < D, D, BLOCK_T)


@triton.jit
def _tile(a, C: tl.constexpr, length, t, t0, t_ok, c, c0, c_ok, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """Payload tokens ``t`` x channels ``c`` (the first ``c0``) as float32; rows outside ``t_ok`` hold anything
    finite. A half of whole bytes (codes of 1, 2, 4 or 8 bits) is loaded contiguously, each row's bytes once, and
    its fields dequantised apart and interleaved in registers (``tl.join``: channel ``c0 + PER_BYTE i + j`` is
    field ``j`` of byte ``i``); otherwise one gathered byte (or two) per code (:func:`codes`)."""
    BITS: tl.constexpr = C.BITS
    ROW_BYTES: tl.constexpr = (D * BITS + 7) // 8
    PER_BYTE: tl.constexpr = 8 // BITS
    HALF: tl.constexpr = c.shape[0]
    if 8 % BITS == 0 and HALF == D // 2 and HALF % PER_BYTE == 0:
        i = tl.arange(0, HALF // PER_BYTE)
        byte = tl.load(a.data.ptr + t[:, None] * ROW_BYTES + c0 // PER_BYTE + i[None, :], mask=t_ok[:, None],
                       other=0).to(tl.int32)
        f0 = _field(a, C, byte, 0, length, t, t0, t_ok, i, c0, D, BLOCK_T)
        if PER_BYTE == 1:
            return f0
        # the first join's new axis weighs most: field j = 4 c + 2 b + a sits at [..., c, b, a]
        f1 = _field(a, C, byte, 1, length, t, t0, t_ok, i, c0, D, BLOCK_T)
        if PER_BYTE == 2:
            x = tl.join(f0, f1)
        else:
            f2 = _field(a, C, byte, 2, length, t, t0, t_ok, i, c0, D, BLOCK_T)
            f3 = _field(a, C, byte, 3, length, t, t0, t_ok, i, c0, D, BLOCK_T)
            if PER_BYTE == 4:
                x = tl.join(tl.join(f0, f2), tl.join(f1, f3))
            else:
                f4 = _field(a, C, byte, 4, length, t, t0, t_ok, i, c0, D, BLOCK_T)
                f5 = _field(a, C, byte, 5, length, t, t0, t_ok, i, c0, D, BLOCK_T)
                f6 = _field(a, C, byte, 6, length, t, t0, t_ok, i, c0, D, BLOCK_T)
                f7 = _field(a, C, byte, 7, length, t, t0, t_ok, i, c0, D, BLOCK_T)
                x = tl.join(tl.join(tl.join(f0, f4), tl.join(f2, f6)), tl.join(tl.join(f1, f5), tl.join(f3, f7)))
        return tl.reshape(x, (t.shape[0], HALF))
    else:
        code = codes(a.data.ptr, t[:, None] * ROW_BYTES, c[None, :], t_ok[:, None] & c_ok[None, :], BITS, ROW_BYTES)
        return _dequantized(a, C, code, length, t, t0, t_ok, c, c0, c_ok, D, BLOCK_T)


@triton.jit
def halves(a, C: tl.constexpr, length, t, t0, t_ok, c, c_ok, D: tl.constexpr, BLOCK_T: tl.constexpr):
    return (_tile(a, C, length, t, t0, t_ok, c, 0, c_ok, D, BLOCK_T),
            _tile(a, C, length, t, t0, t_ok, c + D // 2, D // 2, c_ok, D, BLOCK_T))


@triton.constexpr_function
def paired_keys(C, DOT, OPERAND, D):
    """Whether per-channel keys are decoded two codes at a time (:func:`_pair`) on ``tl.dot``: 2- or 4-bit codes with
    bf16 or fp16 operands; each field's sub-vector (``D * BITS / 16`` channels, :func:`pair_channels`) at least 16 long,
    groups of a power of two tokens, at least 16 (each tile then lies in one group:
    :meth:`~.uniform.UniformReader.tile_limit`), rows of codes at 4-byte boundaries (:func:`~.uniform.word_aligned`).
    Predicted with bf16 operands (static model, ``tools/kernel_model.py``; not measured): KIVI-2's step 9 %
    less device time at 16 x 32K and 128K, 4 % more at 16 x 4K (4 warps: its operands staged through more shared-memory
    loads), within 1 % at batch 1; KIVI-4's 4-8 % less at batch 16."""
    C = UniformConstants(*C)  # (Triton's interpreter hands a named tuple of constants over as a plain tuple)
    bits_ok = (C.BITS == 4 or C.BITS == 2) and (OPERAND == tl.bfloat16 or OPERAND == tl.float16)
    return (DOT and bits_ok and C.WORDS and C.PER_CHANNEL and not C.HIDDEN_ZERO and C.MULTIPLIER == 0
            and D * C.BITS // 16 >= 16 and C.GROUP >= 16 and not C.GROUP & (C.GROUP - 1))


@triton.jit
def pair_channels(f: tl.constexpr, BITS: tl.constexpr, D: tl.constexpr):
    """The channels of field ``f`` of words of ``BITS``-bit codes, ``[D * BITS / 16]``: entry ``2 w + h`` is code ``f``
    of half ``h`` of word ``w``, channel ``(32 / BITS) w + (16 / BITS) h + f`` (:func:`_pair`'s ``lo`` and ``hi``)."""
    NF: tl.constexpr = 16 // BITS
    u = tl.arange(0, D // NF)
    return (u // 2) * (2 * NF) + (u % 2) * NF + f


@triton.jit
def _unpacked(pair, OPERAND: tl.constexpr):
    """The two ``OPERAND`` numbers of int32 ``pair`` (low half first) as float32."""
    if OPERAND == tl.bfloat16:  # a bf16's bits are a float32's high half
        lo = (pair << 16).to(tl.float32, bitcast=True)
        hi = (pair & -65536).to(tl.float32, bitcast=True)
    else:
        lo = (pair & 65535).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = ((pair >> 16) & 65535).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _pair(w, scales, zeros, BITS: tl.constexpr, OPERAND: tl.constexpr):
    """``code * scale + zero`` of the low ``BITS`` bits of each 16-bit half of int32 words ``w`` in ``OPERAND`` (bf16 or
    fp16), ``scales`` and ``zeros`` two ``OPERAND`` numbers per int32 (:func:`_row_pairs`): two tensors shaped as ``w``
    (:data:`PAIR_F16_2`). Triton's CPU interpreter runs no PTX: there each half is decoded in float32 and rounded once,
    as the GPU's fused multiply-add rounds."""
    if INTERPRETED:
        MASK: tl.constexpr = (1 << BITS) - 1
        s_lo, s_hi = _unpacked(scales, OPERAND)
        z_lo, z_hi = _unpacked(zeros, OPERAND)
        lo = operand(fma((w & MASK).to(tl.float32), s_lo, z_lo), OPERAND)
        hi = operand(fma(((w >> 16) & MASK).to(tl.float32), s_hi, z_hi), OPERAND)
    else:
        if OPERAND == tl.bfloat16:
            ASM: tl.constexpr = PAIR_BF16_2 if BITS == 2 else PAIR_BF16_4
            lo, hi = tl.inline_asm_elementwise(ASM, "=h,=h,r,r,r", [w, scales, zeros],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
        else:
            ASM: tl.constexpr = PAIR_F16_2 if BITS == 2 else PAIR_F16_4
            lo, hi = tl.inline_asm_elementwise(ASM, "=h,=h,r,r,r", [w, scales, zeros], dtype=(tl.float16, tl.float16),
                                               is_pure=True, pack=1)
    return lo, hi


@triton.jit
def _row_pairs(ptr, iw, BITS: tl.constexpr, OPERAND: tl.constexpr):
    """A per-channel parameter row as :func:`_pair` reads it: a tuple over fields ``f`` of int32 ``[len(iw)]``, entry
    ``w`` the ``OPERAND`` bits of channels ``(32 / BITS) w + f`` (low half) and ``(32 / BITS) w + 16 / BITS + f``; the
    row loaded contiguously and split in registers (:func:`_row_fields`). For bf16 one ``cvt.rn.bf16x2.f32`` rounds and
    packs each pair (a conversion per value makes 2-bit pairs slower than bytes: static model)."""
    NF: tl.constexpr = 16 // BITS
    x = tl.load(ptr + iw[:, None] * (2 * NF) + tl.arange(0, 2 * NF)[None, :]).to(tl.float32)  # [NW, 2 NF]
    lo, hi = tl.split(tl.permute(tl.reshape(x, (iw.shape[0], 2, NF)), (0, 2, 1)))  # each word's halves, [NW, NF]
    if OPERAND == tl.bfloat16 and not INTERPRETED:  # (PTX puts the first input in the high half)
        pairs = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi], dtype=tl.int32,
                                          is_pure=True, pack=1)
    else:
        pairs = _half_bits(lo, OPERAND) | (_half_bits(hi, OPERAND) << 16)
    return _fields_of(pairs)


@triton.jit
def _half_bits(x, OPERAND: tl.constexpr):
    """The 16 bits of ``x`` rounded to ``OPERAND`` (:func:`~.tiles_triton.operand`), as the low half of an int32."""
    return operand(x, OPERAND).to(tl.int16, bitcast=True).to(tl.int32) & 65535


@triton.jit
def _paired_scores(query, a, C: tl.constexpr, length, t, t0, t_ok, D: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_T: tl.constexpr, OPERAND: tl.constexpr):
    """Logits of per-channel keys decoded two codes at a time (:func:`paired_keys`): the tile's codes loaded as int32 words
    ``[BLOCK_T, D * BITS / 32]``, and field ``f`` of every word (channels :func:`pair_channels`) decoded by :func:`_pair`
    into a ``tl.dot`` operand in registers that meets the query's sub-vector of the same channels (:func:`packed_query`).
    A tile lies in one group of tokens (:meth:`~.uniform.UniformReader.tile_limit`, tiles aligned to the payload's first
    token): its parameter rows are loaded once."""
    BITS: tl.constexpr = C.BITS
    GROUP: tl.constexpr = C.GROUP
    NF: tl.constexpr = 16 // BITS
    NW: tl.constexpr = D * BITS // 32
    tl.static_assert(GROUP % BLOCK_T == 0, "paired keys: a tile within one group of tokens")
    iw = tl.arange(0, NW)
    words = tl.load(a.data.ptr.to(tl.pointer_type(tl.int32)) + t[:, None] * NW + iw[None, :], mask=t_ok[:, None], other=0)
    row = t0 // GROUP
    scales = _row_pairs(a.scale + row * D, iw, BITS, OPERAND)
    zeros = _row_pairs(a.zero + row * D, iw, BITS, OPERAND)
    s = tl.zeros((BLOCK_R, BLOCK_T), dtype=tl.float32)
    for f in tl.static_range(NF):
        lo, hi = _pair(words >> (f * BITS), scales[f][None, :], zeros[f][None, :], BITS, OPERAND)
        s += dot(query[f], tl.trans(tl.reshape(tl.join(lo, hi), (BLOCK_T, 2 * NW))))
    return s


@triton.jit
def _query_at(q_ptr, rows, row_ok, qk_scale, channels, D: tl.constexpr, OPERAND: tl.constexpr):
    """The query rows' entries at ``channels`` times ``qk_scale``, a ``tl.dot`` operand ``[BLOCK_R, len(channels)]``."""
    q = tl.load(q_ptr + rows[:, None] * D + channels[None, :], mask=row_ok[:, None], other=0.0)
    return operand(q.to(tl.float32) * qk_scale, OPERAND)


@triton.jit
def _query_pair(q_ptr, rows, row_ok, qk_scale, f: tl.constexpr, BITS: tl.constexpr, D: tl.constexpr,
                OPERAND: tl.constexpr):
    return _query_at(q_ptr, rows, row_ok, qk_scale, pair_channels(f, BITS, D), D, OPERAND)


@triton.jit
def _query_field(q_ptr, rows, row_ok, qk_scale, i, j: tl.constexpr, PER_BYTE: tl.constexpr, D: tl.constexpr,
                 OPERAND: tl.constexpr):
    return _query_at(q_ptr, rows, row_ok, qk_scale, i * PER_BYTE + j, D, OPERAND)


@triton.jit
def packed_query(q_ptr, rows, row_ok, qk_scale, a, C: tl.constexpr, D: tl.constexpr, DOT: tl.constexpr,
                 OPERAND: tl.constexpr):
    """For :func:`packed_scores` on the ``tl.dot`` path, the query's field sub-vectors ``[BLOCK_R, W]`` (field ``j``:
    channels ``PER_BYTE i + j``) times ``qk_scale``, loaded once per program (a load in the tile loop is not hoisted
    out of it), then each row's sum of those operands (the zero-points' weight where a token's codes are one group,
    :func:`packed_scores`; compiled out where unused); ``()`` on the register path, which reads one row at a time."""
    BITS: tl.constexpr = C.BITS
    PER_BYTE: tl.constexpr = 8 // BITS
    i = tl.arange(0, D // PER_BYTE)
    if not DOT:
        out = ()
    elif paired_keys(C, DOT, OPERAND, D):  # field f's sub-vector of pair_channels (_paired_scores)
        if BITS == 4:
            out = (_query_pair(q_ptr, rows, row_ok, qk_scale, 0, BITS, D, OPERAND),
                   _query_pair(q_ptr, rows, row_ok, qk_scale, 1, BITS, D, OPERAND),
                   _query_pair(q_ptr, rows, row_ok, qk_scale, 2, BITS, D, OPERAND),
                   _query_pair(q_ptr, rows, row_ok, qk_scale, 3, BITS, D, OPERAND))
        else:
            out = (_query_pair(q_ptr, rows, row_ok, qk_scale, 0, BITS, D, OPERAND),
                   _query_pair(q_ptr, rows, row_ok, qk_scale, 1, BITS, D, OPERAND),
                   _query_pair(q_ptr, rows, row_ok, qk_scale, 2, BITS, D, OPERAND),
                   _query_pair(q_ptr, rows, row_ok, qk_scale, 3, BITS, D, OPERAND),
                   _query_pair(q_ptr, rows, row_ok, qk_scale, 4, BITS, D, OPERAND),
                   _query_pair(q_ptr, rows, row_ok, qk_scale, 5, BITS, D, OPERAND),
                   _query_pair(q_ptr, rows, row_ok, qk_scale, 6, BITS, D, OPERAND),
                   _query_pair(q_ptr, rows, row_ok, qk_scale, 7, BITS, D, OPERAND))
    else:
        c = tl.arange(0, D)
        q = tl.load(q_ptr + rows[:, None] * D + c[None, :], mask=row_ok[:, None], other=0.0)
        total = tl.sum(operand(q.to(tl.float32) * qk_scale, OPERAND).to(tl.float32), 1)
        if PER_BYTE == 1:
            out = (_query_field(q_ptr, rows, row_ok, qk_scale, i, 0, PER_BYTE, D, OPERAND), total)
        elif PER_BYTE == 2:
            out = (_query_field(q_ptr, rows, row_ok, qk_scale, i, 0, PER_BYTE, D, OPERAND),
                   _query_field(q_ptr, rows, row_ok, qk_scale, i, 1, PER_BYTE, D, OPERAND), total)
        elif PER_BYTE == 4:
            out = (_query_field(q_ptr, rows, row_ok, qk_scale, i, 0, PER_BYTE, D, OPERAND),
                   _query_field(q_ptr, rows, row_ok, qk_scale, i, 1, PER_BYTE, D, OPERAND),
                   _query_field(q_ptr, rows, row_ok, qk_scale, i, 2, PER_BYTE, D, OPERAND),
                   _query_field(q_ptr, rows, row_ok, qk_scale, i, 3, PER_BYTE, D, OPERAND), total)
        else:
            out = (_query_field(q_ptr, rows, row_ok, qk_scale, i, 0, PER_BYTE, D, OPERAND),
                   _query_field(q_ptr, rows, row_ok, qk_scale, i, 1, PER_BYTE, D, OPERAND),
                   _query_field(q_ptr, rows, row_ok, qk_scale, i, 2, PER_BYTE, D, OPERAND),
                   _query_field(q_ptr, rows, row_ok, qk_scale, i, 3, PER_BYTE, D, OPERAND),
                   _query_field(q_ptr, rows, row_ok, qk_scale, i, 4, PER_BYTE, D, OPERAND),
                   _query_field(q_ptr, rows, row_ok, qk_scale, i, 5, PER_BYTE, D, OPERAND),
                   _query_field(q_ptr, rows, row_ok, qk_scale, i, 6, PER_BYTE, D, OPERAND),
                   _query_field(q_ptr, rows, row_ok, qk_scale, i, 7, PER_BYTE, D, OPERAND), total)
    return out


@triton.jit
def _fields_of(x):
    """Columns ``j`` of ``[W, N]`` (``N``: 1, 2, 4 or 8) as a tuple over ``j`` of ``[W]``, split in registers
    (``tl.split``: the inverse of :func:`_tile`'s joins)."""
    W: tl.constexpr = x.shape[0]
    N: tl.constexpr = x.shape[1]
    if N == 1:
        out = (tl.reshape(x, (W,)),)
    elif N == 2:
        out = tl.split(x)
    elif N == 4:
        even, odd = tl.split(tl.reshape(x, (W, 2, 2)))
        f0, f2 = tl.split(even)
        f1, f3 = tl.split(odd)
        out = (f0, f1, f2, f3)
    else:
        even, odd = tl.split(tl.reshape(x, (W, 4, 2)))
        e0, e2 = tl.split(tl.reshape(even, (W, 2, 2)))
        o0, o2 = tl.split(tl.reshape(odd, (W, 2, 2)))
        f0, f4 = tl.split(e0)
        f2, f6 = tl.split(e2)
        f1, f5 = tl.split(o0)
        f3, f7 = tl.split(o2)
        out = (f0, f1, f2, f3, f4, f5, f6, f7)
    return out


@triton.jit
def _row_fields(ptr, i, PER_BYTE: tl.constexpr):
    """Entries ``PER_BYTE i + j`` of a row as a tuple over ``j`` of ``[len(i)]`` float32: the row loaded contiguously
    and split in registers (:func:`_fields_of`) instead of ``PER_BYTE`` strided loads."""
    return _fields_of(tl.load(ptr + i[:, None] * PER_BYTE + tl.arange(0, PER_BYTE)[None, :]).to(tl.float32))


@triton.jit
def _token_params(a, C: tl.constexpr, t, t_ok):
    """The scale and zero of tokens ``t`` whose codes form one group each, float32 ``[len(t)]``."""
    sc = tl.load(a.scale + t, mask=t_ok, other=0.0).to(tl.float32)
    if C.HIDDEN_ZERO:
        sc, zc = revealed(sc)
    else:
        zc = tl.load(a.zero + t, mask=t_ok, other=0.0).to(tl.float32)
    return sc, zc


@triton.jit
def _field_codes(byte, j: tl.constexpr, BITS: tl.constexpr):
    """Codes of field ``j`` of bytes ``[BLOCK_T, W]`` (channels ``PER_BYTE i + j``) as float32."""
    return ((byte >> (j * BITS)) & ((1 << BITS) - 1)).to(tl.float32)


@triton.jit
def packed_scores(query, q_ptr, R, rows, row_ok, qk_scale, a, C: tl.constexpr, length, t, t0, t_ok,
                  D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, DOT: tl.constexpr):
    """Logits ``[BLOCK_R, BLOCK_T]`` of packed-int keys in their stored layout, instead of one byte load per channel:
    two codes at a time from int32 words where :func:`paired_keys` (:func:`_paired_scores`), else byte by byte
    (:func:`_byte_scores`)."""
    if DOT:
        if paired_keys(C, DOT, query[0].dtype, D):
            s = _paired_scores(query, a, C, length, t, t0, t_ok, D, BLOCK_R, BLOCK_T, query[0].dtype)
        else:
            s = _byte_scores(query, q_ptr, R, rows, row_ok, qk_scale, a, C, length, t, t0, t_ok, D, BLOCK_R, BLOCK_T, DOT)
    else:
        s = _byte_scores(query, q_ptr, R, rows, row_ok, qk_scale, a, C, length, t, t0, t_ok, D, BLOCK_R, BLOCK_T, DOT)
    return s


@triton.jit
def _byte_scores(query, q_ptr, R, rows, row_ok, qk_scale, a, C: tl.constexpr, length, t, t0, t_ok,
                 D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, DOT: tl.constexpr):
    """:func:`packed_scores` of bytes: each byte of the tile is loaded once, and each of its ``8 / BITS`` fields
    (channels ``PER_BYTE * i + j``) meets the matching query sub-vector (:func:`packed_query`). Where each token's codes
    share one scale and zero (per token, one group of ``D``: vLLM's int4 per token-head), ``tl.dot`` reads the codes as
    they are and applies the token's parameters to its logits, ``s (q . code) + z sum(q)``, instead of decoding every
    value (values alike: :func:`packed_values`)."""
    BITS: tl.constexpr = C.BITS
    GROUP: tl.constexpr = C.GROUP
    PER_CHANNEL: tl.constexpr = C.PER_CHANNEL
    PER_BYTE: tl.constexpr = 8 // BITS
    W: tl.constexpr = D // PER_BYTE
    scale, zero = a.scale, a.zero
    i = tl.arange(0, W)
    ok = t_ok[:, None]
    byte = tl.load(a.data.ptr + t[:, None] * W + i[None, :], mask=ok, other=0).to(tl.int32)  # [BLOCK_T, W]
    s = tl.zeros((BLOCK_R, BLOCK_T), dtype=tl.float32)
    ONE_ROW: tl.constexpr = PER_CHANNEL and GROUP % BLOCK_T == 0
    if ONE_ROW:  # a key tile lies in one window of BLOCK_T tokens from the payload's first (the split kernel's
        row = t0 // GROUP  # tiling), so in one group: its parameter row, loaded once and split per field
        scales = _row_fields(scale + row * D, i, PER_BYTE)
        zeros = _row_fields(zero + row * D, i, PER_BYTE)
    if DOT and C.ONE_GROUP:  # one group per token: the codes as they are, the scale and zero
        # applied to each token's logits, s (q . code) + z sum(q)
        for j in tl.static_range(PER_BYTE):
            s += dot(query[j], tl.trans(operand(_field_codes(byte, j, BITS), query[j].dtype)))
        sc, zc = _token_params(a, C, t, t_ok)
        return s * sc[None, :] + query[PER_BYTE][:, None] * zc[None, :]
    for j in tl.static_range(PER_BYTE):
        channel = i * PER_BYTE + j
        code = _field_codes(byte, j, BITS)
        if ONE_ROW:
            sc = scales[j][None, :]
            zc = zeros[j][None, :]
        elif PER_CHANNEL and BLOCK_T <= GROUP:  # one or two rows of per-channel parameters (see params)
            first = t0 // GROUP
            second_ok = tl.zeros_like(i) + first + 1 < length // GROUP
            in_first = (t // GROUP == first)[:, None]
            sc = tl.where(in_first, tl.load(scale + first * D + channel).to(tl.float32)[None, :],
                          tl.load(scale + (first + 1) * D + channel, mask=second_ok, other=0.0).to(tl.float32)[None, :])
            zc = tl.where(in_first, tl.load(zero + first * D + channel).to(tl.float32)[None, :],
                          tl.load(zero + (first + 1) * D + channel, mask=second_ok, other=0.0).to(tl.float32)[None, :])
        else:
            if PER_CHANNEL:
                param = (t[:, None] // GROUP) * D + channel[None, :]
            else:
                param = t[:, None] * (D // GROUP) + channel[None, :] // GROUP
            sc = tl.load(scale + param, mask=ok, other=0.0).to(tl.float32)
            zc = tl.load(zero + param, mask=ok, other=0.0).to(tl.float32)
        if C.HIDDEN_ZERO:  # (the zero tensor's loads above unused)
            sc, zc = revealed(sc)
        k = code * sc + zc  # [BLOCK_T, W]
        if DOT:
            s += dot(query[j], tl.trans(operand(k, query[j].dtype)))  # the field's query sub-vectors (packed_query)
        else:  # one query row at a time, its field sub-vector [W] loaded as is (L1-resident)
            for r in tl.static_range(BLOCK_R):
                q_r = tl.load(q_ptr + r * D + channel, mask=tl.zeros_like(channel) + r < R, other=0.0)
                s_r = tl.sum(k * (q_r.to(tl.float32) * qk_scale)[None, :], 1)
                s = tl.where(rows[:, None] == r, s + s_r[None, :], s)
    return s


@triton.jit
def _field_dot(p, byte, j: tl.constexpr, BITS: tl.constexpr):
    """``P C_j`` of the codes of field ``j`` on ``tl.dot``, ``p`` an operand already."""
    return dot(p, operand(_field_codes(byte, j, BITS), p.dtype))


@triton.jit
def packed_values(p, rows, a, C: tl.constexpr, t, t_ok, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
                  DOT: tl.constexpr, OPERAND: tl.constexpr):
    """``P V`` of per-token packed-int values in their stored layout, ``[BLOCK_R, 8 / BITS, W]`` where
    ``[r, j, i]`` is channel ``PER_BYTE * i + j``: each byte of the tile is loaded once and each of its
    fields is weighted as it lies; the caller keeps this field-major accumulator and writes it to the head_dim layout
    once, at the end. Registers: one query row at a time; byte ``i`` lies in per-token group
    ``i // (GROUP / PER_BYTE)`` for every field, so a token's few group scales are loaded once and selected per byte.
    ``tl.dot`` (one group per token: :meth:`~.uniform.UniformReader.packed_values`): one product of each field's codes
    as they are, whose operand the compiler builds from the bytes in its own layout, with each token's scale on its
    weight, ``(P s) code + P z``."""
    BITS: tl.constexpr = C.BITS
    GROUP: tl.constexpr = C.GROUP
    PER_BYTE: tl.constexpr = 8 // BITS
    W: tl.constexpr = D // PER_BYTE
    GROUPS: tl.constexpr = D // GROUP
    i = tl.arange(0, W)
    byte = tl.load(a.data.ptr + t[:, None] * W + i[None, :], mask=t_ok[:, None], other=0).to(tl.int32)  # [BLOCK_T, W]
    if DOT:
        tl.static_assert(C.ONE_GROUP, "packed values on tl.dot: one group per token (UniformReader.packed_values)")
        sc, zc = _token_params(a, C, t, t_ok)
        p_zero = tl.sum(p * zc[None, :], 1)
        p = operand(p * sc[None, :], OPERAND)
        if PER_BYTE == 1:
            out = field_major((_field_dot(p, byte, 0, BITS),))
        elif PER_BYTE == 2:
            out = field_major((_field_dot(p, byte, 0, BITS), _field_dot(p, byte, 1, BITS)))
        elif PER_BYTE == 4:
            out = field_major((_field_dot(p, byte, 0, BITS), _field_dot(p, byte, 1, BITS),
                               _field_dot(p, byte, 2, BITS), _field_dot(p, byte, 3, BITS)))
        else:
            out = field_major((_field_dot(p, byte, 0, BITS), _field_dot(p, byte, 1, BITS),
                               _field_dot(p, byte, 2, BITS), _field_dot(p, byte, 3, BITS),
                               _field_dot(p, byte, 4, BITS), _field_dot(p, byte, 5, BITS),
                               _field_dot(p, byte, 6, BITS), _field_dot(p, byte, 7, BITS)))
        out = out + p_zero[:, None, None]
    else:
        group_of = (i // (GROUP // PER_BYTE))[None, :]
        sc = tl.zeros((BLOCK_T, W), dtype=tl.float32)
        zc = tl.zeros((BLOCK_T, W), dtype=tl.float32)
        for k in tl.static_range(GROUPS):
            sc = tl.where(group_of == k, tl.load(a.scale + t * GROUPS + k, mask=t_ok, other=0.0).to(tl.float32)[:, None], sc)
            zc = tl.where(group_of == k, tl.load(a.zero + t * GROUPS + k, mask=t_ok, other=0.0).to(tl.float32)[:, None], zc)
        if C.HIDDEN_ZERO:  # (the zero tensor's loads above unused)
            sc, zc = revealed(sc)
        field = tl.arange(0, PER_BYTE)[None, :, None]
        out = tl.zeros((BLOCK_R, PER_BYTE, W), dtype=tl.float32)
        for j in tl.static_range(PER_BYTE):
            v = _field_codes(byte, j, BITS) * sc + zc
            out = tl.where(field == j, row_values(p, v, rows, BLOCK_R, W)[:, None, :], out)
    return out


UNIFORM = KernelFormat("packed ints", advance, halves, packed_scores, packed_values, packed_query)
