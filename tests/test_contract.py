"""The codec contract's scopes, per-sequence state and variable-length payloads, through the cache.

Three small codecs written against the contract (not registered; they exist to pin the cache's side):
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

import pytest
import torch

from kvcomp.cache import CompressedCache
from kvcomp.codecs.base import (Codec, CodecConfig, LayerEncoding, ModelInfo, Payload, Request, SequenceState,
                                Stateful, StreamPolicy)
from kvcomp.errors import ConfigError
from kvcomp.stages.rope import apply_rope
from kvcomp.stages.uniform_quantizer import GroupQuantizer
from tests.conftest import info_of
from tests.test_memory import held_bytes

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

    def encode(self, request):
        keys, values, previous = request.keys, request.values, request.previous
        predicted = self._predict_keys(previous)
        key, residual = _code(keys.float() if predicted is None else keys.float() - predicted)
        k_hat = residual if predicted is None else residual + predicted
        predicted = self._predict_values(k_hat, previous)
        value, residual = _code(values.float() - predicted)
        self.encoded_layers.append(request.layer)
        return LayerEncoding(key, value, k_hat, residual + predicted)

    def decode(self, payload, request):
        (key, value), previous, dtype = payload, request.previous, request.dtype
        k_hat = QUANTIZER.decode(key.tensors, self.model.head_dim, torch.float32)
        if previous is not None:
            k_hat = k_hat + self._predict_keys(previous)
        v_hat = QUANTIZER.decode(value.tensors, self.model.head_dim, torch.float32) + self._predict_values(k_hat, previous)
        return k_hat.to(dtype), v_hat.to(dtype)


class DeflatedModelCodec(ToyCodec):
    name, scope, payload_layout = "toy_model", "model", "blocks"

    def encode(self, request):
        keys, values = request.keys, request.values
        x = torch.stack([*keys, *values]).float()  # [2L, B, H, T, D]
        lo = x.amin(dim=(0, 2, 4)).half()  # [B, T]: one range per token and row, over every layer and head
        scale = ((x.amax(dim=(0, 2, 4)) - lo.float()) / 255).clamp_min(1e-4).half()
        codes = torch.round((x - lo.float()[None, :, None, :, None]) / scale.float()[None, :, None, :, None])
        codes = codes.clamp(0, 255).to(torch.uint8)
        rows = [torch.frombuffer(bytearray(zlib.compress(codes[:, b].contiguous().numpy().tobytes())), dtype=torch.uint8)
                for b in range(codes.shape[1])]
        return Payload({"lo": lo, "scale": scale}, keys[0].shape[2], {"deflated": rows})

    def decode(self, payload, request):
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

    def encode(self, request):
        x, state = request.tokens, request.state
        anchors = state.tensors["anchors"]
        payload, _ = _code(x.float() - anchors[:, :, -1:])
        payload.tensors["anchor"] = torch.full((x.shape[0], 1, 1), anchors.shape[2] - 1, dtype=torch.int16)
        state.tensors["anchors"] = torch.cat([anchors, x.float().mean(2, keepdim=True)], dim=2)  # grows
        return payload

    def decode(self, payload, request):
        state, dtype = request.state, request.dtype
        index = payload.tensors["anchor"][:, 0, 0].long()  # per row (rows may have been reordered)
        anchors = state.tensors["anchors"][torch.arange(index.shape[0]), :, index][:, :, None]
        codes = {k: v for k, v in payload.tensors.items() if k != "anchor"}
        return (QUANTIZER.decode(codes, self.model.head_dim, torch.float32) + anchors).to(dtype)


def _codec(cls, model, **overrides):
    codec = cls(ToyConfig(name=cls.name, **overrides), info_of(model))
    codec.encoded_layers, codec.prompts = [], []
    return codec


def _generate(model, codec, steps=12, **cache_options):
    ids = torch.randint(1, 96, (2, 19), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cache = CompressedCache(codec, **cache_options)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                         past_key_values=cache, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return torch.stack(out.logits, 1), cache


def _close_to_plain(model, codec):
    """Logits near the uncompressed model's (8-bit codes), and the memory walk holds."""
    from kvcomp.codecs import build_codec

    reference, _ = _generate(model, build_codec({"name": "fp16"}, info_of(model)))
    logits, cache = _generate(model, codec)
    assert (logits - reference).abs().max() < 0.05 * reference.abs().max()
    model_storages = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    assert held_bytes(cache, model_storages) == pytest.approx(cache.nbytes + cache.bookkeeping_nbytes + cache.working_nbytes, rel=0.01)
    for layer in cache.layers:
        for stream in layer.streams:
            assert stream.num_encoded > 0 and stream.num_encoded % 4 == 0
            assert stream.num_sinks == 2  # rows padded alike share streams, which hold no pad token
    return logits, cache


@torch.no_grad()
@pytest.mark.parametrize("pre_rope", [True, False])
def test_layer_scope_codes_each_layer_from_the_previous_reconstruction(tiny_model, pre_rope):
    codec = _codec(PredictiveLayerCodec, tiny_model, pre_rope=pre_rope)
    logits, cache = _close_to_plain(tiny_model, codec)
    layers = codec.model.num_layers
    # in layer order, block by block (each layer encodes the block of each of the two row groups: row 1 is padded)
    assert codec.encoded_layers[:2 * layers] == [layer for layer in range(layers) for _ in range(2)]
    assert all(not s.encode_handoff and not s.decode_handoff and not s.decoded_other
               for s in (part.schedule for layer in cache.layers for part in layer.parts))
    # decoding every block again (no decoded copy) gives the same logits: decode reproduces the encoder's loop
    again, per_step = _generate(tiny_model, _codec(PredictiveLayerCodec, tiny_model, pre_rope=pre_rope), decode_per_step=True)
    torch.testing.assert_close(again, logits, rtol=1e-5, atol=1e-5)
    assert per_step.working_nbytes < cache.working_nbytes


@torch.no_grad()
def test_layer_scope_prediction_matters(tiny_llama):
    """Decoding layer 1 with a wrong predecessor changes its keys: the handoff is what decode uses."""
    codec = _codec(PredictiveLayerCodec, tiny_llama)
    _, cache = _generate(tiny_llama, codec)
    layer = cache.layers[1]
    key_block, value_block = layer.schedule.blocks[2]  # row 0's first block, after its 2 sinks
    payloads = layer.key_stream.store.block(key_block), layer.value_stream.store.block(value_block)
    first = cache.layers[0]
    k0, v0 = codec.decode((first.key_stream.store.block(first.schedule.blocks[2][0]),
                           first.value_stream.store.block(first.schedule.blocks[2][1])), Request(0, dtype=torch.float32))
    right = codec.decode(payloads, Request(1, previous=(k0, v0), dtype=torch.float32))
    wrong = codec.decode(payloads, Request(1, previous=(torch.zeros_like(k0), v0), dtype=torch.float32))
    assert not torch.allclose(right[0], wrong[0], atol=1e-3)
    # what attention read for that block: the right reconstruction, re-rotated (pre-RoPE keys)
    n = key_block.count
    torch.testing.assert_close(layer.key_stream.decoded.view[:, :, :n], apply_rope(right[0], *layer.positions.rope(2, n)))


@torch.no_grad()
def test_model_scope_stores_variable_length_blocks_and_measures_them(tiny_model):
    codec = _codec(DeflatedModelCodec, tiny_model)
    _, cache = _close_to_plain(tiny_model, codec)
    units = [g.scope.unit for g in cache.groups]  # one per row group (row 1 is left-padded)
    assert all(u.store.num_blocks >= 2 for u in units) and cache.payload_nbytes == sum(u.store.nbytes for u in units)
    for unit in units:
        lengths = [len(row) for p in unit.store.payloads for row in p.ragged["deflated"]]
        assert len(set(lengths)) > 1  # entropy coded: rows and blocks differ in size
        assert unit.store.nbytes == sum(lengths) + sum(t.numel() * 2 for p in unit.store.payloads for t in p.tensors.values())
    assert all(layer.payload_nbytes == 0 for layer in cache.layers)  # the payloads are the model unit's
    breakdown = cache.bits_breakdown()
    assert 0 < breakdown["code_bits_per_value"] < 16 and breakdown["state_bits_per_value"] == 0


@torch.no_grad()
def test_model_scope_encodes_after_the_last_layer(tiny_llama):
    """The forward that completes a block sees it in full precision in every layer."""
    codec = _codec(DeflatedModelCodec, tiny_llama, sinks=0, window=0, block=8)
    cache = CompressedCache(codec, "simulated")
    ids = torch.randint(1, 96, (1, 8))
    logits = tiny_llama(ids, past_key_values=cache).logits
    plain = tiny_llama(ids).logits
    torch.testing.assert_close(logits, plain)
    assert all(s.num_encoded == 8 for layer in cache.layers for s in layer.streams)


@torch.no_grad()
def test_stateful_codec_state_is_held_counted_and_reordered(tiny_llama):
    codec = _codec(AnchoredStreamCodec, tiny_llama)
    _, cache = _close_to_plain(tiny_llama, codec)
    assert sorted(set(codec.prompts)) == [16, 19]  # init_state saw each row's whole prompt (sinks, tail), no pad
    stream = cache.layers[1].key_stream
    anchors = stream.state.tensors["anchors"]
    assert anchors.shape[2] == len(stream.blocks) + 1  # grown by one anchor per block
    assert cache.state_nbytes == sum(s.state.nbytes for layer in cache.layers for s in layer.streams) > 0
    assert cache.nbytes == cache.full_precision_nbytes + cache.payload_nbytes + cache.state_nbytes
    cache.batch_repeat_interleave(2)  # rows 0, 0, 1, 1: each row's group holds its two copies
    assert [g.rows for g in cache.groups] == [[0, 1], [2, 3]]
    stream = cache.layers[1].key_stream
    before = stream.materialize()
    cache.reorder_cache(torch.tensor([1, 0, 3, 2]))
    stream.decoded = type(stream.decoded)(2)  # force decoding again from the reordered payload and state
    stream.pending = list(stream.blocks)
    torch.testing.assert_close(stream.materialize(), before.flip(0))
    cache.reorder_cache(torch.tensor([2, 3, 0, 1]))  # rows move between groups: the groups follow them
    assert [g.rows for g in cache.groups] == [[2, 3], [0, 1]]


@torch.no_grad()
def test_beam_search_reorders_layer_and_model_scope_caches(tiny_llama):
    for cls in (PredictiveLayerCodec, DeflatedModelCodec, AnchoredStreamCodec):
        codec = _codec(cls, tiny_llama)
        cache = CompressedCache(codec)
        ids = torch.randint(1, 96, (1, 15), generator=torch.Generator().manual_seed(2))
        out = tiny_llama.generate(ids, num_beams=2, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                  past_key_values=cache, pad_token_id=0)
        assert out.shape == (1, 23) and cache.layers[0].key_stream.batch == 2


def test_scoped_codecs_need_one_policy_per_unit(tiny_llama):
    class Uneven(PredictiveLayerCodec):
        def policy(self, kind, layer_idx):
            return StreamPolicy(2, 4 if kind == "key" else 8, 3)

    with pytest.raises(ConfigError, match="layer-scope codec needs one policy"):
        Uneven(ToyConfig(name="uneven"), info_of(tiny_llama))

    class Unknown(PredictiveLayerCodec):
        name, scope = "unknown", "token"

    with pytest.raises(ConfigError, match="valid scopes: stream, layer, model"):
        Unknown(ToyConfig(name="unknown"), ModelInfo("m", 2, 2, 16))
