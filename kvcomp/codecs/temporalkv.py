"""TemporalKV (the thesis' method, §1): product quantization of *temporal* chunks.

Each chunk is ``l = 8 / bits`` adjacent tokens of one channel, after an offline per-channel z-score
(keys pre-RoPE; RoPE is re-applied after decoding). A chunk is coded by an 8-bit index into a codebook
of 256 centroids in ``R^l``; a group of ``share_group`` adjacent channels (default ``l``, which makes
the centroid memory equal to ChannelKV's) shares one codebook, fitted by Fisher-weighted k-means with
chunk weights ``sigma_c^2 sum_{tokens} g^2``.

Chunks need ``l`` tokens, so the cache keeps new tokens in full precision until a chunk is complete
(App. E): its stream policy encodes blocks of ``l`` tokens.

Hybrid early layers (§1.10): where channel chunks reconstruct better, a stream uses ChannelKV's scheme
(raw values, ``l`` channels per chunk) instead. ``hybrid: auto`` decides per layer and K/V (or per
layer, ``hybrid_granularity: layer``) from the held-out Fisher-weighted MSE of both schemes;
``hybrid: preset`` uses ``hybrid_layers`` for both K and V (the thesis' lists); ``off`` never does.
"""

from dataclasses import dataclass, field

from kvcomp.codecs.channelkv import CENTROIDS, channel_scheme
from kvcomp.codecs.codebook import CodebookCodec, CodebookConfig, Scheme
from kvcomp.codecs.registry import register
from kvcomp.errors import ConfigError
from kvcomp.stages.codebook import ChunkLayout
from kvcomp.stages.normalization import Normalizer

HYBRID_MODES = ("auto", "preset", "off")
GRANULARITIES = ("layer_kv", "layer")


@dataclass
class TemporalKVConfig(CodebookConfig):
    """The codebook fields; ``bits``: 4 | 2 | 1 (chunks of 2 | 4 | 8 tokens), 8: scalar 256-level codebooks."""

    name: str = "temporalkv"
    share_group: int = 0  # channels sharing one codebook; 0 = the chunk length l (ChannelKV's centroid memory)
    hybrid: str = "auto"  # auto (held-out Fisher MSE) | preset (hybrid_layers) | off
    hybrid_granularity: str = "layer_kv"  # auto: decide per (layer, K/V) or per layer
    hybrid_layers: list[int] = field(default_factory=list)  # preset: layers coded like ChannelKV


@register
class TemporalKVCodec(CodebookCodec):
    config_class = TemporalKVConfig

    def validate(self) -> None:
        cfg = self.config
        if cfg.hybrid not in HYBRID_MODES:
            raise ConfigError(f"temporalkv: hybrid={cfg.hybrid!r} unknown; valid: {', '.join(HYBRID_MODES)}")
        if cfg.hybrid_granularity not in GRANULARITIES:
            raise ConfigError(f"temporalkv: hybrid_granularity={cfg.hybrid_granularity!r}; valid: {', '.join(GRANULARITIES)}")
        bad = [i for i in cfg.hybrid_layers if not 0 <= i < self.model.num_layers]
        if bad:
            raise ConfigError(f"temporalkv: hybrid_layers {bad} outside 0..{self.model.num_layers - 1}")
        if cfg.share_group < 0:
            raise ConfigError(f"temporalkv: share_group must be >= 0, got {cfg.share_group}")
        super().validate()

    def schemes(self, kind: str, layer_idx: int) -> dict[str, Scheme]:
        l = self.chunk_len
        group = self.config.share_group or l
        temporal = Scheme(ChunkLayout(time_len=l, channel_len=1, group_channels=group), Normalizer("channel_zscore"), CENTROIDS)
        hybrid = self.config.hybrid
        if hybrid == "auto" and l > 1:
            return {"temporal": temporal, "channel": channel_scheme(l)}
        if hybrid == "preset" and layer_idx in self.config.hybrid_layers:
            return {"channel": channel_scheme(l)}
        return {"temporal": temporal}

    def choose_schemes(self, layer_idx: int, errors: dict[str, dict[str, float]]) -> dict[str, str]:
        if self.config.hybrid_granularity == "layer_kv" or not errors:
            return super().choose_schemes(layer_idx, errors)
        totals = {name: sum(per_kind[name] for per_kind in errors.values()) for name in next(iter(errors.values()))}
        best = min(totals, key=totals.get)
        return {kind: best for kind in errors}
