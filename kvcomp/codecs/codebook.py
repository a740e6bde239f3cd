"""What the three codebook codecs of the TemporalKV thesis share: calibration, coding, bit accounting.

KVQuant, ChannelKV and TemporalKV (``kvquant.py``, ``channelkv.py``, ``temporalkv.py``) differ only in
their *schemes*: how a ``[B, H, T, D]`` block is cut into chunks (:class:`ChunkLayout`), how it is
normalised first (:class:`Normalizer`), and how many centroids a codebook has. Everything else is here,
identical for all three, as the thesis requires for a fair comparison (§6.3.3):

- calibration: pre-RoPE K/V and their squared gradients, the :class:`~kvcomp.codecs.base.Activations`
  ``fit`` receives (Fisher weights are collected only when ``fisher`` or a hybrid choice uses them); offline per-channel
  statistics; per (layer, K/V, KV head, channel group) a Fisher-weighted k-means codebook (Eq. 3),
  fitted on the first ``train_fraction`` of the calibration windows, the rest held out;
- chunk weights in normalised space ``sum_{elements} scale^2 * g^2`` (``fisher: false`` drops ``g^2``);
- ``sinks`` first tokens in full precision, optional full-precision ``window`` of recent tokens;
- optional dense-and-sparse outliers (``outliers: 0.01`` keeps up to 1% of each token's entries exactly),
  chosen by ``outlier_rule``: ``token_topk`` or the KVQuant reference's thresholds (:mod:`kvcomp.stages.outliers`);
- pre-RoPE keys (the cache re-applies RoPE after decoding).

When a codec offers several schemes for a stream (TemporalKV's hybrid early layers), every candidate is
fitted and the one with the lower held-out Fisher-weighted MSE ``mean(g^2 (x - x_hat)^2)`` wins
(thesis §1.10 / §7.3).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import torch

from kvcomp.codecs.base import (KINDS, Activations, Calibrated, Codec, CodecConfig, CodecState, FusedPayload, Payload,
                                StreamPolicy, StreamRequest)
from kvcomp.errors import CalibrationMismatchError, ConfigError
from kvcomp.kernels.codebook_encode import encode_codebook
from kvcomp.kernels.formats import CodebookReader
from kvcomp.progress import progress_bar
from kvcomp.stages.codebook import ChunkLayout, CodebookQuantizer
from kvcomp.stages.kmeans import KMeansSettings, weighted_kmeans
from kvcomp.stages.normalization import ChannelStats, Normalizer
from kvcomp.stages.outliers import RULES, TOKEN_TOPK, OutlierSelector
from kvcomp.stages.ranges import saturated

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
SUPPORTED_BITS = (1, 2, 4, 8)

log = logging.getLogger(__name__)


@dataclass
class CodebookConfig(CodecConfig):
    bits: int = 2  # bits per value: chunks of 8/bits values per 8-bit code (KVQuant: 2^bits scalar centroids)
    sinks: int = 8  # first tokens kept in full precision (thesis §1.9)
    window: int = 0  # most recent tokens kept in full precision besides the chunk buffer
    outliers: float = 0.0  # fraction of each token's entries stored exactly, at most (0.01: the thesis' "-1%")
    outlier_rule: str = TOKEN_TOPK  # which entries: token_topk | reference (kvcomp.stages.outliers)
    clamp_outliers: bool = False  # clamp flagged entries to the calibration range before encoding
    exclude_outliers_from_kmeans: bool = False  # zero the Fisher weight of outliers during k-means
    fisher: bool = True  # Fisher-weighted k-means (False: weights scale^2 only, thesis Table 2)
    kmeans_iters: int = 50
    kmeans_tol: float = 1e-4
    kmeans_seed: int = 0
    train_fraction: float = 0.75  # calibration windows used for k-means; the rest score the hybrid choice
    codebook_dtype: str = "bfloat16"
    calibration_drop_first: int = 8  # sink tokens left out of calibration


@dataclass(frozen=True)
class Scheme:
    """How one stream is coded: chunk layout, normalisation and codebook size."""

    layout: ChunkLayout
    normalizer: Normalizer
    num_centroids: int

    @property
    def quantizer(self) -> CodebookQuantizer:
        return CodebookQuantizer(self.layout, self.num_centroids)


class CodebookCodec(Codec, Calibrated, FusedPayload):
    """Base of the codebook codecs; subclasses define :meth:`schemes` (and may override :meth:`chunk_len`)."""

    inference_only_fields = ("sinks", "window")  # calibration does not depend on these
    outliers_change_schemes = False  # whether the outlier setting changes normalisation (KVQuant)

    @property
    def pre_rope(self) -> bool:
        return True

    @property
    def chunk_len(self) -> int:
        """Values per 8-bit code (``l`` in the thesis)."""
        return 8 // self.config.bits

    def schemes(self, kind: str, layer_idx: int) -> dict[str, Scheme]:
        """Candidate schemes for a stream, in preference order; calibration picks one when several."""
        raise NotImplementedError

    # ----------------------------------------------------------------- validation and schedule
    def validate(self) -> None:
        cfg = self.config
        if cfg.bits not in SUPPORTED_BITS:
            raise ConfigError(f"{self.name}: bits={cfg.bits} is not supported; choose one of {SUPPORTED_BITS}")
        if cfg.codebook_dtype not in DTYPES:
            raise ConfigError(f"{self.name}: codebook_dtype {cfg.codebook_dtype!r} unknown; valid: {', '.join(DTYPES)}")
        if not 0 <= cfg.outliers < 0.5:
            raise ConfigError(f"{self.name}: outliers={cfg.outliers} must be a fraction in [0, 0.5)")
        if cfg.outlier_rule not in RULES:
            raise ConfigError(f"{self.name}: outlier_rule {cfg.outlier_rule!r} unknown; valid: {', '.join(RULES)}")
        if cfg.sinks < 0 or cfg.window < 0 or cfg.calibration_drop_first < 0:
            raise ConfigError(f"{self.name}: sinks, window and calibration_drop_first must be >= 0")
        if not 0 < cfg.train_fraction <= 1:
            raise ConfigError(f"{self.name}: train_fraction={cfg.train_fraction} must be in (0, 1]")
        for layer in range(self.model.num_layers):
            for kind in KINDS:
                for scheme in self.schemes(kind, layer).values():
                    problem = scheme.layout.check(self.model.head_dim)
                    if problem:
                        raise ConfigError(f"{self.name} at {cfg.bits} bits: {problem}")

    def build(self) -> None:
        self.outlier_selector = OutlierSelector(self.config.outliers, self.config.outlier_rule)
        self.chosen: dict[tuple[int, str], str] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.stats: dict[tuple[int, str], ChannelStats] = {}  # built once from the loaded state
        self.device_state: dict[tuple[int, str, str], tuple[ChannelStats, torch.Tensor, tuple]] = {}

    def scheme(self, kind: str, layer_idx: int) -> Scheme:
        candidates = self.schemes(kind, layer_idx)
        if len(candidates) == 1:
            return next(iter(candidates.values()))
        if (layer_idx, kind) not in self.chosen:
            raise ConfigError(f"{self.name}: layer {layer_idx} {kind}s choose their scheme at calibration; calibrate first")
        return candidates[self.chosen[(layer_idx, kind)]]

    def policy(self, kind: str, layer_idx: int) -> StreamPolicy:
        return StreamPolicy(self.config.sinks, self.scheme(kind, layer_idx).layout.time_len, self.config.window)

    # ----------------------------------------------------------------- coding
    def _stats(self, layer_idx: int, kind: str, device) -> ChannelStats:
        return self._on_device(layer_idx, kind, device)[0]

    def _codebooks(self, layer_idx: int, kind: str, device) -> torch.Tensor:
        return self._on_device(layer_idx, kind, device)[1]

    def _on_device(self, layer_idx: int, kind: str, device) -> tuple[ChannelStats, torch.Tensor, tuple]:
        """The stream's statistics, codebooks and per-channel inverse normalisation
        (:meth:`~kvcomp.stages.normalization.Normalizer.channel_affine`, float32) on ``device``: one copy per device,
        not a transfer per call, and the same tensors at every call (what a captured decode step reads again)."""
        key = (layer_idx, kind, str(device))
        if (layer_idx, kind) not in self.stats:
            raise ConfigError(f"{self.name}: no calibration state loaded (layer {layer_idx} {kind}s)")
        if key not in self.device_state:
            codebooks = self.tensors[f"layer{layer_idx}.{kind}.codebooks"]
            stats = self.stats[(layer_idx, kind)].to(device)
            channel = tuple(t.float().contiguous() for t in self.scheme(kind, layer_idx).normalizer.channel_affine(stats))
            self.device_state[key] = (stats, codebooks.to(device), channel)
        return self.device_state[key]

    def calibration_key(self) -> dict:
        """Outliers change the codebooks only when they are clamped or left out of k-means (KVQuant also
        switches normalisation with them); otherwise codecs with and without outliers share a fit. The
        outlier rule counts only then, and only when not the default (artifacts fitted before it keep their keys)."""
        cfg = self.config
        key = super().calibration_key()
        if not (cfg.clamp_outliers or cfg.exclude_outliers_from_kmeans or self.outliers_change_schemes):
            key.pop("outliers")
        if "outliers" not in key or cfg.outliers == 0 or cfg.outlier_rule == TOKEN_TOPK:
            key.pop("outlier_rule")
        return key

    def _encode_with(self, scheme, kind, x, stats, codebooks, outliers: bool = True, backend: str = "torch",
                     range_checks: list | None = None) -> dict:
        stored: dict[str, torch.Tensor] = {}
        if outliers and self.config.outliers > 0:
            stored.update(self.outlier_selector.select(x, stats, kind))
            if self.config.clamp_outliers:
                x = self._clamped(x, stats, stored)
        z, _, params = scheme.normalizer.normalize(x, stats, range_checks)
        stored.update(params)
        stored["codes"] = encode_codebook(scheme.quantizer, z, codebooks, backend)
        return stored

    def _decode_with(self, scheme, stored, stats, codebooks) -> torch.Tensor:
        z = scheme.quantizer.decode(stored["codes"], codebooks, self.model.head_dim)
        x = scheme.normalizer.denormalize(z, stats, stored)
        if "outlier_index" in stored:
            x = self.outlier_selector.restore(x, stored)
        return x

    def _clamped(self, x, stats, selected):
        mask = self.outlier_selector.mask(x, selected)
        low, high = (t[None, :, None, :].to(x.device) for t in (stats.low, stats.high))
        return torch.where(mask, torch.minimum(torch.maximum(x.float(), low), high), x.float())

    def encode(self, request: StreamRequest) -> Payload:
        x, kind, layer_idx = request.tokens, request.kind, request.layer
        stats = self._stats(layer_idx, kind, x.device)
        codebooks = self._codebooks(layer_idx, kind, x.device)
        stored = self._encode_with(self.scheme(kind, layer_idx), kind, x, stats, codebooks, backend=request.kernel_backend,
                                   range_checks=request.range_checks)
        return Payload(stored, num_tokens=x.shape[2])

    def decode(self, payload: Payload, request: StreamRequest) -> torch.Tensor:
        kind, layer_idx, device = request.kind, request.layer, payload.tensors["codes"].device
        stats = self._stats(layer_idx, kind, device)
        codebooks = self._codebooks(layer_idx, kind, device)
        return saturated(self._decode_with(self.scheme(kind, layer_idx), payload.tensors, stats, codebooks), request.dtype)

    def fused_attention_supported(self, layer_idx: int) -> bool:
        """Without sparse outliers (their scatter stays on the torch path)."""
        return self.config.outliers == 0

    def payload_reader(self, payload: Payload, kind: str, layer_idx: int) -> CodebookReader:
        scheme, stored = self.scheme(kind, layer_idx), payload.tensors
        device = stored["codes"].device
        _, codebooks, channel = self._on_device(layer_idx, kind, device)
        return CodebookReader(payload.num_tokens, self.model.head_dim, stored["codes"], codebooks, scheme.layout,
                              *channel, *scheme.normalizer.token_affine(stored))

    # ----------------------------------------------------------------- bit accounting
    def code_bits_per_value(self, kind: str, layer_idx: int) -> float:
        scheme = self.scheme(kind, layer_idx)
        h, d = self.model.num_kv_heads, self.model.head_dim
        return (
            scheme.quantizer.bits_per_value(d)
            + scheme.normalizer.bits_per_value(h, d)
            + self.outlier_selector.bits_per_value(h, d)
        )

    def paper_bits_per_value(self) -> float:
        """The thesis' accounting: code bits plus 16 bits per outlier value (4/2/1, +0.16 at 1%)."""
        return self.config.bits + self.outlier_selector.paper_bits_per_value()

    def overhead_bits(self) -> int:
        """Codebooks and per-channel statistics the decoder keeps (all layers, K and V)."""
        return sum(
            t.numel() * torch.finfo(t.dtype).bits for name, t in self.tensors.items() if ".mse." not in name
        )

    # ----------------------------------------------------------------- calibration
    def _kmeans_settings(self) -> KMeansSettings:
        cfg = self.config
        return KMeansSettings(iters=cfg.kmeans_iters, tol=cfg.kmeans_tol, seed=cfg.kmeans_seed)

    def _fit_codebooks(self, scheme: Scheme, kind: str, x: torch.Tensor, grad2: torch.Tensor | None,
                       stats: ChannelStats) -> tuple[torch.Tensor, int]:
        """Fisher-weighted k-means codebooks ``[H, G, k, dim]`` of one ``kind`` stream from ``x, grad2 [S, H, T, D]``
        (``grad2`` None: ``fisher`` off), and the iterations k-means ran."""
        keep = torch.ones_like(x, dtype=torch.bool)
        if self.config.outliers > 0:
            selected = self.outlier_selector.select(x, stats, kind)
            mask = self.outlier_selector.mask(x, selected)
            if self.config.clamp_outliers:
                x = self._clamped(x, stats, selected)
            if self.config.exclude_outliers_from_kmeans:
                keep = ~mask
        z, scale, _ = scheme.normalizer.normalize(x, stats)
        weight = scale.square().expand_as(z) * (grad2 if self.config.fisher and grad2 is not None else 1.0) * keep
        chunks = scheme.layout.to_chunks(z)
        chunk_weight = scheme.layout.to_chunks(weight).sum(-1)
        h, g, n, dim = chunks.shape
        if n < scheme.num_centroids:
            raise ConfigError(
                f"{self.name}: calibration gives {n} chunks per codebook but {scheme.num_centroids} centroids "
                "need more; raise calibration.num_samples or calibration.seq_len"
            )
        centroids, _, iters = weighted_kmeans(
            chunks.reshape(h * g, n, dim), chunk_weight.reshape(h * g, n), scheme.num_centroids, self._kmeans_settings()
        )
        return centroids.view(h, g, scheme.num_centroids, dim).to(DTYPES[self.config.codebook_dtype]), iters

    def _heldout_mse(self, scheme, kind, codebooks, x, grad2, stats) -> float:
        """Fisher-weighted reconstruction error ``mean(g^2 (x - x_hat)^2)`` in raw space, without outlier
        patching (as [REF]), so that the hybrid choice does not depend on the outlier setting."""
        x_hat = self._decode_with(scheme, self._encode_with(scheme, kind, x, stats, codebooks, outliers=False), stats, codebooks)
        return float((grad2 * (x.float() - x_hat).square()).mean())

    def choose_schemes(self, layer_idx: int, errors: dict[str, dict[str, float]]) -> dict[str, str]:
        """Pick each stream's scheme from held-out errors ``{kind: {scheme: mse}}``: the lowest per stream."""
        return {kind: min(per_scheme, key=per_scheme.get) for kind, per_scheme in errors.items()}

    @property
    def needs_fisher(self) -> bool:
        """Fisher weights serve Fisher-weighted k-means (``fisher``) and the held-out errors of hybrid
        scheme choices; without either, calibration runs forward passes only."""
        hybrid = any(len(self.schemes(kind, layer)) > 1 for layer in range(self.model.num_layers) for kind in KINDS)
        return self.config.fisher or hybrid

    @property
    def calibration_drop_first(self) -> int:
        return self.config.calibration_drop_first

    def fit(self, acts: Activations) -> CodecState:
        """Per layer and stream: channel statistics, codebooks of each candidate scheme, and the scheme
        with the lowest held-out Fisher-weighted error."""
        cfg = self.config
        start = time.perf_counter()
        device = acts.device
        samples, _, tokens, _ = acts.shape
        train = max(1, round(cfg.train_fraction * samples))
        usable = tokens // 8 * 8  # whole chunks for every chunk length
        tensors: dict[str, torch.Tensor] = {}
        iterations: list[int] = []
        bar = progress_bar(self.model.num_layers * len(KINDS), f"{self.name}: k-means", "fit")
        for layer in range(self.model.num_layers):
            data = acts.layer(layer)
            fitted, errors = {}, {}
            for kind in KINDS:
                x = data[kind][:, :, :usable].to(device, torch.float32)
                grad2 = data[f"{kind}_grad2"][:, :, :usable].to(device, torch.float32) if self.needs_fisher else None
                stats = ChannelStats.of(x)
                tensors.update(stats.as_tensors(f"layer{layer}.{kind}"))
                held_x, held_g = (x[train:], None if grad2 is None else grad2[train:]) if train < samples else (x, grad2)
                candidates = self.schemes(kind, layer)
                for name, scheme in candidates.items():
                    codebooks, iters = self._fit_codebooks(scheme, kind, x[:train], None if grad2 is None else grad2[:train], stats)
                    iterations.append(iters)
                    fitted[(kind, name)] = codebooks
                    if len(candidates) > 1:
                        mse = self._heldout_mse(scheme, kind, codebooks, held_x, held_g, stats)
                        errors.setdefault(kind, {})[name] = mse
                        tensors[f"layer{layer}.{kind}.mse.{name}"] = torch.tensor([mse])
                bar.update(1)
            choice = self.choose_schemes(layer, errors)
            for kind in KINDS:
                names = list(self.schemes(kind, layer))
                name = choice.get(kind, names[0])
                tensors[f"layer{layer}.{kind}.codebooks"] = fitted[(kind, name)].cpu()
                tensors[f"layer{layer}.{kind}.scheme"] = torch.tensor([names.index(name)])
        bar.close()
        log.info("%s calibration: codebooks %.1fs (k-means iterations: max %d)", self.name,
                 time.perf_counter() - start, max(iterations))
        return CodecState(tensors)

    def load_state(self, state: CodecState) -> None:
        tensors = dict(state.tensors)
        chosen = {}
        for layer in range(self.model.num_layers):
            for kind in KINDS:
                names = list(self.schemes(kind, layer))
                key = f"layer{layer}.{kind}.scheme"
                needed = (key, f"layer{layer}.{kind}.codebooks", f"layer{layer}.{kind}.mean")
                if any(name not in tensors for name in needed):
                    raise CalibrationMismatchError(f"{self.name}: calibration state lacks layer {layer} {kind}s")
                chosen[(layer, kind)] = names[int(tensors.pop(key))]
        self.chosen, self.tensors = chosen, tensors
        self.device_state = {}
        self.stats = {
            (layer, kind): ChannelStats.from_tensors(tensors, f"layer{layer}.{kind}")
            for layer in range(self.model.num_layers)
            for kind in KINDS
        }

    def describe(self) -> str:
        """``name(bits=..., outliers=..., <fields that differ from their defaults>)``."""
        defaults = asdict(type(self.config)())
        shown = {k: v for k, v in asdict(self.config).items() if k in ("bits", "outliers") or (k != "name" and v != defaults[k])}
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in shown.items())})"

    def summary(self) -> dict:
        """Which layers chose which scheme (for codecs with several candidates)."""
        picked: dict[str, list[str]] = {}
        for (layer, kind), name in sorted(self.chosen.items()):
            if len(self.schemes(kind, layer)) > 1:
                picked.setdefault(f"{kind}:{name}", []).append(str(layer))
        return {"paper_bits_per_value": round(self.paper_bits_per_value(), 4), **{k: ",".join(v) for k, v in picked.items()}}
