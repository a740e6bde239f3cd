"""Uniform asymmetric integer quantization of keys and values (round-to-nearest, min-max groups).

Each stream is quantized with :class:`~kvcomp.stages.uniform_quantizer.GroupQuantizer` along its own
axis (``per_token``: groups of channels of one token; ``per_channel``: groups of tokens of one channel).
Optional full-precision sinks and window of recent tokens.
"""

from dataclasses import dataclass

import torch

from kvcomp.codecs.base import Codec, CodecConfig, FusedPayload, Payload, StreamPolicy, StreamRequest
from kvcomp.codecs.registry import register
from kvcomp.errors import ConfigError
from kvcomp.kernels.formats import UniformReader
from kvcomp.stages.uniform_quantizer import GroupQuantizer

PARAM_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class UniformConfig(CodecConfig):
    name: str = "uniform"
    bits: int = 4  # 1..8
    group_size: int = 64  # channels per group (per_token) or tokens per group (per_channel)
    key_axis: str = "per_token"  # per_token | per_channel
    value_axis: str = "per_token"  # per_token | per_channel
    window: int = 0  # most recent tokens kept in full precision
    sinks: int = 0  # first tokens kept in full precision
    param_dtype: str = "float16"  # storage of scale and zero-point
    pre_rope: bool = False  # quantize keys before RoPE (the cache re-rotates them)


@register
class UniformCodec(Codec, FusedPayload):
    """Asymmetric min-max quantization; ``x_hat = round((x - z) / s) * s + z`` per group."""

    config_class = UniformConfig

    def validate(self) -> None:
        if self.config.param_dtype not in PARAM_DTYPES:
            raise ConfigError(
                f"{self.name}: param_dtype {self.config.param_dtype!r} unknown; valid: {', '.join(PARAM_DTYPES)}"
            )
        self.check_schedule()
        for kind, quantizer in self.build_quantizers().items():
            quantizer.validate(self.model.head_dim, f"{self.name} ({kind}s)")

    def build(self) -> None:
        self.quantizers = self.build_quantizers()

    def check_schedule(self) -> None:
        """Raise :class:`ConfigError` for a sink/window setting the cache cannot follow."""
        if self.config.window < 0 or self.config.sinks < 0:
            raise ConfigError(
                f"{self.name}: window and sinks must be >= 0, got {self.config.window} and {self.config.sinks}"
            )

    def build_quantizers(self) -> dict[str, GroupQuantizer]:
        cfg = self.config
        dtype = PARAM_DTYPES[cfg.param_dtype]
        return {
            "key": GroupQuantizer(cfg.bits, cfg.group_size, cfg.key_axis, dtype),
            "value": GroupQuantizer(cfg.bits, cfg.group_size, cfg.value_axis, dtype),
        }

    def policy(self, kind: str, layer_idx: int) -> StreamPolicy:
        return StreamPolicy(self.config.sinks, self.quantizers[kind].block_multiple, self.config.window)

    def encode(self, request: StreamRequest) -> Payload:
        return Payload(self.quantizers[request.kind].encode(request.tokens, request.range_checks),
                       num_tokens=request.tokens.shape[2])

    def decode(self, payload: Payload, request: StreamRequest) -> torch.Tensor:
        return self.quantizers[request.kind].decode(payload.tensors, self.model.head_dim, request.dtype)

    def code_bits_per_value(self, kind: str, layer_idx: int) -> float:
        return self.quantizers[kind].bits_per_value(self.model.head_dim)

    def payload_reader(self, payload: Payload, kind: str, layer_idx: int) -> UniformReader:
        return UniformReader.of(self.quantizers[kind], payload, self.model.head_dim)
