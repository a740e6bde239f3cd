"""QJL (Zandieh, Daliri, Han 2024): 1-bit JL sketches of keys with an asymmetric estimator; values KIVI-style.

Keys (after RoPE, as the authors' code) are coded by :mod:`kvcomp.stages.jl_sketch`: per token
``sign(S k_in)`` (``m`` bits) and ``||k_in||``; the ``n_out`` channels of largest norm over each group of
``group_size`` tokens are split off (``k = k_in + k_out``) and sketched apart by the first ``m_o`` rows of
the same ``S`` (disjoint channels, so independent for Gaussian ``S``: the paper's "two independent copies"),
with ``||k_out||`` and the group's channel ids (uint8). Layers ``< initial_layers`` use their own sketch
sizes (the authors' code gives the first 15 layers ``m = 512, m_o = 128``, later ones ``256, 256``).
Keys are sketched in chunks of ``key_buffer`` tokens, so 0..key_buffer-1 recent keys are full precision.

Values: per-token asymmetric ``value_bits`` quantization in groups of ``value_group_size`` channels,
the last ``value_window`` values in full precision (KIVI's value path).

Scores need no decoded keys: :meth:`QJLCodec.payload_scores` evaluates the estimator (Eq. 4 plus the
outlier term, spec §2.4) from the packed bits, with the Triton kernel when ``hardware`` selects it.
:meth:`QJLCodec.decode` returns ``k_hat = sqrt(pi/2)/m ||k|| S^T sign(S k)`` (per part), an unbiased
reconstruction whose inner product with any query *is* the estimator, so the reference attention path
(decode + SDPA) computes the same logits.

``center`` (a deviation from the paper, default ``none``): keys sketched as ``k - R_p c``, with ``c`` one
pre-RoPE vector per layer (the calibration mean of the pre-RoPE keys, or the model's k_proj bias:
:mod:`kvcomp.stages.centering`) rotated to the token's position ``p``; the cache subtracts it before encoding
and adds it back to decoded keys (:meth:`~kvcomp.codecs.base.Codec.rotated_key_offset`), so the logits are
``<q, k_hat(k - R_p c)> + <q, R_p c>``: the sketch's error scales with the deviation's norm, not the offset's.
Centred keys are read by the reference path (decode + attention), not by the score or fused kernels.

Differences from the authors' code: the inlier norm is stored directly (they store ``||k||`` and recover
``||k_in|| = sqrt(||k||^2 - ||k_out||^2)``; same 16 bits, no cancellation); ``row_norm: chi`` and
``projection: gaussian`` are options. Prefill: the authors attend exactly during prefill; here that is the
cache protocol ``exact_prefill``. Prefill attending to the compressed keys too (``prefill_compressed``,
spec A6) is protocol ``simulated`` (or ``streaming``, as a token-by-token feed would see it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from kvcomp.codecs.base import (Activations, Calibrated, Codec, CodecConfig, CodecState, FusedPayload, Payload,
                                PayloadScores, StreamPolicy, StreamRequest)
from kvcomp.codecs.registry import register
from kvcomp.codecs.uniform import PARAM_DTYPES
from kvcomp.errors import ConfigError, unknown_choice
from kvcomp.kernels.formats import SketchedKeys, SketchReader, UniformReader, reconstruct_keys
from kvcomp.kernels.formats.sketch import columns_of
from kvcomp.kernels.qjl_scores import qjl_scores
from kvcomp.stages.centering import CENTERS, Offsets, fit_offsets
from kvcomp.stages.jl_sketch import (
    PROJECTIONS,
    ROW_NORMS,
    channel_mask,
    group_outlier_channels,
    jl_projection,
    sign_sketch,
)
from kvcomp.stages.ranges import saturated, stable_norm, stored_in
from kvcomp.stages.uniform_quantizer import GroupQuantizer


@dataclass
class QJLConfig(CodecConfig):
    name: str = "qjl"
    sketch_dim: int = 256  # m: inlier sign bits per key token (layers >= initial_layers)
    outlier_sketch_dim: int = 256  # m_o: outlier sign bits per key token: the first m_o rows of S (<= sketch_dim)
    initial_layers: int = 15  # layers 0..initial_layers-1 use the two sizes below
    initial_sketch_dim: int = 512
    initial_outlier_sketch_dim: int = 128
    outlier_channels: int = 8  # n_out per group of tokens, by l2 norm; 0: one sketch of the whole key
    group_size: int = 32  # tokens sharing one outlier channel set
    key_buffer: int = 128  # keys sketched in chunks of this many tokens (0..key_buffer-1 recent keys full precision)
    value_bits: int = 2
    value_group_size: int = 32
    value_window: int = 128  # most recent values kept in full precision
    projection: str = "orthogonal"  # orthogonal (block QR, the paper; rows scaled per row_norm) | gaussian
    row_norm: str = "sqrt_d"  # sqrt_d (authors' code) | chi (rows with chi_d norms: exactly unbiased); orthogonal only
    seed: int = 42
    norm_dtype: str = "float16"  # storage of the two key norms
    param_dtype: str = "float16"  # storage of the value scales and zero-points
    center: str = "none"  # none (paper) | calibration | bias: take a rotated per-layer key offset out first (not the paper's)


@dataclass
class LayerSketch:
    """Sketch sizes of one layer class and its projection (drawn once on the CPU, copied once per device)."""

    sketch_dim: int
    outlier_sketch_dim: int
    projection: torch.Tensor  # [m, D] float32, CPU
    device_copies: dict[torch.device, tuple] = field(default_factory=dict, repr=False)

    def on(self, device: torch.device) -> torch.Tensor:
        """The projection on ``device`` (no copy on every encode or decode step)."""
        return self._copies(device)[0]

    def columns_on(self, device: torch.device) -> tuple:
        """Its transpose on ``device`` as the score kernels read it (:func:`~kvcomp.kernels.formats.sketch.columns_of`)."""
        return self._copies(device)[1]

    def _copies(self, device) -> tuple:
        device = torch.device(device)
        if device not in self.device_copies:
            projection = self.projection.to(device)
            self.device_copies[device] = (projection, columns_of(projection))
        return self.device_copies[device]


@register
class QJLCodec(Codec, Calibrated, FusedPayload, PayloadScores):
    """QJL keys and KIVI values (stream scope; calibrated only with ``center``)."""

    config_class = QJLConfig
    quiet_defaults = {**Codec.quiet_defaults, "center": "none"}

    def calibrates(self) -> bool:
        """With ``center``: the key offsets."""
        return self.config.center != "none"

    def validate(self) -> None:
        cfg, d = self.config, self.model.head_dim
        if cfg.projection not in PROJECTIONS:
            raise unknown_choice("qjl projection", cfg.projection, PROJECTIONS)
        if cfg.row_norm not in ROW_NORMS:
            raise unknown_choice("qjl row_norm", cfg.row_norm, ROW_NORMS)
        for name in ("norm_dtype", "param_dtype"):
            if getattr(cfg, name) not in PARAM_DTYPES:
                raise unknown_choice(f"qjl {name}", getattr(cfg, name), PARAM_DTYPES)
        if not 0 <= cfg.outlier_channels < min(d, 256):
            raise ConfigError(f"qjl: outlier_channels={cfg.outlier_channels} must be in 0..{min(d, 256) - 1} (head_dim={d})")
        if cfg.group_size < 1 or cfg.key_buffer < cfg.group_size or cfg.key_buffer % cfg.group_size:
            raise ConfigError(
                f"qjl: key_buffer={cfg.key_buffer} must be a positive multiple of group_size={cfg.group_size} "
                "(outlier channels are chosen per whole group of tokens)"
            )
        if cfg.center not in CENTERS:
            raise unknown_choice("qjl center", cfg.center, CENTERS)
        if cfg.center != "none" and not self.model.has_rope:
            raise ConfigError(f"qjl: center={cfg.center} rotates the offset with RoPE, and model {self.model.name} has none")
        if cfg.value_window < 0 or not 0 <= cfg.initial_layers:
            raise ConfigError(f"qjl: value_window and initial_layers must be >= 0, got {cfg.value_window}, {cfg.initial_layers}")
        for prefix in ("", "initial_"):
            m, m_o = getattr(cfg, f"{prefix}sketch_dim"), getattr(cfg, f"{prefix}outlier_sketch_dim")
            if m < 8 or m % 8:
                raise ConfigError(f"qjl: {prefix}sketch_dim={m} must be a positive multiple of 8 (bits are packed in bytes)")
            if cfg.outlier_channels and (m_o < 8 or m_o % 8 or m_o > m):
                raise ConfigError(
                    f"qjl: {prefix}outlier_sketch_dim={m_o} must be a positive multiple of 8 and <= "
                    f"{prefix}sketch_dim={m} (the outlier sketch uses the first m_o rows of S)"
                )
        self._value_quantizer().validate(d, "qjl (values)")

    def build(self) -> None:
        self.value_quantizer = self._value_quantizer()
        self.offsets = Offsets()

    def fit(self, activations: Activations) -> CodecState:
        """The pre-RoPE key offset of every layer (``center``: calibration mean or k_proj bias)."""
        offsets = fit_offsets(activations, self.config.center, range(self.model.num_layers), ("key",), self.name)
        return CodecState(offsets.tensors())

    def load_state(self, state: CodecState) -> None:
        self.offsets = Offsets.from_tensors(state.tensors)

    def rotated_key_offset(self, layer_idx: int) -> torch.Tensor | None:
        return self.offsets.vectors.get((layer_idx, "key"))

    def _value_quantizer(self) -> GroupQuantizer:
        cfg = self.config
        return GroupQuantizer(cfg.value_bits, cfg.value_group_size, "per_token", PARAM_DTYPES[cfg.param_dtype])

    @cached_property
    def _sketches(self) -> dict[tuple[int, int], LayerSketch]:
        cfg = self.config
        sizes = {self.sketch_sizes(layer) for layer in range(self.model.num_layers)}
        return {
            (m, m_o): LayerSketch(m, m_o, jl_projection(m, self.model.head_dim, cfg.projection, cfg.row_norm, cfg.seed))
            for m, m_o in sizes
        }

    def sketch(self, layer_idx: int) -> LayerSketch:
        """The sketch sizes and projection of ``layer_idx``'s class (shared by its heads, as the authors')."""
        return self._sketches[self.sketch_sizes(layer_idx)]

    def policy(self, kind: str, layer_idx: int) -> StreamPolicy:
        if kind == "key":
            return StreamPolicy(sinks=0, block_size=self.config.key_buffer, window=0)
        return StreamPolicy(sinks=0, block_size=1, window=self.config.value_window)

    @property
    def norm_dtype(self) -> torch.dtype:
        return PARAM_DTYPES[self.config.norm_dtype]

    def encode(self, request: StreamRequest) -> Payload:
        x = request.tokens
        if request.kind == "value":
            return Payload(self.value_quantizer.encode(x, request.range_checks), num_tokens=x.shape[2])
        cfg, sketch = self.config, self.sketch(request.layer)
        projection = sketch.on(x.device)
        keys = x.float()
        tensors = {}
        if cfg.outlier_channels:
            channels = group_outlier_channels(keys, cfg.group_size, cfg.outlier_channels)
            outlier_part = keys * channel_mask(channels, self.model.head_dim, cfg.group_size)
            keys = keys - outlier_part
            tensors["outlier_signs"] = sign_sketch(outlier_part, projection[: sketch.outlier_sketch_dim])
            tensors["outlier_norm"] = stored_in(stable_norm(outlier_part), self.norm_dtype, request.range_checks)
            tensors["outlier_channels"] = channels.to(torch.uint8)
        tensors["signs"] = sign_sketch(keys, projection)
        tensors["inlier_norm"] = stored_in(stable_norm(keys), self.norm_dtype, request.range_checks)
        return Payload(tensors, num_tokens=x.shape[2])

    def sketched_keys(self, payload: Payload, layer_idx: int) -> SketchedKeys:
        """The key payload in the form the score kernels take."""
        p, sketch = payload.tensors, self.sketch(layer_idx)
        return SketchedKeys(
            signs=p["signs"],
            inlier_norm=p["inlier_norm"],
            projection=sketch.on(p["signs"].device),
            group_size=self.config.group_size,
            outlier_signs=p.get("outlier_signs"),
            outlier_norm=p.get("outlier_norm"),
            outlier_channels=p.get("outlier_channels"),
            projection_columns=sketch.columns_on(p["signs"].device),
        )

    def decode(self, payload: Payload, request: StreamRequest) -> torch.Tensor:
        """Values: dequantized. Keys: ``k_hat`` (module docstring), whose logits equal the estimator's."""
        if request.kind == "value":
            return self.value_quantizer.decode(payload.tensors, self.model.head_dim, request.dtype)
        return saturated(reconstruct_keys(self.sketched_keys(payload, request.layer), self.model.head_dim), request.dtype)

    def payload_scores(self, query: torch.Tensor, payload: Payload, layer_idx: int, backend: str = "torch") -> torch.Tensor:
        """Logits ``<q, k_hat>`` of queries ``[B, Hq, Tq, D]`` against the encoded keys, float32
        ``[B, Hq, Tq, T]``, computed from the packed bits (GQA: query head ``h`` reads KV head
        ``h // (Hq / H)``)."""
        b, hq, tq, d = query.shape
        h = self.model.num_kv_heads
        grouped = query.reshape(b, h, (hq // h) * tq, d)
        scores = qjl_scores(grouped, self.sketched_keys(payload, layer_idx), backend)
        return scores.reshape(b, hq, tq, -1)

    def fused_attention_supported(self, layer_idx: int) -> bool:
        """The fused decode kernel reads the sign bits (any sketch sizes; groups of at least 16 tokens, a
        power of two, so that a tile lies in one group) and the per-token uniform values; not with ``center``
        (the kernel adds a key offset in a launch of its own over one payload of keys and values, and QJL's key
        and value payloads cover different tokens)."""
        group = self.config.group_size
        return group >= 16 and group & (group - 1) == 0 and self.config.center == "none"

    def payload_reader(self, payload: Payload, kind: str, layer_idx: int) -> SketchReader | UniformReader:
        if kind == "value":
            return UniformReader.of(self.value_quantizer, payload, self.model.head_dim)
        return SketchReader(payload.num_tokens, self.model.head_dim, self.sketched_keys(payload, layer_idx))

    def key_bits_per_token(self, layer_idx: int) -> float:
        """Stored bits of one key token of one head: sign bits, norms, amortised outlier channel ids."""
        cfg, (m, m_out) = self.config, self.sketch_sizes(layer_idx)
        norm_bits = torch.finfo(self.norm_dtype).bits
        bits = m + norm_bits
        if cfg.outlier_channels:
            bits += m_out + norm_bits + cfg.outlier_channels * 8 / cfg.group_size
        return bits

    def sketch_sizes(self, layer_idx: int) -> tuple[int, int]:
        """``(m, m_o)`` of ``layer_idx`` (without drawing the projection)."""
        cfg = self.config
        if layer_idx < cfg.initial_layers:
            return cfg.initial_sketch_dim, cfg.initial_outlier_sketch_dim
        return cfg.sketch_dim, cfg.outlier_sketch_dim

    def code_bits_per_value(self, kind: str, layer_idx: int) -> float:
        if kind == "value":
            return self.value_quantizer.bits_per_value(self.model.head_dim)
        return self.key_bits_per_token(layer_idx) / self.model.head_dim

    def overhead_bits(self) -> int:
        """The float32 projections of the layer classes in use (regenerable from the seed, but held in memory) and
        the key offsets."""
        return sum(32 * sketch.projection.numel() for sketch in self._sketches.values()) + self.offsets.bits
