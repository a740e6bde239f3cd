"""kvtc (KV cache transform coding; spec ``seed-004-kvtc.md``): PCA across every layer and head, DP bit
allocation, DEFLATE. Model scope: a block of tokens of every layer is one payload.

Per token, the pre-RoPE keys of every layer and KV head form one feature row (``p = layers x heads x
head_dim``, (layer, head, dim) order), values another, each with its own basis (``layers_per_group``
splits the layers into PCA groups instead, Table 16). Calibration (:meth:`KVTCCodec.fit`) samples
``calibration_tokens`` positions without replacement (sinks excluded), fits a rank-``rank`` PCA
(randomized SVD, basis and mean stored in fp16) and simulates every group of the DP on the first
``dp_rows`` sampled rows (K10). Those group errors do not depend on the compression ratio, so they are
the fitted state; the DP plan of a ratio (``floor(16 p / CR)`` bits per token, K8) is computed from them
when the codec loads and cached on disk (:func:`plan_for`). ``cr`` is therefore an inference setting: a
sweep over ratios calibrates once.

Encoding projects each token, codes its coefficients with the plan, packs them (K7) and DEFLATEs each
batch row's stream per (K or V, layer group): the compressed bytes are the payload (ragged, variable
length), so the codec has no fixed rate; rows report the measured ratios (:meth:`example_metrics`).
Decoding a layer inflates the stream and reconstructs only that layer's columns (K18).

``deflate_scope``: ``block`` (the default, K7) DEFLATEs each compression event's stream alone (a zlib stream
per block: each block decodes by itself, but DEFLATE learns from 16 tokens only). ``sequence`` runs one raw
DEFLATE stream per (batch row, K or V, layer group) over the sequence's blocks: each block's bytes are the
stream's next segment, flushed with ``Z_SYNC_FLUSH``, so they are stored and counted when the block is encoded,
and may refer back to the last 32 KiB (DEFLATE's window) of the earlier blocks' packed bytes. This is what a
deployment that extends and ships a cache block by block would do: the compressing side (e.g. the prefill
node) keeps per stream the last 32 KiB it compressed, the decompressing side the last 32 KiB it inflated, and
blocks are decoded once, in order (a block read again, e.g. ``decode_per_step``, or out of order is refused).
Both windows are per-sequence state here (:class:`~kvcomp.codecs.base.SequenceState`: held, counted in the
cache's bytes and batch-reordered by the cache); ``cr`` leaves them out, as they are the coders' working
memory, rebuilt from the stored bytes, not stored. Each block also stores the sequence position it starts at
(int64 per row) to check the order. A deviation from the spec (K7: one stream per compression event); the
paper leaves its stream boundaries unstated (nvCOMP on whole caches compressed between inference phases).
A cache with ``sequence`` cannot be stored between turns (:mod:`kvcomp.cache.offload` refuses codecs with
per-sequence state).

The first ``sinks`` tokens are never PCA-coded: the first block codes them in FP8 E4M3 with an fp16 absmax
scale per (layer, head, token) (K11; ``sink_dtype=model`` keeps them apart in the model's dtype instead).
The newest ``window - every`` to ``window`` tokens stay in the model's dtype and ``every`` tokens are
encoded at a time (K12).

Ablations: ``quantization=truncate`` (kvtc-DPQ: the leading ``p / cr`` coefficients in fp16, Table 15) and
``pca_source=prompt`` (Table 18: each sequence's own PCA of its prompt, fitted at its first encode and kept
as per-sequence state, so its bytes count; kvtc-DPQ only).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field

import torch

from kvcomp.artifacts import write_json_atomic
from kvcomp.codecs.base import (KINDS, Activations, CacheStatistics, Calibrated, Codec, CodecConfig, CodecState, ModelRequest,
                                Payload, SequenceState, Stateful, StreamPolicy)
from kvcomp.codecs.registry import register
from kvcomp.errors import ConfigError, DamagedPayloadError, NonFiniteKVError, unknown_choice
from kvcomp.paths import cache_dir
from kvcomp.progress import progress_bar
from kvcomp.stages.bit_allocation import (
    DP_TYPES, FP8_MAX, GROUP_OVERHEAD_BITS, GROUP_SIZES, TYPE_BITS, GroupErrors, Plan, allocate_from, group_errors,
    truncation_plan,
)
from kvcomp.stages.ranges import saturated, stored_in
from kvcomp.stages.transform_coding import (WINDOW, PCABasis, check_inflates_to, decode_rows, deflate, encode_rows,
                                             feature_rows, fit_pca, inflate)

TYPE_NAMES = tuple(TYPE_BITS)
QUANTIZATIONS = ("dp", "truncate")
PCA_SOURCES = ("calibration", "prompt")
SINK_DTYPES = ("fp8", "model")
DEFLATE_SCOPES = ("block", "sequence")

log = logging.getLogger(__name__)


@dataclass
class KVTCConfig(CodecConfig):
    name: str = "kvtc"
    cr: float = 16.0  # target compression ratio before DEFLATE: floor(16 p / cr) bits per token and cache (K8)
    cr_key: float | None = None  # per-cache ratios (Table 7, K14); None: cr
    cr_value: float | None = None
    quantization: str = "dp"  # dp: the DP plan | truncate: kvtc-DPQ, the leading p/cr coefficients in fp16 (Table 15)
    rank: int = 10000  # PCA rank cap (the paper: 10,000; 8,000 for Qwen)
    pca_iters: int = 8
    calibration_tokens: int = 160000  # positions sampled without replacement, sinks excluded
    # The first sampled rows the DP simulates (K10). The paper's 32768 takes minutes on a GPU but about an hour
    # per cache on 2 CPU cores; 1024 keeps the embedded calibration at a few minutes. The hub experiments
    # (conf/experiment/kvtc/) set 32768.
    dp_rows: int = 1024
    group_sizes: list[int] = field(default_factory=lambda: list(GROUP_SIZES))
    layers_per_group: int = 0  # layers per PCA; 0: all of them (K1, Table 16)
    # calibration | prompt: each sequence's own PCA of its prompt, stored with it (kvtc-DPQ only, Table 18)
    pca_source: str = "calibration"
    calibration_drop_first: int = 4  # sink positions never sampled
    seed: int = 0
    sinks: int = 4  # the first tokens, never PCA-coded
    sink_dtype: str = "fp8"  # fp8: E4M3 with an fp16 absmax scale per (layer, head, token) (K11) | model: the model's dtype
    window: int = 128  # the newest window - every .. window tokens stay uncompressed (K12)
    every: int = 16  # tokens per compression event (K12)
    deflate_level: int = 6
    # block: one DEFLATE stream per compression event (K7) | sequence: one per sequence, a segment per block
    # (a deviation: the module docstring)
    deflate_scope: str = "block"
    pre_rope: bool = True


@register
class KVTCCodec(Codec, Calibrated, Stateful):
    config_class = KVTCConfig
    scope = "model"
    payload_layout = "blocks"
    quiet_defaults = {**Codec.quiet_defaults, "deflate_scope": "block"}
    inference_only_fields = ("cr", "cr_key", "cr_value", "quantization", "sinks", "sink_dtype", "window", "every",
                             "deflate_level", "deflate_scope")

    def validate(self) -> None:
        cfg = self.config
        ratios = [r for r in (cfg.cr, cfg.cr_key, cfg.cr_value) if r is not None]
        if min(ratios) < 1 or cfg.rank < 1 or cfg.calibration_tokens < 2 or cfg.dp_rows < 1:
            raise ConfigError(f"{self.name}: cr (cr_key, cr_value) >= 1, rank >= 1, calibration_tokens >= 2 and "
                              f"dp_rows >= 1 required, got {ratios}, {cfg.rank}, {cfg.calibration_tokens}, {cfg.dp_rows}")
        if cfg.sinks < 0 or cfg.every < 1 or cfg.window < cfg.every or not cfg.group_sizes:
            raise ConfigError(f"{self.name}: sinks >= 0, every >= 1, window >= every and non-empty group_sizes required, "
                              f"got sinks={cfg.sinks}, every={cfg.every}, window={cfg.window}")
        if cfg.quantization not in QUANTIZATIONS:
            raise unknown_choice("codec.quantization", cfg.quantization, QUANTIZATIONS)
        if cfg.sink_dtype not in SINK_DTYPES:
            raise unknown_choice("codec.sink_dtype", cfg.sink_dtype, SINK_DTYPES)
        if cfg.deflate_scope not in DEFLATE_SCOPES:
            raise unknown_choice("codec.deflate_scope", cfg.deflate_scope, DEFLATE_SCOPES)
        if cfg.pca_source not in PCA_SOURCES:
            raise unknown_choice("codec.pca_source", cfg.pca_source, PCA_SOURCES)
        if cfg.pca_source == "prompt" and (cfg.quantization != "truncate" or cfg.layers_per_group):
            raise ConfigError(f"{self.name}: pca_source=prompt runs kvtc-DPQ over all layers (Table 18): set "
                              f"quantization=truncate and layers_per_group=0 (the DP needs calibration data)")
        layers = self.model.num_layers
        size = cfg.layers_per_group or layers
        if not 1 <= size <= layers:
            raise ConfigError(f"{self.name}: layers_per_group must be 0 (all) or 1..{layers}, got {cfg.layers_per_group}")
        self._check_budgets()

    def build(self) -> None:
        self.pca: dict[tuple[str, int], PCABasis] = {}
        self.plans: dict[tuple[str, int], Plan] = {}
        self._coefficients: dict[tuple[int, int], tuple[Payload, dict]] = {}  # see decode

    @property
    def width(self) -> int:
        """Feature columns per layer: every KV head's channels."""
        return self.model.num_kv_heads * self.model.head_dim

    @property
    def layer_groups(self) -> list[range]:
        """The layers each PCA spans (``layers_per_group``; 0: all of them)."""
        layers = self.model.num_layers
        size = self.config.layers_per_group or layers
        return [range(a, min(a + size, layers)) for a in range(0, layers, size)]

    def calibrates(self) -> bool:
        """``pca_source=calibration``: the PCA bases and bit allocation (per-prompt PCA fits nothing)."""
        return self.config.pca_source == "calibration"

    def keeps_state(self) -> bool:
        """Per-prompt PCA keeps each sequence's basis and mean, ``deflate_scope=sequence`` its DEFLATE windows, as
        per-sequence state (counted in its bytes)."""
        return self.config.pca_source == "prompt" or self.config.deflate_scope == "sequence"

    def init_state(self, unit, held) -> SequenceState:
        """Per-prompt PCA (Table 18): each batch row's basis and mean from the tokens its cache holds at the
        first encode (the prompt), rank ``min(rank, tokens, p)``, fp16. ``deflate_scope=sequence``: per batch row
        and stream (K or V, layer group), the empty windows of the compressing (``.deflated``) and decompressing
        (``.inflated``) sides and the position the next block to inflate starts at (``.inflated_to``)."""
        tensors, ragged = {}, {}
        batch = held[0, "key"].shape[0]
        for kind in KINDS:
            if self.config.pca_source == "prompt":
                layers = [held[layer, kind] for layer in range(self.model.num_layers)]
                fits = [fit_pca(feature_rows([x[b:b + 1] for x in layers]), self.config.rank, self.config.pca_iters,
                                self.config.seed) for b in range(batch)]
                tensors |= {f"{kind}.mean": torch.stack([f.mean for f in fits]), f"{kind}.basis": torch.stack([f.basis for f in fits])}
            if self.config.deflate_scope == "sequence":
                for g in range(len(self.layer_groups)):
                    ragged |= {f"{kind}.{g}.{side}": [torch.zeros(0, dtype=torch.uint8)] * batch for side in ("deflated", "inflated")}
                    tensors[f"{kind}.{g}.inflated_to"] = torch.zeros(batch, dtype=torch.int64)
        return SequenceState(tensors, ragged)

    def _bases(self, kind: str, g: int, batch: int, state) -> list[tuple[PCABasis, Plan]]:
        """The PCA and plan of each batch row: the calibrated ones, or each row's own (per-prompt PCA)."""
        if self.config.pca_source == "calibration":
            return [(self.pca[kind, g], self.plans[kind, g])] * batch
        bases = [PCABasis(m, v) for m, v in zip(state.tensors[f"{kind}.mean"], state.tensors[f"{kind}.basis"])]
        return [(pca, truncation_plan(pca.basis.shape[1], self.budget_bits(kind, g))) for pca in bases]

    def policy(self, kind: str, layer_idx: int) -> StreamPolicy:
        """FP8 sinks are coded in the first block(s) (:meth:`encode`), so the cache keeps none apart."""
        sinks = self.config.sinks if self.config.sink_dtype == "model" else 0
        return StreamPolicy(sinks, self.config.every, self.config.window - self.config.every)

    def fp8_sinks(self, tokens: int, encoded_before: int) -> int:
        """How many of a block's ``tokens`` are sinks coded in FP8 (the first ``sinks`` of the sequence)."""
        if self.config.sink_dtype != "fp8":
            return 0
        return max(0, min(tokens, self.config.sinks - encoded_before))

    @property
    def calibration_drop_first(self) -> int:
        return self.config.calibration_drop_first

    def ratio(self, kind: str) -> float:
        explicit = self.config.cr_key if kind == "key" else self.config.cr_value
        return self.config.cr if explicit is None else explicit

    def budget_bits(self, kind: str, group: int = 0) -> int:
        """Bits per token the plan of ``kind`` and layer group ``group`` may spend: ``floor(16 p / CR)`` (K8)."""
        return int(16 * self.width * len(self.layer_groups[group]) // self.ratio(kind))

    def _check_budgets(self) -> None:
        """Refuse ratios whose budget cannot pay for one coded group per token (every coefficient dropped):
        the smallest int2 group plus its shift and scale (DP), or one fp16 coefficient (truncate)."""
        cheapest = (TYPE_BITS["fp16"] if self.config.quantization == "truncate"
                    else min(self.config.group_sizes) * TYPE_BITS["int2"] + GROUP_OVERHEAD_BITS)
        for kind in KINDS:
            budget = self.budget_bits(kind, len(self.layer_groups) - 1)  # the last group is the smallest
            if budget < cheapest:
                features = self.width * len(self.layer_groups[-1])
                raise ConfigError(
                    f"{self.name}: a {kind} compression ratio of {self.ratio(kind):g} leaves {budget} bits per token for "
                    f"{features} features (floor(16 p / cr)), fewer than the {cheapest} bits of the cheapest coded group; "
                    f"valid: cr <= {16 * features / cheapest:g}")

    def _group_of(self, layer_idx: int) -> int:
        return layer_idx // len(self.layer_groups[0])

    def fit(self, activations: Activations) -> CodecState:
        """Per cache and layer group: PCA of the sampled rows and the DP's group errors (module docstring)."""
        cfg, tensors = self.config, {}
        bar = progress_bar(len(KINDS) * len(self.layer_groups), f"{self.name}: PCA", "group")
        for kind in KINDS:
            layers = [activations.layer(layer)[kind].float() for layer in range(self.model.num_layers)]
            order = None
            for g, group in enumerate(self.layer_groups):
                rows = feature_rows([layers[i] for i in group])
                if order is None:  # the same sampled tokens for every group
                    order = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(cfg.seed))
                    order = order[: cfg.calibration_tokens]
                rows = rows[order].to(activations.device)
                start = time.perf_counter()
                pca = fit_pca(rows, cfg.rank, cfg.pca_iters, cfg.seed)
                middle = time.perf_counter()
                errors = group_errors(pca.project(rows[: cfg.dp_rows]), tuple(cfg.group_sizes), DP_TYPES)
                log.info("kvtc %ss, layers %d-%d: PCA of %s -> rank %d in %.0fs, DP group errors on %d rows in %.0fs",
                         kind, group.start, group.stop - 1, tuple(rows.shape), pca.basis.shape[1], middle - start,
                         min(cfg.dp_rows, len(rows)), time.perf_counter() - middle)
                choices = torch.tensor([[s, TYPE_NAMES.index(k)] for s, k in errors.choices], dtype=torch.int32)
                tensors |= {f"{kind}.{g}.mean": pca.mean, f"{kind}.{g}.basis": pca.basis, f"{kind}.{g}.deltas": errors.deltas,
                            f"{kind}.{g}.energy": torch.tensor([errors.energy], dtype=torch.float64),
                            f"{kind}.{g}.choices": choices}
                bar.update(1)
        bar.close()
        return CodecState(tensors)

    def load_state(self, state: CodecState) -> None:
        t = state.tensors
        for kind in KINDS:
            for g in range(len(self.layer_groups)):
                self.pca[kind, g] = PCABasis(t[f"{kind}.{g}.mean"], t[f"{kind}.{g}.basis"])
                choices = tuple((int(s), TYPE_NAMES[int(k)]) for s, k in t[f"{kind}.{g}.choices"].tolist())
                errors = GroupErrors(choices, float(t[f"{kind}.{g}.energy"]), t[f"{kind}.{g}.deltas"].double())
                budget = self.budget_bits(kind, g)
                self.plans[kind, g] = (truncation_plan(errors.width, budget) if self.config.quantization == "truncate"
                                       else plan_for(errors, budget))

    def bits_per_value(self) -> float:
        """Bits per encoded value the plans spend before DEFLATE (codes + shift/scale; per-prompt PCA: the
        budget); stored bytes are measured."""
        if self.config.pca_source == "prompt":
            return self.paper_bits_per_value()
        bits = sum(plan.bits for plan in self.plans.values())
        return bits / (len(KINDS) * self.model.num_layers * self.width)

    def paper_bits_per_value(self) -> float:
        """The target: 16 bits over the ratio (mean of K and V)."""
        return sum(16 / self.ratio(kind) for kind in KINDS) / len(KINDS)

    def encode(self, request: ModelRequest) -> Payload:
        """The block's first :meth:`fp8_sinks` tokens in FP8 (``sink.key`` / ``sink.value`` codes ``[B, L, H, s, d]``
        and fp16 scales), the others PCA-coded: one DEFLATE stream (``deflate_scope=sequence``: the next segment of
        the sequence's stream, and the block's first position, ``position [B]``) per batch row, cache and layer group."""
        keys, values, state, encoded_before = request.keys, request.values, request.state, request.encoded_before
        tensors, packed = {}, {}
        sinks = self.fp8_sinks(keys[0].shape[2], encoded_before)
        for kind, layers in (("key", keys), ("value", values)):
            if sinks:
                codes, scale = fp8_absmax(torch.stack([x[:, :, :sinks] for x in layers], dim=1), request.range_checks)
                tensors |= {f"sink.{kind}": codes.view(torch.uint8), f"sink.{kind}.scale": scale}
            layers = [x[:, :, sinks:] for x in layers]
            batch, tokens = layers[0].shape[0], layers[0].shape[2]
            for g, group in enumerate(self.layer_groups):
                rows = feature_rows([layers[i] for i in group]).view(batch, tokens, len(group) * self.width)
                try:
                    packed[f"{kind}.{g}"] = [encode_rows(pca.project(x, plan.width_used), plan)
                                             for x, (pca, plan) in zip(rows, self._bases(kind, g, batch, state))]
                except NonFiniteKVError as error:
                    raise NonFiniteKVError(f"the {kind}s of layers {group.start}..{group.stop - 1}: {error}") from error
        if self.config.deflate_scope == "sequence":
            tensors["position"] = torch.full((keys[0].shape[0],), encoded_before, dtype=torch.int64, device=keys[0].device)
        ragged = {name: self._deflate(name, streams, state) for name, streams in packed.items()}
        return Payload(tensors, keys[0].shape[2], ragged)

    def _deflate(self, name: str, streams: list[torch.Tensor], state: SequenceState | None) -> list[torch.Tensor]:
        """Each batch row's packed stream ``name`` (e.g. ``key.0``) DEFLATEd: alone (``block``), or as the next
        segment of the row's sequence stream, from the compressing side's window in ``state``, which it extends."""
        level = self.config.deflate_level
        if self.config.deflate_scope == "block":
            return [_as_bytes(deflate(s, level)) for s in streams]
        windows = state.ragged[f"{name}.deflated"]
        out = [_as_bytes(deflate(s, level, w.numpy().tobytes())) for s, w in zip(streams, windows)]
        state.ragged[f"{name}.deflated"] = [_slide(w, s) for w, s in zip(windows, streams)]
        return out

    def _inflate(self, payload: Payload, name: str, sizes: list[int], state: SequenceState | None) -> list[torch.Tensor]:
        """Each batch row's packed stream ``name`` of ``payload`` (``sizes`` bytes each): inflated alone
        (``block``), or from the decompressing side's window in ``state``, which it extends: the sequence's
        blocks are inflated once each, in order."""
        data = [row.cpu().numpy().tobytes() for row in payload.ragged[name]]
        if self.config.deflate_scope == "block":
            return [inflate(d, n) for d, n in zip(data, sizes)]
        expected, first = state.tensors[f"{name}.inflated_to"], payload.tensors["position"].cpu()
        if not torch.equal(first, expected):
            raise ConfigError(
                f"{self.name}: with deflate_scope=sequence each block is inflated once, in order, but the block at "
                f"position {first.tolist()} was asked for where the next is at {expected.tolist()} (a cache that "
                "decodes every block at every step, decode_per_step=True, reads blocks again): use deflate_scope=block")
        windows = state.ragged[f"{name}.inflated"]
        raws = [inflate(d, n, w.numpy().tobytes()) for d, n, w in zip(data, sizes, windows)]
        state.ragged[f"{name}.inflated"] = [_slide(w, r) for w, r in zip(windows, raws)]
        state.tensors[f"{name}.inflated_to"] = expected + payload.num_tokens
        return raws

    def check_payload(self, payload: Payload, batch: int, encoded_before: int) -> None:
        """A stored block holds :meth:`encode`'s tensors for its tokens: FP8 sinks ``[B, L, H, s, d]`` with their
        scales, and one DEFLATE stream per batch row, cache and layer group that inflates to exactly the packed
        length its plan gives for the block's other tokens (inflated in chunks, keeping nothing)."""
        if self.config.deflate_scope != "block":
            raise ValueError("a stored kvtc block needs deflate_scope=block")
        sinks = self.fp8_sinks(payload.num_tokens, encoded_before)
        layers, heads, dim = self.model.num_layers, self.model.num_kv_heads, self.model.head_dim
        shapes = {f"sink.{kind}{part}": ((batch, layers, heads, sinks) + ((dim,) if not part else ()), dtypes)
                  for kind in KINDS for part, dtypes in (("", (torch.uint8,)), (".scale", (torch.float16, torch.float32)))}
        expected = shapes if sinks else {}
        if sorted(payload.tensors) != sorted(expected):
            raise ValueError(f"tensors {sorted(payload.tensors)}, where {sinks} FP8 sinks need {sorted(expected)}")
        for name, (shape, dtypes) in expected.items():
            t = payload.tensors[name]
            if tuple(t.shape) != shape or t.dtype not in dtypes:
                raise ValueError(f"{name} is {t.dtype} {tuple(t.shape)}, not {dtypes[0]} {shape}")
        streams = {f"{kind}.{g}": (kind, g) for kind in KINDS for g in range(len(self.layer_groups))}
        if sorted(payload.ragged) != sorted(streams):
            raise ValueError(f"DEFLATE streams {sorted(payload.ragged)}, not {sorted(streams)}")
        for name, (kind, g) in streams.items():
            for row, (data, (_, plan)) in enumerate(zip(payload.ragged[name], self._bases(kind, g, batch, None))):
                if data.dtype != torch.uint8:
                    raise ValueError(f"the {name} stream of row {row} is {data.dtype}, not bytes")
                try:
                    check_inflates_to(data.numpy().tobytes(), packed_stream_nbytes(plan, payload.num_tokens - sinks))
                except DamagedPayloadError as error:
                    raise ValueError(f"the {name} stream of row {row}: {error}") from error

    def decode(self, payload: Payload, request: ModelRequest) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``request.layer`` of a block: its FP8 sinks, then its columns of the PCA reconstruction (K18). A
        block's coefficients are inflated and dequantized once, at its first layer, and kept until the group's
        last layer has read them (transient working memory: the coefficients of the blocks decoded in one pass)."""
        layer_idx, dtype, state = request.layer, request.dtype, request.state
        g = self._group_of(layer_idx)
        group = self.layer_groups[g]
        columns = slice((layer_idx - group.start) * self.width, (layer_idx - group.start + 1) * self.width)
        sinks = payload.tensors["sink.key"].shape[3] if "sink.key" in payload.tensors else 0
        t = payload.num_tokens - sinks
        key = (id(payload), g)
        if key not in self._coefficients:
            bases = {kind: self._bases(kind, g, len(payload.ragged[f"{kind}.{g}"]), state) for kind in KINDS}
            self._coefficients[key] = (payload, {
                kind: [decode_rows(raw, plan, t)[:, :plan.width_used].to(pca.basis.device) for raw, (pca, plan) in zip(
                    self._inflate(payload, f"{kind}.{g}", [packed_stream_nbytes(plan, t) for _, plan in bases[kind]], state),
                    bases[kind])]
                for kind in KINDS})
        coefficients = self._coefficients[key][1]
        if layer_idx == group.stop - 1:
            del self._coefficients[key]
        out = []
        for kind in KINDS:
            bases = self._bases(kind, g, len(coefficients[kind]), state)
            rows = [pca.reconstruct(c, columns) for c, (pca, _) in zip(coefficients[kind], bases)]
            x = saturated(torch.stack(rows).view(len(rows), t, self.model.num_kv_heads, self.model.head_dim).transpose(1, 2), dtype)
            if sinks:
                codes = payload.tensors[f"sink.{kind}"][:, layer_idx].view(torch.float8_e4m3fn)
                x = torch.cat([(codes.float() * payload.tensors[f"sink.{kind}.scale"][:, layer_idx, ..., None].float()).to(x), x], 2)
            out.append(x)
        return out[0], out[1]

    def packed_nbytes(self, num_tokens: int, state: SequenceState | None = None) -> int:
        """Bytes of one batch row's streams (all groups, K and V) for ``num_tokens`` tokens before DEFLATE (with
        per-prompt PCA: batch row 0's plans)."""
        return sum(packed_stream_nbytes(self._bases(kind, g, 1, state)[0][1], num_tokens)
                   for kind in KINDS for g in range(len(self.layer_groups)))

    def example_metrics(self, stats: CacheStatistics) -> dict[str, float]:
        """Compression ratios of one example's cache (batch row 0), as the paper reports them (K13, B.15): raw
        16-bit bytes of the PCA-coded tokens over their bytes before and after DEFLATE (``cr``; per-prompt PCA adds
        its basis and mean; ``deflate_scope=sequence``'s windows are working memory, not counted), and of every
        cached token over every stored byte (``cr_with_window``: sinks and window at their stored size, block
        positions included)."""
        payloads = stats.shared_payloads
        sinks = [p.tensors["sink.key"].shape[3] if "sink.key" in p.tensors else 0 for p in payloads]
        tokens = sum(p.num_tokens for p in payloads) - sum(sinks)
        if tokens <= 0:
            return {}
        per_token = 2 * 2 * self.model.num_layers * self.width  # K and V at 16 bits
        deflated = sum(int(rows[0].numel()) for p in payloads for rows in p.ragged.values())
        state = stats.shared_state
        packed = sum(self.packed_nbytes(p.num_tokens - s, state) for p, s in zip(payloads, sinks))
        if self.config.pca_source == "prompt":  # the prompt's basis and mean are part of what is stored (Table 18)
            pca = sum(state.tensors[f"{kind}.{part}"][0].numel() * state.tensors[f"{kind}.{part}"].element_size()
                      for kind in KINDS for part in ("mean", "basis"))
            deflated, packed = deflated + pca, packed + pca
        sink_bytes = sum(t[0].numel() * t.element_size() for p in payloads for t in p.tensors.values())  # and positions
        kept = stats.full_precision_nbytes // max(stats.batch, 1)  # window (+ sinks), model dtype
        kept_tokens = (stats.cached_tokens - stats.encoded_tokens) // stats.streams
        total_tokens = tokens + sum(sinks) + kept_tokens
        return {"cr_before_deflate": per_token * tokens / packed, "cr": per_token * tokens / deflated,
                "cr_with_window": per_token * total_tokens / (deflated + sink_bytes + kept), "deflate_gain": packed / deflated}

    def overhead_bits(self) -> int:
        """PCA bases and means (fp16), amortised over the cache."""
        return sum(8 * (p.mean.numel() * p.mean.element_size() + p.basis.numel() * p.basis.element_size())
                   for p in self.pca.values())

    def summary(self) -> dict:
        return {"kvtc_plans": {f"{kind}.{g}": {"budget_bits": self.budget_bits(kind, g), "bits": plan.bits,
                                               "coefficients_kept": sum(e - s for s, e, k in plan.groups if k != "none"),
                                               "types": _type_counts(plan)}
                               for (kind, g), plan in self.plans.items()},
                "pca_mib": self.overhead_bits() / 8 / 2**20}


def fp8_absmax(x: torch.Tensor, range_checks: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes of ``x [..., d]`` scaled by an fp16 absmax per vector (K11; float32 in a block whose scales
    float16 cannot hold), and the scales ``[...]`` (``range_checks``: :mod:`kvcomp.stages.ranges`)."""
    scale = stored_in(x.float().abs().amax(-1) / FP8_MAX, torch.float16, range_checks)
    scale = scale.clamp_min(torch.finfo(torch.float16).tiny)
    return (x.float() / scale.float()[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _as_bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _slide(window: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
    """The last :data:`~kvcomp.stages.transform_coding.WINDOW` bytes of ``window`` followed by ``stream``."""
    return torch.cat([window, stream.cpu()])[-WINDOW:].clone()


def _type_counts(plan: Plan) -> dict[str, int]:
    counts: dict[str, int] = {}
    for start, end, kind in plan.groups:
        counts[kind] = counts.get(kind, 0) + end - start
    return counts


def packed_stream_nbytes(plan: Plan, num_rows: int) -> int:
    """Length of :func:`~kvcomp.stages.transform_coding.encode_rows`'s stream for ``num_rows`` rows."""
    total = 0
    for start, end, kind in plan.groups:
        if kind == "none":
            continue
        total += -(-num_rows * (end - start) * TYPE_BITS[kind] // 8)
        total += 0 if kind == "fp16" else 4 * num_rows
    return total


_PLANS: dict[str, Plan] = {}  # in-process memo of plan_for


def plan_for(errors: GroupErrors, budget_bits: int) -> Plan:
    """The DP plan of ``errors`` under ``budget_bits``, cached (in process and under ``$KVCOMP_CACHE/kvtc_plans``)
    by a digest of the group errors and the budget: one plan per compression ratio."""
    digest = hashlib.sha256(errors.deltas.numpy().tobytes() + json.dumps([errors.choices, errors.energy, budget_bits]).encode())
    key = digest.hexdigest()[:32]
    if key in _PLANS:
        return _PLANS[key]
    path = cache_dir() / "kvtc_plans" / f"{key}.json"
    plan = None
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
            plan = Plan(tuple((int(s), int(e), str(k)) for s, e, k in saved["groups"]), float(saved["error"]))
            if saved["key"] != key or not _plan_fits(errors, plan, budget_bits):
                plan = None
        except (ValueError, KeyError, TypeError):  # unreadable: recompute
            plan = None
    if plan is None:
        plan = allocate_from(errors, budget_bits)
        write_json_atomic(path, {"key": key, "groups": [list(g) for g in plan.groups], "error": plan.error,
                                 "budget_bits": budget_bits})
    _PLANS[key] = plan
    return plan


def _plan_fits(errors: GroupErrors, plan: Plan, budget_bits: int) -> bool:
    """Whether a cached ``plan`` is one the DP could have returned for ``errors``: contiguous groups of allowed
    choices covering every coefficient, within the budget, with the error its groups' deltas add up to."""
    choices = {c: i for i, c in enumerate(errors.choices)}
    ends = [0] + [end for _, end, _ in plan.groups]
    if ends[-1] != errors.width or any(start != ends[i] for i, (start, _, _) in enumerate(plan.groups)):
        return False
    if plan.bits > budget_bits or any((1 if k == "none" else e - s, k) not in choices for s, e, k in plan.groups):
        return False
    error = errors.energy + sum(float(errors.deltas[choices[e - s, k], s]) for s, e, k in plan.groups if k != "none")
    return abs(error - plan.error) <= 1e-9 * max(abs(errors.energy), 1.0)
