"""The codec contract's scopes, per-sequence state and variable-length payloads, through the cache, pinned by the
three toy codecs of ``tests/toy_codecs.py``."""


import pytest
import torch

from kvcomp.cache import CompressedCache
from kvcomp.cache.accounting import layer_bytes
from kvcomp.codecs.base import LayerRequest, ModelInfo, StreamPolicy
from kvcomp.errors import ConfigError
from kvcomp.stages.rope import apply_rope
from tests.helpers import held_bytes, info_of
from tests.toy_codecs import AnchoredStreamCodec, DeflatedModelCodec, PredictiveLayerCodec, ToyConfig, make_toy


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
    codec = make_toy(PredictiveLayerCodec, tiny_model, pre_rope=pre_rope)
    logits, cache = _close_to_plain(tiny_model, codec)
    layers = codec.model.num_layers
    # in layer order, block by block (each layer encodes the block of each of the two row groups: row 1 is padded)
    assert codec.encoded_layers[:2 * layers] == [layer for layer in range(layers) for _ in range(2)]
    assert all(not s.encode_handoff and not s.decode_handoff and not s.decoded_other
               for s in (part.schedule for layer in cache.layers for part in layer.parts))
    # decoding every block again (no decoded copy) gives the same logits: decode reproduces the encoder's loop
    again, per_step = _generate(tiny_model, make_toy(PredictiveLayerCodec, tiny_model, pre_rope=pre_rope), decode_per_step=True)
    torch.testing.assert_close(again, logits, rtol=1e-5, atol=1e-5)
    assert per_step.working_nbytes < cache.working_nbytes


@torch.no_grad()
def test_layer_scope_prediction_matters(tiny_llama):
    """Decoding layer 1 with a wrong predecessor changes its keys: the handoff is what decode uses."""
    codec = make_toy(PredictiveLayerCodec, tiny_llama)
    _, cache = _generate(tiny_llama, codec)
    layer = cache.layers[1]
    key_block, value_block = layer.parts[0].schedule.blocks[2]  # row 0's first block, after its 2 sinks
    payloads = layer.key_stream.store.block(key_block), layer.value_stream.store.block(value_block)
    first = cache.layers[0]
    k0, v0 = codec.decode((first.key_stream.store.block(first.parts[0].schedule.blocks[2][0]),
                           first.value_stream.store.block(first.parts[0].schedule.blocks[2][1])), LayerRequest(0, dtype=torch.float32))
    right = codec.decode(payloads, LayerRequest(1, previous=(k0, v0), dtype=torch.float32))
    wrong = codec.decode(payloads, LayerRequest(1, previous=(torch.zeros_like(k0), v0), dtype=torch.float32))
    assert not torch.allclose(right[0], wrong[0], atol=1e-3)
    # what attention read for that block: the right reconstruction, re-rotated (pre-RoPE keys)
    n = key_block.count
    torch.testing.assert_close(layer.key_stream.decoded.view[:, :, :n], apply_rope(right[0], *layer.positions.rope(2, n)))


@torch.no_grad()
def test_model_scope_stores_variable_length_blocks_and_measures_them(tiny_model):
    codec = make_toy(DeflatedModelCodec, tiny_model)
    _, cache = _close_to_plain(tiny_model, codec)
    units = [g.scope.unit for g in cache.groups]  # one per row group (row 1 is left-padded)
    assert all(u.store.num_blocks >= 2 for u in units) and cache.payload_nbytes == sum(u.store.nbytes for u in units)
    for unit in units:
        lengths = [len(row) for p in unit.store.payloads for row in p.ragged["deflated"]]
        assert len(set(lengths)) > 1  # entropy coded: rows and blocks differ in size
        assert unit.store.nbytes == sum(lengths) + sum(t.numel() * 2 for p in unit.store.payloads for t in p.tensors.values())
    assert all(layer_bytes(layer).payload == 0 for layer in cache.layers)  # the payloads are the model unit's
    breakdown = cache.bits_breakdown()
    assert 0 < breakdown["code_bits_per_value"] < 16 and breakdown["state_bits_per_value"] == 0


@torch.no_grad()
def test_model_scope_encodes_after_the_last_layer(tiny_llama):
    """The forward that completes a block sees it in full precision in every layer."""
    codec = make_toy(DeflatedModelCodec, tiny_llama, sinks=0, window=0, block=8)
    cache = CompressedCache(codec, "simulated")
    ids = torch.randint(1, 96, (1, 8))
    logits = tiny_llama(ids, past_key_values=cache).logits
    plain = tiny_llama(ids).logits
    torch.testing.assert_close(logits, plain)
    assert all(s.num_encoded == 8 for layer in cache.layers for s in layer.streams)


@torch.no_grad()
def test_stateful_codec_state_is_held_counted_and_reordered(tiny_llama):
    codec = make_toy(AnchoredStreamCodec, tiny_llama)
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
    stream.forget_decoded()  # force decoding again from the reordered payload and state
    torch.testing.assert_close(stream.materialize(), before.flip(0))
    cache.reorder_cache(torch.tensor([2, 3, 0, 1]))  # rows move between groups: the groups follow them
    assert [g.rows for g in cache.groups] == [[2, 3], [0, 1]]


@torch.no_grad()
def test_beam_search_reorders_layer_and_model_scope_caches(tiny_llama):
    for cls in (PredictiveLayerCodec, DeflatedModelCodec, AnchoredStreamCodec):
        codec = make_toy(cls, tiny_llama)
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
