"""vLLM's integer KV caches with per-token-head scales: ``--kv-cache-dtype int8_per_token_head`` and
``int4_per_token_head``.

Every token is stored as it arrives, each KV head of it (``head_dim`` values) with one float32 scale computed
from that head's values (:mod:`kvcomp.stages.minifloat`); keys and values alike:

- ``bits: 8``: symmetric. ``s = max(amax / 127, 1e-6)``, ``q = clamp(round(x (1/s)), -128, 127)`` (int8),
  ``x_hat = q s``; rounding halves away from zero (vLLM's ``_reshape_cache_per_token_head``).
- ``bits: 4``: a randomized Hadamard rotation, then asymmetric with a zero-point (vLLM's
  ``vllm/v1/attention/ops/int4_per_token_head.py``). ``y = H (d_1 * x)``: ``d_1`` a fixed +-1 vector
  (``torch.bernoulli(0.5)`` from a generator seeded ``0x9E3779B9``, vLLM's signs, reproduced) and ``H`` the
  unnormalised Walsh-Hadamard matrix (``H H = head_dim I``), applied to keys and values (and, in vLLM, to the
  queries, whose attention output it un-rotates). On ``y``: ``s = max((max - min) / 15, 1e-6)``,
  ``z = clamp(round(-min / s), 0, 15)``, ``q = clamp(round(y (1/s) + z), 0, 15)``, two codes per byte (low
  nibble first). ``z`` is hidden in the low 4 mantissa bits of the stored float32 scale, so the scale read back
  is ``s`` with those bits cleared: ``y_hat = (q - z) s'`` and ``x_hat = d_1 * H y_hat / head_dim``.

Stored bits per value: ``8 + 32 / head_dim`` or ``4 + 32 / head_dim`` (vLLM's page: ``head_dim`` or
``head_dim / 2`` bytes plus a float32 scale per token and head). ``skip_layers`` keeps codec layers in the
model dtype (vLLM's ``--kv-cache-dtype-skip-layers``). Differences from vLLM: the rotation is computed in
float32 and quantized as such (vLLM rounds it to the model dtype first); the torch path decodes ``x_hat``; with
``kernel_backend=triton`` int4 decode steps rotate the query and un-rotate the attention output as vLLM does
(:class:`~kvcomp.kernels.formats.RotatedReader`; the same attention, up to float rounding), and int8 codes are
loaded as signed bytes times their scale (:class:`~kvcomp.kernels.formats.ScaledReader`).
Older vLLM releases truncated int8 codes (an implicit float-to-int8 store) and stored int4 symmetrically
(``[-8, 7]``, no rotation); this codec follows the current kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcomp.codecs.base import CodecConfig, FusedPayload, Payload, StreamRequest
from kvcomp.codecs.fp8 import EngineFormatCodec
from kvcomp.codecs.registry import register
from kvcomp.errors import ConfigError, NonFiniteKVError
from kvcomp.kernels.formats import RotatedReader, ScaledReader, UniformReader
from kvcomp.kernels.formats.uniform import hide_zero, reveal_zero
from kvcomp.stages.hadamard import fwht, is_power_of_two
from kvcomp.stages.minifloat import SCALE_FLOOR, round_half_away, token_head_scale
from kvcomp.stages.packing import pack_bits, unpack_bits
from kvcomp.stages.ranges import range_fits, saturated

BITS = (8, 4)
RHT_SEED = 0x9E3779B9  # vLLM's seed of the int4 rotation's signs
LEVELS4 = 15


def rht_signs(head_dim: int) -> torch.Tensor:
    """vLLM's +-1 signs ``d_1`` of the int4 rotation (float32 ``[head_dim]``)."""
    generator = torch.Generator().manual_seed(RHT_SEED)
    return 2.0 * torch.bernoulli(torch.full((head_dim,), 0.5), generator=generator) - 1.0


@dataclass
class IntTokenHeadConfig(CodecConfig):
    name: str = "int_token_head"
    bits: int = 8  # 8 (vLLM's int8_per_token_head) | 4 (int4_per_token_head: rotation and zero-points)
    skip_layers: list[int] = field(default_factory=list)  # codec layers kept in the model dtype


@register
class IntTokenHeadCodec(EngineFormatCodec, FusedPayload):
    """int8 (symmetric) or int4 (rotated, asymmetric) keys and values, one float32 scale per token and KV head;
    the fused decode kernel loads int8 codes natively and reads int4 payloads in the rotated basis (the query
    rotated, the output un-rotated)."""

    config_class = IntTokenHeadConfig

    def validate(self) -> None:
        if self.config.bits not in BITS:
            raise ConfigError(f"{self.name}: bits={self.config.bits!r} is not supported; valid: 8, 4")
        if self.config.bits == 4 and not is_power_of_two(self.model.head_dim):
            raise ConfigError(f"{self.name}: bits=4 rotates each head by a Walsh-Hadamard transform, which needs a "
                              f"power-of-two head_dim; this model has head_dim={self.model.head_dim} (use bits=8)")
        super().validate()

    def build(self) -> None:
        super().build()
        self.signs = rht_signs(self.model.head_dim) if self.config.bits == 4 else None
        self.on_device: dict = {}  # device -> (signs, rotation): moved once, not at every encode (a host sync)

    def _rotation(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(d_1, R)`` on ``device``: ``R = H diag(d_1) / head_dim``, so that ``x_hat = y_hat @ R``."""
        if device not in self.on_device:
            d = self.model.head_dim
            rotation = fwht(torch.eye(d)) * self.signs[None, :] / d
            self.on_device[device] = (self.signs.to(device), rotation.to(device))
        return self.on_device[device]

    def payload_reader(self, payload: Payload, kind: str, layer_idx: int) -> ScaledReader | RotatedReader:
        """int8: the signed codes loaded as they are, times the scale. int4: ``y_hat = q s' - z s'`` per token and
        head (packed ints whose zero-point ``z`` hides in the scale ``s'``) in the rotated basis."""
        d = self.model.head_dim
        if self.config.bits == 8:
            return ScaledReader(payload.num_tokens, d, payload.tensors["codes"], torch.int8, payload.tensors["scale"])
        stored = payload.tensors["scale"]  # the zero-points hidden in it, revealed by the kernel (no tensor per step)
        inner = UniformReader(payload.num_tokens, d, payload.tensors["codes"], stored, stored, 4, d, False,
                              hidden_zero=True)
        return RotatedReader(payload.num_tokens, d, inner, self._rotation(stored.device)[1])

    def encode(self, request: StreamRequest) -> Payload:
        x = request.tokens.float()
        if self.config.bits == 8:
            scale = token_head_scale(x, 127.0)
            codes = round_half_away(x * (1.0 / scale)).clamp_(-128, 127).to(torch.int8)
            return Payload({"codes": codes, "scale": scale}, x.shape[2])
        y = fwht(x * self._rotation(x.device)[0])
        lo, hi = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
        scale = ((hi - lo) / LEVELS4).clamp_min(SCALE_FLOOR)
        if not range_fits(torch.isfinite(scale).all(), request.range_checks):
            raise NonFiniteKVError(
                f"{self.name}: a rotated key or value head's range (max - min) overflows float32 (the unnormalised "
                f"Hadamard rotation multiplies magnitudes by up to head_dim={self.model.head_dim}; largest input "
                f"magnitude {x.abs().max().item():.3g}); inputs this large cannot be stored")
        zero = round_half_away(-lo / scale).clamp_(0, LEVELS4)
        codes = round_half_away(y * (1.0 / scale) + zero).clamp_(0, LEVELS4)
        return Payload({"codes": pack_bits(codes.to(torch.uint8), 4), "scale": hide_zero(scale, zero)}, x.shape[2])

    def decode(self, payload: Payload, request: StreamRequest) -> torch.Tensor:
        codes, stored = payload.tensors["codes"], payload.tensors["scale"]
        if self.config.bits == 8:
            return saturated(codes.float() * stored, request.dtype)
        scale, zero = reveal_zero(stored)
        y = (unpack_bits(codes, 4, self.model.head_dim).float() - zero) * scale
        d = self.model.head_dim
        return saturated(fwht(y / d) * self._rotation(y.device)[0], request.dtype)  # / d first: no overflow

    def encoded_bits(self) -> float:
        return self.config.bits + 32.0 / self.model.head_dim
