"""The fused decode-attention kernel and the fused codebook encode kernel against their torch references
(under TRITON_INTERPRET=1 on the CPU), the payload readers against the codecs' own decode, and the
attention path that serves decode steps from the payloads."""

from importlib import import_module

import pytest
import torch

from kvcomp.cache import CompressedCache, install, with_cache
from kvcomp.codecs import ModelInfo, build_codec
from kvcomp.codecs.base import StreamRequest
from kvcomp.kernels.codebook_encode import encode_codebook
from kvcomp.kernels.decode_attention import decode_attention, decode_attention_reference
from kvcomp.kernels.formats import CodebookReader, RotaryPositions, UniformReader
from kvcomp.kernels.valid_tokens import SPAN, ValidTokens
from kvcomp.stages.codebook import ChunkLayout, CodebookQuantizer
from kvcomp.stages.packing import packed_length
from kvcomp.stages.uniform_quantizer import GroupQuantizer
from tests.codec_matrix import QJL_FUSED, fitted
from tests.helpers import info_of
from tests.kernels.generation import check_fused_generation, check_graphed_generation

pytestmark = pytest.mark.usefixtures("session_cache")

triton = pytest.importorskip("triton")
tl = triton.language
from kvcomp.kernels.formats.tiles_triton import cos_sin  # noqa: E402


@triton.jit
def _cos_sin_kernel(x_ptr, cos_ptr, sin_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    cos, sin = cos_sin(tl.load(x_ptr + i))
    tl.store(cos_ptr + i, cos)
    tl.store(sin_ptr + i, sin)


@triton.jit
def _count_kernel(n_ptr, out_ptr):
    total = 0
    for _ in range(tl.load(n_ptr)):  # a loop bound loaded on the device, as the merge kernel's slots
        total += 1
    tl.store(out_ptr, total)


def _uniform(x, bits, group, axis):
    quantizer = GroupQuantizer(bits, group, axis)
    stored = quantizer.encode(x)
    reader = UniformReader(x.shape[2], x.shape[3], stored["codes"], stored["scale"], stored["zero"], bits, group, axis == "per_channel")
    return reader, quantizer.decode(stored, x.shape[3], torch.float32)


def _mask(b, length, gen):
    """Left padding on the last sequence (one run of valid tokens: the kernels skip the rest and read no mask), a
    shorter (ragged) sequence 0 with a hole (the mask read per token)."""
    valid = torch.ones(b, length, dtype=torch.bool)
    valid[-1, : int(torch.randint(1, 9, (), generator=gen))] = False
    valid[0, length - int(torch.randint(1, 9, (), generator=gen)) :] = False
    valid[0, length // 3] = False
    return valid


# (batch, kv heads, query heads per kv head, head_dim, key bits, value bits, kv group size)
UNIFORM_SHAPES = [
    (2, 2, 4, 32, 2, 2, 16),  # KIVI-2, GQA 4:1
    (1, 1, 1, 128, 4, 4, 32),  # KIVI-4 at Llama's head_dim, one head
    (2, 3, 5, 16, 1, 8, 8),  # odd GQA ratio and head count, 1- and 8-bit codes, head_dim below one tile
    (2, 2, 4, 32, 3, 5, 16),  # codes straddling bytes (3-bit keys, 5-bit values)
    (1, 1, 4, 128, 1, 2, 32),  # 1-bit keys scored with tl.dot: eight fields per byte (query and parameter rows)
]


@pytest.mark.parametrize("shape", UNIFORM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_uniform_kernel_matches_the_reference(shape):
    """KIVI's layout: per-channel keys and per-token values whose payloads end at different tokens, between
    full-precision sinks and tails (several segment intervals, several slices per interval)."""
    from kvcomp.kernels.decode_attention_triton import decode_attention_triton

    b, h, r, d, key_bits, value_bits, group = shape
    gen = torch.Generator().manual_seed(sum(shape))
    sinks = torch.randn(b, h, 3, d, generator=gen)
    key_reader, _ = _uniform(torch.randn(b, h, 4 * group, d, generator=gen), key_bits, group, "per_channel")
    value_reader, _ = _uniform(torch.randn(b, h, 4 * group + 5, d, generator=gen), value_bits, group, "per_token")
    key_tail, value_tail = torch.randn(b, h, 11, d, generator=gen), torch.randn(b, h, 6, d, generator=gen)
    keys, values = [sinks, key_reader, key_tail], [sinks, value_reader, value_tail]
    length = 3 + 4 * group + 11
    query = torch.randn(b, h * r, d, generator=gen)
    valid = _mask(b, length, gen)
    reference = decode_attention_reference(query, keys, values, d**-0.5, valid)
    for splits in (1, 3):
        out = decode_attention(query, keys, values, d**-0.5, valid, backend="triton", num_splits=splits)
        assert out.shape == (b, h * r, d)
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    if group >= 16:  # the register path with 16-token tiles (smaller groups cap every tile at the group)
        registers = decode_attention_triton(query, keys, values, d**-0.5, valid, num_splits=3, dot=False, block_tokens=16)
        torch.testing.assert_close(registers, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("per_token", [False, True], ids=["tensor-scale", "token-head-scale"])
def test_float8_payloads_are_read_natively(fmt, per_token):
    """vLLM's fp8 caches (:class:`ScaledReader`): float8 values loaded by the kernel and scaled per tensor or
    per token and head, between full-precision sinks and a tail, on the default (tl.dot) and register paths."""
    from kvcomp.kernels.decode_attention_triton import decode_attention_triton
    from kvcomp.kernels.formats import ScaledReader
    from kvcomp.stages.minifloat import FLOAT8, float8_max, to_float8, token_head_scale

    gen = torch.Generator().manual_seed(8)
    b, h, r, d, n = 2, 2, 4, 32, 40
    dtype = FLOAT8[fmt]
    x = {kind: 3 * torch.randn(b, h, n, d, generator=gen) for kind in ("key", "value")}
    readers = {}
    for kind, tokens in x.items():
        scale = token_head_scale(tokens, float8_max(dtype)) if per_token else torch.tensor(0.05)
        readers[kind] = ScaledReader(n, d, to_float8(tokens / scale, dtype), dtype, scale)
    sinks, tail = torch.randn(b, h, 2, d, generator=gen), torch.randn(b, h, 9, d, generator=gen)
    keys, values = [sinks, readers["key"], tail], [sinks, readers["value"], tail]
    query = torch.randn(b, h * r, d, generator=gen)
    valid = _mask(b, 2 + n + 9, gen)
    reference = decode_attention_reference(query, keys, values, d**-0.5, valid)
    assert (readers["key"].dequantize_unrotated() - x["key"]).abs().max() < 0.3 * x["key"].abs().max()  # float8 rounding
    for options in ({"num_splits": 3}, {"dot": False, "block_tokens": 16}):
        out = decode_attention_triton(query, keys, values, d**-0.5, valid, **options)
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def test_rotated_payloads_are_read_by_rotating_the_query_and_the_output():
    """A :class:`RotatedReader` (``x = inner @ R``) between sinks and a tail: its launches take ``q R^T`` and its
    partial outputs are un-rotated before the one merge; keys and values with different rotations."""
    from kvcomp.kernels.decode_attention_triton import decode_attention_triton
    from kvcomp.kernels.formats import RotatedReader

    gen = torch.Generator().manual_seed(9)
    b, h, r, d, n = 2, 2, 4, 32, 48
    rotations = [torch.linalg.qr(torch.randn(d, d, generator=gen))[0] for _ in range(2)]
    readers = []
    for rotation in rotations:
        inner, _ = _uniform(torch.randn(b, h, n, d, generator=gen), 4, d, "per_token")
        readers.append(RotatedReader(n, d, inner, rotation))
    sinks, tail = torch.randn(b, h, 3, d, generator=gen), torch.randn(b, h, 7, d, generator=gen)
    keys, values = [sinks, readers[0], tail], [sinks, readers[1], tail]
    query = torch.randn(b, h * r, d, generator=gen)
    valid = _mask(b, 3 + n + 7, gen)
    reference = decode_attention_reference(query, keys, values, d**-0.5, valid)
    for options in ({"num_splits": 3}, {"dot": False}):
        torch.testing.assert_close(decode_attention_triton(query, keys, values, d**-0.5, valid, **options), reference,
                                   rtol=1e-5, atol=1e-5)
    only = decode_attention_triton(query, [readers[0]], [readers[1]], d**-0.5, valid[:, 3:3 + n])  # nothing else cached
    torch.testing.assert_close(only, decode_attention_reference(query, [readers[0]], [readers[1]], d**-0.5, valid[:, 3:3 + n]),
                               rtol=1e-5, atol=1e-5)
    for k, v in (([sinks, readers[0], tail], [sinks, readers[1].inner, tail]),  # keys rotated only (vLLM's TurboQuant)
                 ([sinks, readers[0].inner, tail], [sinks, readers[1], tail])):  # values rotated only
        torch.testing.assert_close(decode_attention_triton(query, k, v, d**-0.5, valid),
                                   decode_attention_reference(query, k, v, d**-0.5, valid), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="rotated or offset payload must be one"):  # two rotated payloads per stream
        decode_attention_triton(query, [readers[0], readers[0]], [readers[1], readers[1]], d**-0.5)


def test_a_new_wrapper_is_read_by_what_it_says_it_adds():
    """A wrapper defined outside the formats (here: a payload stored in one basis shared by every head, less a value
    offset) is read in launch groups of its own by what its ``unwrap`` records, the launcher unchanged; wrappers nest
    only as ``Wrapped.NESTING`` orders them."""
    from dataclasses import dataclass

    from kvcomp.kernels.decode_attention_triton import decode_attention_triton
    from kvcomp.kernels.formats import OffsetReader, PayloadReader, RotatedReader
    from kvcomp.kernels.formats.base import Wrapped

    @dataclass
    class SharedBasis(PayloadReader):
        inner: PayloadReader
        basis: torch.Tensor
        offset: torch.Tensor
        own_launches = True

        @property
        def kv_heads(self) -> int:
            return self.inner.kv_heads

        def unwrap(self, wrapped: Wrapped) -> PayloadReader:
            wrapped.add("offset", offset=self.offset, offset_rotated=False)
            wrapped.add("rotation", rotation=self.basis)
            return self.inner

        def dequantize_unrotated(self) -> torch.Tensor:
            return self.inner.dequantize_unrotated() @ self.basis + self.offset[None, :, None, :]

    gen = torch.Generator().manual_seed(13)
    b, h, r, d, n = 2, 2, 4, 32, 48
    basis = torch.linalg.qr(torch.randn(d, d, generator=gen))[0]
    keys, _ = _uniform(torch.randn(b, h, n, d, generator=gen), 4, d, "per_token")
    inner, _ = _uniform(torch.randn(b, h, n, d, generator=gen), 4, d, "per_token")
    values = SharedBasis(n, d, inner, basis, torch.randn(h, d, generator=gen))
    sinks = torch.randn(b, h, 3, d, generator=gen)
    query = torch.randn(b, h * r, d, generator=gen)
    reference = decode_attention_reference(query, [sinks, keys], [sinks, values], d**-0.5)
    torch.testing.assert_close(decode_attention_triton(query, [sinks, keys], [sinks, values], d**-0.5), reference,
                               rtol=1e-5, atol=1e-5)
    misnested = RotatedReader(n, d, OffsetReader(n, d, inner, values.offset, False), basis)  # an offset inside a rotation
    with pytest.raises(ValueError, match="wrappers nest as offset"):
        decode_attention_triton(query, [keys], [misnested], d**-0.5)


@pytest.mark.parametrize("global_scale", [1.0, 0.37])
def test_nvfp4_codes_are_read_with_their_block_scales(global_scale):
    """NVFP4 (:class:`BlockFloatReader`): e2m1 codes looked up in the kernel (times the global scale) and scaled per
    block of 16 channels by float8 e4m3 scales, between sinks and a tail, on both product paths."""
    from kvcomp.codecs.base import StreamRequest
    from kvcomp.kernels.decode_attention_triton import decode_attention_triton

    gen = torch.Generator().manual_seed(11)
    b, h, r, d, n = 2, 2, 4, 32, 36
    codec = build_codec({"name": "nvfp4"}, ModelInfo("tiny", 1, h, d))
    readers = {}
    for kind in ("key", "value"):
        payload = codec.encode(StreamRequest(0, kind, tokens=3 * torch.randn(b, h, n, d, generator=gen)))
        reader = codec.payload_reader(payload, kind, 0)
        assert torch.equal(reader.dequantize(), codec.decode(payload, StreamRequest(0, kind, dtype=torch.float32)))
        reader.levels = reader.levels * global_scale  # as a fitted global scale folds in
        readers[kind] = reader
    sinks, tail = torch.randn(b, h, 2, d, generator=gen), torch.randn(b, h, 7, d, generator=gen)
    keys, values = [sinks, readers["key"], tail], [sinks, readers["value"], tail]
    query = torch.randn(b, h * r, d, generator=gen)
    valid = _mask(b, 2 + n + 7, gen)
    reference = decode_attention_reference(query, keys, values, d**-0.5, valid)
    for options in ({"num_splits": 3}, {"dot": False, "block_tokens": 16}):
        torch.testing.assert_close(decode_attention_triton(query, keys, values, d**-0.5, valid, **options), reference,
                                   rtol=1e-5, atol=1e-5)


def test_unit_norm_codebooks_and_codes_straddling_bytes():
    """vLLM's ``turboquant_3bit_nc`` layout: rotated 3-bit scalar codes (straddling bytes) rescaled to unit norm
    per token and head before the stored norm (norm correction), beside per-token 3-bit uniform values that are
    not rotated."""
    from kvcomp.kernels.decode_attention_triton import decode_attention_triton
    from kvcomp.kernels.formats import RotatedReader

    gen = torch.Generator().manual_seed(10)
    b, h, r, d, n = 2, 2, 4, 32, 40
    codes = torch.randint(0, 256, (b, h, n, packed_length(d, 3)), generator=gen, dtype=torch.uint8)
    centroids = torch.randn(8, generator=gen).reshape(1, 1, 8, 1).expand(h, 1, 8, 1).contiguous()
    norms = (torch.rand(b, h, n, generator=gen) + 0.5).half()
    inner = CodebookReader(n, d, codes, centroids, ChunkLayout(1, 1, d), torch.ones(h, d), torch.zeros(h, d), norms,
                           unit_norm=True)
    keys = RotatedReader(n, d, inner, torch.linalg.qr(torch.randn(d, d, generator=gen))[0])
    decoded = keys.dequantize()
    torch.testing.assert_close(decoded.norm(dim=-1), norms.float(), rtol=1e-5, atol=1e-5)  # the stored norms
    values, _ = _uniform(torch.randn(b, h, n, d, generator=gen), 3, d, "per_token")
    sinks, tail = torch.randn(b, h, 2, d, generator=gen), torch.randn(b, h, 6, d, generator=gen)
    query = torch.randn(b, h * r, d, generator=gen)
    valid = _mask(b, 2 + n + 6, gen)
    k, v = [sinks, keys, tail], [sinks, values, tail]
    reference = decode_attention_reference(query, k, v, d**-0.5, valid)
    for options in ({"num_splits": 3}, {"dot": False, "block_tokens": 16}):
        torch.testing.assert_close(decode_attention_triton(query, k, v, d**-0.5, valid, **options), reference,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("r, dot, d, group, key_axis", [
    (16, None, 32, 16, "per_channel"), (4, True, 32, 16, "per_channel"), (16, False, 32, 16, "per_channel"),
    (4, True, 64, 8, "per_channel"), (4, False, 64, 16, "per_token"),
], ids=["r16-default", "r4-dot", "r16-registers", "gathered-parameters", "per-token-keys"])
def test_both_product_paths_match_the_reference(r, dot, d, group, key_axis):
    """Scores and P V as register reductions (``dot=False``) or as tl.dot (the default); keys
    scored in their packed layout or per channel; scales and zeros read as one or two rows / columns per
    tile, or (groups too small for the tile) gathered."""
    from kvcomp.kernels.decode_attention_triton import decode_attention_triton

    b, h = 2, 1
    gen = torch.Generator().manual_seed(r)
    key_reader, _ = _uniform(torch.randn(b, h, 4 * group, d, generator=gen), 2, group, key_axis)
    value_reader, _ = _uniform(torch.randn(b, h, 4 * group, d, generator=gen), 4, group, "per_token")
    tail = torch.randn(b, h, 7, d, generator=gen)
    keys, values = [key_reader, tail], [value_reader, tail]
    query = torch.randn(b, h * r, d, generator=gen)
    valid = _mask(b, 4 * group + 7, gen)
    reference = decode_attention_reference(query, keys, values, d**-0.5, valid)
    out = decode_attention_triton(query, keys, values, d**-0.5, valid, num_splits=2, dot=dot)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("key_bits, value_bits", [(2, 4), (4, 8), (8, 1)])
def test_one_group_per_token_is_applied_to_the_products(key_bits, value_bits):
    """Codes with one scale and zero per token (vLLM's int4 per token-head, TurboQuant's uniform values) on ``tl.dot``:
    the codes multiplied as they are and each token's parameters applied to its logits and weights (``s (q . code) +
    z sum(q)``, ``(P s) code + P z``), with full-precision sinks and tail, against the reference: exact float32 products
    (float32 operands under the interpreter), and bf16 operands no worse than the output's own rounding."""
    from kvcomp.kernels.decode_attention_triton import decode_attention_triton, decode_launches

    b, h, r, d = 2, 2, 4, 128  # (1-bit values: 16 bytes per token, tl.dot's least)
    gen = torch.Generator().manual_seed(key_bits + value_bits)
    key_reader, _ = _uniform(3 * torch.randn(b, h, 70, d, generator=gen) + 1, key_bits, d, "per_token")
    value_reader, _ = _uniform(torch.randn(b, h, 70, d, generator=gen) - 2, value_bits, d, "per_token")
    sinks, tail = torch.randn(b, h, 3, d, generator=gen), torch.randn(b, h, 9, d, generator=gen)
    keys, values = [sinks, key_reader, tail], [sinks, value_reader, tail]
    query = torch.randn(b, h * r, d, generator=gen)
    valid = _mask(b, 82, gen)
    args = decode_launches(query, keys, values, d**-0.5, valid)[1][0].args
    assert args["PACKED_K"] and args["PACKED_V"] and args["K"].ONE_GROUP and args["V"].ONE_GROUP
    reference = decode_attention_reference(query, keys, values, d**-0.5, valid, None, torch.float64)
    out = decode_attention_triton(query, keys, values, d**-0.5, valid, num_splits=3)
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-5)
    half = decode_attention_triton(query.bfloat16(), keys, values, d**-0.5, valid, num_splits=3).double()
    error = float((half - reference).norm() / reference.norm())
    assert error < 4 * float((reference.bfloat16().double() - reference).norm() / reference.norm()), error


@pytest.mark.parametrize("bits, d, group, dtype, operands", [
    (4, 128, 32, torch.bfloat16, None), (4, 64, 16, torch.float16, None), (4, 128, 64, torch.bfloat16, None),
    (2, 128, 32, torch.float16, None), (2, 128, 32, torch.bfloat16, None), (2, 128, 32, torch.bfloat16, "float16")])
def test_per_channel_keys_are_decoded_two_codes_at_a_time(bits, d, group, dtype, operands):
    """Per-channel keys on ``tl.dot`` (``uniform_triton.paired_keys``): 2- and 4-bit codes with 16-bit operands (the
    query's type, or ``operands="float16"``), read as int32 words and decoded two per fused multiply-add in the operand
    type, the parameters rounded to it (exact for fp16: the quantizer stores fp16; bf16 keeps 8 of their 11 bits). Keys
    with large per-channel offsets (zero-points well above the scales), a full-precision sink and tail, a mask, several
    slices: no worse against the reference of those rounded parameters than 4x the output's own rounding. The
    interpreter runs the pair's float32 stand-in (no PTX); float32 operands stay byte by byte."""
    import dataclasses

    from kvcomp.kernels.decode_attention_triton import OPERANDS, decode_attention_triton, decode_launches
    from kvcomp.kernels.formats.uniform_triton import paired_keys

    b, h, r = 2, 1, 4  # paired keys of two heads: test_keys_cut_at_an_odd_byte_are_read_byte_by_byte
    gen = torch.Generator().manual_seed(bits + d + group)
    x = torch.randn(b, h, 4 * group, d, generator=gen) + 3 * torch.randn(d, generator=gen)
    key_reader, _ = _uniform(x, bits, group, "per_channel")
    value_reader, _ = _uniform(torch.randn(b, h, 4 * group + 5, d, generator=gen), bits, 32, "per_token")
    sinks = torch.randn(b, h, 3, d, generator=gen).to(dtype)
    key_tail, value_tail = torch.randn(b, h, 11, d, generator=gen).to(dtype), torch.randn(b, h, 6, d, generator=gen).to(dtype)
    keys, values = [sinks, key_reader, key_tail], [sinks, value_reader, value_tail]
    query = torch.randn(b, h * r, d, generator=gen).to(dtype)
    valid = _mask(b, 3 + 4 * group + 11, gen)
    options = {"operands": operands} if operands else {}
    args = decode_launches(query, keys, values, d**-0.5, valid, **options)[1][0].args
    assert args["PACKED_K"] and paired_keys(args["K"], args["DOT"], args["OPERAND"], d)
    assert not paired_keys(args["K"], args["DOT"], OPERANDS["float32"], d)
    assert paired_keys(args["K"], args["DOT"], OPERANDS["bfloat16"], d)
    operand = {"float16": torch.float16}.get(operands, dtype)
    rounded = dataclasses.replace(key_reader, scale=key_reader.scale.to(operand).to(key_reader.scale.dtype),
                                  zero=key_reader.zero.to(operand).to(key_reader.zero.dtype))
    reference = decode_attention_reference(query, [sinks, rounded, key_tail], values, d**-0.5, valid, None, torch.float64)
    own = float((reference.to(dtype).double() - reference).norm() / reference.norm())
    for splits in (1, 3):
        out = decode_attention_triton(query, keys, values, d**-0.5, valid, num_splits=splits, **options).double()
        error = float((out - reference).norm() / reference.norm())
        assert error < 4 * own, (error, own)


def test_keys_cut_at_an_odd_byte_are_read_byte_by_byte():
    """Paired keys load each token's codes as int32 words, and a misaligned word load is a fatal CUDA error (the
    interpreter, reading host memory, would not notice): codes viewed from an odd byte of their buffer are refused the
    word loads (``uniform.word_aligned``) and read byte by byte, both paths close to the reference; the aligned view
    takes them."""
    import dataclasses

    from kvcomp.kernels.decode_attention_triton import decode_attention_triton, decode_launches
    from kvcomp.kernels.formats.uniform_triton import paired_keys

    b, h, r, d, group = 2, 2, 4, 128, 32
    gen = torch.Generator().manual_seed(9)
    key_reader, _ = _uniform(torch.randn(b, h, 2 * group, d, generator=gen), 4, group, "per_channel")
    value_reader, _ = _uniform(torch.randn(b, h, 2 * group, d, generator=gen), 4, 32, "per_token")
    codes = key_reader.codes
    buffer = torch.zeros(codes.numel() + 1, dtype=torch.uint8)
    buffer[1:] = codes.flatten()
    cut = dataclasses.replace(key_reader, codes=buffer[1:].view(codes.shape))
    assert cut.codes.data_ptr() % 4 and cut.codes[0, 0].is_contiguous()
    query = torch.randn(b, h * r, d, generator=gen).to(torch.bfloat16)
    outs = []
    for reader, words in ((key_reader, True), (cut, False)):
        args = decode_launches(query, [reader], [value_reader], d**-0.5)[1][0].args
        assert args["PACKED_K"] and args["K"].WORDS == words
        assert paired_keys(args["K"], args["DOT"], args["OPERAND"], d) == words
        outs.append(decode_attention_triton(query, [reader], [value_reader], d**-0.5).float())
    reference = decode_attention_reference(query, [key_reader], [value_reader], d**-0.5, None, None, torch.float64)
    for out in outs:
        assert float((out.double() - reference).norm() / reference.norm()) < 2e-2
    assert not torch.equal(outs[0], outs[1])  # bf16 parameters in pairs, float32 byte by byte: two paths ran


def test_packed_values_on_tl_dot_refuse_several_groups_per_token(monkeypatch):
    """The field-major ``tl.dot`` products of packed values apply one scale per token: a reader that let a payload of
    several groups per token (KIVI's values) take them would be refused when the kernel compiles, not read wrong."""
    from triton.runtime.errors import InterpreterError

    from kvcomp.kernels.decode_attention_triton import decode_attention_triton

    b, h, r, d, group = 1, 1, 4, 64, 16
    gen = torch.Generator().manual_seed(2)
    key_reader, _ = _uniform(torch.randn(b, h, 32, d, generator=gen), 2, group, "per_channel")
    value_reader, _ = _uniform(torch.randn(b, h, 32, d, generator=gen), 2, group, "per_token")
    assert not value_reader.one_group and not value_reader.packed_values(d, True)
    monkeypatch.setattr(UniformReader, "packed_values", lambda self, head_dim, dot: True)
    with pytest.raises((InterpreterError, AssertionError), match="one group per token"):
        decode_attention_triton(torch.randn(b, h * r, d, generator=gen), [key_reader], [value_reader], d**-0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_tl_dot_operands_follow_the_query_dtype(dtype):
    """``tl.dot`` takes operands of the query's type by default (bf16 MMAs for a bf16 model, as FlashAttention's; TF32
    for float32); packed-int keys and values with a full-precision tail, against the float64 reference. Under the
    interpreter bf16 operands are multiplied as the float32 numbers they hold (``tiles_triton.dot``: the interpreter's
    own bf16 ``tl.dot`` is ~1e9 off)."""
    from kvcomp.kernels.decode_attention_triton import OPERANDS, decode_attention_triton, decode_launches

    b, h, r, d, group = 2, 2, 4, 64, 16
    gen = torch.Generator().manual_seed(5)
    key_reader, _ = _uniform(torch.randn(b, h, 4 * group, d, generator=gen), 2, group, "per_channel")
    value_reader, _ = _uniform(torch.randn(b, h, 4 * group, d, generator=gen), 2, group, "per_token")
    tail = torch.randn(b, h, 7, d, generator=gen).to(dtype)
    keys, values = [key_reader, tail], [value_reader, tail]
    query = torch.randn(b, h * r, d, generator=gen).to(dtype)
    _, launches = decode_launches(query, keys, values, d**-0.5)
    assert launches[0].args["OPERAND"] == OPERANDS[{torch.float32: "float32"}.get(dtype, str(dtype).split(".")[1])]
    reference = decode_attention_reference(query, keys, values, d**-0.5, None, None, torch.float64)
    out = decode_attention_triton(query, keys, values, d**-0.5, num_splits=2).double()
    error = float((out - reference).norm() / reference.norm())
    assert error < (1e-5 if dtype == torch.float32 else 1.5e-2), error
    if dtype != torch.float32:  # no worse than the output's own rounding to the query's type
        assert error < 4 * float((reference.to(dtype).double() - reference).norm() / reference.norm())


def test_cos_sin_of_rope_angles_matches_torch():
    """The split kernel's RoPE cosines and sines (``tiles_triton.cos_sin``: one reduction, polynomials) against float64
    at Llama-3's frequencies and positions up to 1M tokens: within 1e-7 (float32's own error is about 4e-8) and, rounded
    to bfloat16 as the rotary embedding's output is, equal to torch's float32 ``cos`` / ``sin``."""
    n = 1 << 14
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 1 << 20, (n // 64,), generator=gen).float()
    inv_freq = 500000.0 ** (-torch.arange(0, 128, 2).float() / 128)
    x = (positions[:, None] * inv_freq[None, :]).flatten()
    x[:8] = torch.tensor([0.0, 1e-30, 0.7853981, 0.7853982, 1.5707964, 3.1415927, -2.0, 131072.0])
    cos, sin = torch.empty_like(x), torch.empty_like(x)
    _cos_sin_kernel[(1,)](x, cos, sin, n)
    exact = x.double()
    assert float((cos.double() - exact.cos()).abs().max()) < 1e-7
    assert float((sin.double() - exact.sin()).abs().max()) < 1e-7
    assert torch.equal(cos.bfloat16(), x.cos().bfloat16()) and torch.equal(sin.bfloat16(), x.sin().bfloat16())


def test_a_loop_bound_loaded_in_a_kernel_is_an_index():
    """A scalar loaded in a kernel bounds a ``range`` under the interpreter too: Triton 3.6's (the GPU machine's)
    converts it with ``int(array)``, which numpy 2.4 refuses for a one-element array; the decode launcher lends it the
    element as an index (``decode_attention_triton._interpreted_scalars_index``)."""
    import kvcomp.kernels.decode_attention_triton  # noqa: F401  (what every decode launch imports)

    out = torch.zeros(1, dtype=torch.int32)
    _count_kernel[(1,)](torch.tensor([5], dtype=torch.int32), out)
    assert int(out) == 5


def test_nothing_that_grows_with_the_cache_specializes_a_kernel():
    """Triton compiles a variant per value class (1, multiple of 16) of every specialised integer: lengths and
    bounds that grow with the cache would recompile the kernels as decoding goes on. The decode kernels read them from
    the plan's rows on the device; their runtime scalars are fixed per model (strides stay specialised: they remain
    multiples of head_dim as buffers grow, and the class lets the compiler vectorise loads)."""
    import inspect

    from kvcomp.kernels import decode_attention_triton as kernels

    def runtime(kernel):
        parameters = inspect.signature(kernel.fn).parameters.values()
        return {p.name for p in parameters if "constexpr" not in str(p.annotation)}

    assert runtime(kernels._split_kernel) == {"q_ptr", "part_ptr", "lse_ptr", "bounds", "H", "R", "unit", "qk_scale",
                                              "k_pieces", "k", "v_pieces", "v", "valid", "rope", "offset", "residual"}
    assert runtime(kernels._merge_kernel) == {"part_ptr", "lse_ptr", "out_ptr", "slots", "R"}
    from kvcomp.kernels.codebook_encode_triton import _encode_kernel
    from kvcomp.kernels.qjl_scores_triton import _qjl_scores_kernel

    assert "T" in _unspecialized(_encode_kernel) and "T" in _unspecialized(_qjl_scores_kernel)


def test_a_format_function_edited_changes_the_kernel_cache_key():
    """Triton keys its on-disk cache on the text of a compile-time argument, not on the source of functions inside a
    tuple: a format's key names each function's source hash, so an edited format recompiles the kernel."""
    from types import SimpleNamespace

    from kvcomp.kernels.formats.base import KernelFormat

    first, edited = (KernelFormat("f", SimpleNamespace(cache_key=key)) for key in ("a1", "b2"))
    assert first.cache_key != edited.cache_key and "a1" in first.cache_key and "a1" in str((first, 1))


def test_a_launch_reads_its_bounds_from_the_plan_rows():
    """Each split launch's row holds its tokens, slots, and each stream's payload and piece bounds in order."""
    from kvcomp.kernels import decode_plan as dp

    keys, values = (0, 3, 67, 76, 77), (0, 3, 72, 76, 77)  # sinks, payload, tail, fresh token
    encoded = (False, True, False, False)
    plan = dp.plan_decode(keys, encoded, values, encoded, programs=4, wave=4, block_tokens=32, num_splits=2)
    (row,) = plan.rows(valid_s_b=80, pos_s_b=96)
    assert len(row) == dp.ROW and dp.ROW % 4 == 0
    assert row[dp.LO: dp.POS_S_B + 1] == [0, 77, 3, 0, 2, 80, 96]
    assert row[dp.K_FIRST: dp.V_LENGTH + 1] == [3, 64, 3, 69]
    assert row[dp.K_LOWS: dp.K_LOWS + 3] == [0, 67, 76] and row[dp.K_CUTS: dp.K_CUTS + 3] == [3, 67, 76]
    assert row[dp.V_LOWS: dp.V_LOWS + 3] == [0, 72, 76] and row[dp.V_CUTS: dp.V_CUTS + 3] == [3, 72, 76]


def test_one_launch_reads_every_segment_of_a_step():
    """Sinks, payload, tail and the fresh token of both streams (keys and values encoded up to different
    tokens) are one split launch plus the merge; a stream with two payloads, or more than three full-precision
    pieces, gets one launch per run of segments that fits. Every plan equals the reference."""
    from kvcomp.kernels.decode_attention_triton import decode_launches

    b, h, r, d, group = 2, 2, 4, 32, 16
    gen = torch.Generator().manual_seed(11)
    x = lambda n: torch.randn(b, h, n, d, generator=gen)  # noqa: E731
    sinks, fresh = x(3), x(1)
    key_reader, _ = _uniform(x(2 * group), 2, group, "per_channel")
    value_reader, _ = _uniform(x(2 * group + 5), 2, group, "per_token")
    query = torch.randn(b, h * r, d, generator=gen)
    cases = {  # name -> (keys, values, split launches)
        "step": ([sinks, key_reader, x(9), fresh], [sinks, value_reader, x(4), fresh], 1),
        "dense only": ([sinks, x(40), fresh], [sinks, x(40), fresh], 1),
        "two payloads": ([sinks, key_reader, key_reader, x(10)], [sinks, value_reader, value_reader], 3),
        "five pieces": ([x(5), x(7), x(2), x(9), fresh], [x(23), fresh], 2),
    }
    for name, (keys, values, expected) in cases.items():
        length = sum(s.num_tokens if isinstance(s, UniformReader) else s.shape[2] for s in keys)
        valid = _mask(b, length, gen)
        _, launches = decode_launches(query, keys, values, d**-0.5, valid, num_splits=3)
        assert len(launches) == expected + 1, name  # + the merge
        reference = decode_attention_reference(query, keys, values, d**-0.5, valid)
        out = decode_attention(query, keys, values, d**-0.5, valid, backend="triton", num_splits=3)
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5, msg=name)


def _unspecialized(kernel) -> set[str]:
    """A jitted kernel's ``do_not_specialize`` argument names (compiled or under the interpreter)."""
    listed = getattr(kernel, "do_not_specialize", None)
    listed = kernel.kwargs["do_not_specialize"] if listed is None else listed
    return {kernel.arg_names[i] if isinstance(i, int) else i for i in listed}


LAYOUTS = {  # name -> (layout, centroids): the three codebook codecs' schemes at 2 bits; codes straddling bytes; 4 bits
    "temporal": (ChunkLayout(4, 1, 4), 256),
    "channel": (ChunkLayout(1, 4, 4), 256),
    "scalar": (ChunkLayout(1, 1, 4), 4),
    "pairs-6bit": (ChunkLayout(1, 2, 4), 64),  # HIGGS-3's d = 2 grid: 6-bit codes
    "temporal-2": (ChunkLayout(2, 1, 8), 256),  # TemporalKV-4's chunks of 2 tokens
    "scalar-4bit": (ChunkLayout(1, 1, 2), 16),
}


def _codebook_reader(b, h, d, tokens, layout, centroids, per_token, gen):
    code_bits = (centroids - 1).bit_length()
    row_bytes = packed_length(d // layout.channel_len, code_bits)
    codes = torch.randint(0, 256, (b, h, tokens // layout.time_len, row_bytes), generator=gen, dtype=torch.uint8)
    codebooks = torch.randn(h, d // layout.group_channels, centroids, layout.dim, generator=gen).bfloat16()
    token_scale = (torch.rand(b, tokens, generator=gen) + 0.5).half() if per_token else None
    token_center = torch.randn(b, tokens, generator=gen).half() if per_token else None
    return CodebookReader(
        tokens, d, codes, codebooks, layout, torch.rand(h, d, generator=gen) + 0.5, torch.randn(h, d, generator=gen),
        token_scale, token_center,
    )


@pytest.mark.parametrize("per_token", [False, True], ids=["channel-norm", "token-norm"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_codebook_kernel_with_rope_matches_the_reference(layout, per_token):
    """Codebook gather + denormalisation + RoPE at each token's position (left-padded sequences have shifted
    positions) for keys and values, GQA 2:1."""
    from kvcomp.kernels.decode_attention_triton import decode_attention_triton

    b, h, r, d, tokens = 2, 1, 2, 32, 32  # codebooks of two heads: test_the_kernel_reads_a_cache_payload_in_place
    gen = torch.Generator().manual_seed(7)
    reader = _codebook_reader(b, h, d, tokens, *LAYOUTS[layout], per_token, gen)
    sinks, tail = torch.randn(b, h, 3, d, generator=gen), torch.randn(b, h, 5, d, generator=gen)
    length = 3 + tokens + 5
    valid = _mask(b, length, gen)
    positions = (valid.cumsum(-1) - 1).clamp_min(0)  # as generate() derives them from the attention mask
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    query = torch.randn(b, h * r, d, generator=gen)
    segments = [sinks, reader, tail]
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):  # bf16: cos/sin rounded like HF's
        rope = RotaryPositions(positions, 3, inv_freq, 1.0, dtype)
        reference = decode_attention_reference(query, segments, segments, d**-0.5, valid, rope)
        out = decode_attention(query, segments, segments, d**-0.5, valid, rope, backend="triton", num_splits=2)
        torch.testing.assert_close(out, reference, rtol=tolerance, atol=tolerance)
        if dtype == torch.float32:  # the register path with 16-token tiles
            registers = decode_attention_triton(query, segments, segments, d**-0.5, valid, key_rope=rope, num_splits=2,
                                                dot=False, block_tokens=16)
            torch.testing.assert_close(registers, reference, rtol=tolerance, atol=tolerance)


def test_tiles_of_token_chunks_start_at_whole_chunks():
    """TemporalKV's chunks of 4 tokens are read as one vector each: the split kernel's tiles start at whole chunks of
    the key payload, so a value payload whose chunks are not whole chunks apart from it, or tiles shorter than a chunk,
    are refused before any launch, naming the offset or the tile."""
    from kvcomp.kernels.decode_attention_triton import decode_launches

    b, h, r, d, tokens = 1, 2, 2, 32, 48
    gen = torch.Generator().manual_seed(3)
    keys = _codebook_reader(b, h, d, tokens, *LAYOUTS["temporal"], False, gen)
    values = _codebook_reader(b, h, d, tokens, *LAYOUTS["temporal"], False, gen)
    query = torch.randn(b, h * r, d, generator=gen)
    sinks = [torch.randn(b, h, n, d, generator=gen) for n in (3, 4, 5)]
    _, launches = decode_launches(query, [sinks[0], keys, sinks[1]], [sinks[0], values, sinks[1]], d**-0.5)
    assert launches
    with pytest.raises(ValueError, match="starts 1 tokens after the key payload"):
        decode_launches(query, [sinks[0], keys, sinks[2]], [sinks[1], values, sinks[1]], d**-0.5)
    with pytest.raises(ValueError, match="2-token tiles"):
        decode_launches(query, [sinks[0], keys], [sinks[0], values], d**-0.5, dot=False, block_tokens=2)


def test_packed_ints_take_two_warps_where_the_grid_gives_a_multiprocessor_eight_programs():
    """Packed ints and natively read payloads in narrow tiles take 2 warps per program, capped at 128 registers (eight
    programs per multiprocessor), where the grid gives each multiprocessor eight programs or more; fewer programs, a
    payload that keeps 4 warps (a codebook, codes straddling bytes) beside them, wide tiles, the register path and a
    caller's ``num_warps`` keep 4 (:func:`~kvcomp.kernels.decode_attention_triton._launch_shape`)."""
    from kvcomp.kernels.decode_attention_triton import decode_launches
    from kvcomp.kernels.formats import ScaledReader
    from kvcomp.stages.minifloat import FLOAT8, to_float8

    b, h, r, d, group = 16, 2, 4, 32, 32  # 32 programs, one slice each, on the interpreter's 4 multiprocessors: 8 each
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(b, h, 4 * group, d, generator=gen)
    keys, _ = _uniform(x, 2, group, "per_channel")
    values, _ = _uniform(x, 2, group, "per_token")
    codebook = _codebook_reader(b, h, d, 4 * group, *LAYOUTS["scalar"], False, gen)
    fp8 = ScaledReader(4 * group, d, to_float8(x, FLOAT8["e4m3"]), FLOAT8["e4m3"], torch.tensor(1.0))
    query = torch.randn(b, h * r, d, generator=gen)

    def shape(key, value, query=query, **options):
        args = decode_launches(query, [key], [value], d**-0.5, **options)[1][0].args
        return args["num_warps"], args.get("maxnreg")

    assert shape(keys, values) == (2, 128) and shape(fp8, fp8) == (2, 128)
    assert shape(keys, values, num_warps=4) == (4, 128) and shape(keys, values, registers=0) == (2, None)
    assert shape(fp8, fp8, num_warps=4) == (4, None)  # natively read payloads take fewer at 4 warps: no cap
    assert shape(keys, codebook) == (4, 128)  # the codebook keeps 4 warps, so the launch does
    assert shape(_uniform(x, 3, group, "per_channel")[0], values) == (4, 128)  # codes straddling bytes keep 4
    assert shape(values, values, block_tokens=128) == (4, None)  # wide tiles
    assert shape(keys, values, dot=False) == (4, 255)
    seven = slice(0, 14)  # 28 programs: 7 per multiprocessor, 4 warps still capped (more than two each)
    keys_7, _ = _uniform(x[seven], 2, group, "per_channel")
    values_7, _ = _uniform(x[seven], 2, group, "per_token")
    assert shape(keys_7, values_7, query=query[seven]) == (4, 128)


def test_packed_ints_and_grouped_codebooks_cap_the_registers_of_narrow_tl_dot_launches():
    """Packed ints and codebooks in 32-token tiles cap a ``tl.dot`` launch at four programs per multiprocessor (128
    registers per thread at 4 warps, 64 at 8), also one codebook for every channel (EDEN's, TurboQuant's) where another
    payload narrows its tiles; wide tiles (that codebook alone), the register path and ``registers=0`` leave the
    compiler its choice; ``registers`` sets any cap. Only where the grid crowds the multiprocessors: at most two
    programs each (4 warps) stay uncapped."""
    from kvcomp.kernels.decode_attention_triton import decode_launches

    b, h, r, d, group = 8, 2, 4, 32, 32  # 16 programs, one slice each, on the interpreter's 4 multiprocessors
    gen = torch.Generator().manual_seed(9)
    keys, _ = _uniform(torch.randn(b, h, 4 * group, d, generator=gen), 2, group, "per_channel")
    values, _ = _uniform(torch.randn(b, h, 4 * group, d, generator=gen), 2, group, "per_token")
    codebook = _codebook_reader(b, h, d, 4 * group, *LAYOUTS["scalar"], False, gen)  # a codebook per 4 channels
    one_codebook = _codebook_reader(b, h, d, 4 * group, ChunkLayout(1, 1, d), 4, False, gen)
    query = torch.randn(b, h * r, d, generator=gen)

    def cap(key, value, **options):
        return decode_launches(query, [key], [value], d**-0.5, **options)[1][0].args.get("maxnreg")

    assert cap(keys, values) == 128 and cap(keys, values, num_warps=8) == 64
    assert cap(values, values, block_tokens=128) is None  # wide tiles (per-channel keys' groups allow 32 tokens)
    assert cap(keys, codebook) == 128 and cap(codebook, codebook, num_warps=8) == 64
    assert cap(keys, one_codebook) == 128 and cap(one_codebook, one_codebook) is None  # narrow, then wide tiles
    assert cap(keys, values, registers=0) is None and cap(keys, one_codebook, registers=96) == 96
    assert cap(keys, values, dot=False) == 255  # the register path: the register file's share of a program
    one = slice(0, 1)  # one sequence: 2 programs on 4 multiprocessors
    keys_1, _ = _uniform(keys.dequantize_unrotated()[one], 2, group, "per_channel")
    values_1, _ = _uniform(values.dequantize_unrotated()[one], 2, group, "per_token")
    out = decode_launches(query[one], [keys_1], [values_1], d**-0.5)[1][0]
    assert out.grid == (2, 1) and out.args.get("maxnreg") is None
    assert decode_launches(query[one], [keys_1], [values_1], d**-0.5, registers=128)[1][0].args["maxnreg"] == 128


def test_any_mask_runs_in_the_kernel_and_empty_rows_are_zero(monkeypatch):
    """The kernel reads the mask per token: holes, a row with nothing valid, and a batch-broadcast mask (stride
    0) all match the reference, and the torch reference is never called on the triton backend."""
    import kvcomp.kernels.decode_attention as module

    gen = torch.Generator().manual_seed(3)
    b, h, d = 2, 1, 16
    keys, values = [torch.randn(b, h, 20, d, generator=gen)], [torch.randn(b, h, 20, d, generator=gen)]
    query = torch.randn(b, 2, d, generator=gen)
    holes = torch.ones(b, 20, dtype=torch.bool)
    holes[0, 5], holes[1, 7:12] = False, False
    empty = torch.ones(b, 20, dtype=torch.bool)
    empty[1] = False
    broadcast = (torch.arange(20) % 3 != 0).expand(b, 20)
    references = {id(m): decode_attention_reference(query, keys, values, 0.25, m) for m in (holes, empty, broadcast)}
    monkeypatch.setattr(module, "decode_attention_reference", None)  # a fallback would fail loudly
    for mask in (holes, empty, broadcast):
        out = decode_attention(query, keys, values, 0.25, mask, backend="triton")
        torch.testing.assert_close(out, references[id(mask)])
    assert torch.equal(decode_attention(query, keys, values, 0.25, empty, backend="triton")[1], torch.zeros(2, d))


def _spans_of(mask: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(first, stop, exact)`` per row, computed one row at a time in Python."""
    out = []
    for row in mask.tolist():
        at = [i for i, ok in enumerate(row) if ok]
        first, stop = (at[0], at[-1] + 1) if at else (0, 0)
        out.append((first, stop, int(len(at) == stop - first)))
    return out


def test_valid_tokens_are_one_span_per_sequence():
    """Left padding, right padding, a sliding window, every token, none (an empty exact span) and a hole (not exact);
    made on the mask's device, int32."""
    rows = [[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0],
            [1, 1, 0, 1, 1, 0]]
    mask = torch.tensor(rows, dtype=torch.bool)
    spans = ValidTokens(mask).spans
    assert spans.dtype == torch.int32 and spans.shape == (6, SPAN)
    assert [tuple(row[:3]) for row in spans.tolist()] == _spans_of(mask)
    assert [tuple(row[:3]) for row in spans.tolist()] == [(2, 6, 1), (0, 3, 1), (1, 4, 1), (0, 6, 1), (0, 0, 1),
                                                           (0, 5, 0)]
    assert ValidTokens(torch.ones(2, 0, dtype=torch.bool)).spans[:, :3].tolist() == [[0, 0, 1]] * 2


def test_a_launch_groups_spans_are_derived_from_the_steps():
    """The spans of the tokens ``[lo, hi)`` of a mask, and of those outside (a rotated payload's launch groups), derived
    from the step's without reading the mask again: equal to the sliced mask's own where exact, and holding every
    valid token where not."""
    gen = torch.Generator().manual_seed(11)
    for trial in range(200):
        length = int(torch.randint(1, 24, (), generator=gen))
        mask = torch.zeros(6, length, dtype=torch.bool)
        for row in range(6):
            first, stop = sorted(torch.randint(0, length + 1, (2,), generator=gen).tolist())
            mask[row, first:stop] = True
        mask[5] = torch.rand(length, generator=gen) < 0.5  # any pattern
        lo, hi = sorted(torch.randint(0, length + 1, (2,), generator=gen).tolist())
        valid = ValidTokens(mask)
        for part, sliced in ((valid.columns(lo, hi), mask[:, lo:hi]), (valid.without(lo, hi),
                                                                         torch.cat([mask[:, :lo], mask[:, hi:]], 1))):
            assert torch.equal(part.mask, sliced)
            for derived, own, row in zip(part.spans.tolist(), _spans_of(sliced), sliced.tolist()):
                if derived[2]:
                    assert tuple(derived[:3]) == own or (own == (0, 0, 1) and derived[0] == derived[1])
                at = [i for i, ok in enumerate(row) if ok]
                assert all(derived[0] <= i < derived[1] for i in at)


@pytest.mark.parametrize("splits", [1, 4])
def test_an_exact_span_skips_the_mask_and_the_tiles_outside_it(splits):
    """Sequences whose valid tokens are one run (a sliding window over a KIVI payload between full-precision pieces,
    left padding, none at all) are read from their spans alone: given a mask of zeros with the true spans, the
    kernel matches the reference of the true mask (slices left without a tile write empty partial outputs)."""
    from kvcomp.kernels.decode_attention_triton import decode_attention_triton

    b, h, r, d, group = 3, 2, 4, 32, 16
    gen = torch.Generator().manual_seed(4)
    sinks = torch.randn(b, h, 3, d, generator=gen)
    key_reader, _ = _uniform(torch.randn(b, h, 8 * group, d, generator=gen), 2, group, "per_channel")
    value_reader, _ = _uniform(torch.randn(b, h, 8 * group, d, generator=gen), 2, group, "per_token")
    tail = torch.randn(b, h, 9, d, generator=gen)
    keys, values = [sinks, key_reader, tail], [sinks, value_reader, tail]
    length = 3 + 8 * group + 9
    mask = torch.zeros(b, length, dtype=torch.bool)
    mask[0, 70:length - 2] = True  # a window ending before the fresh tokens
    mask[1, 40:] = True  # left padding
    query = torch.randn(b, h * r, d, generator=gen)
    reference = decode_attention_reference(query, keys, values, d**-0.5, mask)
    spans = ValidTokens(mask).spans
    assert spans[:, 2].tolist() == [1, 1, 1]
    out = decode_attention_triton(query, keys, values, d**-0.5, ValidTokens(torch.zeros_like(mask), spans),
                                  num_splits=splits)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[2], torch.zeros(h * r, d))


@pytest.mark.parametrize("layout", ["temporal", "channel", "scalar", "temporal-2", "scalar-4bit"])
def test_fused_encode_kernel_matches_the_torch_encoder(layout):
    """Nearest centroid + packing in one kernel; codes may differ only between equal centroids (the torch
    scalar path sorts), so the decoded values must be identical. (Codes straddling bytes are encoded in torch.)"""
    chunk_layout, centroids = LAYOUTS[layout]
    from kvcomp.kernels.codebook_encode_triton import encode_codebook_triton

    gen = torch.Generator().manual_seed(5)
    b, h, d, t = 2, 2, 16, 40
    z = torch.randn(b, h, t, d, generator=gen)
    codebooks = torch.randn(h, d // chunk_layout.group_channels, centroids, chunk_layout.dim, generator=gen).bfloat16()
    quantizer = CodebookQuantizer(chunk_layout, centroids)
    reference = quantizer.encode(z, codebooks)
    fused = encode_codebook_triton(z, codebooks, chunk_layout, quantizer.code_bits)
    assert fused.shape == reference.shape and fused.dtype == torch.uint8
    assert torch.equal(quantizer.decode(fused, codebooks, d), quantizer.decode(reference, codebooks, d))
    assert torch.equal(encode_codebook(quantizer, z, codebooks, "triton"), fused)


def test_readers_decode_exactly_what_the_codecs_decode(tiny_llama):
    info = info_of(tiny_llama)
    x = torch.randn(2, info.num_kv_heads, 32, info.head_dim, generator=torch.Generator().manual_seed(0))
    kivi = build_codec({"name": "kivi", "group_size": 8, "residual_length": 16}, info)
    codecs = [kivi, fitted(tiny_llama, "temporalkv"), fitted(tiny_llama, "kvquant"), fitted(tiny_llama, "channelkv")]
    for codec in codecs:
        for kind in ("key", "value"):
            payload = codec.encode(StreamRequest(1, kind, tokens=x))
            reader = codec.payload_reader(payload, kind, 1)
            assert torch.equal(reader.dequantize(), codec.decode(payload, StreamRequest(1, kind, dtype=torch.float32))), (codec.name, kind)


def test_layers_with_sparse_outliers_keep_the_torch_path(tiny_llama):
    codec = fitted(tiny_llama, "kvquant", outliers=0.05)
    assert not codec.fused_attention_supported(0)
    assert fitted(tiny_llama, "kvquant").fused_attention_supported(0)


NEW_TOKENS = 3  # of the fused-generation checks: two decode steps, the first reading what the prefill stored, the
# second what a fused step appended


@torch.no_grad()
def test_kivi_decode_steps_read_the_payloads(tiny_model):
    """Every generated token's logits equal the torch path's (decode + SDPA), with GQA and left padding, on
    each family; under exact_prefill no block is ever decoded."""
    codec = build_codec({"name": "kivi", "group_size": 8, "residual_length": 16}, info_of(tiny_model))
    layer = check_fused_generation(tiny_model, codec, new_tokens=NEW_TOKENS)
    assert layer.key_stream.num_encoded >= 16 and layer.key_stream.decoded.length == 0 and layer.value_stream.decoded.length == 0


@torch.no_grad()
def test_a_chunked_prefills_decoded_copy_is_freed_by_the_first_fused_step(tiny_llama):
    """A prompt prefilled in two forwards decodes the first one's blocks for the second's attention (the torch path's
    copy); the first decode step read from the payloads frees it (what the cache holds drops by that copy), its
    logits those of the torch path, and a later multi-token forward decodes the blocks again, equal to the torch path."""
    codec = build_codec({"name": "kivi", "group_size": 8, "residual_length": 16}, info_of(tiny_llama))
    ids = torch.randint(1, 96, (2, 48), generator=torch.Generator().manual_seed(3))
    logits = {}
    for backend in ("torch", "triton"):
        install(tiny_llama, kernel_backend=backend)
        try:
            cache = CompressedCache(codec, "exact_prefill")
            run = lambda part: tiny_llama(part, **with_cache(tiny_llama, cache), use_cache=True).logits[:, -1]  # noqa: E731
            run(ids[:, :24])
            run(ids[:, 24:40])
            stream = cache.layers[1].key_stream
            decoded, copy, working = stream.decoded.length, stream.decoded.nbytes, cache.working_nbytes
            logits[backend] = [run(ids[:, 40:41])]
            if backend == "triton":
                assert decoded > 0 and stream.decoded.length == 0
                assert cache.working_nbytes <= working - copy  # this stream's copy (and every other's)
            logits[backend].append(run(ids[:, 41:44]))
        finally:
            install(tiny_llama, kernel_backend="torch")
    for fused, reference in zip(logits["triton"], logits["torch"]):
        torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-4)
    assert stream.decoded.length == stream.num_encoded  # the three-token forward decoded every block again


@pytest.mark.parametrize("name", ["temporalkv", "kvquant", "channelkv"])
@torch.no_grad()
def test_codebook_decode_steps_read_the_payloads(tiny_llama, name):
    """Pre-RoPE keys rotated in the kernel from the recorded position ids; encoded with the fused kernel."""
    codec = fitted(tiny_llama, name, sinks=4)
    layer = check_fused_generation(tiny_llama, codec, new_tokens=NEW_TOKENS)
    assert layer.key_stream.num_encoded >= 32 and layer.key_stream.decoded.length == 0
    # one row group per padding: row 0 (37 tokens), row 1 (5 pads left out), each with the tokens generated but the last
    assert [p.positions.ids.view.shape for p in layer.parts] == [(1, 37 + NEW_TOKENS - 1), (1, 32 + NEW_TOKENS - 1)]
    assert all(p.positions.recomputed for p in layer.parts)


@pytest.mark.parametrize("config", [{"name": "fp8"}, {"name": "fp8", "scale": "token_head", "format": "e5m2"},
                                    {"name": "nvfp4"}], ids=["fp8", "fp8-per-token-head-e5m2", "nvfp4"])
@torch.no_grad()
def test_fp8_and_nvfp4_decode_steps_read_the_payloads(tiny_llama, config):
    """vLLM's fp8 and NVFP4 caches on the fused path: every token's float8 bytes (NVFP4: e2m1 codes and float8
    block scales) are read by the kernel (nothing decoded), the logits those of the torch path, and the reader
    decodes exactly what the codec decodes."""
    codec = build_codec(config, info_of(tiny_llama))
    x = torch.randn(2, codec.model.num_kv_heads, 8, codec.model.head_dim, generator=torch.Generator().manual_seed(5))
    payload = codec.encode(StreamRequest(1, "value", tokens=x))
    assert torch.equal(codec.payload_reader(payload, "value", 1).dequantize(),
                       codec.decode(payload, StreamRequest(1, "value", dtype=torch.float32)))
    layer = check_fused_generation(tiny_llama, codec, new_tokens=NEW_TOKENS)
    assert layer.key_stream.num_encoded == 37 + NEW_TOKENS - 1 and layer.key_stream.decoded.length == 0


@pytest.mark.parametrize("bits", [4, 8])
@torch.no_grad()
def test_int_token_head_decode_steps_read_the_payload(tiny_llama, bits):
    """vLLM's per-token-head integer caches on the fused path: int4 read in its rotated basis (the query rotated,
    the output un-rotated), int8 loaded as signed bytes times the scale; the logits those of the torch path, which
    decodes every token."""
    codec = build_codec({"name": "int_token_head", "bits": bits}, info_of(tiny_llama))
    x = torch.randn(2, codec.model.num_kv_heads, 8, codec.model.head_dim, generator=torch.Generator().manual_seed(6))
    payload = codec.encode(StreamRequest(1, "key", tokens=x))
    torch.testing.assert_close(codec.payload_reader(payload, "key", 1).dequantize(),
                               codec.decode(payload, StreamRequest(1, "key", dtype=torch.float32)), rtol=1e-5, atol=1e-5)
    layer = check_fused_generation(tiny_llama, codec, new_tokens=NEW_TOKENS)
    assert layer.key_stream.num_encoded == 37 + NEW_TOKENS - 1 and layer.key_stream.decoded.length == 0


@torch.no_grad()
def test_kvarn_decode_steps_read_the_normalised_codes_in_the_rotated_basis(tiny_llama):
    """KVarN on the fused path: keys as per-channel packed ints times a per-token normaliser, values as per-token
    packed ints times a per-channel normaliser of their tile, in the Hadamard basis; the reader decodes what the
    codec decodes; the logits those of the torch path."""
    codec = build_codec({"name": "kvarn", "tile": 16, "sinks": 4, "key_bits": 3}, info_of(tiny_llama))
    x = 4 * torch.randn(2, codec.model.num_kv_heads, 32, codec.model.head_dim, generator=torch.Generator().manual_seed(12))
    for kind in ("key", "value"):
        payload = codec.encode(StreamRequest(0, kind, tokens=x))
        torch.testing.assert_close(codec.payload_reader(payload, kind, 0).dequantize(),
                                   codec.decode(payload, StreamRequest(0, kind, dtype=torch.float32)), rtol=1e-5, atol=1e-5)
    layer = check_fused_generation(tiny_llama, codec, new_tokens=5)  # the second row's values fill a tile at step 4
    assert layer.key_stream.num_encoded >= 32 and layer.key_stream.decoded.length == 0
    from kvcomp.kernels.decode_attention_triton import decode_attention_triton

    readers = [codec.payload_reader(codec.encode(StreamRequest(0, kind, tokens=x)), kind, 0) for kind in ("key", "value")]
    query = torch.randn(2, codec.model.num_kv_heads * 2, codec.model.head_dim, generator=torch.Generator().manual_seed(13))
    reference = decode_attention_reference(query, readers[:1], readers[1:], 0.25)
    for options in ({"num_splits": 3}, {"dot": False, "block_tokens": 8}, {"dot": False, "block_tokens": 32}):
        torch.testing.assert_close(decode_attention_triton(query, readers[:1], readers[1:], 0.25, **options), reference,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("granularity", ["layer", "kv_head"])
@torch.no_grad()
def test_oscar_decode_steps_read_the_int2_payload_in_its_rotated_basis(tiny_llama, granularity):
    """OSCAR's fitted rotations (one per layer, or one per KV head) on the fused path: sinks, the INT2 payload and
    the recent window in one step, the logits those of the torch path."""
    from tests.codec_matrix import make_codec

    codec = make_codec(tiny_llama, "oscar", granularity=granularity)
    layer = check_fused_generation(tiny_llama, codec, new_tokens=NEW_TOKENS)  # each row's window flushes a block
    assert layer.key_stream.num_encoded >= 24 and layer.key_stream.decoded.length == 0


VLLM_TURBOQUANT = {"name": "turboquant", "values": "uniform", "rotation": "plain_hadamard", "density": "gaussian"}


@pytest.mark.parametrize("config", [
    {"name": "turboquant", "key_bits": 2, "value_bits": 4},
    {"name": "eden", "key_bits": 4, "value_bits": 2, "scale": "unbiased"},
    {"name": "eden", "key_bits": 2, "value_bits": 2, "rotation": "random"},
    {"name": "turboquant"},
    {**VLLM_TURBOQUANT, "norm_correction": True},
    {**VLLM_TURBOQUANT, "key_bits": 8, "value_bits": 4},
    {"name": "turboquant", "variant": "prod", "key_bits": 3, "value_bits": 2},
], ids=["turboquant-k2v4", "eden-k4v2-unbiased", "eden-2-haar", "turboquant-3", "vllm-3bit-nc", "vllm-k8v4", "prod-k3v2"])
@torch.no_grad()
def test_turboquant_and_eden_decode_steps_read_the_codes_in_the_rotated_basis(tiny_llama, config):
    """TurboQuant-mse, EDEN and vLLM's presets on the fused path: Lloyd-Max codes (3-bit ones straddle bytes) as a
    scalar codebook times each vector's stored scale (per token and head), in the rotated basis, rescaled to unit
    norm first under vLLM's norm correction; vLLM's k8 keys as float8 and its uniform values as packed ints, not
    rotated; prod's residual sketches scored and weighted from their sign bits; logits those of the torch path; the
    reader decodes what the codec decodes (``center``: tests/codecs/test_centering.py)."""
    codec = build_codec(config, info_of(tiny_llama))
    assert codec.fused_attention_supported(0)
    x = torch.randn(2, codec.model.num_kv_heads, 8, codec.model.head_dim, generator=torch.Generator().manual_seed(7))
    for kind in ("key", "value"):
        payload = codec.encode(StreamRequest(0, kind, tokens=x))
        torch.testing.assert_close(codec.payload_reader(payload, kind, 0).dequantize(),
                                   codec.decode(payload, StreamRequest(0, kind, dtype=torch.float32)), rtol=1e-5, atol=1e-5)
    layer = check_fused_generation(tiny_llama, codec, new_tokens=NEW_TOKENS)
    assert layer.key_stream.num_encoded == 37 + NEW_TOKENS - 1 and layer.key_stream.decoded.length == 0


@torch.no_grad()
def test_offset_payload_between_full_precision_pieces_matches_the_reference():
    """:class:`OffsetReader` in the kernel: a rotated EDEN payload stored less offsets, after two full-precision
    sink tokens and before a tail, each row at its own positions (the offset's angles), some tokens masked, with
    ``tl.dot`` and on the register path, equals the reference (which decodes ``inner R + R_p c`` and ``+ c_v``)."""
    from kvcomp.kernels.decode_attention_triton import decode_attention_triton
    from kvcomp.kernels.formats import OffsetReader

    b, h, r, d, n = 2, 2, 3, 32, 40
    g = torch.Generator().manual_seed(11)
    codec = build_codec({"name": "eden", "key_bits": 3, "value_bits": 2}, ModelInfo("tiny", 1, h, d))
    segments = {}
    for kind in ("key", "value"):
        payload = codec.encode(StreamRequest(0, kind, tokens=torch.randn(b, h, n, d, generator=g)))
        reader = OffsetReader(n, d, codec.payload_reader(payload, kind, 0), 3 * torch.randn(h, d, generator=g), kind == "key")
        segments[kind] = [torch.randn(b, h, 2, d, generator=g), reader, torch.randn(b, h, 3, d, generator=g)]
    positions = torch.stack([torch.arange(45), torch.arange(45) + 7]).to(torch.int32)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    rope = RotaryPositions(positions, 2, inv_freq, 1.0, torch.float32)
    valid = torch.ones(b, 45, dtype=torch.bool)
    valid[1, :4] = False
    valid[0, 20] = False
    query = torch.randn(b, h * r, d, generator=g)
    expected = decode_attention_reference(query, segments["key"], segments["value"], d**-0.5, valid, rope)
    for options in ({"num_splits": 3}, {"dot": False, "block_tokens": 16}):
        out = decode_attention_triton(query, segments["key"], segments["value"], d**-0.5, valid, key_rope=rope, **options)
        torch.testing.assert_close(out, expected, rtol=2e-4, atol=2e-4)
    with pytest.raises(ValueError, match="key_rope gives the positions"):
        decode_attention_triton(query, segments["key"], segments["value"], d**-0.5, valid)


@pytest.mark.parametrize("offsets", [False, True], ids=["plain", "offsets"])
@torch.no_grad()
def test_prod_residual_sketches_are_read_from_their_sign_bits(offsets):
    """:class:`ResidualSketchReader` in the kernel (TurboQuant-prod, 3 bits: 2-bit codes in the rotated basis plus the
    sign sketch of the residual): keys scored as ``q R^T . c + sqrt(pi/2)/d ||r|| <S q, sign(S r)>``, values weighted in
    both bases and taken back, between full-precision pieces, some tokens masked, on the register path (the default
    for 3 query rows) and with ``tl.dot``, with and without offsets, equal the reference (which decodes ``k_hat``); dropping either sketch's
    contribution from the reference breaks the match."""
    from kvcomp.kernels.decode_attention_triton import decode_attention_triton
    from kvcomp.kernels.formats import OffsetReader, ResidualSketchReader

    b, h, r, d, n = 2, 2, 3, 32, 40
    g = torch.Generator().manual_seed(13)
    codec = build_codec({"name": "turboquant", "variant": "prod", "key_bits": 3, "value_bits": 3}, ModelInfo("tiny", 1, h, d))
    segments, readers = {}, {}
    for kind in ("key", "value"):
        payload = codec.encode(StreamRequest(0, kind, tokens=torch.randn(b, h, n, d, generator=g)))
        reader = readers[kind] = codec.payload_reader(payload, kind, 0)
        assert isinstance(reader, ResidualSketchReader)
        if offsets:
            reader = OffsetReader(n, d, reader, 2 * torch.randn(h, d, generator=g), kind == "key")
        segments[kind] = [torch.randn(b, h, 2, d, generator=g), reader, torch.randn(b, h, 3, d, generator=g)]
    positions = torch.stack([torch.arange(45), torch.arange(45) + 5]).to(torch.int32)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    rope = RotaryPositions(positions, 2, inv_freq, 1.0, torch.float32) if offsets else None
    valid = torch.ones(b, 45, dtype=torch.bool)
    valid[1, :3] = False
    valid[0, 17] = False
    query = torch.randn(b, h * r, d, generator=g)
    expected = decode_attention_reference(query, segments["key"], segments["value"], d**-0.5, valid, rope)
    for options in ({"num_splits": 2}, {"dot": True}, {"block_tokens": 16}):
        out = decode_attention_triton(query, segments["key"], segments["value"], d**-0.5, valid, key_rope=rope, **options)
        torch.testing.assert_close(out, expected, rtol=2e-4, atol=2e-4)
    if not offsets:  # one stream's sketch dropped: the kernel still matches, and the output moves (so each is tested)
        for kind in ("key", "value"):
            without = {**segments, kind: [s.inner if s is readers[kind] else s for s in segments[kind]]}
            reference = decode_attention_reference(query, without["key"], without["value"], d**-0.5, valid)
            assert not torch.allclose(reference, expected, atol=1e-3)
            out = decode_attention_triton(query, without["key"], without["value"], d**-0.5, valid, num_splits=2)
            torch.testing.assert_close(out, reference, rtol=2e-4, atol=2e-4)


@torch.no_grad()
def test_streaming_prefill_then_fused_decode(tiny_llama):
    codec = build_codec({"name": "uniform", "bits": 2, "group_size": 8, "window": 4, "sinks": 2}, info_of(tiny_llama))
    layer = check_fused_generation(tiny_llama, codec, "streaming", NEW_TOKENS)
    assert layer.key_stream.decoded.length < layer.key_stream.num_encoded  # decode-step blocks never decoded


def test_gpu_benchmark_script_runs_on_the_interpreter():
    """python -m benchmarks.bench_decode_attention --smoke: the GPU benchmark's code path on a tiny CPU shape, with the
    kernel checked inside the script against the float64 reference on fresh inputs (bf16 outputs). QJL's fused step
    runs in ``bench_qjl_decode.py``'s own check (tests/kernels/test_qjl_kernel.py)."""
    module = import_module("benchmarks.bench_decode_attention")
    table = module.main(["--smoke", "--codecs", "kivi-2", "temporalkv-2", "--step-mask"])
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| 1 | 160 |")]
    assert [row[2] for row in rows][1:] == ["kivi-2", "kivi-2 (mask)", "temporalkv-2", "temporalkv-2 (mask)"]
    errors = [float(row[-1].rstrip(" |")) for row in rows[1:]]
    assert all(0 < error < 1e-2 for error in errors)  # relative error: bf16 output rounding, not zero
    assert all(float(row[4]) == float(row[3]) > 0 for row in rows[1:])  # on a CPU the host time is the time
    assert "| temporalkv-2 |" in table.split("Prefill encode")[1]


def test_a_smoke_run_with_a_failing_row_is_an_error(monkeypatch, capsys):
    """On a GPU a failing format is a row of the table and the others are measured; ``--smoke``, the script's check,
    exits with an error naming it (under Triton 3.6 without the interpreter's scalar index, every row failed and the
    check passed)."""
    module = import_module("benchmarks.bench_decode_attention")

    def failing(name, *args, **kwargs):
        raise RuntimeError(f"{name} cannot run here")

    monkeypatch.setattr(module, "_bench_codec", failing)
    with pytest.raises(SystemExit, match=r"--smoke: 1 row\(s\) failed: kivi-2: RuntimeError: kivi-2 cannot run here"):
        module.main(["--smoke", "--codecs", "kivi-2"])
    assert "| 1 | 160 | kivi-2 | failed: RuntimeError" in capsys.readouterr().out  # the table is printed first


def test_decode_call_profile_runs_on_the_interpreter():
    """python -m benchmarks.profile_decode_call --smoke: one call's host time, its Python functions and torch operators."""
    report = import_module("benchmarks.profile_decode_call").main(["--smoke", "--codecs", "kivi-2", "--top", "5"])
    host = float(report.split("host ms per call, median of 2: ")[1].split()[0])
    assert report.startswith("=== kivi-2 at 1 x 160") and host > 0
    assert "function calls" in report.split("--- torch operators")[0]  # cProfile timed the calls
    assert "aten::" in report.split("--- torch operators")[1]


def test_launch_configuration_sweep_runs_on_the_interpreter():
    """python -m benchmarks.sweep_decode_kernel --smoke: each configuration (here the default tl.dot launch and the register
    path with 8 warps) runs, is timed and is checked against the float64 reference inside the script."""
    module = import_module("benchmarks.sweep_decode_kernel")
    table = module.main(["--smoke", "--codecs", "kivi-2", "--configs", "0", "2"])
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| kivi-2 | 1 x 160 |")]
    assert [row[2] for row in rows] == list(module.CONFIGS)[0:3:2]
    assert all(float(row[3]) > 0 and 0 < float(row[-1].rstrip(" |")) < 1e-2 for row in rows)


def test_a_step_is_planned_once_and_runs_every_layer_in_one_workspace(monkeypatch):
    """flashinfer's plan / run split: the step's first layer plans its launches, the other layers find the plan; every
    layer and the next steps run in the same scratch (one region per launch group, grown to the largest step), and
    each layer's output is its own and equals the reference."""
    from kvcomp.kernels import decode_plan
    from kvcomp.kernels.decode_attention_triton import decode_attention_triton
    from kvcomp.kernels.formats import RotatedReader

    real, planned = decode_plan.plan_decode, []
    monkeypatch.setattr(decode_plan, "plan_decode", lambda *inputs, **options: planned.append(inputs) or real(*inputs, **options))
    gen = torch.Generator().manual_seed(3)
    workspace = decode_plan.DecodeWorkspace()
    outputs, held, sizes = [], set(), []
    for batch in (1, 1, 2):  # a step, the same shape again, a larger batch
        step = decode_plan.DecodePlans(workspace)
        key_reader, _ = _uniform(torch.randn(batch, 1, 32, 16, generator=gen), 2, 16, "per_channel")
        value_reader, _ = _uniform(torch.randn(batch, 1, 32, 16, generator=gen), 2, 16, "per_token")
        tail = torch.randn(batch, 1, 5, 16, generator=gen)
        before = len(planned)
        for _layer in range(3):  # the layers of one step: same segment boundaries, their own payloads
            query = torch.randn(batch, 2, 16, generator=gen)
            out = decode_attention_triton(query, [key_reader, tail], [value_reader, tail], 0.25, num_splits=3, step=step)
            torch.testing.assert_close(out, decode_attention_reference(query, [key_reader, tail], [value_reader, tail],
                                                                       0.25), rtol=1e-5, atol=1e-5)
            outputs.append(out)
            held |= {id(t) for key, t in workspace._storage.items() if key[0] == "scratch"}
        assert len(planned) == before + 1  # once per step
        sizes.append(sum(t.nbytes for key, t in workspace._storage.items() if key[0] == "scratch"))
    assert len({o.data_ptr() for o in outputs}) == len(outputs)  # outputs leave the layer: never reused
    assert len(held) == 2 and sum(key[0] == "scratch" for key in workspace._storage) == 1  # one region, grown once
    # [B*H, slots, R, D] partial outputs, then [B*H, slots, R] log-sum-exps from the next 256 bytes, float32: 37
    # tokens are one 128-token tile, one slot
    assert sizes[0] == sizes[1] < sizes[2] == (64 + (2 * 1) * 1 * 2) * 4
    partial, lse = workspace.scratch(torch.device("cpu"), 0, 2, 1, 2, 16)
    assert lse.data_ptr() - partial.data_ptr() == 256
    # a rotated payload's launch groups are merged together: each writes its own region of the same workspace
    d = 16
    rotation = torch.linalg.qr(torch.randn(d, d, generator=gen))[0]
    inner, _ = _uniform(torch.randn(1, 1, 40, d, generator=gen), 4, d, "per_token")
    keys = [torch.randn(1, 1, 3, d, generator=gen), RotatedReader(40, d, inner, rotation)]
    query = torch.randn(1, 2, d, generator=gen)
    out = decode_attention_triton(query, keys, keys, 0.25, step=decode_plan.DecodePlans(workspace))
    torch.testing.assert_close(out, decode_attention_reference(query, keys, keys, 0.25), rtol=1e-5, atol=1e-5)
    assert {key[2] for key in workspace._storage if key[0] == "scratch"} == {0, 1}


def test_default_tile_is_wide_only_for_the_formats_measured_faster_with_it():
    """The tile each of the GPU benchmark's caches is planned with (:func:`default_tile`): 128 tokens for packed ints,
    block floats and one shared codebook (the H100 sweep), 32 for per-group codebooks, QJL's sketches, the float8 /
    int8 formats not yet measured with them, and launches that rotate keys or their offset (EDEN-2 with center)."""

    from kvcomp.codecs import needs_calibration
    from kvcomp.kernels.decode_attention_triton import decode_launches, payload_launch_inputs

    bench = import_module("benchmarks.bench_decode_attention")
    wide = {"kivi-2", "kivi-4", "int4-token-head", "eden-2", "nvfp4", "kvarn", "turboquant-k3v4-nc"}
    for name, config in bench.CODECS.items():
        codec = build_codec(config, ModelInfo("llama31_8b", 1, 2, 128))
        if needs_calibration(codec):
            bench.synthetic_state(codec, torch.Generator().manual_seed(0))
        keys, values, rope, _ = bench.cache_state(codec, 1, 384, torch.device("cpu"))
        query = torch.randn(1, 8, 128)
        inputs = payload_launch_inputs(query, keys, values, None, rope, {})
        _, launches = decode_launches(*inputs[:2], inputs[2], 128**-0.5, inputs[3], inputs[4], **inputs[5])
        assert launches[0].args["unit"] == (128 if name in wide else 32), name

def test_packed_int_keys_are_scored_in_their_stored_layout_where_the_tile_allows():
    values, _ = _uniform(torch.randn(1, 1, 8, 128), 2, 32, "per_token")  # KIVI-2 values: 4 groups per token
    assert values.packed_values(128, dot=False) and not values.packed_values(128, dot=True)  # tl.dot: decoded
    one_group, _ = _uniform(torch.randn(1, 1, 8, 128), 4, 128, "per_token")  # vLLM's int4: one group per token
    assert one_group.packed_values(128, dot=False) and one_group.packed_values(128, dot=True)
    narrow_values, _ = _uniform(torch.randn(1, 1, 8, 32), 2, 16, "per_token")  # 8 bytes per token
    assert narrow_values.packed_values(32, dot=False) and not narrow_values.packed_values(32, dot=True)
    many_groups, _ = _uniform(torch.randn(1, 1, 8, 128), 2, 8, "per_token")  # 16 groups: gathered, per channel
    assert not many_groups.packed_values(128, dot=False)

    kivi2, _ = _uniform(torch.randn(1, 1, 32, 128), 2, 32, "per_channel")  # 32 bytes per token
    narrow, _ = _uniform(torch.randn(1, 1, 32, 32), 2, 32, "per_channel")  # 8 bytes per token
    assert kivi2.packed_scores(128, dot=False) and kivi2.packed_scores(128, dot=True)
    assert narrow.packed_scores(32, dot=False) and not narrow.packed_scores(32, dot=True)  # tl.dot needs 16
    assert not kivi2.packed_values(128, dot=False)  # per-channel values: gathered


@pytest.mark.parametrize("outliers, sketch", [(2, 64), (0, 64), (2, 40)])
def test_qjl_sign_bits_are_scored_in_the_kernel(outliers, sketch):
    """QJL's sketched keys as a kernel format: logits from the sign bits (outlier term per 16-token group) and
    P V over the packed per-token values equal the reference (decoded k_hat, whose logits are the
    estimator's), with left padding and a value boundary inside a key group (tiles aligned to the groups)."""
    from kvcomp.kernels.decode_attention_triton import decode_attention_triton

    b, h, r, d = 2, 2, 3, 32
    config = {"name": "qjl", "initial_layers": 0, "sketch_dim": sketch, "outlier_sketch_dim": 24, "group_size": 16,
              "outlier_channels": outliers, "key_buffer": 32, "value_window": 16}  # 40, 24: padded to 64 rows
    codec = build_codec(config, ModelInfo("tiny", 1, h, d))
    g = torch.Generator().manual_seed(outliers)
    k, v = torch.randn(b, h, 48, d, generator=g), torch.randn(b, h, 48, d, generator=g)
    assert codec.fused_attention_supported(0)
    keys = [codec.payload_reader(codec.encode(StreamRequest(0, "key", tokens=k[:, :, :32])), "key", 0), k[:, :, 32:]]
    values = [codec.payload_reader(codec.encode(StreamRequest(0, "value", tokens=v[:, :, :24])), "value", 0), v[:, :, 24:]]
    query = torch.randn(b, h * r, d, generator=g)
    valid = torch.ones(b, 48, dtype=torch.bool)
    valid[0, :5] = False
    reference = decode_attention_reference(query, keys, values, d**-0.5, valid)
    for splits, options in ((None, {}), (3, {"block_tokens": 8}), (2, {"dot": True})):  # defaults, small tiles, tl.dot
        out = decode_attention_triton(query, keys, values, d**-0.5, valid, num_splits=splits, **options)
        assert ((out - reference).norm() / reference.norm()) < 1e-5
    assert not build_codec({**config, "group_size": 8}, ModelInfo("tiny", 1, h, d)).fused_attention_supported(0)


@pytest.mark.parametrize("name", ["kivi", "qjl", "temporalkv", "channelkv", "kvquant", "fp8"])
def test_the_kernel_reads_a_cache_payload_in_place(tiny_llama, name, monkeypatch):
    """A payload store's views are narrowed along tokens from buffers with spare capacity, so they are not
    contiguous; the kernel reads them in place (by their sequence and head strides) instead of copying
    every payload tensor at every layer and step, and agrees with the reference."""
    from kvcomp.codecs import Payload
    from kvcomp.kernels.decode_attention_triton import decode_launches
    from tests.codec_matrix import make_codec

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    codec = make_codec(tiny_llama, name)
    cache = CompressedCache(codec, "exact_prefill", capacity=64)
    ids = torch.randint(1, 96, (2, 45), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        tiny_llama(ids, **with_cache(tiny_llama, cache))
    layer = cache.layers[1]
    stores = [s.store for s in layer.streams]
    assert not any(g.view.is_contiguous() for store in stores for g in store.tensors.values())
    keys, values = ([codec.payload_reader(s, kind, 1) if isinstance(s, Payload) else s for s in stream.segments()]
                    for kind, stream in zip(("key", "value"), layer.streams))
    query = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(4))
    rope = layer.positions.key_rope(layer.key_stream.num_sinks) if codec.pre_rope else None
    _, launches = decode_launches(query, keys, values, 0.25, key_rope=rope)
    read = {t.untyped_storage().data_ptr() for launch in launches for t in launch.tensors()}
    held = [g.buffer for store in stores for g in store.tensors.values()]
    if rope is not None:
        held.append(layer.positions.ids.buffer)  # pre-RoPE codecs rotate by the cached position ids
    assert all(t.untyped_storage().data_ptr() in read for t in held)
    out = decode_attention(query, keys, values, 0.25, key_rope=rope, backend="triton")
    torch.testing.assert_close(out, decode_attention_reference(query, keys, values, 0.25, key_rope=rope), rtol=1e-4, atol=1e-4)


def test_a_captured_call_replays_with_each_steps_bounds_query_and_mask(monkeypatch):
    """With CUDA graphs (here a stand-in whose replay runs the captured launches again, with the arguments they were
    captured with): a call runs, the same call the next step is captured, later ones replay without building their
    launches (found by their inputs: the launches read only the segments' tensors and the workspace's). Every output
    equals the reference although the payload grew in place and the query and the mask are new tensors each step: the
    bounds and the mask are read from the workspace's buffers, the grid does not change, the query is copied in."""
    from dataclasses import replace

    from kvcomp.kernels import decode_attention_triton as kernels
    from kvcomp.kernels.decode_attention_triton import decode_attention_triton, decode_launches
    from kvcomp.kernels.decode_graphs import DecodeGraphs
    from kvcomp.kernels.decode_plan import DecodePlans, DecodeWorkspace

    built = []
    setup_launches = kernels.setup_launches
    monkeypatch.setattr(kernels, "setup_launches", lambda *args, **kw: built.append(1) or setup_launches(*args, **kw))
    captured = []
    workspace = DecodeWorkspace(DecodeGraphs(capture=lambda run: captured.append(run) or run))
    b, h, r, d, group, capacity = 2, 2, 2, 32, 16, 128
    gen = torch.Generator().manual_seed(5)
    full_keys, _ = _uniform(torch.randn(b, h, capacity, d, generator=gen), 4, group, "per_token")
    full_values, _ = _uniform(torch.randn(b, h, capacity, d, generator=gen), 2, group, "per_token")
    fresh = torch.randn(b, h, 4, d, generator=gen)  # a buffer with spare capacity: the fresh token is its first row
    outputs, grids, builds = [], set(), []
    for tokens in (64, 80, 96, 112):
        keys, values = ([replace(full, num_tokens=tokens, codes=full.codes[:, :, :tokens], scale=full.scale[:, :, :tokens],
                                 zero=full.zero[:, :, :tokens]), fresh[:, :, :1]] for full in (full_keys, full_values))
        query, valid = torch.randn(b, h * r, d, generator=gen), _mask(b, tokens + 1, gen)
        step = DecodePlans(workspace)
        grids.add(tuple(launch.grid for launch in decode_launches(query, keys, values, 0.2, valid, step=DecodePlans(DecodeWorkspace(DecodeGraphs())))[1]))
        before = len(built)
        out = decode_attention_triton(query, keys, values, 0.2, valid, step=step)
        torch.testing.assert_close(out, decode_attention_reference(query, keys, values, 0.2, valid), rtol=1e-5, atol=1e-5)
        outputs.append(out)
        builds.append(len(built) - before)
    assert len(grids) == 1  # the grid of a graph's plan does not change as the cache grows
    assert len(captured) == 1 and outputs[1] is outputs[2] is outputs[3]  # captured once, replayed into its own output
    assert builds == [1, 1, 0, 0]  # the launches of the first two calls only


def test_row_groups_masks_keep_buffers_of_their_own_under_cuda_graphs():
    """Two row groups of one batch size attend with masks of their own in every layer of a step (their lengths differ by
    their pads): under CUDA graphs (a stand-in capture) each mask and its spans are copied once per step into a buffer
    of their own, so that the second layer's call of the first group reads its own mask, not the one copied last."""
    from kvcomp.kernels.decode_attention_triton import decode_attention_triton
    from kvcomp.kernels.decode_graphs import DecodeGraphs
    from kvcomp.kernels.decode_plan import DecodePlans, DecodeWorkspace

    b, h, r, d, group = 2, 2, 2, 32, 16
    gen = torch.Generator().manual_seed(8)
    groups = []
    for tokens in (48, 43):
        keys, _ = _uniform(torch.randn(b, h, tokens, d, generator=gen), 4, group, "per_token")
        values, _ = _uniform(torch.randn(b, h, tokens, d, generator=gen), 2, group, "per_token")
        groups.append(([keys], [values], tokens))
    workspace = DecodeWorkspace(DecodeGraphs(capture=lambda run: run))
    for _ in range(3):
        step = DecodePlans(workspace)
        masks = [ValidTokens(torch.rand(b, tokens, generator=gen) < 0.7) for _, _, tokens in groups]
        for _layer in range(2):
            for (keys, values, _), valid in zip(groups, masks):
                query = torch.randn(b, h * r, d, generator=gen)
                out = decode_attention_triton(query, keys, values, 0.2, valid, step=step)
                torch.testing.assert_close(out, decode_attention_reference(query, keys, values, 0.2, valid.mask),
                                           rtol=1e-5, atol=1e-5)


def test_a_call_reading_what_it_made_is_replayed_only_by_its_launches(monkeypatch):
    """A captured call whose launches read a tensor made during the call (here the keys' scales converted to float32
    by their reader each call) is never replayed by its inputs alone: its launches are built every step (and matched
    by their arguments), so the replay reads this step's tensor."""
    from kvcomp.kernels import decode_attention_triton as kernels
    from kvcomp.kernels.decode_graphs import DecodeGraphs
    from kvcomp.kernels.decode_plan import DecodePlans, DecodeWorkspace

    built = []
    setup_launches = kernels.setup_launches
    monkeypatch.setattr(kernels, "setup_launches", lambda *args, **kw: built.append(1) or setup_launches(*args, **kw))
    workspace = DecodeWorkspace(DecodeGraphs(capture=lambda run: run))
    b, h, r, d, tokens = 1, 2, 2, 32, 64
    gen = torch.Generator().manual_seed(6)
    keys = _codebook_reader(b, h, d, tokens, *LAYOUTS["scalar"], False, gen)
    keys.channel_scale = keys.channel_scale.double()  # CodebookReader.kernel_args converts it per call
    values = torch.randn(b, h, tokens, d, generator=gen)
    for _ in range(4):
        query = torch.randn(b, h * r, d, generator=gen)
        out = kernels.decode_attention_triton(query, [keys], [values], 0.2, step=DecodePlans(workspace))
        torch.testing.assert_close(out, decode_attention_reference(query, [keys], [values], 0.2), rtol=1e-5, atol=1e-5)
    assert len(built) == 4 and not workspace.graphs.by_inputs


def test_a_replayed_call_remakes_what_it_derives_from_the_query():
    """QJL's launches read the projected query ``y = S q`` (and its bf16 parts), made from each call's query. The
    captured call remakes them from the graph's own copy of the query before its launches (``CallQuery.refresh``), so
    it is captured although each call makes new ones, replayed by its inputs, and every replay with a new query equals
    the reference (a stand-in capture whose replay runs the captured work again)."""
    from kvcomp.kernels import decode_attention_triton as kernels
    from kvcomp.kernels.decode_graphs import DecodeGraphs
    from kvcomp.kernels.decode_plan import DecodePlans, DecodeWorkspace

    b, h, r, d = 1, 2, 2, 32
    config = {"name": "qjl", "initial_layers": 0, "sketch_dim": 32, "outlier_sketch_dim": 16, "group_size": 16,
              "outlier_channels": 2, "key_buffer": 16, "value_window": 16}
    codec = build_codec(config, ModelInfo("tiny", 1, h, d))
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(b, h, 48, d, generator=g), torch.randn(b, h, 48, d, generator=g)
    keys = [codec.payload_reader(codec.encode(StreamRequest(0, "key", tokens=k[:, :, :32])), "key", 0), k[:, :, 32:]]
    values = [codec.payload_reader(codec.encode(StreamRequest(0, "value", tokens=v[:, :, :32])), "value", 0), v[:, :, 32:]]
    workspace = DecodeWorkspace(DecodeGraphs(capture=lambda run: run))
    outputs = []
    for _ in range(4):
        query = torch.randn(b, h * r, d, generator=g)
        out = kernels.decode_attention_triton(query, keys, values, 0.2, step=DecodePlans(workspace))
        assert ((out - decode_attention_reference(query, keys, values, 0.2)).norm() / out.norm()) < 1e-5
        outputs.append(out)
    assert workspace.graphs.by_inputs and outputs[1] is outputs[2] is outputs[3]  # captured, then replayed


def test_a_rotated_payloads_launch_groups_are_captured_and_replayed(monkeypatch):
    """A rotated payload's own launches (:func:`launch_groups`: the payload's, with the query rotated, then the sinks'
    and tail's) under CUDA graphs: each group's split launches are captured and replayed by their inputs, the rotations
    and the one merge run as they are, and every step's output with a new query and mask equals the reference (a
    stand-in capture whose replay runs the captured launches again). Two layers of a step share the step's mask: its
    groups' parts of it are made once, and copied into two buffers of the workspace for all layers and steps."""
    from kvcomp.kernels import decode_attention_triton as kernels
    from kvcomp.kernels.decode_graphs import DecodeGraphs
    from kvcomp.kernels.decode_plan import DecodePlans, DecodeWorkspace
    from kvcomp.kernels.formats import RotatedReader

    built = []
    setup_launches = kernels.setup_launches
    monkeypatch.setattr(kernels, "setup_launches", lambda *args, **kw: built.append(1) or setup_launches(*args, **kw))
    gen = torch.Generator().manual_seed(10)
    b, h, r, d, n = 2, 2, 2, 32, 32
    readers = [RotatedReader(n, d, _uniform(torch.randn(b, h, n, d, generator=gen), 4, d, "per_token")[0],
                             torch.linalg.qr(torch.randn(d, d, generator=gen))[0]) for _ in range(2)]
    sinks, tail = torch.randn(b, h, 3, d, generator=gen), torch.randn(b, h, 5, d, generator=gen)
    keys, values = [sinks, readers[0], tail], [sinks, readers[1], tail]
    workspace = DecodeWorkspace(DecodeGraphs(capture=lambda run: run))
    builds = []
    for _ in range(4):
        step, valid = DecodePlans(workspace), ValidTokens(_mask(b, 3 + n + 5, gen))
        before = len(built)
        for _layer in range(2):
            query = torch.randn(b, h * r, d, generator=gen)
            out = kernels.decode_attention_triton(query, keys, values, 0.2, valid, step=step)
            torch.testing.assert_close(out, decode_attention_reference(query, keys, values, 0.2, valid.mask), rtol=1e-5,
                                       atol=1e-5)
        builds.append(len(built) - before)
    assert builds == [4, 0, 0, 0]  # two groups, their launches built twice (met, captured), then replayed
    assert len(workspace.graphs.by_inputs) == 2
    assert valid.columns(3, 3 + n) is valid.columns(3, 3 + n)
    assert sorted(key[2] for key in workspace._storage if key[0] == "mask") == [0, 1]  # the slots of the two groups


@pytest.mark.parametrize("name", ["kivi", "temporalkv", "qjl", "eden", "turboquant_prod", "int4_token_head"])
@torch.no_grad()
def test_generation_under_cuda_graphs_matches_the_torch_path(tiny_llama, name, monkeypatch):
    """``install(model, "triton", cuda_graphs=True)`` with a stand-in capture (its replay runs the captured work
    again): every generated token's logits equal the torch path's (left padding; pre-RoPE keys rotated from the cached
    position ids), and once generation has captured every call, no step builds a launch again. KIVI's full-precision
    tail moves along its buffer as tokens leave it, and the kernel is given the buffer from its first row and the plan's
    row of bounds the tail's start, so a call reads the same tensors step after step. TemporalKV's reader is given the
    same float32 channel statistics at every call (kept per device by the codec). QJL's projected query ``y = S q``,
    made from each call's query, is remade by the graph from its own copy of the query (``CallQuery.refresh``). EDEN's
    rotated payload runs in launch groups of its own, whose split launches are captured (the rotations run as they
    are). TurboQuant-prod's residual sketch scores keys against ``y = S q`` of the model's query, which its launch
    groups derive from their own query as QJL's launches do (a key offset's query likewise: tests/codecs/test_centering.py).
    vLLM's int4 hides each zero-point in its scale, which the kernel reveals as it reads the scales."""
    if name == "qjl":  # sketch sizes the fused kernel reads
        codec = build_codec(QJL_FUSED, info_of(tiny_llama))
    elif name == "eden":
        codec = build_codec({"name": "eden", "key_bits": 2, "value_bits": 2}, info_of(tiny_llama))
    elif name == "turboquant_prod":
        codec = build_codec({"name": "turboquant", "variant": "prod", "key_bits": 3, "value_bits": 3}, info_of(tiny_llama))
    elif name == "int4_token_head":
        codec = build_codec({"name": "int_token_head", "bits": 4}, info_of(tiny_llama))
    else:
        codec = build_codec({"name": "kivi", "group_size": 8, "residual_length": 16}, info_of(tiny_llama)) \
            if name == "kivi" else fitted(tiny_llama, name, sinks=4)
    # a call runs at the first decode step, is captured at the second, replayed from the third (KIVI's: from the fifth)
    check_graphed_generation(tiny_llama, codec, monkeypatch, new_tokens=6 if name == "kivi" else 4)


def test_cuda_graphs_need_the_fused_kernels(tiny_llama):
    from kvcomp.errors import ConfigError

    with pytest.raises(ConfigError, match="cuda_graphs=True .* needs kernel_backend='triton'"):
        install(tiny_llama, "torch", cuda_graphs=True)


def test_calls_that_never_come_back_do_not_pile_up(monkeypatch):
    """A call whose tensors change every step (a cache without spare capacity) is never captured: the graphs remember
    the last KEPT calls only; one met again is captured, then replayed."""
    from kvcomp.kernels import Launch, decode_graphs
    from kvcomp.kernels.formats import CallQuery

    class Kernel:  # a launchable stand-in: kernel[grid](**args) records the call's tag
        def __getitem__(self, grid):
            return lambda **args: runs.append(args["tag"])

    monkeypatch.setattr(decode_graphs, "KEPT", 2)
    runs, kernel = [], Kernel()
    graphs = decode_graphs.DecodeGraphs(capture=lambda run: run)
    query, out = torch.zeros(1), torch.zeros(1)
    for tag in (0, 1, 2, 3, 3, 3):  # four calls met once, then the last one twice more
        graphs.run([Launch(kernel, (1,), {"tag": tag, "q_ptr": query})], CallQuery(query), out)
    assert len(graphs.seen) == 2 and len(graphs.captured) == 1
    assert runs == [0, 1, 2, 3, 3, 3]  # run, run, run, run, captured (and run), replayed
