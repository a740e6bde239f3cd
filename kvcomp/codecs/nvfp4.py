"""vLLM's NVFP4 KV cache (``--kv-cache-dtype nvfp4``, and ``nvfp4_4over6`` as an option).

Every token is stored as it arrives; each KV head's ``head_dim`` values are cut into blocks of 16, following
vLLM's Triton writer (``_reshape_cache_nvfp4_kernel`` in ``vllm/v1/attention/ops/
triton_reshape_and_cache_flash.py``), with ``g`` the float32 global scale of the layer and stream:

- block scale ``b = e4m3(amax_block (1/g) / 6)`` (float8_e4m3fn, saturating at 448);
- elements ``q = e2m1(clamp(x (1/g) / b, -6, 6))``: the nearest of the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 with a
  sign bit, ties to the even code (:func:`~kvcomp.stages.minifloat.e2m1_codes`), two codes per byte, low nibble
  first (:mod:`kvcomp.stages.packing`); a block whose ``b`` is 0 stores zeros;
- ``x_hat = e2m1 value * b * g``.

With ``kernel_backend=triton`` decode steps read the codes and block scales in the fused decode-attention kernel
(:class:`~kvcomp.kernels.formats.BlockFloatReader`: ``e2m1 value * g`` looked up per code, times ``b``).

The global scale ``g`` (vLLM's ``k_scale`` / ``v_scale``, a dequantization multiplier) comes from the checkpoint,
else 1.0. ``global_scale: one`` (the default) is the uncalibrated 1.0; ``global_scale: calibrated`` is the
convention of the NVFP4 KV calibrations of llm-compressor and ModelOpt checkpoints, ``g = amax / (6 x 448)`` over
the calibration tokens (here kvcomp's calibration set; post-RoPE keys), so that the largest block scale is
e4m3's 448.

``four_over_six`` (vLLM's ``nvfp4_4over6``, "selects between max/6 and max/4 scales per 16 values by minimizing
squared reconstruction error", ``vllm/config/cache.py``): each block also tries ``b = e4m3(amax (1/g) / 4)`` and
keeps the one with the smaller squared error; same layout and bits. Implemented from that description only:
vLLM's kernel for it was not read (its tie-breaking and whether it changes the global scale are unverified).

Stored bits per value: ``4 + 8 / 16 = 4.5`` (vLLM's page: ``head_dim / 2 + head_dim / 16`` bytes per token and
head); the global scales are model-level overhead. ``skip_layers`` keeps codec layers in the model dtype.
Differences from vLLM: the block scale is rounded to e4m3 by torch (ties to even; vLLM's bit-level conversion
rounds ties up); vLLM's writer also needs ``head_dim / 16`` divisible by 4 for its swizzled scale layout, a
layout detail this codec does not need (any ``head_dim`` divisible by 16).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcomp.codecs.base import Activations, Calibrated, CodecConfig, CodecState, FusedPayload, Payload, StreamRequest
from kvcomp.codecs.fp8 import EngineFormatCodec
from kvcomp.codecs.registry import register
from kvcomp.errors import ConfigError, unknown_choice
from kvcomp.kernels import loads_float8
from kvcomp.kernels.formats import BlockFloatReader
from kvcomp.stages.minifloat import (E2M1_MAX, StreamScales, e2m1_codes, e2m1_values, float8_max, from_float8,
                                     to_float8)
from kvcomp.stages.packing import pack_bits, unpack_bits
from kvcomp.stages.ranges import saturated

BLOCK = 16  # values per e4m3 block scale
SCALE_DTYPE = torch.float8_e4m3fn
GLOBAL_SCALES = ("one", "calibrated")


@dataclass
class NVFP4Config(CodecConfig):
    name: str = "nvfp4"
    global_scale: str = "one"  # one (vLLM without checkpoint scales) | calibrated (amax / (6 x 448))
    four_over_six: bool = False  # true: vLLM's nvfp4_4over6 (each block's scale: amax/6 or amax/4, less error)
    skip_layers: list[int] = field(default_factory=list)  # codec layers kept in the model dtype


@register
class NVFP4Codec(EngineFormatCodec, Calibrated, FusedPayload):
    """e2m1 keys and values in blocks of 16 with an e4m3 scale each and a float32 scale per layer and stream
    (calibrated only with ``global_scale=calibrated``); the fused decode kernel reads the codes and block scales."""

    config_class = NVFP4Config
    inference_only_fields = ("four_over_six", "skip_layers")

    def calibrates(self) -> bool:
        """``global_scale=calibrated``: the per-layer and stream scales."""
        return self.config.global_scale == "calibrated"

    def validate(self) -> None:
        if self.config.global_scale not in GLOBAL_SCALES:
            raise unknown_choice(f"{self.name} global_scale", self.config.global_scale, GLOBAL_SCALES)
        if self.model.head_dim % BLOCK:
            raise ConfigError(f"{self.name}: head_dim={self.model.head_dim} is not a multiple of the NVFP4 block of "
                              f"{BLOCK} values")
        super().validate()

    def build(self) -> None:
        super().build()
        self.stream_scales = StreamScales()
        self.levels: dict = {}  # (device, layer, kind) -> the e2m1 values times the global scale, for the fused kernel

    def fit(self, activations: Activations) -> CodecState:
        """The global scales: ``amax / (6 x 448)`` of every layer's keys and values."""
        return CodecState(StreamScales.fit(activations.layer, self.model.num_layers, activations.rope,
                                           E2M1_MAX * float8_max(SCALE_DTYPE)).tensors())

    def load_state(self, state: CodecState) -> None:
        self.stream_scales = StreamScales.from_tensors(state.tensors)
        self.levels = {}

    def _global(self, request: StreamRequest, device: torch.device) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """``(g, 1/g)`` of the request's layer and stream (``1/g`` is 1 where ``g`` is 0, as vLLM's writer)."""
        g = self.stream_scales.get(request.layer, request.kind, device)
        if isinstance(g, float):
            return g, 1.0 / g
        return g, torch.where(g == 0, 1.0, 1.0 / g)

    def encode(self, request: StreamRequest) -> Payload:
        x = request.tokens.float()
        b, h, t, d = x.shape
        _, inv_g = self._global(request, x.device)
        blocks = x.view(b, h, t, d // BLOCK, BLOCK)
        peak = inv_g * blocks.abs().amax(-1, keepdim=True)
        scales, codes = self._quantize(blocks, peak, E2M1_MAX, inv_g)
        if self.config.four_over_six:
            scales4, codes4 = self._quantize(blocks, peak, 4.0, inv_g)
            scaled = blocks * inv_g
            better = _squared_error(scaled, scales4, codes4) < _squared_error(scaled, scales, codes)
            scales, codes = torch.where(better, scales4, scales), torch.where(better, codes4, codes)
        return Payload({"codes": pack_bits(codes.view(b, h, t, d), 4), "scales": scales.squeeze(-1)}, t)

    @staticmethod
    def _quantize(blocks: torch.Tensor, peak: torch.Tensor, top: float,
                  inv_g: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
        """e4m3 block scales (uint8 ``[..., 1]``) of ``peak / top`` (``peak``: the blocks' amax over ``g``) and
        the e2m1 codes of ``blocks`` (``x``, in its own units) under them."""
        scales = to_float8(peak / top, SCALE_DTYPE)
        scale = from_float8(scales, SCALE_DTYPE)
        output_scale = torch.where(scale == 0, 0.0, inv_g / scale)
        return scales, e2m1_codes((blocks * output_scale).clamp(-E2M1_MAX, E2M1_MAX))

    def decode(self, payload: Payload, request: StreamRequest) -> torch.Tensor:
        codes, scales = payload.tensors["codes"], payload.tensors["scales"]
        b, h, t, _ = codes.shape
        d = self.model.head_dim
        g, _ = self._global(request, codes.device)
        values = e2m1_values(unpack_bits(codes, 4, d)).view(b, h, t, d // BLOCK, BLOCK)
        x = values * (from_float8(scales, SCALE_DTYPE).unsqueeze(-1) * g)
        return saturated(x.view(b, h, t, d), request.dtype)

    def fused_attention_supported(self, layer_idx: int) -> bool:
        """Where Triton loads the float8 block scales (:func:`~kvcomp.kernels.loads_float8`); else the torch path."""
        return loads_float8()

    def payload_reader(self, payload: Payload, kind: str, layer_idx: int) -> BlockFloatReader:
        """The codes name ``e2m1 value * g`` (made once per device, layer and stream), times each block's scale."""
        codes = payload.tensors["codes"]
        key = (codes.device, layer_idx, kind)
        if key not in self.levels:
            g = self.stream_scales.get(layer_idx, kind, codes.device)
            self.levels[key] = (e2m1_values(torch.arange(16, dtype=torch.uint8, device=codes.device)) * g).contiguous()
        return BlockFloatReader(payload.num_tokens, self.model.head_dim, codes, payload.tensors["scales"].view(SCALE_DTYPE),
                                self.levels[key], 4, BLOCK)

    def encoded_bits(self) -> float:
        return 4.0 + 8.0 / BLOCK

    def overhead_bits(self) -> int:
        """The fitted global scales (float32, one per layer and stream)."""
        return self.stream_scales.bits


def _squared_error(scaled: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Per block, the squared error of the codes against ``scaled = x / g`` (the units of the block scales)."""
    decoded = e2m1_values(codes) * from_float8(scales, SCALE_DTYPE)
    return (scaled - decoded).pow(2).sum(-1, keepdim=True)
