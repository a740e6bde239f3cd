"""TurboQuant (Zandieh, Daliri, Hadian, Mirrokni, ICLR 2026, arXiv 2504.19874) and vLLM's TurboQuant KV-cache presets.

Every key and value vector (one head of one token, ``d = head_dim``, keys after RoPE) is coded on its own by
:mod:`kvcomp.stages.lloyd_max`: its norm (float16), and the ``b``-bit Lloyd-Max code of each coordinate of the
rotated unit vector ``Pi x / ||x||``:

- ``variant: mse`` (Algorithm 1): ``x_hat = ||x|| Pi^T c``; ``d b + 16`` bits per vector;
- ``variant: prod`` (Algorithm 2): ``b - 1`` bits of mse, then ``sign(S r)`` of the residual ``r`` (``S`` a
  ``d x d`` Gaussian matrix, :mod:`kvcomp.stages.jl_sketch`) and ``||r||`` (float16): unbiased inner products;
  ``d b + 32`` bits per vector.

The codebook is solved for the exact coordinate density of the paper's Lemma 1 (``density: beta``) and the
rotation is a seeded Haar matrix (``rotation: random``), one for every layer and head, as Algorithm 1.

**vLLM's presets** (``vllm/model_executor/layers/quantization/turboquant/config.py`` and the TurboQuant attention
backend, read in November 2026): ``--kv-cache-dtype turboquant_k8v4 | turboquant_4bit_nc | turboquant_k3v4_nc |
turboquant_3bit_nc`` (``conf/codec/turboquant_*.yaml``) have no QJL stage; keys: the plain Sylvester Hadamard
``H / sqrt(d)`` without random signs (``rotation: plain_hadamard``), Lloyd-Max centroids of ``N(0, 1/d)``
(``density: gaussian``) at ``key_bits`` 3 or 4, the norm in float16, or, with ``key_bits: 8`` ("k8"), each key
value cast to float8 e4m3 with no scale and no rotation; "nc" (``norm_correction``) rescales the decoded centroid
vector to unit norm before the norm is applied; values: per-token asymmetric min-max over the head
(``values: uniform``, :class:`~kvcomp.stages.uniform_quantizer.GroupQuantizer` with one group of ``d``, scale and
zero in float16); the first and last 2 layers of a dense model kept in bf16 (``boundary_layers: 2``). Bytes per
head and token: keys ``ceil(d b / 8) + 2`` (k8: ``d``), values ``ceil(d b / 8) + 4``, as vLLM's
``key_packed_size`` / ``value_packed_size``.

``center`` (not the paper's, default ``none``): keys coded as ``k - R_p c`` with ``c`` a pre-RoPE offset per layer
rotated to the token's position by the cache (:meth:`~kvcomp.codecs.base.Codec.rotated_key_offset`, as
:mod:`kvcomp.codecs.qjl`), values as ``v - c_v`` (:mod:`kvcomp.stages.centering`); ``c`` is the calibration mean
or the model's k_proj / v_proj bias.

Differences: the paper's KV experiments split outlier channels into a second TurboQuant instance at another bit
width (2.5 and 3.5 bits); here every coordinate has ``key_bits`` / ``value_bits``. The paper does not say how the
norm is stored (float16 here, as vLLM). Against vLLM: the codebook is solved to convergence on a fine grid (vLLM
runs at most 200 Lloyd iterations with 200-point trapezoid integrals); uniform values round half to even and
compute codes with the float16-rounded scale and zero (vLLM rounds half up with the float32 ones); k8 keys
saturate at +-448 (``float8_e4m3fn``; vLLM's Triton kernels use e4m3fn on Hopper and later, e4b15 before);
vLLM keeps no boundary layers on hybrid (Mamba) models and clamps ``boundary_layers`` to half the layers, while
here boundary layers count the layers the codec encodes (full-attention ones) and leaving none to compress is
an error; vLLM attends exactly during prefill (kvcomp's ``benchmark.protocol=exact_prefill``).

Fused decode (``kernel_backend=triton``): TurboQuant-mse, EDEN and vLLM's presets are read by the fused kernel
(:meth:`RotatedCodec.payload_reader`): Lloyd-Max codes (any width, norm correction included) in the rotated basis
(the query rotated, the output un-rotated), k8 keys as float8, uniform values as packed ints; ``center``'s offsets
are added by the kernel (the key offset's score ``q . R_p c`` per token, the value offset to the output); ``prod``'s
residual sketch too (:class:`~kvcomp.kernels.formats.ResidualSketchReader`: its score ``sqrt(pi/2)/d ||r|| <S q,
sign(S r)>`` added to each key's; the values' sketch weighted over the same keys in its own basis, taken back by ``S``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from kvcomp.codecs.base import (KINDS, Activations, Calibrated, Codec, CodecConfig, CodecState, FusedPayload, Payload,
                                StreamPolicy, StreamRequest)
from kvcomp.codecs.registry import register
from kvcomp.codecs.uniform import PARAM_DTYPES
from kvcomp.errors import ConfigError, unknown_choice
from kvcomp.kernels import loads_float8
from kvcomp.kernels.formats import (CodebookReader, PayloadReader, ResidualSketchReader, RotatedReader, ScaledReader,
                                     SignReader, UniformReader)
from kvcomp.stages.centering import CENTERS, Offsets, fit_offsets
from kvcomp.stages.codebook import ChunkLayout
from kvcomp.stages.hadamard import is_power_of_two
from kvcomp.stages.minifloat import FLOAT8, from_float8, to_float8
from kvcomp.stages.lloyd_max import DENSITIES, ROTATIONS, ProdQuantizer, RotatedScalarQuantizer, Rotation
from kvcomp.stages.ranges import saturated
from kvcomp.stages.skip_layers import SKIPPED_BITS, skipped_layers
from kvcomp.stages.uniform_quantizer import GroupQuantizer

VARIANTS = ("mse", "prod")
VALUE_QUANTIZERS = ("turboquant", "uniform")
LLOYD_MAX_BITS = range(1, 5)
FP8_KEY_BITS = 8  # vLLM's "k8": float8 e4m3 keys


class FP8Keys:
    """vLLM's k8 keys: every value cast to float8 e4m3 (saturated at +-448), no scale, no rotation."""

    held_bits = 0

    def __init__(self, dim: int):
        self.dim = dim

    def encode(self, x: torch.Tensor, range_checks: list | None = None) -> dict[str, torch.Tensor]:
        return {"codes": to_float8(x.float(), FLOAT8["e4m3"])}

    def decode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return from_float8(tensors["codes"], FLOAT8["e4m3"])

    def bits_per_vector(self) -> int:
        return 8 * self.dim


class UniformValues:
    """vLLM's TurboQuant values: per-token asymmetric min-max over the whole head (one group of ``dim``)."""

    held_bits = 0

    def __init__(self, bits: int, dim: int, param_dtype: torch.dtype):
        self.quantizer, self.dim = GroupQuantizer(bits, dim, "per_token", param_dtype), dim

    def encode(self, x: torch.Tensor, range_checks: list | None = None) -> dict[str, torch.Tensor]:
        return self.quantizer.encode(x, range_checks)

    def decode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.quantizer.decode(tensors, self.dim, torch.float32)

    def bits_per_vector(self) -> int:
        return round(self.quantizer.bits_per_value(self.dim) * self.dim)


class RotatedCodec(Codec, Calibrated, FusedPayload):
    """What TurboQuant and EDEN share: per-vector coders of keys and values (:meth:`coder`), one seeded rotation,
    skipped layers, and the ``center`` option (calibrated only with it). Subclass configs have ``rotation``,
    ``density``, ``seed``, ``skip_layers``, ``boundary_layers`` and ``center``."""

    quiet_defaults = {**Codec.quiet_defaults, "center": "none"}

    def calibrates(self) -> bool:
        """With ``center``: the offsets."""
        return self.config.center != "none"

    @property
    def stored_dtype(self) -> torch.dtype:
        """The dtype of the per-vector floats (norms, scales)."""
        raise NotImplementedError

    def check_bits(self) -> None:
        """Raise :class:`ConfigError` for bit widths this codec cannot do."""
        raise NotImplementedError

    def coder(self, kind: str):
        """The coder of ``kind`` vectors: ``encode``, ``decode`` (float32), ``bits_per_vector()``, ``held_bits``."""
        raise NotImplementedError

    def uses_rotation(self) -> bool:
        """Whether a coder rotates (vLLM's k8 keys with uniform values do not)."""
        return True

    def validate(self) -> None:
        cfg, d = self.config, self.model.head_dim
        if cfg.rotation not in ROTATIONS:
            raise unknown_choice(f"{self.name} rotation", cfg.rotation, ROTATIONS)
        if cfg.rotation != "random" and not is_power_of_two(d) and self.uses_rotation():
            raise ConfigError(f"{self.name}: rotation={cfg.rotation} needs a power-of-two head_dim, got {d}; "
                              "use rotation=random")
        if cfg.density not in DENSITIES:
            raise unknown_choice(f"{self.name} density", cfg.density, DENSITIES)
        if cfg.center not in CENTERS:
            raise unknown_choice(f"{self.name} center", cfg.center, CENTERS)
        if cfg.center != "none" and not self.model.has_rope:
            raise ConfigError(f"{self.name}: center={cfg.center} rotates the key offset with RoPE, and model "
                              f"{self.model.name} has none")
        self.check_bits()
        skipped_layers(list(cfg.skip_layers), cfg.boundary_layers, self.model.num_layers, self.name)

    def build(self) -> None:
        cfg = self.config
        self.skipped = skipped_layers(list(cfg.skip_layers), cfg.boundary_layers, self.model.num_layers, self.name)
        self.rotation = Rotation(cfg.rotation, self.model.head_dim, cfg.seed) if self.uses_rotation() else None
        self.coders = {kind: self.coder(kind) for kind in KINDS}
        self.offsets = Offsets()
        self.reader_tables: dict = {}  # (device, kind) -> what payload_reader hands the fused kernel, made once

    def rotated(self, bits: int, scale: str) -> RotatedScalarQuantizer:
        return RotatedScalarQuantizer(self.rotation, bits, self.config.density, scale, self.stored_dtype)

    def fit(self, activations: Activations) -> CodecState:
        """The offsets of every encoded layer's keys (pre-RoPE) and values: calibration mean or model bias."""
        layers = [layer for layer in range(self.model.num_layers) if layer not in self.skipped]
        return CodecState(fit_offsets(activations, self.config.center, layers, KINDS, self.name).tensors())

    def load_state(self, state: CodecState) -> None:
        self.offsets = Offsets.from_tensors(state.tensors)

    def rotated_key_offset(self, layer_idx: int) -> torch.Tensor | None:
        return self.offsets.vectors.get((layer_idx, "key"))

    def policy(self, kind: str, layer_idx: int) -> StreamPolicy:
        if layer_idx in self.skipped:
            return StreamPolicy(block_size=None)
        return StreamPolicy(sinks=0, block_size=1, window=0)

    def encode(self, request: StreamRequest) -> Payload:
        x = request.tokens
        if request.kind == "value":
            x = self.offsets.remove(x, request.layer, "value")
        return Payload(self.coders[request.kind].encode(x, request.range_checks), num_tokens=request.tokens.shape[2])

    def decode(self, payload: Payload, request: StreamRequest) -> torch.Tensor:
        x = self.coders[request.kind].decode(payload.tensors)
        if request.kind == "value":
            x = self.offsets.restore(x, request.layer, "value")
        return saturated(x, request.dtype)

    def fused_attention_supported(self, layer_idx: int) -> bool:
        """Where the fused kernel reads both streams: Lloyd-Max codes of any width times a per-vector scale
        (vLLM's norm correction included) with or without prod's residual sketch, vLLM's k8 keys (where Triton loads
        float8) and uniform values, with or without ``center``'s offsets (:class:`~kvcomp.kernels.formats.OffsetReader`)."""
        coders = self.coders.values()
        whole_bytes = self.model.head_dim % 8 == 0  # prod's sign bits: one byte per 8 channels
        return ((loads_float8() or not any(isinstance(c, FP8Keys) for c in coders))
                and (whole_bytes or not any(isinstance(c, ProdQuantizer) for c in coders)))

    def value_offset(self, layer_idx: int) -> torch.Tensor | None:
        return self.offsets.vectors.get((layer_idx, "value"))

    def fused_offset(self, kind: str, layer_idx: int, device: torch.device) -> torch.Tensor | None:
        return self.offsets.on(layer_idx, kind, device)  # copied to the device once, not at every step

    def payload_reader(self, payload: Payload, kind: str, layer_idx: int) -> PayloadReader:
        """k8 keys: float8 e4m3 values (scale 1). Uniform values: packed ints, one group per vector. Lloyd-Max
        codes: a codebook payload in the rotated basis, one scalar codebook for every channel and head
        (``centroids[q]``) times the stored per-vector scale, ``x_hat = (scale centroids[q]) R`` with ``R`` the
        inverse rotation as a matrix (under norm correction, ``centroids[q]`` rescaled to unit norm first). Prod: that
        of its mse codes plus the sign sketch of the residual and its norm (:class:`ResidualSketchReader`)."""
        coder, stored, d, n = self.coders[kind], payload.tensors, self.model.head_dim, payload.num_tokens
        codes = stored["codes"]
        if isinstance(coder, UniformValues):
            return UniformReader(n, d, codes, stored["scale"], stored["zero"], coder.quantizer.bits, d, False)
        table = self.reader_tables.get((codes.device, kind))
        if table is None:
            table = self.reader_tables[(codes.device, kind)] = self.reader_table(coder, codes.shape[1], codes.device)
        if isinstance(coder, FP8Keys):
            return ScaledReader(n, d, codes, FLOAT8["e4m3"], table)
        codebooks, ones, zeros, rotation = table[:4]
        prod = isinstance(coder, ProdQuantizer)
        inner = CodebookReader(n, d, codes, codebooks, ChunkLayout(1, 1, d), ones, zeros, stored["scale"],
                               unit_norm=(coder.mse if prod else coder).scale == "unit")
        reader = RotatedReader(n, d, inner, rotation)
        if not prod:
            return reader
        residual = SignReader(n, d, stored["signs"], stored["residual_norm"])
        return ResidualSketchReader(n, d, reader, residual, table[4])

    def reader_table(self, coder, kv_heads: int, device: torch.device):
        """What :meth:`payload_reader` hands the fused kernel besides the payload, made once per device and kind:
        k8 keys' unit scale, or the codebook of every head, unit channel scales, zero centres and the rotation (prod:
        and its sketch matrix ``S``)."""
        d = self.model.head_dim
        if isinstance(coder, FP8Keys):
            return torch.ones((), device=device)
        mse = coder.mse if isinstance(coder, ProdQuantizer) else coder
        centroids = mse.codebook.centroids.float().to(device).reshape(1, 1, -1, 1)
        table = (centroids.expand(kv_heads, 1, -1, 1).contiguous(), torch.ones(kv_heads, d, device=device),
                 torch.zeros(kv_heads, d, device=device), mse.rotation.inverse(torch.eye(d, device=device)))
        return (*table, coder.projection.to(device)) if isinstance(coder, ProdQuantizer) else table

    def code_bits_per_value(self, kind: str, layer_idx: int) -> float:
        if layer_idx in self.skipped:
            return SKIPPED_BITS
        return self.coders[kind].bits_per_vector() / self.model.head_dim

    def overhead_bits(self) -> int:
        """The rotation (float32, shared), each coder's codebook (and sketch matrix), and the offsets."""
        rotation = self.rotation.bits if self.rotation else 0
        return rotation + sum(coder.held_bits for coder in self.coders.values()) + self.offsets.bits


def fitted_fields(config_class) -> tuple[str, ...]:
    """The config fields a fitted state (the offsets) does not depend on."""
    keyed = ("name", "center", "skip_layers", "boundary_layers", "compress_sliding")
    return tuple(f.name for f in fields(config_class) if f.name not in keyed)


@dataclass
class TurboQuantConfig(CodecConfig):
    name: str = "turboquant"
    variant: str = "mse"  # mse (Algorithm 1) | prod (Algorithm 2: b-1 bits of mse + a 1-bit QJL sketch of the residual)
    key_bits: int = 3  # 1..4 Lloyd-Max bits per coordinate (prod: 2..4); 8: float8 e4m3 keys (vLLM's k8)
    value_bits: int = 3  # 1..4 (prod: 2..4); values=uniform: 1..8
    values: str = "turboquant"  # turboquant (the keys' quantizer) | uniform (vLLM: per-token min-max, fp16 scale/zero)
    rotation: str = "random"  # random (Haar, the paper) | hadamard (random signs) | plain_hadamard (vLLM)
    density: str = "beta"  # beta (exact, the paper's Lemma 1) | gaussian (its N(0, 1/d) limit, vLLM)
    norm_correction: bool = False  # vLLM's "nc": the decoded centroid vector rescaled to unit norm
    norm_dtype: str = "float16"  # the stored norms (and prod's residual norms)
    seed: int = 0  # of the rotation (prod's sketch matrix: seed + 1)
    skip_layers: list[int] = field(default_factory=list)  # layers kept in the model dtype (negative: from the end)
    boundary_layers: int = 0  # the first and last n layers kept in the model dtype (vLLM's presets: 2)
    center: str = "none"  # none (paper) | calibration | bias: take a per-layer offset out first (not the paper's)


@register
class TurboQuantCodec(RotatedCodec):
    """TurboQuant-mse / -prod keys and values, or vLLM's presets (module docstring)."""

    config_class = TurboQuantConfig
    inference_only_fields = fitted_fields(TurboQuantConfig)

    @property
    def stored_dtype(self) -> torch.dtype:
        return PARAM_DTYPES[self.config.norm_dtype]

    def uses_rotation(self) -> bool:
        cfg = self.config
        return cfg.key_bits != FP8_KEY_BITS or cfg.values == "turboquant"

    def check_bits(self) -> None:
        cfg = self.config
        if cfg.variant not in VARIANTS:
            raise unknown_choice("turboquant variant", cfg.variant, VARIANTS)
        if cfg.values not in VALUE_QUANTIZERS:
            raise unknown_choice("turboquant values", cfg.values, VALUE_QUANTIZERS)
        if cfg.norm_dtype not in PARAM_DTYPES:
            raise unknown_choice("turboquant norm_dtype", cfg.norm_dtype, PARAM_DTYPES)
        least = 2 if cfg.variant == "prod" else 1
        lloyd = f"{least}..{LLOYD_MAX_BITS[-1]} ({cfg.variant})"
        if cfg.key_bits != FP8_KEY_BITS and not least <= cfg.key_bits <= LLOYD_MAX_BITS[-1]:
            raise ConfigError(f"turboquant: key_bits={cfg.key_bits} is not supported; valid: {lloyd}, or "
                              f"{FP8_KEY_BITS} (float8 e4m3 keys)")
        if cfg.values == "uniform":
            GroupQuantizer(cfg.value_bits, self.model.head_dim, "per_token").validate(self.model.head_dim,
                                                                                     "turboquant (uniform values)")
        elif not least <= cfg.value_bits <= LLOYD_MAX_BITS[-1]:
            raise ConfigError(f"turboquant: value_bits={cfg.value_bits} is not supported; valid: {lloyd}, "
                              "or 1..8 with values=uniform")

    def coder(self, kind: str):
        cfg, d = self.config, self.model.head_dim
        if kind == "key" and cfg.key_bits == FP8_KEY_BITS:
            return FP8Keys(d)
        if kind == "value" and cfg.values == "uniform":
            return UniformValues(cfg.value_bits, d, self.stored_dtype)
        bits = cfg.key_bits if kind == "key" else cfg.value_bits
        scale = "unit" if cfg.norm_correction else "one"
        if cfg.variant == "prod":
            return ProdQuantizer(self.rotated(bits - 1, scale), seed=cfg.seed + 1)
        return self.rotated(bits, scale)
