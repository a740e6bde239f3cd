"""The uncompressed reference: every token stays in the model's own precision.

Named ``fp16`` after the 16-bit baseline of the papers; it stores K/V in the dtype the model runs in
(bf16/fp16 on GPU, fp32 on CPU), so its results are exactly those of the plain model.
"""

from dataclasses import dataclass

import torch

from kvcomp.codecs.base import Codec, CodecConfig, Payload, StreamPolicy, StreamRequest
from kvcomp.codecs.registry import register


@dataclass
class FullPrecisionConfig(CodecConfig):
    name: str = "fp16"


@register
class FullPrecisionCodec(Codec):
    config_class = FullPrecisionConfig

    def policy(self, kind: str, layer_idx: int) -> StreamPolicy:
        return StreamPolicy(sinks=0, block_size=None, window=0)

    def encode(self, request: StreamRequest) -> Payload:
        raise RuntimeError("the fp16 codec never encodes: its policy keeps every token in the tail")

    def decode(self, payload: Payload, request: StreamRequest) -> torch.Tensor:
        raise RuntimeError("the fp16 codec never encodes, so there is nothing to decode")

    def code_bits_per_value(self, kind: str, layer_idx: int) -> float:
        return 16.0
