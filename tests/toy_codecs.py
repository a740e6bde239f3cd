"""Toy codecs written against the codec contract (not registered; they exist to pin the cache's side).

- ``OffsetCodec`` (uniform, ``Calibrated``): a fitted per-channel offset, for the calibration artifact cache;
- ``PredictiveLayerCodec`` (scope ``layer``): AQUA-KV's shape of dependency. Layer ``l``'s keys are
  predicted from layer ``l-1``'s reconstructed keys, its values from ``[this layer's reconstructed keys;
  layer l-1's reconstructed values]``, and only the 8-bit residual is stored;
- ``DeflatedModelCodec`` (scope ``model``, ``payload_layout="blocks"``): kvtc's shape. One vector per token
  spanning every layer and head, 8-bit codes DEFLATE-compressed per batch row to a variable length;
- ``AnchoredStreamCodec`` (scope ``stream``, ``stateful``): CSR's shape. A per-sequence bank of anchors
  sampled from the prompt, grown by one anchor per encoded block; blocks store the residual to an anchor.
"""

import zlib
from dataclasses import dataclass

import torch

from kvcomp.codecs import Calibrated, CodecState
from kvcomp.codecs.base import (Codec, CodecConfig, LayerEncoding, LayerRequest, ModelInfo, ModelRequest, Payload,
                                SequenceState, Stateful, StreamPolicy, StreamRequest)
from kvcomp.codecs.uniform import UniformCodec, UniformConfig
from kvcomp.stages.uniform_quantizer import GroupQuantizer
from tests.helpers import info_of

MODEL = ModelInfo(name="tiny", num_layers=2, num_kv_heads=2, head_dim=16, fingerprint="aaaa")


@dataclass
class OffsetConfig(UniformConfig):
    name: str = "test_offset"
    group_size: int = 16


class OffsetCodec(UniformCodec, Calibrated):
    """Test-only codec: a fitted per-channel offset (the mean of the calibration windows' token ids)."""

    name = "test_offset"
    config_class = OffsetConfig

    def fit(self, calibration):
        self.fit_calls = getattr(self, "fit_calls", 0) + 1
        return CodecState({"offset": calibration.float().mean() * torch.ones(MODEL.head_dim)})

    def load_state(self, state):
        self.offset = state.tensors["offset"]


QUANTIZER = GroupQuantizer(8, 16, "per_token")


def _code(x: torch.Tensor) -> tuple[Payload, torch.Tensor]:
    """8-bit per-token payload of ``x`` and its reconstruction (float32)."""
    stored = QUANTIZER.encode(x)
    return Payload(stored, x.shape[2]), QUANTIZER.decode(stored, x.shape[3], torch.float32)


@dataclass
class ToyConfig(CodecConfig):
    name: str = "toy"
    pre_rope: bool = True
    sinks: int = 2
    block: int = 4
    window: int = 3


class ToyCodec(Codec):
    config_class = ToyConfig

    def policy(self, kind, layer_idx):
        return StreamPolicy(self.config.sinks, self.config.block, self.config.window)


class PredictiveLayerCodec(ToyCodec):
    name, scope = "toy_layer", "layer"

    @staticmethod
    def _predict_keys(previous):
        return None if previous is None else 0.5 * previous[0]

    @staticmethod
    def _predict_values(keys, previous):
        return 0.25 * keys if previous is None else 0.25 * keys + 0.25 * previous[1]

    def encode(self, request: LayerRequest):
        keys, values, previous = request.keys, request.values, request.previous
        predicted = self._predict_keys(previous)
        key, residual = _code(keys.float() if predicted is None else keys.float() - predicted)
        k_hat = residual if predicted is None else residual + predicted
        predicted = self._predict_values(k_hat, previous)
        value, residual = _code(values.float() - predicted)
        self.encoded_layers.append(request.layer)
        return LayerEncoding(key, value, k_hat, residual + predicted)

    def decode(self, payload, request: LayerRequest):
        (key, value), previous, dtype = payload, request.previous, request.dtype
        k_hat = QUANTIZER.decode(key.tensors, self.model.head_dim, torch.float32)
        if previous is not None:
            k_hat = k_hat + self._predict_keys(previous)
        v_hat = QUANTIZER.decode(value.tensors, self.model.head_dim, torch.float32) + self._predict_values(k_hat, previous)
        return k_hat.to(dtype), v_hat.to(dtype)


class DeflatedModelCodec(ToyCodec):
    name, scope, payload_layout = "toy_model", "model", "blocks"

    def encode(self, request: ModelRequest):
        keys, values = request.keys, request.values
        x = torch.stack([*keys, *values]).float()  # [2L, B, H, T, D]
        lo = x.amin(dim=(0, 2, 4)).half()  # [B, T]: one range per token and row, over every layer and head
        scale = ((x.amax(dim=(0, 2, 4)) - lo.float()) / 255).clamp_min(1e-4).half()
        codes = torch.round((x - lo.float()[None, :, None, :, None]) / scale.float()[None, :, None, :, None])
        codes = codes.clamp(0, 255).to(torch.uint8)
        rows = [torch.frombuffer(bytearray(zlib.compress(codes[:, b].contiguous().numpy().tobytes())), dtype=torch.uint8)
                for b in range(codes.shape[1])]
        return Payload({"lo": lo, "scale": scale}, keys[0].shape[2], {"deflated": rows})

    def decode(self, payload, request: ModelRequest):
        layer_idx, dtype = request.layer, request.dtype
        num_layers, h, d = self.model.num_layers, self.model.num_kv_heads, self.model.head_dim
        t = payload.num_tokens
        out = []
        for b, row in enumerate(payload.ragged["deflated"]):
            codes = torch.frombuffer(bytearray(zlib.decompress(row.numpy().tobytes())), dtype=torch.uint8)
            codes = codes.reshape(2 * num_layers, h, t, d).float()
            lo, scale = payload.tensors["lo"][b].float(), payload.tensors["scale"][b].float()
            out.append(codes * scale[None, None, :, None] + lo[None, None, :, None])
        x = torch.stack(out, dim=1)  # [2L, B, H, T, D]
        return x[layer_idx].to(dtype), x[num_layers + layer_idx].to(dtype)


class AnchoredStreamCodec(ToyCodec, Stateful):
    name = "toy_stateful"

    def init_state(self, unit, held):
        (x,) = held.values()
        self.prompts.append(x.shape[2])
        return SequenceState({"anchors": x.float().mean(2, keepdim=True)})  # [B, H, 1, D]: from the prompt

    def encode(self, request: StreamRequest):
        x, state = request.tokens, request.state
        anchors = state.tensors["anchors"]
        payload, _ = _code(x.float() - anchors[:, :, -1:])
        payload.tensors["anchor"] = torch.full((x.shape[0], 1, 1), anchors.shape[2] - 1, dtype=torch.int16)
        state.tensors["anchors"] = torch.cat([anchors, x.float().mean(2, keepdim=True)], dim=2)  # grows
        return payload

    def decode(self, payload, request: StreamRequest):
        state, dtype = request.state, request.dtype
        index = payload.tensors["anchor"][:, 0, 0].long()  # per row (rows may have been reordered)
        anchors = state.tensors["anchors"][torch.arange(index.shape[0]), :, index][:, :, None]
        codes = {k: v for k, v in payload.tensors.items() if k != "anchor"}
        return (QUANTIZER.decode(codes, self.model.head_dim, torch.float32) + anchors).to(dtype)


def make_toy(cls, model, **overrides):
    """A toy codec of ``cls`` for ``model``, recording the layers it encodes and the prompts it starts from."""
    codec = cls(ToyConfig(name=cls.name, **overrides), info_of(model))
    codec.encoded_layers, codec.prompts = [], []
    return codec
