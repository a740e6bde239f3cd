"""Packed ints with a scale and zero-point per group (:class:`~kvcomp.stages.uniform_quantizer.GroupQuantizer`: KIVI,
``uniform``, KVarN, vLLM's int4 and TurboQuant values): ``x = code * scale + zero``. Device functions:
:mod:`kvcomp.kernels.formats.uniform_triton`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvcomp.kernels.formats.base import CallQuery, PayloadReader, Strided, four_programs, in_place
from kvcomp.stages.packing import unpack_bits
from kvcomp.stages.uniform_quantizer import GroupQuantizer


ZERO_BITS = 0xF  # vLLM's int4: the float32 scale's low mantissa bits that hold the zero-point


def hide_zero(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The float32 ``scale`` with its 4 low mantissa bits replaced by ``zero`` (0..15): vLLM's int4 per token-head."""
    return ((scale.view(torch.int32) & ~ZERO_BITS) | zero.to(torch.int32)).view(torch.float32)


def reveal_zero(stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale with the 4 low mantissa bits cleared, zero-point)`` (float32) of a stored int4 scale."""
    bits = stored.view(torch.int32)
    return (bits & ~ZERO_BITS).view(torch.float32), (bits & ZERO_BITS).float()


def word_aligned(codes: Strided) -> bool:
    """Whether each token's row of codes, read in place, starts at a multiple of 4 bytes (its first row's address,
    the sequence and head strides, and the row's length), so that a kernel may load it as int32 words
    (:func:`~.uniform_triton.paired_keys`): a misaligned word load is a fatal CUDA error. Every payload store's view
    is (whole tokens from an allocation's start); a view cut at an odd byte is read byte by byte."""
    return all(n % 4 == 0 for n in (codes.ptr.data_ptr(), codes.s_b, codes.s_h, codes.ptr.shape[-1]))


class UniformArgs(NamedTuple):
    """The kernel's runtime arguments: codes (in place), scales and zero-points (one pair of strides for both), and
    the multiplier (``()`` where none)."""

    data: Strided
    scale: torch.Tensor
    zero: torch.Tensor
    param_s_b: int
    param_s_h: int
    multiplier: tuple


class UniformConstants(NamedTuple):
    BITS: int
    GROUP: int
    PER_CHANNEL: bool
    MULTIPLIER: int  # the multiplier's group along the other axis than the parameters (0: none)
    HIDDEN_ZERO: bool  # each zero-point hidden in its scale (:func:`hide_zero`), the zero tensor unread
    ONE_GROUP: bool  # each token's codes are one group (:attr:`UniformReader.one_group`)
    WORDS: bool  # every token's codes start on a 4-byte boundary: readable as int32 words (:func:`word_aligned`)


@dataclass
class UniformReader(PayloadReader):
    """A :class:`~kvcomp.stages.uniform_quantizer.GroupQuantizer` payload: ``codes`` uint8
    ``[B, H, T, D*bits/8]``; ``scale``/``zero`` ``[B, H, T, D/G]`` (per token) or ``[B, H, T/G, D]``
    (per channel). ``multiplier`` (KVarN's normaliser), applied after ``code * scale + zero``: one factor per
    token ``[B, H, T]`` for per-channel payloads, or per channel ``[B, H, T/multiplier_group, D]`` (one row per
    ``multiplier_group`` tokens) for per-token payloads. ``hidden_zero``: each code's zero-point ``z`` is hidden in its
    scale (vLLM's int4, :func:`hide_zero`; ``zero`` is not read): ``x = (code - z) * scale``, the scale's 4 low bits
    cleared. The kernel reveals them as it reads the scales, so a decode step makes no tensor from the payload."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int
    per_channel: bool
    multiplier: torch.Tensor | None = None
    multiplier_group: int = 0
    hidden_zero: bool = False

    @classmethod
    def of(cls, quantizer: GroupQuantizer, payload, head_dim: int) -> UniformReader:
        """The reader of a :class:`~kvcomp.codecs.base.Payload` that ``quantizer`` encoded."""
        t = payload.tensors
        return cls(payload.num_tokens, head_dim, t["codes"], t["scale"], t["zero"], quantizer.bits, quantizer.group_size,
                   quantizer.axis == "per_channel")

    wide_tile = True

    def register_cap(self, narrow: bool, num_warps: int) -> int:
        """128 registers per thread in ``narrow`` tiles, four programs per multiprocessor of 4 warps or more (eight of
        the 2 warps of :meth:`crowded_warps`): KIVI-2's launch of 4 warps (keys scored in their stored layout, bf16
        operands) then compiles to 118-123 registers without spilling, where the compiler takes 136-138 and three
        programs fit; of 2 warps to 128 with 144 bytes of spills per thread under Triton 3.6, where the compiler takes
        244 and four fit (``tools/kernel_resources.py``). In wide tiles the cap spills (vLLM's int4: 860 bytes)."""
        return four_programs(max(4, num_warps)) if narrow else 0

    def crowded_warps(self, narrow: bool) -> int:
        """2 in ``narrow`` tiles of codes that fill bytes (1, 2, 4, 8 bits) at a head_dim of at most 128: KIVI-2's
        launch at 16 x 32K, eight programs of 2 warps per multiprocessor, is predicted 0.608 ms of device time against
        0.794 for four programs of 4 (static model, ``tools/kernel_model.py``; not measured): a warp of two
        decodes twice the values per tile, and the tile's reductions, layout conversions and operand arrangement, which
        every warp repeats, are shared by two warps instead of four (1,156 instructions per tile and warp against 707,
        2,312 per tile against 2,828). Codes straddling bytes and wider heads keep 4: at 2 warps and 128 registers they
        spill 1.7-4.3 KB per thread under Triton 3.9 (3-bit codes with 8 query heads, 2-bit at head_dim 256; 0.6-0.9 KB
        at 4)."""
        return 2 if narrow and 8 % self.bits == 0 and self.head_dim <= 128 else 0


    def kernel_args(self, query: CallQuery) -> tuple[UniformArgs, UniformConstants]:
        (scale, zero), param_s_b, param_s_h = in_place(self.scale, self.zero)
        multiplier, group = (), 0
        if self.multiplier is not None:  # per token (per-channel payloads) or per channel every few tokens
            multiplier = Strided.of(self.multiplier)
            group = self.head_dim if self.per_channel else self.multiplier_group
        codes = Strided.of(self.codes)
        return (UniformArgs(codes, scale, zero, param_s_b, param_s_h, multiplier),
                UniformConstants(self.bits, self.group_size, self.per_channel, group, self.hidden_zero, self.one_group,
                                 word_aligned(codes)))

    @property
    def one_group(self) -> bool:
        """Each token's codes share one scale and zero (per token, a group of ``head_dim``: vLLM's int4 per
        token-head): on ``tl.dot`` the kernels then take the codes as they are and apply the parameters to each token's
        logit and weight (:func:`~.uniform_triton.packed_scores`, :func:`~.uniform_triton.packed_values`)."""
        return not self.per_channel and self.group_size == self.head_dim

    def tile_limit(self, block_tokens: int, dot: bool) -> int:
        """At most a per-channel group (its parameters, or the multiplier of a per-token payload; a power of two, at
        least 16 for ``tl.dot``), so that each tile reads at most two rows of them (:func:`~.uniform_triton.params`)."""
        groups = [self.group_size] if self.per_channel else []
        if self.multiplier is not None and not self.per_channel:
            groups.append(self.multiplier_group)
        for group in groups:
            if group < block_tokens and not group & (group - 1) and (group >= 16 or not dot):
                block_tokens = group
        return block_tokens

    def packed_scores(self, head_dim: int, dot: bool) -> bool:
        """Codes within bytes, no multiplier, bytes per token a power of two (a Triton range), at least 16 for
        ``tl.dot`` (:func:`~.uniform_triton.packed_scores`)."""
        if 8 % self.bits or self.multiplier is not None:
            return False
        width = head_dim * self.bits // 8
        return not width & (width - 1) and (width >= 16 or not dot)

    def packed_values(self, head_dim: int, dot: bool) -> bool:
        """Per-token codes within bytes without a multiplier, bytes per token a power of two, groups of whole bytes,
        at most 8 groups per token (their scales are selected in registers) (:func:`~.uniform_triton.packed_values`);
        on ``tl.dot`` one group per token and at least 16 bytes. Several groups per token on ``tl.dot`` are decoded
        to head_dim order instead (:func:`~.uniform_triton.halves`): the static model puts KIVI-2's launch at 16 x
        32K at 0.794 ms that way, where the H200 measured 0.829, and at 0.846 with one product per field."""
        if self.per_channel or 8 % self.bits or self.multiplier is not None:
            return False
        per_byte, width = 8 // self.bits, head_dim * self.bits // 8
        if dot and (width < 16 or not self.one_group):
            return False
        return not width & (width - 1) and self.group_size % per_byte == 0 and head_dim // self.group_size <= 8

    def _parameters(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codes (float32 ``[B, H, T, D]``), scale and zero-point (float32), ``x = code * scale + zero`` per group."""
        codes = unpack_bits(self.codes, self.bits, self.head_dim, torch.float32)
        if not self.hidden_zero:
            return codes, self.scale.float(), self.zero.float()
        scale, zero = reveal_zero(self.scale)
        return codes, scale, -zero * scale

    def torch_scores(self, q: torch.Tensor) -> torch.Tensor:
        """Per channel: ``q . (c s + z) = (q s) . c + q . z`` per group of tokens; per token: ``sum_g s_g (q_g . c_g)
        + z_g sum(q_g)`` over the groups of channels. Nothing the size of the payload but its codes is made."""
        if self.multiplier is not None:
            return super().torch_scores(q)
        codes, scale, zero = self._parameters()
        b, h, t, d = codes.shape
        g = self.group_size
        if self.per_channel:  # [B, H, T/G, R, D] queries times [B, H, T/G, D, G] codes
            folded = q[:, :, None] * scale[:, :, :, None]
            logits = folded @ codes.view(b, h, t // g, g, d).transpose(-1, -2)
            logits = logits + (q[:, :, None] * zero[:, :, :, None]).sum(-1, keepdim=True)
            return logits.permute(0, 1, 3, 2, 4).reshape(b, h, q.shape[2], t)
        logits = 0.0
        for i in range(d // g):
            part = slice(i * g, (i + 1) * g)
            partial = q[..., part] @ codes[..., part].transpose(-1, -2)
            logits = logits + partial * scale[:, :, None, :, i] + q[..., part].sum(-1, keepdim=True) * zero[:, :, None, :, i]
        return logits

    def torch_values(self, weights: torch.Tensor) -> torch.Tensor:
        """Per token: ``sum_t w_t (c_t s_t + z_t) = sum_t (w_t s_t) c_t + sum_t w_t z_t`` per group of channels;
        per channel: decoded (no format uses it for values)."""
        if self.multiplier is not None or self.per_channel:
            return super().torch_values(weights)
        codes, scale, zero = self._parameters()
        g = self.group_size
        shares = [(weights * scale[:, :, None, :, i]) @ codes[..., i * g:(i + 1) * g]
                  for i in range(self.head_dim // g)]
        offsets = weights @ zero  # [B, H, R, D / G]
        return (torch.stack(shares, -2) + offsets[..., None]).flatten(-2)

    def dequantize_unrotated(self) -> torch.Tensor:
        quantizer = GroupQuantizer(self.bits, self.group_size, "per_channel" if self.per_channel else "per_token")
        scale, zero = self.scale, self.zero
        if self.hidden_zero:
            scale, zero = reveal_zero(scale)
            zero = -zero * scale
        x = quantizer.decode({"scale": scale, "zero": zero, "codes": self.codes}, self.head_dim, torch.float32)
        if self.multiplier is None:
            return x
        m = self.multiplier.float()
        return x * (m[..., None] if self.per_channel else m.repeat_interleave(self.multiplier_group, dim=2))
