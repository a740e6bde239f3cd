"""Every registered codec through the cache: round trip, bytes, state save/load, batch maps, beam search.
The matrix itself (one entry per codec) and the other tests that read it: ``tests/codec_matrix.py``."""

import pytest
import torch
from transformers import DynamicCache

from kvcomp.cache import CompressedCache
from kvcomp.codecs import CODECS, ModelInfo, expected_cache_bits, keeps_state
from kvcomp.codecs.base import LayerRequest, ModelRequest, StreamRequest
from kvcomp.errors import CalibrationMismatchError
from tests.codec_matrix import MATRIX, make_codec

NAMES = list(MATRIX)


pytestmark = pytest.mark.usefixtures("session_cache")


def test_every_registered_codec_joins_the_matrix():
    assert set(MATRIX) == set(CODECS), "add an Entry for each codec to tests/codec_matrix.py"


def _ids(batch=2, length=40, seed=0):
    return torch.randint(1, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_through_the_cache_and_measured_bytes(tiny_llama, name):
    codec = make_codec(tiny_llama, name)
    ids = _ids()
    reference = DynamicCache(config=tiny_llama.config)
    cache = CompressedCache(codec, "simulated")
    with torch.no_grad():
        tiny_llama(ids, past_key_values=reference)
        tiny_llama(ids, past_key_values=cache)
    for layer, plain in zip(cache.layers, reference.layers):
        for stream, original in ((layer.key_stream, plain.keys), (layer.value_stream, plain.values)):
            error = (stream.materialize() - original).pow(2).mean().sqrt() / original.pow(2).mean().sqrt()
            assert error <= MATRIX[name].error, (stream.kind, error)
            assert name == "fp16" or stream.num_encoded > 0
    try:
        expected = expected_cache_bits(codec, ids.shape[1], ids.shape[0], fp_bits=32)
    except NotImplementedError:  # variable-rate codecs report measured bytes only
        expected = None
    if expected is not None:  # per-sequence state (CSR's online bank) is measured apart, see tests/codecs/test_csr.py
        assert (cache.nbytes - cache.state_nbytes) * 8 == pytest.approx(expected)
        assert keeps_state(codec) == (cache.state_nbytes > 0)
    assert cache.nbytes == cache.full_precision_nbytes + cache.payload_nbytes + cache.state_nbytes


@pytest.mark.parametrize("name", [n for n in NAMES if MATRIX[n].fitted])
def test_state_save_load_and_mismatch(tiny_llama, name, tmp_path):
    path = tmp_path / f"{name}.safetensors"
    fitted = make_codec(tiny_llama, name, path=path)
    loaded = make_codec(tiny_llama, name, path=path)  # reuses the artifact: no second fit
    x = torch.randn(2, fitted.model.num_kv_heads, 8, fitted.model.head_dim)
    for a, b in zip(_layer1_round_trip(fitted, x), _layer1_round_trip(loaded, x)):
        assert torch.equal(a, b)
    other = ModelInfo.from_hf_config(tiny_llama.config, fingerprint="another-model")
    codec = type(fitted)(fitted.config, other)
    from kvcomp.calibration import calibrate
    from tests.codec_matrix import CALIBRATION

    with pytest.raises(CalibrationMismatchError, match="model: artifact has"):
        calibrate(codec, CALIBRATION, None, path)


def _layer1_round_trip(codec, x):
    """Layer 1's decoded keys and values of ``x`` (a layer-scope codec is given layer 0's reconstruction, a
    model-scope one every layer's block)."""
    if codec.scope == "layer":
        previous = codec.encode(LayerRequest(0, keys=x, values=x))
        handed = previous.keys, previous.values
        encoded = codec.encode(LayerRequest(1, keys=x, values=-x, previous=handed))
        return codec.decode((encoded.key, encoded.value), LayerRequest(1, previous=handed, dtype=torch.float32))
    if codec.scope == "model":
        layers = range(codec.model.num_layers)
        payload = codec.encode(ModelRequest(keys=[x * (i + 1) for i in layers], values=[-x * (i + 1) for i in layers]))
        return codec.decode(payload, ModelRequest(1, dtype=torch.float32))
    return [codec.decode(codec.encode(StreamRequest(1, kind, tokens=y)), StreamRequest(1, kind, dtype=torch.float32))
            for y, kind in ((x, "key"), (-x, "value"))]


@pytest.mark.parametrize("name", NAMES)
def test_batch_maps_move_every_row(tiny_llama, name):
    """reorder / select / repeat move sinks, payloads, tails and decoded blocks of every row together."""
    codec = make_codec(tiny_llama, name)
    cache = CompressedCache(codec)
    with torch.no_grad():
        tiny_llama(_ids(batch=3), past_key_values=cache)
    before = [(s.materialize(), s.num_encoded) for layer in cache.layers for s in layer.streams]
    cache.reorder_cache(torch.tensor([2, 0, 1]))
    cache.batch_select_indices(torch.tensor([True, False, True]))  # rows 2 and 1 of the original
    cache.batch_repeat_interleave(2)
    pick = torch.tensor([2, 2, 1, 1])
    for (x, encoded), stream in zip(before, (s for layer in cache.layers for s in layer.streams)):
        assert stream.num_encoded == encoded and stream.batch == 4
        stream.forget_decoded()  # decode the moved payloads again
        torch.testing.assert_close(stream.materialize(), x[pick])


@pytest.mark.parametrize("name", NAMES)
def test_beam_search(tiny_llama, name):
    codec = make_codec(tiny_llama, name)
    cache = CompressedCache(codec)
    with torch.no_grad():
        out = tiny_llama.generate(_ids(batch=1, length=30), num_beams=3, max_new_tokens=12, min_new_tokens=12,
                                  do_sample=False, past_key_values=cache, pad_token_id=0)
    assert out.shape == (1, 42) and cache.layers[0].key_stream.batch == 3
