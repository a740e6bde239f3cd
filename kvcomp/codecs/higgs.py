"""HIGGS as a KV codec (AQUA-KV's baseline quantizer, spec §3.4; "HIGGS-b-gs1024" in its tables).

Every token's keys (or values) over all KV heads of a layer, ``D = kv_heads x head_dim`` values, are
coded by :class:`~kvcomp.stages.higgs.HiggsQuantizer`: Hadamard groups of ``g`` values, one 16-bit L2
scale per group, pairs (``grid_dim = 2``) of rotated coordinates on a ``2^(bits x grid_dim)``-point
Gaussian grid. ``g`` is ``group_size`` (1024, the paper's) when it divides ``D``; otherwise the largest
power of two that divides ``D`` and is at most ``group_size`` (``D = 192`` for SmolLM2 gives ``g = 64``:
the scales then cost 0.25 bit per value, which every row reports), or, with ``pad_groups``, ``D`` is
zero-padded to whole groups of ``min(group_size, next power of two >= D)`` as the reference code does,
and the padded codes are stored and counted. Same cache schedule as AQUA-KV (spec §3.6): 4 full-precision
sinks, pre-RoPE keys, recent tokens kept in a 128-token full-precision buffer and encoded 128 at a time.

``center`` (a deviation from the paper, default ``none``): code ``x - c`` with ``c`` one vector per layer and
stream, the calibration mean or the model's k_proj/v_proj bias (:mod:`kvcomp.stages.centering`); HIGGS then
needs a (cheap) calibration.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcomp.codecs.base import (KINDS, Activations, Calibrated, Codec, CodecConfig, CodecState, ModelInfo, Payload,
                                StreamPolicy, StreamRequest)
from kvcomp.codecs.registry import register
from kvcomp.errors import ConfigError, unknown_choice
from kvcomp.stages.centering import CENTERS, Offsets, fit_offsets
from kvcomp.stages.grids import gaussian_grid
from kvcomp.stages.hadamard import is_power_of_two
from kvcomp.stages.higgs import HiggsQuantizer
from kvcomp.stages.ranges import saturated

SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def higgs_group(dim: int, group_size: int, pad_groups: bool) -> int:
    """The Hadamard group for ``dim``-vectors (see the module docstring)."""
    if pad_groups:
        return min(group_size, 1 << (dim - 1).bit_length())
    return max(g for g in (1 << i for i in range(group_size.bit_length())) if g <= group_size and dim % g == 0)


def build_higgs(owner: str, model: ModelInfo, bits: int, grid_dim: int, group_size: int, pad_groups: bool,
                scale_dtype: str, grid_seed: int) -> HiggsQuantizer:
    """The HIGGS quantizer of ``bits`` per value for one layer's tokens of ``model``."""
    if scale_dtype not in SCALE_DTYPES:
        raise unknown_choice(f"{owner} scale_dtype", scale_dtype, SCALE_DTYPES)
    if grid_dim < 1 or not 1 <= bits * grid_dim <= 8:
        raise ConfigError(f"{owner}: bits={bits} x grid_dim={grid_dim} must give 1..8 bits per grid index "
                          "(valid: bits 2, 3, 4 with grid_dim 2)")
    if not is_power_of_two(group_size) or group_size < grid_dim:
        raise ConfigError(f"{owner}: group_size={group_size} must be a power of two >= grid_dim={grid_dim}")
    dim = model.num_kv_heads * model.head_dim
    group = higgs_group(dim, group_size, pad_groups)
    if group % grid_dim:
        raise ConfigError(f"{owner}: the Hadamard group {group} of D={dim} is not a multiple of grid_dim={grid_dim}; "
                          "use pad_groups=true or another grid_dim")
    grid = gaussian_grid(2 ** (bits * grid_dim), grid_dim, grid_seed)
    return HiggsQuantizer(grid, group, SCALE_DTYPES[scale_dtype])


class TokenHiggs:
    """A :class:`HiggsQuantizer` over ``[B, H, T, head_dim]`` blocks: each token's ``H x head_dim`` values
    (head-major, as the reference concatenates them) form one vector; payload tensors ``[B, 1, T, ...]``."""

    def __init__(self, quantizer: HiggsQuantizer, model: ModelInfo):
        self.quantizer, self.heads, self.head_dim = quantizer, model.num_kv_heads, model.head_dim

    def encode(self, x: torch.Tensor, range_checks: list | None = None) -> dict[str, torch.Tensor]:
        b, h, t, d = x.shape
        tensors = self.quantizer.encode(x.transpose(1, 2).reshape(b, t, h * d), range_checks)
        return {k: v.unsqueeze(1) for k, v in tensors.items()}

    def decode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Float32 ``[B, H, T, head_dim]``."""
        x = self.quantizer.decode({k: v.squeeze(1) for k, v in tensors.items()}, self.heads * self.head_dim)
        return x.view(*x.shape[:2], self.heads, self.head_dim).transpose(1, 2)

    def bits_per_value(self) -> float:
        return self.quantizer.bits_per_value(self.heads * self.head_dim)


@dataclass
class HiggsConfig(CodecConfig):
    name: str = "higgs"
    bits: int = 2  # grid of 2^(bits x grid_dim) points: 16 / 64 / 256 for 2 / 3 / 4 bits
    grid_dim: int = 2
    # Hadamard group (the paper's gs1024); D = 192 (SmolLM2) uses 64, the largest power of two dividing D
    group_size: int = 1024
    pad_groups: bool = False  # true: zero-pad D to whole groups as the reference does (padded codes counted)
    scale_dtype: str = "float16"
    grid_seed: int = 0
    sinks: int = 4
    buffer: int = 128  # full-precision recent tokens, encoded `buffer` at a time
    pre_rope: bool = True  # false: the quantizer (and AQUA-KV's predictors) see post-RoPE keys (Table F / G)
    center: str = "none"  # none (paper) | calibration | bias: subtract a per-channel offset before coding (not the paper's)


def check_center(owner: str, config: HiggsConfig) -> None:
    """Refuse an unknown ``center``, or one on post-RoPE keys (a pre-RoPE offset rotates with the position)."""
    if config.center not in CENTERS:
        raise unknown_choice(f"{owner} center", config.center, CENTERS)
    if config.center != "none" and not config.pre_rope:
        raise ConfigError(f"{owner}: center={config.center} needs pre_rope=true (after RoPE a constant offset of the "
                          "keys rotates with the position)")


@register
class HiggsCodec(Codec, Calibrated):
    """Per-token HIGGS of keys and values (stream scope; calibrated only with ``center``: the grids depend on
    nothing)."""

    config_class = HiggsConfig
    inference_only_fields = ("sinks", "buffer")
    quiet_defaults = {**Codec.quiet_defaults, "center": "none"}

    def calibrates(self) -> bool:
        """With ``center``: the offsets."""
        return self.config.center != "none"

    def validate(self) -> None:
        cfg = self.config
        if cfg.sinks < 0 or cfg.buffer < 1:
            raise ConfigError(f"{self.name}: sinks must be >= 0 and buffer >= 1, got {cfg.sinks} and {cfg.buffer}")
        check_center(self.name, cfg)

    def build(self) -> None:
        cfg = self.config
        self.tokens = TokenHiggs(build_higgs(self.name, self.model, cfg.bits, cfg.grid_dim, cfg.group_size,
                                             cfg.pad_groups, cfg.scale_dtype, cfg.grid_seed), self.model)
        self.offsets = Offsets()

    def fit(self, activations: Activations) -> CodecState:
        """The centring vector of every layer and stream (``center``: calibration mean or model bias)."""
        offsets = fit_offsets(activations, self.config.center, range(self.model.num_layers), KINDS, self.name)
        return CodecState(offsets.tensors())

    def load_state(self, state: CodecState) -> None:
        self.offsets = Offsets.from_tensors(state.tensors)

    def policy(self, kind: str, layer_idx: int) -> StreamPolicy:
        return StreamPolicy(self.config.sinks, self.config.buffer, 0)

    def encode(self, request: StreamRequest) -> Payload:
        x = self.offsets.remove(request.tokens, request.layer, request.kind)
        return Payload(self.tokens.encode(x, request.range_checks), request.tokens.shape[2])

    def decode(self, payload: Payload, request: StreamRequest) -> torch.Tensor:
        return saturated(self.offsets.restore(self.tokens.decode(payload.tensors), request.layer, request.kind),
                         request.dtype)

    def code_bits_per_value(self, kind: str, layer_idx: int) -> float:
        return self.tokens.bits_per_value()

    def overhead_bits(self) -> int:
        """The grid (float32), shared by every layer, and the centring vectors."""
        return 32 * self.tokens.quantizer.grid.numel() + self.offsets.bits
