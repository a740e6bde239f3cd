"""AQUA-KV (Shutova et al., ICML 2025; spec ``seed-002-aquakv.md``): cross-layer linear predictors plus a
quantized residual, layer scope.

For a block of tokens and layer ``l >= 1`` (spec §3.2, Alg. 2-3), with hats marking reconstructions:

- keys: ``K_pred = f_key(K_hat_{l-1})``, store ``Q(K_l - K_pred)``, ``K_hat_l = Q^-1(.) + K_pred``;
- values: ``V_pred = f_value([K_hat_l ; V_hat_{l-1}])``, store ``Q(V_l - V_pred)``, ``V_hat_l = Q^-1(.) + V_pred``;

``f`` are affine maps over one token's ``D = kv_heads x head_dim`` values (head-major), fitted in closed
form (:mod:`kvcomp.stages.ridge`) and stored in 16 bits; ``Q`` is per-token HIGGS
(:mod:`kvcomp.codecs.higgs`) or, ``quantizer=quanto``, int-``bits`` min-max groups of 64 channels.
Layer 0 has no predictor and is coded with 4-bit HIGGS (``first_layer_bits``; 16 keeps it in bf16).
Keys are pre-RoPE; 4 sinks stay in full precision; recent tokens wait in a full-precision buffer that
is encoded 128 tokens at a time (§3.6).

Calibration (Alg. 1, :meth:`AquaKVCodec.fit`) is closed loop: layer ``l``'s predictors are fitted on the
reconstructions this codec itself produces for layer ``l - 1`` (quantize -> dequantize), with the same
code path as inference; a held-out share of the calibration windows gives each layer's relative MSE.
Encode and decode compute predictions in float32 from the reconstructions cast to the cache dtype, so the
decoder reproduces the encoder's predictions exactly.

Deviations (documented options): the buffer is encoded in whole 128-token blocks, so a multi-token
forward leaves its last ``< 128`` tokens in full precision where the reference compresses the whole
buffer; token by token the two schedules are identical. ``value_inputs=previous_layer`` uses
``[K_hat_{l-1} ; V_hat_{l-1}]`` (spec A1's ablation). ``center`` (default ``none``) codes ``Q(r - c)`` with
``c`` one vector per layer and stream (:mod:`kvcomp.stages.centering`): ``calibration``, the calibration mean of
what the quantizer codes (layer 0's keys and values, and the residuals); ``bias``, the model's k_proj / v_proj
bias for what is coded without a predictor (layer 0; the predictors' intercepts hold the offset of the others).
``damping_basis=centred`` damps the ridge fit by the inputs' centred covariance instead of the uncentred
``X^T X`` (the reference), which over-regularises inputs on a large offset (:mod:`kvcomp.stages.ridge`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcomp.codecs.base import (Activations, Calibrated, Codec, CodecState, LayerEncoding, LayerRequest, Payload,
                                StreamPolicy, fit_layer_by_layer)
from kvcomp.codecs.higgs import HiggsConfig, TokenHiggs, build_higgs, check_center
from kvcomp.codecs.registry import register
from kvcomp.errors import ConfigError, unknown_choice
from kvcomp.progress import progress_bar
from kvcomp.stages.centering import Offsets, channel_mean, model_bias
from kvcomp.stages.ranges import saturated
from kvcomp.stages.ridge import DAMPING_BASES, LinearPredictor, RidgeFit
from kvcomp.stages.rope import apply_rope
from kvcomp.stages.uniform_quantizer import GroupQuantizer

QUANTIZERS = ("higgs", "quanto")
VALUE_INPUTS = ("current_keys", "previous_layer")
PREDICTOR_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
METRICS = ("fit_prediction", "heldout_prediction", "heldout_reconstruction")


class TokenQuanto:
    """optimum-quanto's int-b per-token groups (min-max, 16-bit scale and zero-point) over ``[B, H, T, d]``."""

    def __init__(self, bits: int, group: int, head_dim: int, owner: str):
        self.quantizer, self.head_dim = GroupQuantizer(bits, group, "per_token"), head_dim
        self.quantizer.validate(head_dim, owner)

    def encode(self, x: torch.Tensor, range_checks: list | None = None) -> dict[str, torch.Tensor]:
        return self.quantizer.encode(x, range_checks)

    def decode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.quantizer.decode(tensors, self.head_dim, torch.float32)

    def bits_per_value(self) -> float:
        return self.quantizer.bits_per_value(self.head_dim)


class BFloat16:
    """Layer 0 kept in 16 bits (Table D's "Keep in BF16")."""

    def encode(self, x: torch.Tensor, range_checks: list | None = None) -> dict[str, torch.Tensor]:
        return {"x": x.to(torch.bfloat16)}

    def decode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return tensors["x"].float()

    def bits_per_value(self) -> float:
        return 16.0


def tokens_major(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, d] -> [B, T, H d]`` (one row per token, heads concatenated)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def heads_major(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of :func:`tokens_major`."""
    b, t, _ = x.shape
    return x.view(b, t, heads, -1).transpose(1, 2)


@dataclass
class AquaKVConfig(HiggsConfig):
    """HIGGS's fields (``bits`` of the residual: 2 | 3 | 4, grid, groups, sinks, buffer, ``pre_rope``) plus the
    predictors'."""

    name: str = "aquakv"
    quantizer: str = "higgs"  # higgs | quanto (int-bits per-token groups of quanto_group_size, Table B)
    quanto_group_size: int = 64
    first_layer_bits: int = 4  # HIGGS bits of layer 0, no predictor (2 | 3 | 4), or 16: kept in bf16 (Table D)
    key_predictor: bool = True  # false: "w/o K predictor" (Table G)
    value_predictor: bool = True  # false: "w/o V predictor"
    value_inputs: str = "current_keys"  # current_keys: [K_hat_l; V_hat_l-1] (paper) | previous_layer: [K_hat_l-1; V_hat_l-1]
    predictor_rank: int = 0  # 0: full linear maps; r > 0: reduced-rank regression (Table C: 256)
    damping: float = 1.0e-3  # ridge: lambda * mean(diag(X^T X))
    damping_basis: str = "uncentred"  # uncentred: diag(X^T X) (reference) | centred: diag of X's covariance (not the paper's)
    predictor_dtype: str = "bfloat16"
    heldout_fraction: float = 0.125  # held-out calibration windows (the paper: 32 of 256): relative MSE per layer
    calibration_drop_first: int = 0  # the reference fits on every position (spec A9)


@register
class AquaKVCodec(Codec, Calibrated):
    config_class = AquaKVConfig
    quiet_defaults = {**Codec.quiet_defaults, "center": "none", "damping_basis": "uncentred"}
    scope = "layer"
    inference_only_fields = ("sinks", "buffer")

    def validate(self) -> None:
        cfg = self.config
        if cfg.quantizer not in QUANTIZERS:
            raise unknown_choice(f"{self.name} quantizer", cfg.quantizer, QUANTIZERS)
        if cfg.value_inputs not in VALUE_INPUTS:
            raise unknown_choice(f"{self.name} value_inputs", cfg.value_inputs, VALUE_INPUTS)
        if cfg.predictor_dtype not in PREDICTOR_DTYPES:
            raise unknown_choice(f"{self.name} predictor_dtype", cfg.predictor_dtype, PREDICTOR_DTYPES)
        if cfg.damping_basis not in DAMPING_BASES:
            raise unknown_choice(f"{self.name} damping_basis", cfg.damping_basis, DAMPING_BASES)
        check_center(self.name, cfg)
        if cfg.first_layer_bits not in (2, 3, 4, 16):
            raise ConfigError(f"{self.name}: first_layer_bits={cfg.first_layer_bits}; valid: 2, 3, 4 (HIGGS) or 16 (bf16)")
        if cfg.sinks < 0 or cfg.buffer < 1 or cfg.predictor_rank < 0 or cfg.damping < 0 or cfg.calibration_drop_first < 0:
            raise ConfigError(f"{self.name}: sinks, predictor_rank, damping and calibration_drop_first must be >= 0 "
                              f"and buffer >= 1")
        if not 0 < cfg.heldout_fraction < 1:
            raise ConfigError(f"{self.name}: heldout_fraction={cfg.heldout_fraction} must be in (0, 1)")

    def build(self) -> None:
        cfg = self.config
        self.residual = self._higgs(cfg.bits) if cfg.quantizer == "higgs" else TokenQuanto(
            cfg.bits, cfg.quanto_group_size, self.model.head_dim, f"{self.name} (quanto)")
        self.first = BFloat16() if cfg.first_layer_bits == 16 else self._higgs(cfg.first_layer_bits)
        self.predictors: dict[tuple[int, str], LinearPredictor] = {}
        self.offsets = Offsets()
        self.metrics: torch.Tensor | None = None

    def _higgs(self, bits: int) -> TokenHiggs:
        cfg = self.config
        return TokenHiggs(build_higgs(self.name, self.model, bits, cfg.grid_dim, cfg.group_size, cfg.pad_groups,
                                      cfg.scale_dtype, cfg.grid_seed), self.model)

    def policy(self, kind: str, layer_idx: int) -> StreamPolicy:
        return StreamPolicy(self.config.sinks, self.config.buffer, 0)

    @property
    def calibration_drop_first(self) -> int:
        return self.config.calibration_drop_first

    # --- the closed loop shared by calibration and inference ---
    def _quantizer(self, layer_idx: int):
        return self.first if layer_idx == 0 else self.residual

    def _step(self, x: torch.Tensor, layer_idx: int, kind: str, predicted: torch.Tensor | None, dtype: torch.dtype,
              range_checks: list | None = None):
        """Store ``Q(x - predicted - c)``: ``(payload tensors, reconstruction in dtype)``."""
        residual = x.float() if predicted is None else x.float() - predicted
        tensors = self._quantizer(layer_idx).encode(self.offsets.remove(residual, layer_idx, kind), range_checks)
        return tensors, self._reconstruct(self._decoded(tensors, layer_idx, kind), predicted, dtype)

    def _decoded(self, tensors: dict[str, torch.Tensor], layer_idx: int, kind: str) -> torch.Tensor:
        """The stored residual: ``Q^-1(.) + c``."""
        return self.offsets.restore(self._quantizer(layer_idx).decode(tensors), layer_idx, kind)

    @staticmethod
    def _reconstruct(decoded: torch.Tensor, predicted: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        return saturated(decoded if predicted is None else decoded + predicted, dtype)

    def _inputs(self, kind: str, keys: torch.Tensor | None, previous) -> torch.Tensor:
        """Predictor input rows ``[B, T, d_in]``: the previous layer's keys, or the value inputs."""
        if kind == "key":
            return tokens_major(previous[0].float())
        first = previous[0] if self.config.value_inputs == "previous_layer" else keys
        return torch.cat([tokens_major(first.float()), tokens_major(previous[1].float())], dim=-1)

    def _predict(self, kind: str, layer_idx: int, keys: torch.Tensor | None, previous) -> torch.Tensor | None:
        predictor = self.predictors.get((layer_idx, kind))
        if predictor is None or previous is None:
            return None
        return heads_major(predictor(self._inputs(kind, keys, previous)), self.model.num_kv_heads)

    def encode(self, request: LayerRequest) -> LayerEncoding:
        keys, values, layer_idx, previous = request.keys, request.values, request.layer, request.previous
        dtype = keys.dtype
        checks = request.range_checks
        key, k_hat = self._step(keys, layer_idx, "key", self._predict("key", layer_idx, None, previous), dtype, checks)
        value, v_hat = self._step(values, layer_idx, "value", self._predict("value", layer_idx, k_hat, previous), dtype,
                                  checks)
        return LayerEncoding(Payload(key, keys.shape[2]), Payload(value, keys.shape[2]), k_hat, v_hat)

    def decode(self, payload: tuple[Payload, Payload], request: LayerRequest) -> tuple[torch.Tensor, torch.Tensor]:
        (key, value), layer_idx, previous, dtype = payload, request.layer, request.previous, request.dtype
        k_hat = self._reconstruct(self._decoded(key.tensors, layer_idx, "key"),
                                  self._predict("key", layer_idx, None, previous), dtype)
        v_hat = self._reconstruct(self._decoded(value.tensors, layer_idx, "value"),
                                  self._predict("value", layer_idx, k_hat, previous), dtype)
        return k_hat, v_hat

    def code_bits_per_value(self, kind: str, layer_idx: int) -> float:
        return self._quantizer(layer_idx).bits_per_value()

    # --- calibration (Alg. 1) ---
    def _heldout(self, samples: int) -> torch.Tensor:
        """Boolean mask of held-out calibration windows (a seeded permutation, at least one each side)."""
        if samples < 2:
            raise ConfigError(f"{self.name}: calibration needs >= 2 windows (fit + held out), got {samples}")
        count = min(samples - 1, max(1, round(samples * self.config.heldout_fraction)))
        mask = torch.zeros(samples, dtype=torch.bool)
        mask[torch.randperm(samples, generator=torch.Generator().manual_seed(0))[:count]] = True
        return mask

    def _fit_predictor(self, kind: str, layer_idx: int, x: torch.Tensor, y: torch.Tensor) -> None:
        y = tokens_major(y.float())
        ridge = RidgeFit(x.shape[-1], y.shape[-1], x.device)
        ridge.add(x.flatten(0, 1), y.flatten(0, 1))
        fitted = ridge.solve(self.config.damping, self.config.predictor_rank, self.config.damping_basis)
        self.predictors[(layer_idx, kind)] = fitted.to(PREDICTOR_DTYPES[self.config.predictor_dtype])

    def fit(self, activations: Activations) -> CodecState:
        """Fit the predictors layer by layer on reconstructed earlier layers (closed loop); record relative
        MSEs (:data:`METRICS`) per layer and K/V."""
        heldout = self._heldout(activations.shape[0]).to(activations.device)
        self.predictors, self.offsets = {}, Offsets()
        metrics = torch.ones(self.model.num_layers, 2, len(METRICS))
        rope = None if self.pre_rope else activations.rope
        if not self.pre_rope and self.model.has_rope and rope is None:
            raise ConfigError(f"{self.name}: pre_rope=false needs the calibration windows' RoPE angles (Activations.rope)")
        bar = progress_bar(self.model.num_layers, f"{self.name}: predictors", "layer")

        def fit_layer(layer_idx, fields, previous):
            k, v = (fields[kind].to(activations.device).float() for kind in ("key", "value"))
            if rope is not None:
                k = apply_rope(k, *(t.to(k.device)[None] for t in rope))  # the keys inference will see
            hats = []
            for i, (kind, target) in enumerate((("key", k), ("value", v))):
                if previous is not None and getattr(self.config, f"{kind}_predictor"):
                    inputs = self._inputs(kind, hats[0] if hats else None, previous)
                    self._fit_predictor(kind, layer_idx, inputs[~heldout], target[~heldout])
                predicted = self._predict(kind, layer_idx, hats[0] if hats else None, previous)
                self._fit_center(kind, layer_idx, target[~heldout], None if predicted is None else predicted[~heldout],
                                 activations.biases)
                _, hat = self._step(target, layer_idx, kind, predicted, torch.float32)
                hats.append(hat)
                if predicted is not None:
                    metrics[layer_idx, i, 0] = _relative_mse(predicted[~heldout], target[~heldout])
                    metrics[layer_idx, i, 1] = _relative_mse(predicted[heldout], target[heldout])
                metrics[layer_idx, i, 2] = _relative_mse(hat[heldout], target[heldout])
            bar.update(1)
            return None, tuple(hats)

        fit_layer_by_layer(activations, fit_layer)
        bar.close()
        self.metrics = metrics
        tensors = {f"layer{layer}.{kind}.{name}": t for (layer, kind), p in self.predictors.items()
                   for name, t in p.tensors().items()}
        return CodecState({**tensors, **self.offsets.tensors(), "metrics": metrics})

    def _fit_center(self, kind: str, layer_idx: int, target: torch.Tensor, predicted: torch.Tensor | None,
                    biases: dict | None) -> None:
        """The centring vector of what layer ``layer_idx``'s ``kind`` quantizer codes (``center``; fitted windows)."""
        if self.config.center == "calibration":
            self.offsets.vectors[(layer_idx, kind)] = channel_mean(target if predicted is None else target - predicted)
        elif self.config.center == "bias" and predicted is None:
            self.offsets.vectors[(layer_idx, kind)] = model_bias(biases, layer_idx, kind, self.name)

    def load_state(self, state: CodecState) -> None:
        self.predictors = {}
        for layer in range(1, self.model.num_layers):
            for kind in ("key", "value"):
                if f"layer{layer}.{kind}.weight" in state.tensors:
                    parts = [state.tensors.get(f"layer{layer}.{kind}.{name}") for name in ("weight", "bias", "up")]
                    self.predictors[(layer, kind)] = LinearPredictor(*parts)
        self.offsets = Offsets.from_tensors(state.tensors)
        self.metrics = state.tensors["metrics"]

    def predictor_bytes(self) -> int:
        return sum(p.numel * p.weight.element_size() for p in self.predictors.values())

    def overhead_bits(self) -> int:
        """Predictors (16-bit) and the grids (float32), amortised over the cache (spec §3.9)."""
        grids = {id(q.quantizer.grid): q.quantizer.grid.numel() for q in (self.first, self.residual) if isinstance(q, TokenHiggs)}
        return 8 * self.predictor_bytes() + 32 * sum(grids.values()) + self.offsets.bits

    def summary(self) -> dict:
        """Predictor size and the held-out relative MSE per layer (prediction alone, and reconstruction)."""
        if self.metrics is None:
            return {}
        out = {"predictors_mib": round(self.predictor_bytes() / 2**20, 3)}
        for i, kind in enumerate(("key", "value")):
            out[f"{kind}_heldout_prediction_relmse"] = [round(x, 4) for x in self.metrics[:, i, 1].tolist()]
            out[f"{kind}_heldout_reconstruction_relmse"] = [round(x, 5) for x in self.metrics[:, i, 2].tolist()]
        return out


def _relative_mse(estimate: torch.Tensor, target: torch.Tensor) -> float:
    """``|estimate - target|^2 / |target|^2``."""
    return ((estimate - target).square().sum() / target.square().sum().clamp_min(1e-30)).item()
