"""What the kernels read: one reader per payload format, each with its torch decoding and the fused decode kernel's
arguments for it.

A decode step's keys and values are each a list of *segments* in cache order: full-precision tensors
``[B, H, T, D]`` and payload readers, which say how a kernel decodes an encoded block in registers
(:mod:`kvcomp.kernels.decode_attention` has the formats and their equations). Each reader says what the split kernel
reads of it (:meth:`PayloadReader.kernel_args`: its tensors, strides and compile-time format constants), how many
tokens a tile may hold (:meth:`~PayloadReader.tile_limit`, :attr:`~PayloadReader.wide_tile`) and whether it is read
in its packed layout; the launcher (:mod:`kvcomp.kernels.decode_attention_triton`) asks, and never tests a format's
type. Both the torch references and the Triton launchers import this module, and it imports neither of them, so no
kernel module imports another in a circle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcomp.stages.codebook import ChunkLayout, CodebookQuantizer
from kvcomp.stages.jl_sketch import channel_mask, estimator_scale, unpack_signs
from kvcomp.stages.lloyd_max import TINY
from kvcomp.stages.normalization import affine_denormalize, per_token
from kvcomp.stages.packing import unpack_bits
from kvcomp.stages.rope import apply_rope
from kvcomp.stages.uniform_quantizer import GroupQuantizer


@dataclass
class RotaryPositions:
    """RoPE of the tokens of one key payload, recomputed from positions as the model's rotary embedding
    does: ``cos = cos(pos * inv_freq) * scaling`` rounded to the model's ``dtype`` (HF's cos/sin dtype).

    ``positions [B, L]``: the position id of every cached token; the payload's token ``t`` is cached
    token ``first + t``.
    """

    positions: torch.Tensor
    first: int
    inv_freq: torch.Tensor  # [D/2] float32
    scaling: float
    dtype: torch.dtype

    def cos_sin(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[B, T, D]`` (float32) of the payload's ``num_tokens`` tokens."""
        pos = self.positions[:, self.first : self.first + num_tokens].float()
        freqs = pos[..., None] * self.inv_freq.float().to(pos.device)
        angles = torch.cat([freqs, freqs], dim=-1)
        return tuple((f(angles) * self.scaling).to(self.dtype).float() for f in (torch.cos, torch.sin))


# the split kernel's payload formats (its K_FMT / V_FMT): none (full-precision pieces only), packed ints (uniform
# codes, or codes naming a small float format), codebook indices, QJL's sign bits, a natively loaded dtype
DENSE, UNIFORM, CODEBOOK, SKETCH, SCALED = 0, 1, 2, 3, 4


def in_place(*tensors: torch.Tensor) -> tuple[list[torch.Tensor], int, int]:
    """Tensors ``[B, H, ...]`` (or ``[B, T]``) of one shape as a kernel reads them, and their shared sequence
    and head strides (0 for ``[B, T]``): read in place when each (sequence, head) slice is contiguous and
    the strides agree (a payload store's views, narrowed along tokens from buffers with spare capacity),
    else copied contiguous. The copy would read and write the whole payload at every layer and step."""
    inner = (lambda t: t[0, 0]) if tensors[0].dim() > 2 else (lambda t: t[0])
    strides = {t.stride()[:2] for t in tensors}
    if len(strides) > 1 or not all(inner(t).is_contiguous() for t in tensors):
        tensors = tuple(t.contiguous() for t in tensors)
    first = tensors[0]
    return list(tensors), first.stride(0), first.stride(1) if first.dim() > 2 else 0


def _read(name: str, tensor: torch.Tensor, strides: str) -> dict:
    """``{name: tensor, <strides>_s_b, <strides>_s_h}`` of one tensor read in place (:func:`in_place`)."""
    (tensor,), s_b, s_h = in_place(tensor)
    return {name: tensor, f"{strides}_s_b": s_b, f"{strides}_s_h": s_h}


@dataclass
class PayloadReader:
    """What a kernel needs to read one encoded segment; subclasses define the format."""

    num_tokens: int
    head_dim: int
    wide_tile = False  # whether the kernel's wide tiles suit it (read without a per-group table: default_tile)

    def dequantize_unrotated(self) -> torch.Tensor:
        raise NotImplementedError

    @property
    def kv_heads(self) -> int:
        return self.codes.shape[1]

    def kernel_args(self) -> tuple[dict, dict]:
        """The split kernel's arguments for this payload: runtime (``data``, ``scale``, ``zero``, ``codebooks``,
        ``ch_scale``, ``ch_center``, ``tok_scale``, ``tok_center`` and the strides ``data_s_*``, ``param_s_*``,
        ``tok_s_*``) and compile-time (``FMT`` and its constants), the launcher prefixing them with ``k_`` / ``v_``;
        the fields a format does not read keep the launcher's placeholders."""
        raise NotImplementedError(f"the fused decode kernel cannot read a {type(self).__name__} payload")

    def tile_limit(self, block_tokens: int, dot: bool) -> int:
        """Tokens per tile this payload allows, at most ``block_tokens`` (``dot``: a ``tl.dot`` launch)."""
        return block_tokens

    def packed_scores(self, head_dim: int, dot: bool) -> bool:
        """Whether keys of this format are scored in their packed layout."""
        return False

    def packed_values(self, head_dim: int, dot: bool) -> bool:
        """Whether values of this format are weighted in their packed layout."""
        return False

    def dequantize(self, rope: RotaryPositions | None = None) -> torch.Tensor:
        """The segment decoded in torch, ``[B, H, T, D]`` float32 (rotated when ``rope`` is given)."""
        x = self.dequantize_unrotated()
        if rope is None:
            return x
        return apply_rope(x, *rope.cos_sin(self.num_tokens))


@dataclass
class UniformReader(PayloadReader):
    """A :class:`~kvcomp.stages.uniform_quantizer.GroupQuantizer` payload: ``codes`` uint8
    ``[B, H, T, D*bits/8]``; ``scale``/``zero`` ``[B, H, T, D/G]`` (per token) or ``[B, H, T/G, D]``
    (per channel). ``multiplier`` (KVarN's normaliser), applied after ``code * scale + zero``: one factor per
    token ``[B, H, T]`` for per-channel payloads, or per channel ``[B, H, T/multiplier_group, D]`` (one row per
    ``multiplier_group`` tokens) for per-token payloads."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int
    per_channel: bool
    multiplier: torch.Tensor | None = None
    multiplier_group: int = 0

    @classmethod
    def of(cls, quantizer: GroupQuantizer, payload, head_dim: int) -> UniformReader:
        """The reader of a :class:`~kvcomp.codecs.base.Payload` that ``quantizer`` encoded."""
        t = payload.tensors
        return cls(payload.num_tokens, head_dim, t["codes"], t["scale"], t["zero"], quantizer.bits, quantizer.group_size,
                   quantizer.axis == "per_channel")

    wide_tile = True

    def kernel_args(self) -> tuple[dict, dict]:
        (scale, zero), param_s_b, param_s_h = in_place(self.scale, self.zero)
        runtime = dict(_read("data", self.codes, "data"), scale=scale, zero=zero, param_s_b=param_s_b, param_s_h=param_s_h)
        static = dict(FMT=UNIFORM, BITS=self.bits, GROUP=self.group_size, PER_CHANNEL=self.per_channel)
        if self.multiplier is not None:  # per token (per-channel payloads) or per channel every few tokens
            runtime.update(_read("tok_scale", self.multiplier, "tok"))
            static["MULTIPLIER"] = self.head_dim if self.per_channel else self.multiplier_group
        return runtime, static

    def tile_limit(self, block_tokens: int, dot: bool) -> int:
        """At most a per-channel group (its parameters, or the multiplier of a per-token payload; a power of two, at
        least 16 for ``tl.dot``), so that each tile reads at most two rows of them (the kernel's ``_params``)."""
        groups = [self.group_size] if self.per_channel else []
        if self.multiplier is not None and not self.per_channel:
            groups.append(self.multiplier_group)
        for group in groups:
            if group < block_tokens and not group & (group - 1) and (group >= 16 or not dot):
                block_tokens = group
        return block_tokens

    def packed_scores(self, head_dim: int, dot: bool) -> bool:
        """Codes within bytes, no multiplier, bytes per token a power of two (a Triton range), at least 16 for
        ``tl.dot`` (the kernel's ``_packed_scores``)."""
        if 8 % self.bits or self.multiplier is not None:
            return False
        width = head_dim * self.bits // 8
        return not width & (width - 1) and (width >= 16 or not dot)

    def packed_values(self, head_dim: int, dot: bool) -> bool:
        """Per-token codes within bytes without a multiplier, bytes per token a power of two, groups of whole bytes,
        at most 8 groups per token (their scales are selected in registers), on the register path (the kernel's
        ``_packed_values``)."""
        if dot or self.per_channel or 8 % self.bits or self.multiplier is not None:
            return False
        per_byte, width = 8 // self.bits, head_dim * self.bits // 8
        return not width & (width - 1) and self.group_size % per_byte == 0 and head_dim // self.group_size <= 8

    def dequantize_unrotated(self) -> torch.Tensor:
        quantizer = GroupQuantizer(self.bits, self.group_size, "per_channel" if self.per_channel else "per_token")
        x = quantizer.decode({"scale": self.scale, "zero": self.zero, "codes": self.codes}, self.head_dim, torch.float32)
        if self.multiplier is None:
            return x
        m = self.multiplier.float()
        return x * (m[..., None] if self.per_channel else m.repeat_interleave(self.multiplier_group, dim=2))


@dataclass
class BlockFloatReader(PayloadReader):
    """Codes of ``bits`` bits naming the values of a small float format, ``levels[code]`` (float32 ``[2**bits]``,
    on the payload's device), times one scale per block of ``block`` channels of each token and head (``scales``
    ``[B, H, T, D/block]``, of a dtype the kernel loads natively): vLLM's NVFP4 (e2m1 codes, e4m3 block scales,
    the layer's global scale folded into ``levels``). ``codes`` uint8 ``[B, H, T, D*bits/8]``."""

    codes: torch.Tensor
    scales: torch.Tensor
    levels: torch.Tensor
    bits: int
    block: int
    wide_tile = True

    def kernel_args(self) -> tuple[dict, dict]:
        (scale,), param_s_b, param_s_h = in_place(self.scales)
        return (dict(_read("data", self.codes, "data"), scale=scale, codebooks=self.levels, param_s_b=param_s_b,
                     param_s_h=param_s_h),
                dict(FMT=UNIFORM, BITS=self.bits, GROUP=self.block, LEVELS=True))

    def dequantize_unrotated(self) -> torch.Tensor:
        b, h, t, _ = self.codes.shape
        values = self.levels.float()[unpack_bits(self.codes, self.bits, self.head_dim).long()]
        return (values.view(b, h, t, -1, self.block) * self.scales.float()[..., None]).view(b, h, t, self.head_dim)


@dataclass
class CodebookReader(PayloadReader):
    """A :class:`~kvcomp.stages.codebook.CodebookQuantizer` payload and the normalisation to undo:
    ``codes`` uint8 ``[B, H, T/time_len, bytes]`` of ``code_bits``-bit indices into ``codebooks``
    ``[H, G, k, dim]``; per-channel ``channel_scale``/``channel_center`` ``[H, D]`` and optional per-token
    ``token_scale``/``token_center`` ``[B, T]``, or per token and head ``[B, H, T]`` (TurboQuant's norms).
    ``unit_norm`` (vLLM's TurboQuant norm correction): each token's vector, before its ``token_scale``, is
    rescaled to unit norm over all channels."""

    codes: torch.Tensor
    codebooks: torch.Tensor
    layout: ChunkLayout
    channel_scale: torch.Tensor
    channel_center: torch.Tensor
    token_scale: torch.Tensor | None = None
    token_center: torch.Tensor | None = None
    unit_norm: bool = False

    @property
    def num_centroids(self) -> int:
        return self.codebooks.shape[2]

    @property
    def wide_tile(self) -> bool:
        """One codebook for every channel group (TurboQuant, EDEN); per-group codebooks need narrow tiles."""
        return self.codebooks.shape[1] == 1

    def kernel_args(self) -> tuple[dict, dict]:
        layout = self.layout
        runtime = dict(_read("data", self.codes, "data"), codebooks=self.codebooks.contiguous(),
                       ch_scale=self.channel_scale.float().contiguous(), ch_center=self.channel_center.float().contiguous())
        names = [name for name in ("token_scale", "token_center") if getattr(self, name) is not None]
        if names:  # per-token normalisation [B, T], or per token and head [B, H, T]
            tokens, runtime["tok_s_b"], runtime["tok_s_h"] = in_place(*(getattr(self, name) for name in names))
            runtime.update({name.replace("token", "tok"): t for name, t in zip(names, tokens)})
        return runtime, dict(FMT=CODEBOOK, CODE_BITS=self.code_bits, CENTROIDS=self.num_centroids, TL=layout.time_len,
                             CL=layout.channel_len, GC=layout.group_channels, TOKEN_SCALE=self.token_scale is not None,
                             TOKEN_CENTER=self.token_center is not None, UNIT=self.unit_norm)

    @property
    def code_bits(self) -> int:
        return CodebookQuantizer(self.layout, self.num_centroids).code_bits

    def dequantize_unrotated(self) -> torch.Tensor:
        quantizer = CodebookQuantizer(self.layout, self.num_centroids)
        z = quantizer.decode(self.codes, self.codebooks, self.head_dim)
        if not self.unit_norm:
            return affine_denormalize(z, self.channel_scale, self.channel_center, self.token_scale, self.token_center)
        x = affine_denormalize(z, self.channel_scale, self.channel_center, None, self.token_center)
        return x / x.norm(dim=-1, keepdim=True).clamp_min(TINY) * per_token(self.token_scale)


@dataclass
class SketchedKeys:
    """Encoded keys of one layer, ``T`` tokens per (batch, KV head); ``T`` a multiple of ``group_size``.

    ``signs`` uint8 ``[B, H, T, m/8]`` and ``inlier_norm`` ``[B, H, T]`` code the inlier part; with
    outliers, ``outlier_signs`` uint8 ``[B, H, T, m_o/8]`` (sketched by the first ``m_o`` rows of
    ``projection``), ``outlier_norm`` ``[B, H, T]`` and ``outlier_channels`` ``[B, H, T/G, n_out]``.
    """

    signs: torch.Tensor
    inlier_norm: torch.Tensor
    projection: torch.Tensor  # [m, D] float32
    group_size: int
    outlier_signs: torch.Tensor | None = None
    outlier_norm: torch.Tensor | None = None
    outlier_channels: torch.Tensor | None = None

    @property
    def sketch_dim(self) -> int:
        return self.signs.shape[-1] * 8

    @property
    def outlier_sketch_dim(self) -> int:
        return 0 if self.outlier_signs is None else self.outlier_signs.shape[-1] * 8

    @property
    def num_outliers(self) -> int:
        return 0 if self.outlier_channels is None else self.outlier_channels.shape[-1]


def reconstruct_keys(keys: SketchedKeys, head_dim: int) -> torch.Tensor:
    """``k_hat`` float32 ``[B, H, T, D]``, whose logits ``<q, k_hat>`` equal the estimator's: on each part,
    ``sqrt(pi/2)/m' ||k'|| S'^T sign(S' k')`` (outlier channels from the outlier sketch)."""
    projection = keys.projection.to(keys.signs.device)

    def reconstruct(signs, norm, rows):
        return estimator_scale(rows) * norm.float()[..., None] * (unpack_signs(signs, rows) @ projection[:rows])

    k_hat = reconstruct(keys.signs, keys.inlier_norm, keys.sketch_dim)
    if keys.num_outliers:
        mask = channel_mask(keys.outlier_channels, head_dim, keys.group_size)
        k_hat = torch.where(mask, reconstruct(keys.outlier_signs, keys.outlier_norm, keys.outlier_sketch_dim), k_hat)
    return k_hat


@dataclass
class SketchReader(PayloadReader):
    """QJL's sign-sketched keys (:class:`SketchedKeys`). The kernel scores them
    from their sign bits (:mod:`kvcomp.kernels.qjl_scores`: Eq. 4 plus the outlier term); the reference
    decodes ``k_hat`` (:func:`reconstruct_keys`), whose logits are the same."""

    keys: SketchedKeys

    def dequantize_unrotated(self) -> torch.Tensor:
        return reconstruct_keys(self.keys, self.head_dim)

    @property
    def kv_heads(self) -> int:
        return self.keys.signs.shape[1]

    def kernel_args(self) -> tuple[dict, dict]:
        """The inlier sign bits and norms (the rest of the format: :meth:`sketch_args`)."""
        (norm,), param_s_b, param_s_h = in_place(self.keys.inlier_norm)
        return (dict(_read("data", self.keys.signs, "data"), scale=norm, param_s_b=param_s_b, param_s_h=param_s_h),
                dict(FMT=SKETCH))

    def tile_limit(self, block_tokens: int, dot: bool) -> int:
        """Within one group of outlier channels."""
        return min(block_tokens, self.keys.group_size)

    def sketch_args(self, q: torch.Tensor, queries: dict) -> dict:
        """The kernel's ``sk_*`` / ``SK_*`` arguments: the projected queries ``y = S q`` ``[B, H, R, m]`` (kept in
        ``queries`` for the step's other launches), the projection, the outliers' signs, norms and channels, the
        estimator's scales (Eq. 4) and the sketch sizes."""
        keys = self.keys
        projection = keys.projection.to(q.device, torch.float32).contiguous()
        if id(self) not in queries:
            queries[id(self)] = (q.float() @ projection.T).contiguous()
        m, m_out, n_out = keys.sketch_dim, keys.outlier_sketch_dim, keys.num_outliers
        out = dict(sk_y=queries[id(self)], sk_proj=projection, sk_scale_in=estimator_scale(m),
                   SK_M=m, SK_M_OUT=m_out, SK_N_OUT=n_out, SK_GROUP=keys.group_size, SK_M_PAD=1 << (m - 1).bit_length())
        if n_out:
            out["sk_scale_out"] = estimator_scale(m_out)
            out.update(_read("sk_out_signs", keys.outlier_signs, "sk_out"), **_read("sk_out_norm", keys.outlier_norm, "sk_onorm"),
                       **_read("sk_channels", keys.outlier_channels, "sk_ch"))
        return out


@dataclass
class SignReader(PayloadReader):
    """Values ``x = norm * (+-1)`` from sign bits packed 8 per byte (``signs`` uint8 ``[B, H, T, D/8]``, bit ``c % 8`` of
    byte ``c // 8``) and one ``norm`` per token and head ``[B, H, T]``: TurboQuant-prod's residual sketch
    ``sign(S r)`` with ``||r||``, read in the sketch's basis (:class:`ResidualSketchReader`). The kernel reads it as
    values, or as a key payload's residual; QJL's sketched keys are :class:`SketchReader`."""

    signs: torch.Tensor
    norm: torch.Tensor

    @property
    def kv_heads(self) -> int:
        return self.signs.shape[1]

    def kernel_args(self) -> tuple[dict, dict]:
        (norm,), param_s_b, param_s_h = in_place(self.norm)
        return (dict(_read("data", self.signs, "data"), scale=norm, param_s_b=param_s_b, param_s_h=param_s_h),
                dict(FMT=SKETCH))

    def dequantize_unrotated(self) -> torch.Tensor:
        return unpack_signs(self.signs, self.head_dim) * self.norm.float()[..., None]


@dataclass
class ResidualSketchReader(PayloadReader):
    """TurboQuant-prod (Algorithm 2): a payload ``inner`` plus the 1-bit QJL sketch of its residual,
    ``x = inner + sqrt(pi/2)/d ||r|| S^T sign(S r)`` (``residual``: the signs and ``||r||``; ``projection`` ``S``
    float32 ``[d, d]``). The kernel adds the sketch's score ``sqrt(pi/2)/d ||r|| <S q, sign(S r)>`` to each key's (the
    query as the model made it, projected once per step), and reads the values' sketch in launches of their own over
    the same keys, whose partial outputs, taken back by ``sqrt(pi/2)/d S``, add to the payload's (the same softmax)."""

    inner: PayloadReader
    residual: SignReader
    projection: torch.Tensor

    @property
    def kv_heads(self) -> int:
        return self.inner.kv_heads

    @property
    def basis(self) -> torch.Tensor:
        """``sqrt(pi/2)/d S``: what takes the sketch's basis back to the vectors' (``x = inner + residual @ basis``)."""
        return self.projection.float() * estimator_scale(self.head_dim)

    def dequantize_unrotated(self) -> torch.Tensor:
        residual = self.residual.dequantize_unrotated()
        return self.inner.dequantize_unrotated() + residual @ self.basis.to(residual.device)


@dataclass
class ScaledReader(PayloadReader):
    """Values of a dtype the kernel loads natively, times a scale: vLLM's ``fp8`` / ``fp8_per_token_head`` caches
    (:mod:`kvcomp.codecs.fp8`) and ``int8_per_token_head`` (:mod:`kvcomp.codecs.int_token_head`). ``codes``
    ``[B, H, T, D]`` of ``dtype`` (float8: its bit patterns as uint8; int8), times ``scale``: one float32 value
    (per tensor) or ``[B, H, T, 1]`` (per token and head)."""

    codes: torch.Tensor
    dtype: torch.dtype
    scale: torch.Tensor

    @property
    def per_token(self) -> bool:
        return self.scale.dim() == 4

    def kernel_args(self) -> tuple[dict, dict]:
        if self.per_token:
            (scale,), param_s_b, param_s_h = in_place(self.scale)
        else:  # one value for every sequence and head
            scale, param_s_b, param_s_h = self.scale.float().reshape(1).contiguous(), 0, 0
        return (dict(_read("data", self.codes.view(self.dtype), "data"), scale=scale, param_s_b=param_s_b,
                     param_s_h=param_s_h),
                dict(FMT=SCALED, TOKEN_SCALE=self.per_token))

    def dequantize_unrotated(self) -> torch.Tensor:
        return self.codes.view(self.dtype).float() * self.scale.float()


@dataclass
class RotatedReader(PayloadReader):
    """A payload stored in a rotated basis: ``x = inner @ rotation`` (``rotation`` float32 ``[D, D]``, or one per KV
    head ``[1 or H, D, D]``; e.g. vLLM's int4 per-token-head Hadamard, OSCAR's fitted rotations). The kernel reads ``inner`` as it is stored: scores as ``(q rotation^T) . inner``,
    and the attention output over the payload as ``(P inner) rotation`` (the query rotated, the output
    un-rotated, nothing decoded). Keys must be post-RoPE."""

    inner: PayloadReader
    rotation: torch.Tensor

    @property
    def kv_heads(self) -> int:
        return self.inner.kv_heads

    def dequantize_unrotated(self) -> torch.Tensor:
        return self.inner.dequantize_unrotated() @ self.rotation


@dataclass
class OffsetReader(PayloadReader):
    """A payload stored less an offset per KV head, ``offset`` float32 ``[H, D]`` (the ``center`` option of
    TurboQuant / EDEN / QJL): values ``x = inner + c``; keys (``rotated``) ``x = inner + R_p c``, the pre-RoPE offset
    rotated to each token's position (the step's :class:`RotaryPositions`). The kernel adds ``q . R_p c`` to each
    key's score and ``c`` to the values' share of the output (softmax weights sum to one); nothing is decoded."""

    inner: PayloadReader
    offset: torch.Tensor
    rotated: bool

    @property
    def kv_heads(self) -> int:
        return self.inner.kv_heads

    def dequantize(self, rope: RotaryPositions | None = None) -> torch.Tensor:
        x = self.inner.dequantize()
        b, h, t, d = x.shape
        offset = self.offset.float().to(x.device)[None, :, None, :].expand(b, h, t, d)
        if self.rotated:
            if rope is None:
                raise ValueError("a rotated key offset needs the keys' positions (key_rope)")
            offset = apply_rope(offset, *rope.cos_sin(t))
        return x + offset


Segment = torch.Tensor | PayloadReader


def segment_length(segment: Segment) -> int:
    return segment.num_tokens if isinstance(segment, PayloadReader) else segment.shape[2]


def fused_encode_supported(layout: ChunkLayout, code_bits: int) -> bool:
    """Whether every codebook group fills whole bytes (then a program packs its group alone)."""
    return 8 % code_bits == 0 and (layout.group_channels // layout.channel_len * code_bits) % 8 == 0
