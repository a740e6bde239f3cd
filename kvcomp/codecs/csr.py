"""CSR (Zhang et al., AAAI 2025; spec ``seed-003-csr.md``): each pre-RoPE key and value vector stored as ``s``
(int16 atom index, fp16 coefficient) pairs found by matching pursuit over a dictionary. Stream scope,
stateful.

- **Codes** (§2.2-2.3): keys are coded whole (``key_chunks`` s_n = 1) with ``sparsity`` MP steps; values
  are split into ``value_chunks`` (s_n = 2) contiguous channel chunks, each coded with ``sparsity / s_n``
  steps (``key_sparsity`` / ``value_sparsity`` set the steps per chunk directly: the CSR(s, s_n) variants),
  so CSR-s stores ``s`` pairs per key and per value vector:
  ``32 s s_n / d_head`` bits per channel (:meth:`CSRCodec.code_bits_per_value`, exact).
- **Offline dictionary** (NeuralDict, §2.6, :mod:`kvcomp.stages.neuraldict`): ``atoms`` unit atoms per
  (merged layer group, KV head) (C4; ``dict_scope=shared``: ``atoms x heads`` shared by the heads), value
  chunks sharing one dictionary. Layer groups come from the Jensen-Shannon criterion
  (:mod:`kvcomp.stages.layer_merging`; ``merged_groups=paper``: the paper's groups for 32-layer models).
  Trained once per model on the calibration activations at ``train_key_sparsity`` / ``train_value_sparsity``
  (8 / 4) and reused for every CSR-s (C3); the fitted state holds the atoms (fp16) and each group's
  held-out relative MSE.
- **Online bank** (§2.7, C8): per sequence, layer and KV head, ``online_atoms`` atoms appended to the
  offline ones: a sampled part, the l2-normalised vectors (value chunks) of the last tokens the stream holds
  at its first encode (the prompt; ``online_sampling=random``: a seeded random draw from them), and a
  ``guard_fraction`` share of guard atoms. A vector whose MP relative residual exceeds the prompt's
  ``guard_quantile`` becomes a guard atom while slots are free, in prefill and decoding, and is coded by it
  exactly (one pair; the others zero). Guard atoms are never evicted (the paper's FIFO would invalidate
  codes that name them). The bank is per-sequence state: the cache counts its bytes and reorders it with
  the batch.
- **Schedule** (C10): no sinks and no recent window by default; each token is stored in full precision
  during its own step only (``window = recent_window + 1``) and coded when the next token arrives.
- **Decoding**: the dense reconstruction ``X~ = D r`` (Eq. 12) as a gather-sum; the cache re-applies RoPE to
  keys. ``desparse=fused``: decode steps never decode the values, the attention output of the coded ones is
  ``D u`` with ``u`` the attention weights times the coefficients scattered onto their atoms (§5.4,
  :meth:`CSRCodec.payload_values`).

Bits (C13): ``bits_per_value`` is the nominal ``32 s s_n / d_head`` (exactly what the codes hold); the
cache's measured bits add the online bank (``state_bits_per_value``); the offline dictionaries are
:meth:`CSRCodec.overhead_bits`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

import torch

from kvcomp.codecs.base import (KINDS, Activations, CacheStatistics, Calibrated, Codec, CodecConfig, CodecState, Payload,
                                PayloadValues, SequenceState, Stateful, StreamPolicy, StreamRequest)
from kvcomp.codecs.registry import register
from kvcomp.errors import ConfigError, unknown_choice
from kvcomp.stages.layer_merging import PAPER_GROUPS, merge_layers
from kvcomp.stages.neuraldict import DictTraining, train_dictionaries
from kvcomp.stages.ranges import saturated, stable_norm, stored_in
from kvcomp.stages.sparse_coding import (
    matching_pursuit, normalize_rows, orthogonal_matching_pursuit, reconstruct, sparse_weighted_sum,
)

log = logging.getLogger(__name__)

CODERS = ("mp", "omp")
SAMPLINGS = ("reverse_sequential", "random")
MERGES = ("auto", "paper", "none")
DICT_SCOPES = ("per_head", "shared")
DESPARSE = ("dense", "fused")
MAX_ATOMS = 2**15  # int16 indices
JSD_SAMPLE = 4096  # vectors per layer and head the merging criterion compares


@dataclass
class CSRConfig(CodecConfig):
    name: str = "csr"
    sparsity: int = 8  # CSR-s: s pairs per key and per value vector
    key_sparsity: int | None = None  # CSR(s, s_n) variants: MP steps per key chunk; None: sparsity / key_chunks
    value_sparsity: int | None = None  # MP steps per value chunk; None: sparsity / value_chunks
    key_chunks: int = 1  # s_n of keys (the paper: 1; Table 4 varies it)
    value_chunks: int = 2  # s_n of values
    coder: str = "mp"  # mp | omp (C2 ablation)
    atoms: int = 256  # offline atoms per (merged layer group, KV head) (C4; the paper's 2048 / 8 heads)
    dict_scope: str = "per_head"  # per_head | shared (atoms x heads shared by the heads of a group, C4)
    online_atoms: int = 256  # per (sequence, layer, KV head) (the paper: = offline size); 0: offline dictionary only
    online_sampling: str = "reverse_sequential"  # reverse_sequential (the last prompt tokens) | random
    guard_fraction: float = 0.0  # share of the online atoms kept for guard atoms ([pub]: 2/3; seed parity: 0)
    guard_quantile: float = 0.95  # guard atoms for vectors worse than this quantile of the prompt's relative residual
    merged_groups: str = "auto"  # auto (JSD, Eqs. 6-7) | paper (32-layer models) | none (one group per layer)
    jsd_delta1: float = 0.2
    jsd_delta2: float = 1.0
    jsd_bins: int = 200
    train_key_sparsity: int = 8  # NeuralDict is trained once at these two and reused for every CSR-s (C3)
    train_value_sparsity: int = 4
    epochs: int = 30  # this field and those down to seed: NeuralDict's settings (DictTraining)
    batch_size: int = 4096
    lr: float = 1.0e-3
    lr_final: float = 1.0e-4
    diversity: bool = True  # the L_div term of NeuralDict (Table 6)
    beta_scale: float = 0.1
    beta_cap: float = 1.0
    kmeans_iters: int = 20
    heldout_fraction: float = 0.05
    patience: int = 3
    max_vectors: int = 1048576  # training vectors per (group, head), drawn at random when there are more
    seed: int = 0
    sinks: int = 0
    recent_window: int = 0  # full-precision recent tokens besides the current one, exact in its own step only (C10)
    # dense: decode steps read D r (Eq. 12) | fused: values weighted as D u, never decoded (§5.4)
    desparse: str = "dense"
    pre_rope: bool = True


@register
class CSRCodec(Codec, Calibrated, Stateful, PayloadValues):
    config_class = CSRConfig
    inference_only_fields = ("sparsity", "key_sparsity", "value_sparsity", "coder", "online_atoms", "online_sampling",
                             "guard_fraction", "guard_quantile", "sinks", "recent_window", "desparse")

    def validate(self) -> None:
        cfg, d = self.config, self.model.head_dim
        if cfg.coder not in CODERS:
            raise unknown_choice("codec.coder", cfg.coder, CODERS)
        if cfg.online_sampling not in SAMPLINGS:
            raise unknown_choice("codec.online_sampling", cfg.online_sampling, SAMPLINGS)
        if cfg.merged_groups not in MERGES:
            raise unknown_choice("codec.merged_groups", cfg.merged_groups, MERGES)
        if cfg.desparse not in DESPARSE:
            raise unknown_choice("codec.desparse", cfg.desparse, DESPARSE)
        if cfg.dict_scope not in DICT_SCOPES:
            raise unknown_choice("codec.dict_scope", cfg.dict_scope, DICT_SCOPES)
        for kind in KINDS:
            chunks, explicit = self.chunks(kind), getattr(cfg, f"{kind}_sparsity")
            if chunks < 1 or d % chunks:
                raise ConfigError(f"{self.name}: {kind}_chunks must divide head_dim {d}, got {chunks}")
            if explicit is None and cfg.sparsity % chunks:
                raise ConfigError(f"{self.name}: sparsity {cfg.sparsity} must be a multiple of {kind}_chunks {chunks} "
                                  f"(CSR-s codes each chunk with s / s_n atoms), or set {kind}_sparsity")
        steps = (self.sparsity("key"), self.sparsity("value"), cfg.train_key_sparsity, cfg.train_value_sparsity)
        if min(steps) < 1 or cfg.atoms < 1 or cfg.online_atoms < 0:
            raise ConfigError(f"{self.name}: sparsities >= 1, atoms >= 1 and online_atoms >= 0 required, got "
                              f"sparsities {steps}, atoms {cfg.atoms}, online_atoms {cfg.online_atoms}")
        if self.offline_atoms + cfg.online_atoms > MAX_ATOMS:
            raise ConfigError(f"{self.name}: {self.offline_atoms} offline + {cfg.online_atoms} online atoms exceed the "
                              f"{MAX_ATOMS} int16 indices can name")
        if not 0 <= cfg.guard_fraction <= 1 or not 0 < cfg.guard_quantile < 1:
            raise ConfigError(f"{self.name}: guard_fraction in [0, 1] and guard_quantile in (0, 1) required, got "
                              f"{cfg.guard_fraction}, {cfg.guard_quantile}")
        if cfg.sinks < 0 or cfg.recent_window < 0:
            raise ConfigError(f"{self.name}: sinks and recent_window must be >= 0, got {cfg.sinks}, {cfg.recent_window}")
        if cfg.merged_groups == "paper" and self.model.num_layers != 32:
            raise ConfigError(f"{self.name}: merged_groups=paper holds the paper's groups of 32-layer models; "
                              f"{self.model.name} has {self.model.num_layers} layers: use auto or none")

    def build(self) -> None:
        self.atoms: dict[str, list[torch.Tensor]] = {}  # kind -> per group [heads or 1, N, d] (fp16)
        self.groups: dict[str, list[list[int]]] = {}
        self.report: dict = {}
        self._on_device: dict[tuple[str, int, torch.device], torch.Tensor] = {}

    def keeps_state(self) -> bool:
        """With ``online_atoms``: each sequence's atoms sampled from its prompt."""
        return self.config.online_atoms > 0

    def uses_payload_values(self) -> bool:
        """``desparse=fused``: decode steps weight the coded values as ``D u`` (:meth:`payload_values`)."""
        return self.config.desparse == "fused"

    @property
    def offline_atoms(self) -> int:
        """Offline atoms one head codes with: ``atoms`` (per head) or ``atoms x heads`` (shared)."""
        return self.config.atoms * (self.model.num_kv_heads if self.config.dict_scope == "shared" else 1)

    def chunks(self, kind: str) -> int:
        """s_n: contiguous channel chunks a vector of ``kind`` is split into, each coded apart."""
        return self.config.key_chunks if kind == "key" else self.config.value_chunks

    def sparsity(self, kind: str) -> int:
        """MP steps per coded chunk."""
        return getattr(self.config, f"{kind}_sparsity") or self.config.sparsity // self.chunks(kind)

    def policy(self, kind: str, layer_idx: int) -> StreamPolicy:
        return StreamPolicy(self.config.sinks, 1, self.config.recent_window + 1)

    def code_bits_per_value(self, kind: str, layer_idx: int) -> float:
        """``32 s s_n / d_head``: an int16 index and an fp16 coefficient per pair (§2.8)."""
        return 32 * self.sparsity(kind) * self.chunks(kind) / self.model.head_dim

    # --- calibration (NeuralDict) ---
    def _vectors(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        """``[S, H, T, D]`` -> coded vectors per head ``[H, S T s_n, D / s_n]``."""
        s, h, t, d = x.shape
        return x.permute(1, 0, 2, 3).reshape(h, s * t * self.chunks(kind), d // self.chunks(kind))

    def _layer_groups(self, kind: str, activations: Activations) -> list[list[int]]:
        cfg, layers = self.config, self.model.num_layers
        if cfg.merged_groups == "paper":
            return PAPER_GROUPS[kind]
        if cfg.merged_groups == "none" or layers == 1:
            return [[layer] for layer in range(layers)]
        generator = torch.Generator().manual_seed(cfg.seed)
        samples = []
        for layer in range(layers):
            x = activations.layer(layer)[kind]
            x = x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[3])
            pick = torch.randperm(x.shape[1], generator=generator)[:JSD_SAMPLE]
            samples.append(x[:, pick.to(x.device)].float().cpu())
        return merge_layers(samples, cfg.jsd_delta1, cfg.jsd_delta2, cfg.jsd_bins)

    def fit(self, activations: Activations) -> CodecState:
        """Per kind: merge layers (JSD), then train each group's dictionaries on its layers' vectors."""
        cfg, tensors = self.config, {}
        for kind in KINDS:
            groups = self._layer_groups(kind, activations)
            shared = {f.name: getattr(cfg, f.name) for f in fields(DictTraining) if f.name not in ("atoms", "sparsity")}
            settings = DictTraining(atoms=self.offline_atoms, sparsity=getattr(cfg, f"train_{kind}_sparsity"), **shared)
            log.info("csr %ss: %d layer groups %s", kind, len(groups), groups)
            for g, group in enumerate(groups):
                x = torch.cat([self._vectors(activations.layer(layer)[kind], kind) for layer in group], 1)
                if cfg.dict_scope == "shared":
                    x = x.reshape(1, -1, x.shape[-1])
                if x.shape[1] > cfg.max_vectors:
                    pick = torch.randperm(x.shape[1], generator=torch.Generator().manual_seed(cfg.seed))[: cfg.max_vectors]
                    x = x[:, pick.to(x.device)]
                trained = train_dictionaries(x.to(activations.device), settings, f"{kind}s, layers {group[0]}-{group[-1]}")
                tensors |= {f"{kind}.{g}.atoms": trained.atoms.half().cpu(), f"{kind}.{g}.heldout_mse": trained.heldout_mse.cpu(),
                            f"{kind}.{g}.history": torch.tensor(trained.history),
                            f"{kind}.{g}.seconds": torch.tensor([trained.seconds])}
            tensors[f"{kind}.groups"] = torch.tensor([g for g, group in enumerate(groups) for _ in group], dtype=torch.int32)
            tensors[f"{kind}.layers"] = torch.tensor([layer for group in groups for layer in group], dtype=torch.int32)
        return CodecState(tensors)

    def load_state(self, state: CodecState) -> None:
        t = state.tensors
        self._on_device = {}
        for kind in KINDS:
            group_of, layers = t[f"{kind}.groups"].tolist(), t[f"{kind}.layers"].tolist()
            groups: list[list[int]] = [[] for _ in range(max(group_of) + 1)]
            for g, layer in zip(group_of, layers):
                groups[g].append(layer)
            self.groups[kind] = groups
            self.atoms[kind] = [t[f"{kind}.{g}.atoms"] for g in range(len(groups))]
            expected = (self.model.num_kv_heads if self.config.dict_scope == "per_head" else 1, self.offline_atoms,
                        self.model.head_dim // self.chunks(kind))
            if sorted(layers) != list(range(self.model.num_layers)) or tuple(self.atoms[kind][0].shape) != expected:
                raise ConfigError(f"{self.name}: the fitted {kind} dictionaries do not fit {self.model.name} "
                                  f"(layers {sorted(layers)}, atoms {tuple(self.atoms[kind][0].shape)} vs {expected})")
            self.report[kind] = [_group_report(group, t[f"{kind}.{g}.heldout_mse"], t[f"{kind}.{g}.history"], t[f"{kind}.{g}.seconds"])
                                 for g, group in enumerate(groups)]

    def _offline(self, kind: str, layer_idx: int, device: torch.device) -> torch.Tensor:
        """The offline atoms of the layer's group on ``device``, float32 ``[heads or 1, N, d]``."""
        key = (kind, layer_idx, device)
        if key not in self._on_device:
            group = next(g for g, members in enumerate(self.groups[kind]) if layer_idx in members)
            self._on_device[key] = self.atoms[kind][group].to(device=device, dtype=torch.float32)
        return self._on_device[key]

    def dictionary(self, kind: str, layer_idx: int, batch: int, device: torch.device,
                   state: SequenceState | None = None) -> torch.Tensor:
        """Every atom each (batch row, head) codes with: offline then online, float32 ``[B H, N, d]``."""
        offline = self._offline(kind, layer_idx, device)
        h = self.model.num_kv_heads
        atoms = offline.expand(h, -1, -1)[None].expand(batch, -1, -1, -1)
        if state is not None:
            atoms = torch.cat([atoms, state.tensors["bank"].float()], 2)
        return atoms.reshape(batch * h, atoms.shape[2], atoms.shape[3])

    # --- per-sequence online bank ---
    def init_state(self, unit, held) -> SequenceState:
        """The online bank of stream ``unit`` from the tokens it holds at its first encode (module docstring)."""
        cfg = self.config
        x = held[unit.layer, unit.kind]
        b, h, t, d = x.shape
        c = self.chunks(unit.kind)
        vectors = normalize_rows(x.float().reshape(b, h, t * c, d // c))
        guard = int(round(cfg.guard_fraction * cfg.online_atoms))
        sampled = min(cfg.online_atoms - guard, t * c)
        if cfg.online_sampling == "reverse_sequential":
            picked = vectors[:, :, t * c - sampled:].flip(2)
        else:
            generator = torch.Generator().manual_seed(cfg.seed + 1000 * unit.layer + (unit.kind == "value"))
            picked = vectors[:, :, torch.randperm(t * c, generator=generator)[:sampled].to(x.device)]
        bank = torch.cat([picked, torch.zeros(b, h, guard, d // c, device=x.device)], 2).half()
        tensors = {"bank": bank}
        if guard:
            tensors |= {"guard_used": torch.zeros(b, h, dtype=torch.int32, device=x.device),
                        "guard_tau": torch.full((b, h), -1.0, device=x.device)}
        return SequenceState(tensors)

    def _guard(self, vectors, index, coefficient, atoms, state: SequenceState) -> None:
        """Give the worst-coded vectors guard atoms while slots are free, and code them by their atom."""
        b, h = state.tensors["guard_used"].shape
        bank, used, tau = state.tensors["bank"], state.tensors["guard_used"], state.tensors["guard_tau"]
        error = vectors - reconstruct(index, coefficient, atoms)
        energy = vectors.square().sum(-1)
        residual = error.square().sum(-1) / energy.clamp_min(1e-12)
        # vectors beyond ~1e19 overflow the squares: the ratio of their norms instead
        exact = energy.isfinite() & residual.isfinite()
        residual = torch.where(exact, residual, (stable_norm(error) / stable_norm(vectors).clamp_min(1e-6)).square())
        residual = residual.view(b, h, -1)
        unset = tau < 0
        if bool(unset.any()):
            tau[unset] = torch.quantile(residual, self.config.guard_quantile, dim=-1)[unset]
        guard = int(round(self.config.guard_fraction * self.config.online_atoms))
        first_guard = bank.shape[2] - guard
        for row in range(b):
            for head in range(h):
                free = guard - int(used[row, head])
                worst = torch.nonzero(residual[row, head] > tau[row, head]).squeeze(1)
                if not free or not len(worst):
                    continue
                worst = worst[residual[row, head, worst].argsort(descending=True)][:free]
                slots = first_guard + int(used[row, head]) + torch.arange(len(worst), device=bank.device)
                g = row * h + head
                bank[row, head, slots] = normalize_rows(vectors[g, worst]).to(bank.dtype)
                index[g, worst] = (atoms.shape[1] - bank.shape[2] + slots)[:, None]
                coefficient[g, worst] = 0.0
                coefficient[g, worst, 0] = stable_norm(vectors[g, worst])
                used[row, head] += len(worst)

    # --- encode / decode ---
    def encode(self, request: StreamRequest) -> Payload:
        """MP codes of ``x [B, H, T, D]``: ``index`` int16 and ``coefficient`` fp16 (float32 in a block whose
        coefficients float16 cannot hold: inputs beyond 65504), ``[B, H, T, s_n s]``."""
        x, kind, layer_idx, state = request.tokens, request.kind, request.layer, request.state
        b, h, t, d = x.shape
        c, s = self.chunks(kind), self.sparsity(kind)
        vectors = x.float().reshape(b * h, t * c, d // c)
        atoms = self.dictionary(kind, layer_idx, b, x.device, state)
        if self.config.coder == "omp":
            index, coefficient = orthogonal_matching_pursuit(vectors, atoms, s)
        else:
            index, coefficient = matching_pursuit(vectors, atoms, s)
        if state is not None and "guard_used" in state.tensors:
            self._guard(vectors, index, coefficient, atoms, state)
        return Payload({"index": index.to(torch.int16).view(b, h, t, c * s),
                        "coefficient": stored_in(coefficient, torch.float16, request.range_checks).view(b, h, t, c * s)}, t)

    def decode(self, payload: Payload, request: StreamRequest) -> torch.Tensor:
        """``D r`` (Eq. 12) of every coded vector, ``[B, H, T, D]`` in ``request.dtype``."""
        index, coefficient = payload.tensors["index"], payload.tensors["coefficient"]
        b, h, t, pairs = index.shape
        c = self.chunks(request.kind)
        atoms = self.dictionary(request.kind, request.layer, b, index.device, request.state)
        flat = (b * h, t * c, pairs // c)
        x = reconstruct(index.reshape(flat).long(), coefficient.reshape(flat), atoms)
        return saturated(x.view(b, h, t, self.model.head_dim), request.dtype)

    def payload_values(self, weights, payload, layer_idx, state=None) -> torch.Tensor:
        """``sum_t w_t v~_t = D u`` per value chunk (§5.4): the weights ``[B, Hq, Tq, T]`` times each pair's
        coefficient scattered onto its atom, then one product with the dictionary; no value is decoded."""
        index, coefficient = payload.tensors["index"], payload.tensors["coefficient"]
        b, h, t, pairs = index.shape
        hq, tq = weights.shape[1], weights.shape[2]
        c = self.chunks("value")
        s = pairs // c
        grouped = weights.reshape(b * h, (hq // h) * tq, t)
        atoms = self.dictionary("value", layer_idx, b, index.device, state)
        out = [sparse_weighted_sum(grouped, index[..., j * s:(j + 1) * s].reshape(b * h, t, s),
                                   coefficient[..., j * s:(j + 1) * s].reshape(b * h, t, s), atoms) for j in range(c)]
        return torch.cat(out, -1).reshape(b, hq, tq, self.model.head_dim)

    # --- reporting ---
    def overhead_bits(self) -> int:
        """The offline dictionaries (fp16), a per-model constant."""
        return sum(16 * a.numel() for atoms in self.atoms.values() for a in atoms)

    def example_metrics(self, stats: CacheStatistics) -> dict[str, float]:
        """Bits per encoded value of one example (batch row 0): the codes alone and with the online bank (C13)."""
        encoded = stats.encoded_tokens * self.model.num_kv_heads * self.model.head_dim
        if not encoded:
            return {}
        codes = stats.payload_nbytes / max(stats.batch, 1)
        bank = stats.state_nbytes / max(stats.batch, 1)
        return {"code_bits": 8 * codes / encoded, "bits_with_online_bank": 8 * (codes + bank) / encoded}

    def summary(self) -> dict:
        return {"csr_dictionaries": self.report, "csr_dictionary_mib": self.overhead_bits() / 8 / 2**20,
                "csr_training_seconds": round(sum(g["seconds"] for groups in self.report.values() for g in groups), 1)}


def _group_report(layers: list[int], heldout: torch.Tensor, history: torch.Tensor, seconds: torch.Tensor) -> dict:
    """One dictionary group's training record: held-out relative MSE of the kept dictionaries, after the k-means
    initialisation and after epochs 10 and 20 (Table 6's columns, mean over heads), epochs run and time."""
    report = {"layers": layers, "heldout_relative_mse": round(float(heldout.mean()), 5),
              "kmeans_relative_mse": round(float(history[0]), 5), "epochs": len(history) - 1,
              "seconds": round(float(seconds), 1)}
    report |= {f"epoch{e}_relative_mse": round(float(history[e]), 5) for e in (10, 20) if e < len(history)}
    return report
