"""Uniform / KIVI quantization keeps finite values for any finite input (float16 params promoted)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvcomp.cache import CompressedCache
from kvcomp.codecs import ModelInfo, build_codec
from kvcomp.codecs.base import StreamRequest
from kvcomp.errors import NonFiniteKVError
from kvcomp.stages.uniform_quantizer import GroupQuantizer
from tests.helpers import build_tiny, info_of

KIVI = {"name": "kivi", "bits": 2, "group_size": 32, "residual_length": 32}


def _block(magnitude, shape=(1, 2, 32, 16), seed=0):
    x = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return x * magnitude


def _within_half_a_step(quantizer, payload, x, decoded):
    """Every decoded value lies within half a quantization step of its input (float32 rounding aside)."""
    step = quantizer._expand(payload["scale"])
    slack = 1e-6 * x.abs().amax()
    return bool(((decoded - x).abs() <= 0.5 * step * (1 + 1e-3) + slack).all())


@pytest.mark.parametrize("magnitude", [1e5, -1e5, 1e30, -1e30, 1.6e38])
@pytest.mark.parametrize("axis", ["per_token", "per_channel"])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_huge_inputs_round_trip_finite_within_half_a_step(magnitude, axis, bits):
    quantizer = GroupQuantizer(bits, 16, axis)
    x = _block(magnitude)
    payload = quantizer.encode(x)
    assert payload["scale"].dtype == torch.float32 and payload["zero"].dtype == torch.float32
    decoded = quantizer.decode(payload, 16, torch.float32)
    assert torch.isfinite(decoded).all()
    assert _within_half_a_step(quantizer, payload, x, decoded)
    assert (decoded - x).abs().max() <= abs(magnitude) / ((1 << bits) - 1) * 1.01  # range <= 2|magnitude|


@pytest.mark.parametrize("axis", ["per_token", "per_channel"])
@pytest.mark.parametrize("bits", [2, 4])
def test_normal_inputs_keep_float16_parameters_and_the_same_round_trip(axis, bits):
    quantizer = GroupQuantizer(bits, 16, axis)
    x = _block(3.0)
    payload = quantizer.encode(x)
    assert payload["scale"].dtype == torch.float16 and payload["zero"].dtype == torch.float16
    # the min-max recipe with float16 parameters, written out
    dim = -1 if axis == "per_token" else -2
    groups = x.unflatten(dim, (-1, 16))
    lo, hi = groups.amin(dim), groups.amax(dim)
    levels = (1 << bits) - 1
    scale, zero = ((hi - lo) / levels).half(), lo.half()
    assert torch.equal(payload["scale"], scale) and torch.equal(payload["zero"], zero)
    s, z = quantizer._expand(scale), quantizer._expand(zero)
    codes = torch.round((x - z) / s).clamp(0, levels)
    torch.testing.assert_close(quantizer.decode(payload, 16, torch.float32), codes * s + z, rtol=0, atol=0)


def test_float16_is_kept_up_to_its_largest_value():
    quantizer = GroupQuantizer(2, 4, "per_token")
    fits = quantizer.encode(torch.tensor([65504.0, -65504.0, 0.0, 1.0]).reshape(1, 1, 1, 4))
    beyond = quantizer.encode(torch.tensor([65504.0, -70000.0, 0.0, 1.0]).reshape(1, 1, 1, 4))
    assert fits["scale"].dtype == torch.float16 and beyond["scale"].dtype == torch.float32


def test_range_checks_given_keep_float16_and_collect_the_verdicts():
    """With a ``range_checks`` list (``check_finite="deferred"``) the parameters stay float16 and whether they fit is
    appended to it; without one the check happens at once and nothing is collected."""
    quantizer, checks = GroupQuantizer(2, 4, "per_token"), []
    beyond = torch.tensor([65504.0, -70000.0, 0.0, 1.0]).reshape(1, 1, 1, 4)
    fits = quantizer.encode(beyond / 4, checks)
    kept = quantizer.encode(beyond, checks)
    assert fits["scale"].dtype == kept["scale"].dtype == torch.float16
    assert [bool(v) for v in checks] == [True, False]
    codec, checks = build_codec({"name": "uniform", "bits": 2, "group_size": 4}, ModelInfo("m", 1, 1, 4)), []
    payload = codec.encode(StreamRequest(0, "value", tokens=beyond, range_checks=checks))  # what the cache builds
    assert payload.tensors["scale"].dtype == torch.float16 and [bool(v) for v in checks] == [False]
    assert codec.encode(StreamRequest(0, "value", tokens=beyond)).tensors["scale"].dtype == torch.float32


def test_a_huge_block_after_a_normal_one_promotes_the_concatenated_payload():
    quantizer = GroupQuantizer(4, 16, "per_channel")
    a, b = _block(1.0), _block(1e5, seed=1)
    pa, pb = quantizer.encode(a), quantizer.encode(b)
    assert pa["scale"].dtype == torch.float16 and pb["scale"].dtype == torch.float32
    joined = {k: torch.cat([pa[k], pb[k]], dim=2) for k in pa}  # as Payload.concat does
    assert joined["scale"].dtype == torch.float32 and joined["zero"].dtype == torch.float32
    decoded = quantizer.decode(joined, 16, torch.float32)
    assert torch.isfinite(decoded).all()
    torch.testing.assert_close(decoded[:, :, :32], quantizer.decode(pa, 16, torch.float32), rtol=0, atol=0)
    torch.testing.assert_close(decoded[:, :, 32:], quantizer.decode(pb, 16, torch.float32), rtol=0, atol=0)
    assert _within_half_a_step(quantizer, joined, torch.cat([a, b], dim=2), decoded)


@pytest.mark.parametrize("bits", [1, 2, 8])
def test_inputs_whose_range_overflows_float32_are_refused(bits):
    quantizer = GroupQuantizer(bits, 16, "per_token")
    x = _block(1.0)
    x[..., 0], x[..., 1] = 3e38, -3e38  # max - min overflows, though max / levels - min / levels would not
    with pytest.raises(NonFiniteKVError, match=r"overflows float32 \(largest input magnitude 3e\+38"):
        quantizer.encode(x)


def test_non_finite_inputs_are_refused():
    x = _block(1.0)
    x[0, 0, 0, 0] = float("nan")
    with pytest.raises(NonFiniteKVError, match="NaN or Inf"):
        GroupQuantizer(2, 16, "per_token").encode(x)


@pytest.mark.parametrize(
    "config, head_dim",
    [
        (KIVI, 32),  # per-token value groups of 32 channels need head_dim >= 32
        ({**KIVI, "group_size": 16}, 16),
        ({"name": "uniform", "bits": 4, "group_size": 16, "key_axis": "per_channel"}, 16),
        ({"name": "qjl", "sketch_dim": 32, "outlier_sketch_dim": 16, "initial_layers": 0, "outlier_channels": 2,
          "group_size": 32, "key_buffer": 32, "value_group_size": 16}, 16),
    ],
)
def test_codecs_round_trip_magnitude_1e5_finite(config, head_dim):
    codec = build_codec(config, ModelInfo("m", 1, 2, head_dim))
    x = _block(1e5, (1, 2, 64, head_dim))
    kinds = ["value"] if config["name"] == "qjl" else ["key", "value"]  # QJL keys are sign sketches
    for kind in kinds:
        payload = codec.encode(StreamRequest(0, kind, tokens=x))
        assert payload.tensors["scale"].dtype == torch.float32
        decoded = codec.decode(payload, StreamRequest(0, kind, dtype=torch.float32))
        assert torch.isfinite(decoded).all()
        assert (decoded - x).abs().max() <= 2e5 / ((1 << getattr(codec.config, "bits", 2)) - 1)


def test_kivi_cache_with_keys_of_magnitude_1e5_returns_finite_values():
    codec = build_codec(KIVI, ModelInfo("m", 1, 2, 32))
    cache = CompressedCache(codec, "simulated")
    keys, values = _block(1e5, (1, 2, 96, 32)), _block(-1e5, (1, 2, 96, 32), seed=3)
    k, v = cache.layers[0].update(keys, values)
    assert cache.layers[0].key_stream.num_encoded > 0
    assert torch.isfinite(k).all() and torch.isfinite(v).all()
    assert ((k - keys).abs().max() / 1e5) < 0.4 and ((v - values).abs().max() / 1e5) < 0.4


def test_kivi_cache_promotes_a_stream_when_a_huge_block_follows_normal_ones():
    codec = build_codec(KIVI, ModelInfo("m", 1, 2, 32))
    layer = CompressedCache(codec, "simulated").layers[0]
    small, huge = _block(1.0, (1, 2, 64, 32)), _block(1e5, (1, 2, 64, 32), seed=4)
    k_small, _ = layer.update(small, small)
    assert layer.key_stream.payload.tensors["scale"].dtype == torch.float16
    k, v = layer.update(huge, huge)
    assert layer.key_stream.payload.tensors["scale"].dtype == torch.float32
    assert torch.isfinite(k).all() and torch.isfinite(v).all()
    torch.testing.assert_close(k[:, :, :32], k_small[:, :, :32], rtol=0, atol=0)  # earlier block unchanged
    assert ((k[:, :, 64:] - huge).abs().max() / 1e5) < 0.4


def test_tiny_llama_with_keys_and_values_of_magnitude_1e5_keeps_a_finite_kivi_cache():
    model = build_tiny(LlamaConfig, LlamaForCausalLM)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(1e6)  # keys and values of magnitude ~1e5
            layer.self_attn.v_proj.weight.mul_(1e6)
    codec = build_codec({"name": "kivi", "bits": 2, "group_size": 4, "residual_length": 8}, info_of(model))
    cache = CompressedCache(codec, "simulated")
    ids = torch.randint(0, 96, (1, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    for layer in cache.layers:
        for stream in (layer.key_stream, layer.value_stream):
            assert stream.payload.tensors["scale"].dtype == torch.float32
        k, v = layer.key_stream.materialize(), layer.value_stream.materialize()
        assert k.abs().max() > 65504 and torch.isfinite(k).all() and torch.isfinite(v).all()


def test_decode_attention_reads_float32_parameters():
    """The torch reference and the fused kernel (interpreter) read a payload whose huge block promoted
    its params to float32, and agree."""
    from kvcomp.kernels.decode_attention import decode_attention_reference
    from kvcomp.kernels.formats import UniformReader

    quantizer = GroupQuantizer(2, 16, "per_channel")
    x = torch.cat([_block(1.0, (1, 1, 32, 16)), _block(1e5, (1, 1, 32, 16), seed=2)], dim=2)
    stored = quantizer.encode(x)
    assert stored["scale"].dtype == torch.float32
    reader = UniformReader(64, 16, stored["codes"], stored["scale"], stored["zero"], 2, 16, True)
    torch.testing.assert_close(reader.dequantize_unrotated(), quantizer.decode(stored, 16, torch.float32))
    values = torch.randn(1, 1, 64, 16)
    query = torch.randn(1, 2, 16) * 1e-5
    valid = torch.ones(1, 64, dtype=torch.bool)
    reference = decode_attention_reference(query, [reader], [values], 16**-0.5, valid)
    assert torch.isfinite(reference).all()
    pytest.importorskip("triton")
    from kvcomp.kernels.decode_attention import decode_attention

    out = decode_attention(query, [reader], [values], 16**-0.5, valid, backend="triton")
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)
