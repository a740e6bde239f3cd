"""KVarN: the Sinkhorn stage against the reference recurrence, the tile format's bytes, the full-precision sinks and
tail, the normalisation's effect on an outlier token, and refused settings."""

import math

import pytest
import torch
from transformers import DynamicCache

from kvcomp.cache import CompressedCache
from kvcomp.codecs import ModelInfo, build_codec, expected_cache_bits
from kvcomp.codecs.base import StreamRequest
from kvcomp.errors import ConfigError
from kvcomp.stages.sinkhorn import LOG_SCALE_CLIP, imbalance, variance_normalize
from tests.helpers import info_of


def _tile(seed=0, rows=64, cols=32):
    """A tile with one token (column) 20x and one channel (row) 8x larger than the rest, stds all >= 1."""
    m = 2 * torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    m[:, 5] *= 20
    m[3] *= 8
    return m


@pytest.mark.parametrize("seed", range(3))
def test_sinkhorn_equalises_row_and_column_stds_of_a_tile(seed):
    m = _tile(seed, 128, 128)  # a key tile [D, G] of the default shape
    balanced, s_col, s_row = variance_normalize(m, 16)
    cols, rows = balanced.std(dim=0), balanced.std(dim=1)
    assert cols.max() / cols.min() < 1.01 and rows.max() / rows.min() < 1.1
    assert imbalance(m) > 30 and imbalance(balanced) < 2.1  # 2: perfectly balanced
    torch.testing.assert_close(balanced * s_col * s_row, m)


def test_sinkhorn_first_round_is_the_references_recurrence():
    m = _tile(1)
    _, s_col, s_row = variance_normalize(m, 1)
    log_col = m.std(dim=0, keepdim=True).clamp(1e-3, 1e3).log().clamp(*LOG_SCALE_CLIP)
    log_row = (m / log_col.exp()).std(dim=1, keepdim=True).clamp(1e-3, 1e3).log().clamp(*LOG_SCALE_CLIP)
    torch.testing.assert_close(s_col, log_col.exp())
    torch.testing.assert_close(s_row, log_row.exp())


def test_sinkhorn_never_scales_up_beyond_its_clip():
    small = 0.01 * torch.randn(3, 16, 8, generator=torch.Generator().manual_seed(2))
    _, s_col, s_row = variance_normalize(small, 16)
    floor = math.exp(LOG_SCALE_CLIP[0])  # scales >= exp(-0.3): a tiny tile is barely scaled up
    assert torch.allclose(s_col, torch.full_like(s_col, floor)) and torch.allclose(s_row, torch.full_like(s_row, floor))


def test_sinkhorn_keeps_the_round_of_lowest_imbalance():
    g = torch.Generator().manual_seed(0)  # small tiles of wild scales, where later rounds can be worse than earlier ones
    tiles = (torch.randn(2000, 4, 3, generator=g) * torch.exp(3 * torch.randn(2000, 4, 1, generator=g))
             * torch.exp(3 * torch.randn(2000, 1, 3, generator=g)))
    identity, ones_col, ones_row = variance_normalize(tiles, 0)
    assert torch.equal(identity, tiles) and (ones_col == 1).all() and (ones_row == 1).all()
    best = imbalance(variance_normalize(tiles, 16)[0])
    for rounds in range(16):  # the best of rounds 0..16 is no worse than the best of any shorter run
        assert (best <= imbalance(variance_normalize(tiles, rounds)[0]) * (1 + 1e-5)).all(), rounds


def _codec(head_dim=128, **config):
    return build_codec({"name": "kvarn", **config}, ModelInfo("m", 2, 2, head_dim))


def _encode(codec, kind, x):
    return codec.encode(StreamRequest(layer=0, kind=kind, tokens=x))


def test_a_k4v2_tile_holds_the_reference_record_bytes():
    codec = _codec()
    x = torch.randn(1, 1, 128, 128, generator=torch.Generator().manual_seed(0))
    key, value = _encode(codec, "key", x), _encode(codec, "value", x)
    # huawei-csl/KVarN config.py, D = group = 128: K 8192 packed + (2 D + G) fp16; V 4096 packed + (D + 2 G) fp16
    assert (key.nbytes, value.nbytes) == (8192 + 768, 4096 + 768)
    assert key.nbytes + value.nbytes == 13824
    assert (codec.code_bits_per_value("key", 0), codec.code_bits_per_value("value", 0)) == (4.375, 2.375)
    assert codec.bits_per_value() == 3.375
    small = _codec(64, tile=64, key_bits=2)  # SmolLM2's head_dim: keys 2 + 16 (2*64 + 64) / 64^2 bits
    assert small.code_bits_per_value("key", 0) == 2.75 and small.code_bits_per_value("value", 0) == 2.75


def test_keys_are_scaled_per_channel_and_values_per_token_tile_by_tile():
    codec = _codec(16, tile=8)
    x = torch.randn(2, 2, 16, 16, generator=torch.Generator().manual_seed(1))
    key, value = _encode(codec, "key", x).tensors, _encode(codec, "value", x).tensors
    assert key["chan_scale"].shape == key["chan_zero"].shape == (2, 2, 2, 16) and key["token_scale"].shape == (2, 2, 16)
    assert value["token_scale"].shape == value["token_zero"].shape == (2, 2, 16)
    assert value["chan_scale"].shape == (2, 2, 2, 16)
    for kind in ("key", "value"):  # each tile is normalised and quantized on its own
        whole = _encode(codec, kind, x)
        halves = [_encode(codec, kind, x[:, :, i:i + 8]) for i in (0, 8)]
        for name, tensor in whole.tensors.items():
            torch.testing.assert_close(tensor, halves[0].concat(halves[1]).tensors[name], rtol=0, atol=0)


def test_the_normalisation_absorbs_an_outlier_token():
    x = torch.randn(1, 1, 128, 64, generator=torch.Generator().manual_seed(3))
    x[:, :, 40] *= 50  # one token of 50x the others' magnitude
    others = torch.arange(128) != 40
    errors = {}
    for iters in (0, 16):  # 0: Hadamard and per-channel RTN only
        codec = _codec(64, sinkhorn_iters=iters)
        y = codec.decode(_encode(codec, "key", x), StreamRequest(layer=0, kind="key", dtype=torch.float32))
        errors[iters] = ((y - x)[..., others, :].norm() / x[..., others, :].norm()).item()
    assert errors[16] < errors[0] / 4, errors


def test_sinks_and_the_unfinished_tile_stay_exact(tiny_llama):
    codec = build_codec({"name": "kvarn", "tile": 8, "sinks": 4}, info_of(tiny_llama))
    ids = torch.randint(0, 96, (2, 31), generator=torch.Generator().manual_seed(0))
    reference, cache = DynamicCache(), CompressedCache(codec)
    with torch.no_grad():
        tiny_llama(ids, past_key_values=reference)
        tiny_llama(ids, past_key_values=cache)
    exact = reference.layers[0].keys, reference.layers[0].values  # layer 0 sees the same K/V either way
    for stream, original in zip((cache.layers[0].key_stream, cache.layers[0].value_stream), exact):
        assert (stream.num_sinks, stream.num_encoded, stream.num_tail) == (4, 24, 3)
        read = stream.materialize()
        assert torch.equal(read[:, :, :4], original[:, :, :4]) and torch.equal(read[:, :, 28:], original[:, :, 28:])
        assert not torch.equal(read[:, :, 4:28], original[:, :, 4:28])
    assert 8 * cache.nbytes == expected_cache_bits(codec, 31, 2, 32)


@pytest.mark.parametrize("config, head_dim, message", [
    ({"key_bits": 0}, 64, "key_bits=0"),
    ({"value_bits": 9}, 64, "value_bits=9"),
    ({"tile": 1}, 64, "tile=1"),
    ({"sinkhorn_iters": -1}, 64, "sinkhorn_iters"),
    ({"sinks": -2}, 64, "sinks"),
    ({"param_dtype": "float8"}, 64, "param_dtype.*float16"),
    ({}, 96, "head_dim=96.*power of two"),
])
def test_bad_settings_are_refused_naming_them(config, head_dim, message):
    with pytest.raises(ConfigError, match=message):
        _codec(head_dim, **config)
