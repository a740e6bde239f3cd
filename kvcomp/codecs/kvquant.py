"""KVQuant as the TemporalKV thesis re-implements it ("KVQuant-b", "KVQuant-b-1%"; thesis §2.1).

Scalar non-uniform quantization: every value is coded independently to one of ``2^bits`` scalar
centroids learned by Fisher-weighted 1-D k-means; one codebook per group of ``l = 8 / bits`` adjacent
channels (the TemporalKV group size) per layer, KV head and K/V. Codes are bit-packed (``bits`` bits
per value; [REF] stores one int8 per value but counts ``bits``).

- Keys, pre-RoPE: offline per-channel z-score; with outliers, the centre is the channel mean and the
  scale half the channel's 0.5%-99.5% range.
- Values: online per-token normalisation over all KV heads x channels of the layer (mean and std,
  both stored in 16 bits per token); with outliers, half the token's quantile range (stored) around the
  offline channel means. These per-token parameters are counted in the exact bits.
- Outliers are left out of k-means by default ([REF] does so for KVQuant only). Which entries are
  outliers: ``outlier_rule`` (``reference``: the KVQuant reference's per-channel key thresholds and
  per-token value quantiles; :mod:`kvcomp.stages.outliers`).
"""

from dataclasses import dataclass

from kvcomp.codecs.codebook import CodebookCodec, CodebookConfig, Scheme
from kvcomp.codecs.registry import register
from kvcomp.stages.codebook import ChunkLayout
from kvcomp.stages.normalization import Normalizer


@dataclass
class KVQuantConfig(CodebookConfig):
    name: str = "kvquant"
    exclude_outliers_from_kmeans: bool = True


@register
class KVQuantCodec(CodebookCodec):
    config_class = KVQuantConfig
    outliers_change_schemes = True  # normalisation switches to quantile ranges with outliers

    def schemes(self, kind: str, layer_idx: int) -> dict[str, Scheme]:
        with_outliers = self.config.outliers > 0
        if kind == "key":
            mode = "channel_range" if with_outliers else "channel_zscore"
        else:
            mode = "token_range" if with_outliers else "token_zscore"
        layout = ChunkLayout(time_len=1, channel_len=1, group_channels=self.chunk_len)
        return {"scalar": Scheme(layout, Normalizer(mode), 1 << self.config.bits)}
