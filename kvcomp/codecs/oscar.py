"""OSCAR (Zhou et al. 2026, "Offline Spectral Covariance-Aware Rotation for 2-bit KV Cache Quantization",
arXiv 2605.17757; code FutureMLS-Lab/OSCAR): a fitted orthogonal rotation per layer, a clipped INT2 per-token
quantizer, and full-precision sinks and recent window.

Per layer (and stream), offline, from the calibration windows (:meth:`OscarCodec.fit`;
:mod:`kvcomp.stages.covariance_rotation`):

- keys: ``R_K = U_Q H P`` from the post-RoPE queries' second moment ``C_Q = E[q q^T]`` over each KV head's query
  group (the reference's ``qqt``; the paper's ``||QK^T - QK_hat^T||_F^2 = tr(R_K^T C_Q R_K E_K)``);
- values: ``R_V = U_S H P`` from the score-weighted value covariance ``C_S = E_t[w_t v_t v_t^T]``,
  ``w_t = k_t^T C_Q k_t`` normalised to mean 1 (``sst``);
- ``granularity=layer`` (the reference and its RotationZoo, ``source_grouping: "layer"``): the targets averaged
  over the layer's KV heads, one ``[d, d]`` rotation; ``kv_head``: one per KV head (the project site speaks of
  targets "per layer/head"; no released code fits them, an option here).

Online, every encoded row (one token of one KV head, post-RoPE keys) is rotated ``x R``, clipped to
``[-τ, τ]`` with ``τ`` its ``floor(ratio d)``-th smallest magnitude (0-based; ratio 0.96 for keys, 0.92 for values;
0 turns clipping off), then quantized asymmetrically, min-max, to ``bits = 2`` in groups of ``group_size`` channels
(:class:`~kvcomp.stages.uniform_quantizer.GroupQuantizer`; the reference's ``--kv-cache-quant-group-size 128`` is the
whole head on its 128-dim models; default here: the whole head). Decoding rotates back, ``x_hat R^T`` (the reference
rotates the query instead for keys and folds ``R_V`` into ``v_proj`` / ``o_proj``: the same attention). The first
``sinks = 64`` tokens and the ``window = 256`` most recent stay in full precision; the recent window is demoted
``flush_block = 8`` tokens at a time (the reference's ``N_Q``: 4 codes per byte x 2-byte bf16 slots), so it holds
256..263 tokens.

Bits: ``bits + 2 x 16 / group`` per encoded value (2.25 at group 128) and the rotations (float32) as overhead.
:meth:`OscarCodec.paper_bits_per_value` is the paper's "BPE", bits per KV element of a 128K-token cache with
the 64 + 256 full-precision tokens in 16 bits: 2.28 on 128-dim heads.

Differences from the reference, all documented options or stated here: scale and zero-point are stored in
``param_dtype = float16`` (what the paper's 2.25 / 2.28 bits count; the reference's serving stores float32,
``param_dtype=float32``, 2.5 bits at group 128), the zero as the group minimum ``z`` with ``x_hat = q s + z``
(the reference stores ``-min / s`` and rounds ``x / s + zero + 0.5`` down: the same levels up to ties); the
reference's optional Lloyd-Max levels (``SGLANG_LLOYD_MAX``) are not implemented; the statistics come from the
project's calibration windows (the reference dumps 10-30K tokens of GPQA prompts). With ``kernel_backend=triton``
decode steps read the INT2 payload in the fused kernel in its rotated basis
(:class:`~kvcomp.kernels.formats.RotatedReader`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcomp.codecs.base import (KINDS, Activations, Calibrated, Codec, CodecConfig, CodecState, FusedPayload, Payload,
                                StreamPolicy, StreamRequest)
from kvcomp.codecs.registry import register
from kvcomp.codecs.uniform import PARAM_DTYPES
from kvcomp.errors import ConfigError, NonFiniteKVError, unknown_choice
from kvcomp.kernels.formats import RotatedReader, UniformReader
from kvcomp.stages.covariance_rotation import covariance_rotation, score_weighted_covariance
from kvcomp.stages.hadamard import is_power_of_two
from kvcomp.stages.ranges import range_fits, saturated
from kvcomp.stages.rope import apply_rope
from kvcomp.stages.uniform_quantizer import GroupQuantizer

GRANULARITIES = ("layer", "kv_head")
PAPER_CONTEXT = 128 * 1024  # tokens of the cache whose bits per element the paper reports ("BPE at 128K")
PAPER_FP_BITS = 16  # its sinks and recent window are bf16


@dataclass
class OscarConfig(CodecConfig):
    name: str = "oscar"
    bits: int = 2
    group_size: int | None = None  # channels per scale / zero-point; None: the whole head (the reference's 128)
    key_clip_ratio: float = 0.96  # a row is clipped to its floor(ratio x head_dim)-th smallest magnitude; 0: off
    value_clip_ratio: float = 0.92
    param_dtype: str = "float16"  # scale and zero-point (the paper's count; the reference's serving: float32)
    sinks: int = 64
    window: int = 256  # most recent tokens kept in full precision
    flush_block: int = 8  # recent tokens encoded together once the window is full (the reference's N_Q)
    granularity: str = "layer"  # layer (the reference) | kv_head: one rotation per layer or per KV head
    calibration_drop_first: int = 0  # leading tokens of every calibration window left out (the reference keeps all)


def clip_rows(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """``x [..., d]`` with every row clipped to ``[-τ, τ]``, ``τ`` the row's ``min(floor(ratio d), d - 1)``-th
    smallest magnitude (0-based, the reference's per-row threshold); ``ratio <= 0``: ``x`` unchanged."""
    if ratio <= 0:
        return x
    d = x.shape[-1]
    tau = x.abs().kthvalue(min(int(ratio * d), d - 1) + 1, dim=-1, keepdim=True).values
    return torch.minimum(torch.maximum(x, -tau), tau)


@register
class OscarCodec(Codec, Calibrated, FusedPayload):
    """Fitted rotation, clipped INT2 per token, full-precision sinks and window (stream scope, post-RoPE keys)."""

    config_class = OscarConfig
    needs_queries = True
    inference_only_fields = ("bits", "group_size", "key_clip_ratio", "value_clip_ratio", "param_dtype", "sinks",
                             "window", "flush_block")

    @property
    def calibration_drop_first(self) -> int:
        return self.config.calibration_drop_first

    def validate(self) -> None:
        cfg, d = self.config, self.model.head_dim
        if cfg.granularity not in GRANULARITIES:
            raise unknown_choice(f"{self.name} granularity", cfg.granularity, GRANULARITIES)
        if cfg.param_dtype not in PARAM_DTYPES:
            raise unknown_choice(f"{self.name} param_dtype", cfg.param_dtype, PARAM_DTYPES)
        if not is_power_of_two(d):
            raise ConfigError(f"{self.name}: head_dim={d} of {self.model.name} is not a power of two, which the "
                              "rotation's Hadamard factor needs")
        for kind in KINDS:
            ratio = getattr(cfg, f"{kind}_clip_ratio")
            if not 0 <= ratio <= 1:
                raise ConfigError(f"{self.name}: {kind}_clip_ratio={ratio} must be in [0, 1] (0: no clipping)")
        if cfg.sinks < 0 or cfg.window < 0 or cfg.flush_block < 1 or cfg.calibration_drop_first < 0:
            raise ConfigError(f"{self.name}: sinks, window and calibration_drop_first must be >= 0 and flush_block >= 1, "
                              f"got {cfg.sinks}, {cfg.window}, {cfg.calibration_drop_first} and {cfg.flush_block}")
        self.build_quantizer().validate(d, self.name)

    def build_quantizer(self) -> GroupQuantizer:
        cfg = self.config
        group = cfg.group_size or self.model.head_dim
        return GroupQuantizer(cfg.bits, group, "per_token", PARAM_DTYPES[cfg.param_dtype])

    def build(self) -> None:
        self.quantizer = self.build_quantizer()
        self.rotations: dict[tuple[int, str], torch.Tensor] = {}  # [1 or kv_heads, d, d] float32, filled by load_state
        self._placed: dict[tuple[int, str, bool], torch.Tensor] = {}  # on the device that last read

    def fit(self, activations: Activations) -> CodecState:
        """Each layer's key and value rotation from the calibration windows' post-RoPE keys, values and query
        second moments (see the module docstring)."""
        if activations.query_moments is None:
            raise ConfigError(f"{self.name}: the calibration gave no query statistics (Activations.query_moments)")
        rope = activations.rope
        if self.model.has_rope and rope is None:
            raise ConfigError(f"{self.name}: fitting on post-RoPE keys needs the calibration windows' RoPE angles "
                              "(Activations.rope)")
        tensors = {}
        for layer in range(self.model.num_layers):
            fields = activations.layer(layer)
            keys, values = (fields[kind].to(activations.device).float() for kind in KINDS)
            if rope is not None:
                keys = apply_rope(keys, *(t.to(keys.device)[None] for t in rope))  # the keys attention meets
            query_moment = activations.query_moments[layer].to(activations.device)
            targets = {"key": query_moment.double(), "value": score_weighted_covariance(values, keys, query_moment)}
            for kind, target in targets.items():
                if self.config.granularity == "layer":
                    target = target.mean(0, keepdim=True)
                tensors[f"layer{layer}.{kind}.rotation"] = covariance_rotation(target).float().cpu()
        return CodecState(tensors)

    def load_state(self, state: CodecState) -> None:
        self.rotations = {(layer, kind): state.tensors[f"layer{layer}.{kind}.rotation"]
                          for layer in range(self.model.num_layers) for kind in KINDS}
        self._placed = {}

    def rotation(self, layer: int, kind: str, device: torch.device, transposed: bool = False) -> torch.Tensor:
        """The fitted rotation of ``layer``'s ``kind`` on ``device``, ``[1 or kv_heads, d, d]`` (``transposed``:
        ``R^T``, contiguous), moved and transposed once."""
        if not self.rotations:
            raise ConfigError(f"{self.name}: not calibrated (its rotations are fitted on calibration windows)")
        placed = self._placed.get((layer, kind, transposed))
        if placed is None or placed.device != device:
            rotation = self.rotations[(layer, kind)]
            rotation = rotation.transpose(-1, -2).contiguous() if transposed else rotation
            placed = self._placed[(layer, kind, transposed)] = rotation.to(device)
        return placed

    def policy(self, kind: str, layer_idx: int) -> StreamPolicy:
        return StreamPolicy(self.config.sinks, self.config.flush_block, self.config.window)

    def encode(self, request: StreamRequest) -> Payload:
        x = request.tokens
        rotated = x.float() @ self.rotation(request.layer, request.kind, x.device)
        if not range_fits(torch.isfinite(rotated).all(), request.range_checks):
            raise NonFiniteKVError(f"{self.name}: the rotated {request.kind}s hold NaN or Inf (NaN or Inf in the input, "
                                   "or magnitudes near float32's max, which a rotation may exceed)")
        clipped = clip_rows(rotated, getattr(self.config, f"{request.kind}_clip_ratio"))
        return Payload(self.quantizer.encode(clipped, request.range_checks), num_tokens=x.shape[2])

    def decode(self, payload: Payload, request: StreamRequest) -> torch.Tensor:
        rotated = self.quantizer.decode(payload.tensors, self.model.head_dim, torch.float32)
        r = self.rotation(request.layer, request.kind, rotated.device)
        return saturated(rotated @ r.transpose(-1, -2), request.dtype)

    def payload_reader(self, payload: Payload, kind: str, layer_idx: int) -> RotatedReader:
        """The INT2 codes in the rotated basis, ``x_hat = y_hat R^T``: the fused kernel rotates the query and
        un-rotates the output (the reference rotates the query for keys and folds ``R_V`` into the projections)."""
        d = self.model.head_dim
        inner = UniformReader.of(self.quantizer, payload, d)
        return RotatedReader(payload.num_tokens, d, inner, self.rotation(layer_idx, kind, inner.codes.device, transposed=True))

    def code_bits_per_value(self, kind: str, layer_idx: int) -> float:
        return self.quantizer.bits_per_value(self.model.head_dim)

    def overhead_bits(self) -> int:
        """The rotations, float32."""
        return 32 * sum(r.numel() for r in self.rotations.values())

    def paper_bits_per_value(self) -> float:
        """The paper's BPE: bits per K/V element of a :data:`PAPER_CONTEXT`-token cache whose sinks and window are
        16-bit (scales and zero-points counted, the rotations not)."""
        full = min(self.config.sinks + self.config.window, PAPER_CONTEXT)
        return (full * PAPER_FP_BITS + (PAPER_CONTEXT - full) * self.bits_per_value()) / PAPER_CONTEXT
