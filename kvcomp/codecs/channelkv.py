"""ChannelKV (coupled quantization, Zhang et al. 2024) as the TemporalKV thesis re-implements it (§2.2).

Each chunk is ``l = 8 / bits`` adjacent channels of one token, coded by an 8-bit index into a codebook
of 256 centroids in ``R^l``; one codebook per channel group (``head_dim / l`` per layer, KV head and
K/V), fitted by Fisher-weighted k-means with chunk weights ``sum_{channels} g^2``. Keys are pre-RoPE.
[REF] clusters raw (unnormalised) K/V, which is the default; ``normalize: true`` uses the per-channel
z-score instead (the thesis text claims uniform normalisation).
"""

from dataclasses import dataclass

from kvcomp.codecs.codebook import CodebookCodec, CodebookConfig, Scheme
from kvcomp.codecs.registry import register
from kvcomp.stages.codebook import ChunkLayout
from kvcomp.stages.normalization import Normalizer

CENTROIDS = 256


def channel_scheme(chunk_len: int, normalize: bool = False) -> Scheme:
    """``chunk_len`` adjacent channels of one token per 8-bit code; one codebook per channel group."""
    layout = ChunkLayout(time_len=1, channel_len=chunk_len, group_channels=chunk_len)
    return Scheme(layout, Normalizer("channel_zscore" if normalize else "none"), CENTROIDS)


@dataclass
class ChannelKVConfig(CodebookConfig):
    name: str = "channelkv"
    normalize: bool = False  # true: per-channel z-score (the thesis text; [REF] uses none)


@register
class ChannelKVCodec(CodebookCodec):
    config_class = ChannelKVConfig

    def schemes(self, kind: str, layer_idx: int) -> dict[str, Scheme]:
        return {"channel": channel_scheme(self.chunk_len, self.config.normalize)}
