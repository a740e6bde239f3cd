"""KIVI (Liu et al., ICML 2024): keys per-channel, values per-token, recent tokens in full precision.

Faithful to the authors' code (jy-yuan/KIVI), not to transformers' ``QuantizedCache``:

- keys are quantized per channel in groups of ``group_size`` tokens; the full-precision key residual
  fills up to ``residual_length`` tokens and is then quantized as one block (so 0..R-1 recent keys are
  full precision);
- values are quantized per token in groups of ``group_size`` channels; exactly the last
  ``residual_length`` values stay in full precision (the oldest one is quantized as each new token
  arrives);
- scale and zero-point are 16-bit, so KIVI-b costs ``b + 32 / group_size`` bits per encoded value.
"""

from dataclasses import dataclass

from kvcomp.codecs.base import CodecConfig, StreamPolicy
from kvcomp.codecs.registry import register
from kvcomp.codecs.uniform import PARAM_DTYPES, UniformCodec
from kvcomp.errors import ConfigError
from kvcomp.stages.uniform_quantizer import GroupQuantizer


@dataclass
class KIVIConfig(CodecConfig):
    name: str = "kivi"
    bits: int = 2
    group_size: int = 32
    residual_length: int = 128
    param_dtype: str = "float16"


@register
class KIVICodec(UniformCodec):
    config_class = KIVIConfig

    def check_schedule(self) -> None:
        cfg = self.config
        if cfg.group_size < 1 or cfg.residual_length < cfg.group_size or cfg.residual_length % cfg.group_size:
            raise ConfigError(
                f"kivi: residual_length={cfg.residual_length} must be a positive multiple of "
                f"group_size={cfg.group_size} (keys are quantized in whole groups of tokens)"
            )

    def build_quantizers(self) -> dict[str, GroupQuantizer]:
        cfg = self.config
        dtype = PARAM_DTYPES[cfg.param_dtype]
        return {
            "key": GroupQuantizer(cfg.bits, cfg.group_size, "per_channel", dtype),
            "value": GroupQuantizer(cfg.bits, cfg.group_size, "per_token", dtype),
        }

    def policy(self, kind: str, layer_idx: int) -> StreamPolicy:
        r = self.config.residual_length
        if kind == "key":
            return StreamPolicy(sinks=0, block_size=r, window=0)
        return StreamPolicy(sinks=0, block_size=1, window=r)
