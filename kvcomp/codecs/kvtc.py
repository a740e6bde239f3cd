"""kvtc (KV cache transform coding; spec ``seed-004-kvtc.md``): PCA across every layer and head, DP bit
allocation, DEFLATE. Model scope: a block of tokens of every layer is one payload.

Per token, the pre-RoPE keys of every layer and KV head form one feature row (``p = layers x heads x
head_dim``, (layer, head, dim) order), values another, each with its own basis. Calibration
(:meth:`KVTCCodec.fit`) samples ``calibration_tokens`` positions without replacement (sinks excluded),
fits a rank-``rank`` PCA (randomized SVD, basis and mean stored in fp16) and runs the DP of
:mod:`kvcomp.stages.bit_allocation` on the first ``dp_rows`` sampled rows under ``floor(16 p / CR)`` bits per
token (K8). Encoding projects each token, codes its coefficients with the plan, packs them (K7) and
DEFLATEs each batch row's stream: the compressed bytes are the payload (ragged, variable length), so the
codec has no fixed rate and its bits are measured. Decoding a layer inflates the stream and reconstructs
only that layer's columns (K18).

Not yet built (issue 16): FP8 sinks (sinks stay in the model dtype), CR reporting before DEFLATE, the
store/restore mode between turns and its benchmark, nvCOMP.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcomp.codecs.base import KINDS, Activations, Codec, CodecConfig, CodecState, Payload, StreamPolicy
from kvcomp.codecs.registry import register
from kvcomp.errors import ConfigError
from kvcomp.stages.bit_allocation import GROUP_SIZES, TYPE_BITS, Plan, allocate
from kvcomp.stages.transform_coding import PCABasis, decode_rows, deflate, encode_rows, feature_rows, fit_pca, inflate

KIND_NAMES = tuple(TYPE_BITS)


@dataclass
class KVTCConfig(CodecConfig):
    name: str = "kvtc"
    compression_ratio: float = 16.0  # DP target before DEFLATE: floor(16 p / CR) bits per token and cache
    rank: int = 10000  # PCA rank cap (the paper: 10,000; 8,000 for Qwen)
    pca_iters: int = 8
    calibration_tokens: int = 160000
    dp_rows: int = 32768  # the first sampled rows the DP sees (K10)
    group_sizes: list[int] = field(default_factory=lambda: list(GROUP_SIZES))
    calibration_drop_first: int = 4  # sink positions never sampled
    seed: int = 0
    sinks: int = 4
    window: int = 128
    every: int = 16  # tokens per compression event (K12)
    deflate_level: int = 6
    pre_rope: bool = True


@register
class KVTCCodec(Codec):
    name = "kvtc"
    config_class = KVTCConfig
    scope = "model"
    payload_layout = "blocks"
    needs_calibration = True
    inference_only_fields = ("sinks", "window", "every", "deflate_level")

    def validate(self) -> None:
        cfg = self.config
        if cfg.compression_ratio < 1 or cfg.rank < 1 or cfg.calibration_tokens < 2 or cfg.dp_rows < 1:
            raise ConfigError(f"{self.name}: compression_ratio >= 1, rank >= 1, calibration_tokens >= 2 and dp_rows >= 1 "
                              f"required, got {cfg.compression_ratio}, {cfg.rank}, {cfg.calibration_tokens}, {cfg.dp_rows}")
        if cfg.sinks < 0 or cfg.window < 0 or cfg.every < 1 or not cfg.group_sizes:
            raise ConfigError(f"{self.name}: sinks and window must be >= 0, every >= 1 and group_sizes non-empty")
        self.width = self.model.num_kv_heads * self.model.head_dim  # feature columns per layer
        self.pca: dict[str, PCABasis] = {}
        self.plans: dict[str, Plan] = {}

    def policy(self, kind: str, layer_idx: int) -> StreamPolicy:
        return StreamPolicy(self.config.sinks, self.config.every, self.config.window)

    @property
    def calibration_drop_first(self) -> int:
        return self.config.calibration_drop_first

    @property
    def budget_bits(self) -> int:
        """Bits per token and cache (K or V) the DP may spend (K8)."""
        return int(16 * self.width * self.model.num_layers // self.config.compression_ratio)

    def fit(self, activations: Activations) -> CodecState:
        """PCA and DP plan of keys and of values (see the module docstring)."""
        cfg, tensors = self.config, {}
        for kind in KINDS:
            rows = feature_rows([activations.layer(layer)[kind].float() for layer in range(self.model.num_layers)])
            order = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(cfg.seed))
            rows = rows[order[: cfg.calibration_tokens]].to(activations.device)
            pca = fit_pca(rows, cfg.rank, cfg.pca_iters, cfg.seed)
            plan = allocate(pca.project(rows[: cfg.dp_rows]), self.budget_bits, tuple(cfg.group_sizes))
            groups = torch.tensor([[s, e, KIND_NAMES.index(k)] for s, e, k in plan.groups], dtype=torch.int32)
            tensors |= {f"{kind}.mean": pca.mean, f"{kind}.basis": pca.basis, f"{kind}.plan": groups,
                        f"{kind}.plan_error": torch.tensor([plan.error])}
        return CodecState(tensors)

    def load_state(self, state: CodecState) -> None:
        t = state.tensors
        for kind in KINDS:
            self.pca[kind] = PCABasis(t[f"{kind}.mean"], t[f"{kind}.basis"])
            groups = tuple((int(s), int(e), KIND_NAMES[int(k)]) for s, e, k in t[f"{kind}.plan"].tolist())
            self.plans[kind] = Plan(groups, float(t[f"{kind}.plan_error"]))

    def encode_model(self, keys, values, state=None) -> Payload:
        batch, tokens = keys[0].shape[0], keys[0].shape[2]
        ragged = {}
        for kind, layers in (("key", keys), ("value", values)):
            coefficients = self.pca[kind].project(feature_rows(layers)).view(batch, tokens, -1)
            ragged[kind] = [torch.frombuffer(bytearray(deflate(encode_rows(row, self.plans[kind]), self.config.deflate_level)),
                                             dtype=torch.uint8) for row in coefficients]
        return Payload({}, tokens, ragged)

    def decode_model(self, payload, layer_idx, dtype, state=None):
        columns = slice(layer_idx * self.width, (layer_idx + 1) * self.width)
        heads, t = self.model.num_kv_heads, payload.num_tokens
        out = []
        for kind in KINDS:
            rows = [self.pca[kind].reconstruct(decode_rows(inflate(data.numpy().tobytes()), self.plans[kind], t), columns)
                    for data in payload.ragged[kind]]
            out.append(torch.stack(rows).view(len(rows), t, heads, -1).transpose(1, 2).to(dtype))
        return out[0], out[1]

    def overhead_bits(self) -> int:
        """PCA bases and means (fp16), amortised over the cache."""
        return sum(8 * (p.mean.numel() * p.mean.element_size() + p.basis.numel() * p.basis.element_size())
                   for p in self.pca.values())
