"""Uniform / KIVI quantization keeps finite values for any finite input (float16 params promoted)."""

import pytest
import torch

from kvcomp.cache import CompressedCache
from kvcomp.codecs import ModelInfo, build_codec
from kvcomp.errors import NonFiniteKVError
from kvcomp.stages.uniform_quantizer import GroupQuantizer


def _block(magnitude, shape=(1, 2, 32, 16), seed=0):
    x = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return x * magnitude


@pytest.mark.parametrize("magnitude", [1e5, 1e30, -1e5])
@pytest.mark.parametrize("axis", ["per_token", "per_channel"])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_huge_inputs_round_trip_finite_within_half_a_step(magnitude, axis, bits):
    quantizer = GroupQuantizer(bits, 16, axis)
    x = _block(magnitude)
    payload = quantizer.encode(x)
    assert payload["scale"].dtype == torch.float32 and payload["zero"].dtype == torch.float32
    decoded = quantizer.decode(payload, 16, torch.float32)
    assert torch.isfinite(decoded).all()
    step = quantizer._expand(payload["scale"])
    assert ((decoded - x).abs() <= 0.5 * step * (1 + 1e-3) + abs(magnitude) * 1e-6).all()


def test_normal_inputs_keep_float16_parameters():
    quantizer = GroupQuantizer(2, 16, "per_token")
    payload = quantizer.encode(_block(3.0))
    assert payload["scale"].dtype == torch.float16 and payload["zero"].dtype == torch.float16


def test_a_huge_block_after_a_normal_one_promotes_the_stream():
    quantizer = GroupQuantizer(4, 16, "per_channel")
    a, b = _block(1.0), _block(1e5, seed=1)
    pa, pb = quantizer.encode(a), quantizer.encode(b)
    joined = {k: torch.cat([pa[k], pb[k]], dim=2) for k in pa}
    assert joined["scale"].dtype == torch.float32
    decoded = quantizer.decode(joined, 16, torch.float32)
    assert torch.isfinite(decoded).all()
    torch.testing.assert_close(decoded[:, :, :32], quantizer.decode(pa, 16, torch.float32))


def test_inputs_overflowing_float32_are_refused():
    quantizer = GroupQuantizer(1, 16, "per_token")
    x = _block(3e38)
    x[..., 0], x[..., 1] = 3e38, -3e38
    with pytest.raises(NonFiniteKVError, match="overflows float32"):
        quantizer.encode(x)


def test_kivi_cache_with_keys_of_magnitude_1e5_returns_finite_values():
    codec = build_codec({"name": "kivi", "bits": 2, "group_size": 32, "residual_length": 32}, ModelInfo("m", 1, 2, 32))
    cache = CompressedCache(codec, "simulated")
    keys, values = _block(1e5, (1, 2, 96, 32)), _block(-1e5, (1, 2, 96, 32), seed=3)
    k, v = cache.layers[0].update(keys, values)
    assert cache.layers[0].key_stream.num_encoded > 0
    assert torch.isfinite(k).all() and torch.isfinite(v).all()
    assert ((k - keys).abs().max() / 1e5) < 0.4 and ((v - values).abs().max() / 1e5) < 0.4


def test_fused_kernel_reads_float32_parameters():
    """The decode kernel (interpreter) reads a payload whose huge block promoted its params to float32."""
    pytest.importorskip("triton")
    from kvcomp.kernels.decode_attention import UniformReader, decode_attention, decode_attention_reference

    quantizer = GroupQuantizer(2, 16, "per_channel")
    x = torch.cat([_block(1.0, (1, 1, 32, 16)), _block(1e5, (1, 1, 32, 16), seed=2)], dim=2)
    stored = quantizer.encode(x)
    assert stored["scale"].dtype == torch.float32
    reader = UniformReader(64, 16, stored["codes"], stored["scale"], stored["zero"], 2, 16, True)
    values = torch.randn(1, 1, 64, 16)
    query = torch.randn(1, 2, 16) * 1e-5
    valid = torch.ones(1, 64, dtype=torch.bool)
    reference = decode_attention_reference(query, [reader], [values], 16**-0.5, valid)
    out = decode_attention(query, [reader], [values], 16**-0.5, valid, backend="triton")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)
