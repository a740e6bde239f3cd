"""The number formats of the KV caches serving engines ship (vLLM's ``--kv-cache-dtype``), shared by the codecs
``fp8``, ``int_token_head`` and ``nvfp4``.

- float8 (OCP): ``e4m3`` is ``torch.float8_e4m3fn`` (max 448, no infinities; what vLLM's ``fp8`` / ``fp8_e4m3``
  stores on NVIDIA GPUs), ``e5m2`` is ``torch.float8_e5m2`` (max 57344). :func:`to_float8` saturates at the
  format's max, as vLLM's cache writes do (its CUDA path converts with ``__NV_SATFINITE``, its Triton path clamps);
  the codes are kept as their uint8 bit patterns.
- e2m1 (NVFP4's element format): magnitudes :data:`E2M1` and a sign bit, a 4-bit code ``sign << 3 | index``;
  :func:`e2m1_codes` rounds to the nearest magnitude, ties to the even index (the thresholds of vLLM's
  ``_round_to_e2m1_bits``: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4).
- Integer rounding of vLLM's per-token-head kernels: :func:`round_half_away` (``x + 0.5`` truncated for
  ``x >= 0``, ``x - 0.5`` truncated below).
- :func:`token_head_scale`: one float32 scale per token and KV head, ``max(absmax / qmax, 1e-6)`` over the
  head's ``head_dim`` values (vLLM's ``_reshape_cache_per_token_head``).
- :class:`StreamScales`: one float32 scale per layer and stream (fp8's per-tensor scale, NVFP4's global scale),
  fitted as ``amax / divisor`` over the calibration tokens (post-RoPE keys, as the cache holds them).
"""

from __future__ import annotations

import functools

import torch

from kvcomp.stages.rope import apply_rope

FLOAT8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # magnitudes of the 8 e2m1 codes 0..7
E2M1_MAX = 6.0
SCALE_FLOOR = 1e-6  # vLLM's lower bound of a per-token-head scale (an all-zero head)


def float8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def to_float8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32) in float8 ``dtype``, saturated at its max, as uint8 bit patterns (same shape)."""
    peak = float8_max(dtype)
    return x.clamp(-peak, peak).to(dtype).view(torch.uint8)


def from_float8(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float32 values of uint8 bit patterns of float8 ``dtype``."""
    return codes.view(dtype).float()


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest integer, halves away from zero (vLLM's integer KV kernels)."""
    return torch.where(x >= 0, torch.floor(x + 0.5), torch.ceil(x - 0.5))


def token_head_scale(x: torch.Tensor, qmax: float) -> torch.Tensor:
    """Float32 ``max(absmax / qmax, 1e-6)`` over the last dim of ``x [B, H, T, D]``: ``[B, H, T, 1]``."""
    return (x.float().abs().amax(-1, keepdim=True) / qmax).clamp_min(SCALE_FLOOR)


@functools.cache
def _e2m1_grid(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:data:`E2M1` and its midpoints on ``device``, copied once: a host-to-device copy in every decode step's
    encode would make the host wait for the GPU (8 waits per step on 4 layers, measured on an H100)."""
    grid = E2M1.to(device)
    return grid, (grid[1:] + grid[:-1]) / 2


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (uint8, ``sign << 3 | index``) of ``x`` (already scaled; beyond +-6 saturates)."""
    magnitude = x.abs().clamp(max=E2M1_MAX)
    midpoints = _e2m1_grid(x.device)[1]
    index = torch.searchsorted(midpoints, magnitude.contiguous())  # midpoints below; a tie counts below
    tie = (index < len(midpoints)) & (midpoints[index.clamp(max=len(midpoints) - 1)] == magnitude)
    index = index + (tie & (index % 2 == 1)).long()  # a tie goes to the even index
    return (index + 8 * (x < 0).long()).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """Float32 values of e2m1 codes."""
    magnitude = _e2m1_grid(codes.device)[0][(codes & 7).long()]
    return torch.where(codes >= 8, -magnitude, magnitude)


class StreamScales:
    """One float32 scale per layer and stream (``[num_layers, 2]``: keys, values), or none (every scale 1.0,
    vLLM's default without checkpoint scales). :meth:`fit` makes them ``amax / divisor`` over the calibration
    tokens, so that the largest calibration value maps to ``divisor``."""

    KINDS = ("key", "value")

    def __init__(self, scales: torch.Tensor | None = None):
        self.scales = scales
        self.on_device: dict = {}

    @classmethod
    def fit(cls, layer_fields, num_layers: int, rope, divisor: float) -> "StreamScales":
        """Fit on ``layer_fields(layer)`` (``{"key", "value"}: [samples, H, T, D]``, keys pre-RoPE) for each
        of ``num_layers`` layers; ``rope``: the windows' ``(cos, sin)`` ``[T, D]`` (None: keys used as given)."""
        scales = torch.ones(num_layers, 2)
        for layer in range(num_layers):
            fields = layer_fields(layer)
            for i, kind in enumerate(cls.KINDS):
                x = fields[kind].float()
                if kind == "key" and rope is not None:
                    x = apply_rope(x, *(t.to(x.device)[None] for t in rope))
                scales[layer, i] = (x.abs().amax() / divisor).clamp_min(torch.finfo(torch.float32).tiny)
        return cls(scales)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {} if self.scales is None else {"stream_scales": self.scales}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "StreamScales":
        return cls(tensors.get("stream_scales"))

    @property
    def bits(self) -> int:
        return 0 if self.scales is None else 32 * self.scales.numel()

    def get(self, layer: int, kind: str, device: torch.device) -> torch.Tensor | float:
        """The scale of ``layer``'s ``kind`` stream (a float32 scalar tensor on ``device``; 1.0 when unfitted)."""
        if self.scales is None:
            return 1.0
        if device not in self.on_device:
            self.on_device[device] = self.scales.to(device)
        return self.on_device[device][layer, self.KINDS.index(kind)]
