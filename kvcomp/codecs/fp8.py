"""vLLM's float8 KV caches: ``--kv-cache-dtype fp8`` / ``fp8_e4m3`` / ``fp8_e5m2`` and ``fp8_per_token_head``.

Every token is stored as it arrives (no full-precision window), each value one float8 byte
(:mod:`kvcomp.stages.minifloat`; ``e4m3`` is ``float8_e4m3fn``, vLLM's format on NVIDIA GPUs):

- ``scale: tensor`` (``fp8``): ``q = fp8(x / s)``, ``x_hat = q s`` with one float32 ``s`` per layer and stream.
  vLLM takes ``s`` from the checkpoint (``k_scale`` / ``v_scale``) and uses ``1.0`` when the checkpoint has none
  (``BaseKVCacheMethod``; it warns that accuracy may suffer). ``tensor_scale: one`` (the default) is that
  uncalibrated setting; ``tensor_scale: calibrated`` is what vLLM's documentation recommends: per-tensor scales
  calibrated on a dataset with llm-compressor, ``s = amax / 448`` (e4m3; 57344 for e5m2) over the calibration
  tokens, here over kvcomp's calibration set (the codec is then :class:`Calibrated`; post-RoPE keys, as the cache
  holds them). Not implemented: ``--calculate-kv-scales``, which sets ``s`` once from the first batch's
  ``amax / 200`` (keys) and ``amax / 100`` (values).
- ``scale: token_head`` (``fp8_per_token_head``): one float32 scale per token and KV head,
  ``s = max(amax / 448, 1e-6)`` over the head's values, computed as the token is written; ``q = fp8(x (1/s))``.
  vLLM ships it in e4m3 only; ``format: e5m2`` with it is kvcomp's extension (``s = amax / 57344``).

Stored bits per value: 8 (``tensor``; the per-layer scales are model-level overhead) or ``8 + 32 / head_dim``
(``token_head``). ``skip_layers`` (vLLM's ``--kv-cache-dtype-skip-layers`` by index) keeps those codec layers in
the model dtype (:mod:`kvcomp.stages.skip_layers`), counted at 16 bits. Differences from vLLM: rounding to
float8 is torch's (round to nearest even) on float32 ``x / s``, where vLLM divides in the kernel's precision;
with ``kernel_backend=triton`` decode steps read the float8 payload in the fused decode-attention kernel
(:class:`~kvcomp.kernels.formats.ScaledReader`), not a vLLM kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcomp.codecs.base import (
    Activations, Calibrated, Codec, CodecConfig, CodecState, FusedPayload, Payload, StreamPolicy, StreamRequest,
)
from kvcomp.codecs.registry import register
from kvcomp.errors import ConfigError, unknown_choice
from kvcomp.kernels import loads_float8
from kvcomp.kernels.formats import ScaledReader
from kvcomp.stages.minifloat import FLOAT8, StreamScales, float8_max, from_float8, to_float8, token_head_scale
from kvcomp.stages.ranges import saturated
from kvcomp.stages.skip_layers import SKIPPED_BITS, skipped_layers

SCALES = ("tensor", "token_head")
TENSOR_SCALES = ("one", "calibrated")


class EngineFormatCodec(Codec):
    """What vLLM's KV formats share: every token encoded on arrival (block of 1, no sinks or window), except the
    codec layers in ``config.skip_layers``, kept in the model dtype; subclasses give :meth:`encoded_bits`."""

    def validate(self) -> None:
        skipped_layers(list(self.config.skip_layers), 0, self.model.num_layers, self.name)

    def build(self) -> None:
        self.skipped = skipped_layers(list(self.config.skip_layers), 0, self.model.num_layers, self.name)

    def policy(self, kind: str, layer_idx: int) -> StreamPolicy:
        return StreamPolicy(block_size=None) if layer_idx in self.skipped else StreamPolicy(0, 1, 0)

    def code_bits_per_value(self, kind: str, layer_idx: int) -> float:
        return SKIPPED_BITS if layer_idx in self.skipped else self.encoded_bits()

    def encoded_bits(self) -> float:
        """Stored bits per value of an encoded layer."""
        raise NotImplementedError


@dataclass
class FP8Config(CodecConfig):
    name: str = "fp8"
    format: str = "e4m3"  # e4m3 (float8_e4m3fn, vLLM's fp8 / fp8_e4m3) | e5m2 (fp8_e5m2)
    scale: str = "tensor"  # tensor (one per layer and stream: vLLM's fp8) | token_head (vLLM's fp8_per_token_head)
    tensor_scale: str = "one"  # scale=tensor: one (vLLM without checkpoint scales) | calibrated (amax / format max)
    skip_layers: list[int] = field(default_factory=list)  # codec layers kept in the model dtype


@register
class FP8Codec(EngineFormatCodec, Calibrated, FusedPayload):
    """Float8 keys and values with a per-tensor or a per-token-head scale (calibrated only with
    ``tensor_scale=calibrated``); the fused decode kernel loads the float8 values natively."""

    config_class = FP8Config
    inference_only_fields = ("skip_layers",)

    def calibrates(self) -> bool:
        """``scale=tensor`` with ``tensor_scale=calibrated``: the per-tensor scales."""
        return self.config.scale == "tensor" and self.config.tensor_scale == "calibrated"

    def validate(self) -> None:
        cfg = self.config
        if cfg.format not in FLOAT8:
            raise unknown_choice(f"{self.name} format", cfg.format, FLOAT8)
        if cfg.scale not in SCALES:
            raise unknown_choice(f"{self.name} scale", cfg.scale, SCALES)
        if cfg.tensor_scale not in TENSOR_SCALES:
            raise unknown_choice(f"{self.name} tensor_scale", cfg.tensor_scale, TENSOR_SCALES)
        if cfg.scale == "token_head" and cfg.tensor_scale != "one":
            raise ConfigError(f"{self.name}: tensor_scale={cfg.tensor_scale} applies to scale=tensor only "
                              "(scale=token_head computes its scales from each token)")
        super().validate()

    def build(self) -> None:
        super().build()
        self.dtype = FLOAT8[self.config.format]
        self.stream_scales = StreamScales()
        self.unit_scale: dict = {}  # device -> the scale 1.0 of an unfitted tensor scale, for the fused kernel

    def fit(self, activations: Activations) -> CodecState:
        """The per-tensor scales: ``amax / format max`` of every layer's keys and values."""
        return CodecState(StreamScales.fit(activations.layer, self.model.num_layers, activations.rope,
                                           float8_max(self.dtype)).tensors())

    def load_state(self, state: CodecState) -> None:
        self.stream_scales = StreamScales.from_tensors(state.tensors)

    def encode(self, request: StreamRequest) -> Payload:
        x = request.tokens.float()
        if self.config.scale == "tensor":
            codes = to_float8(x / self.stream_scales.get(request.layer, request.kind, x.device), self.dtype)
            return Payload({"codes": codes}, x.shape[2])
        scale = token_head_scale(x, float8_max(self.dtype))
        return Payload({"codes": to_float8(x * (1.0 / scale), self.dtype), "scale": scale}, x.shape[2])

    def decode(self, payload: Payload, request: StreamRequest) -> torch.Tensor:
        values = from_float8(payload.tensors["codes"], self.dtype)
        scale = payload.tensors.get("scale")
        if scale is None:
            scale = self.stream_scales.get(request.layer, request.kind, values.device)
        return saturated(values * scale, request.dtype)

    def fused_attention_supported(self, layer_idx: int) -> bool:
        """Where Triton loads float8 (:func:`~kvcomp.kernels.loads_float8`); else the torch path."""
        return loads_float8()

    def payload_reader(self, payload: Payload, kind: str, layer_idx: int) -> ScaledReader:
        codes = payload.tensors["codes"]
        scale = payload.tensors.get("scale")
        if scale is None:
            scale = self.stream_scales.get(layer_idx, kind, codes.device)
            if not isinstance(scale, torch.Tensor):  # unfitted: 1.0, made on the device once (no host-to-device copy)
                if codes.device not in self.unit_scale:
                    self.unit_scale[codes.device] = torch.ones((), device=codes.device)
                scale = self.unit_scale[codes.device]
        return ScaledReader(payload.num_tokens, self.model.head_dim, codes, self.dtype, scale)

    def encoded_bits(self) -> float:
        return 8.0 if self.config.scale == "tensor" else 8.0 + 32.0 / self.model.head_dim

    def overhead_bits(self) -> int:
        """The fitted per-tensor scales (float32, one per layer and stream)."""
        return self.stream_scales.bits
