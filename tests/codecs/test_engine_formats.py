"""vLLM's KV-cache formats as codecs (``fp8``, ``int_token_head``, ``nvfp4``): the values each stores, its bytes
against vLLM's page layout, skipped layers, calibrated scales and bad settings."""

import pytest
import torch
from transformers import DynamicCache

from kvcomp.cache import CompressedCache
from kvcomp.codecs import Activations, ModelInfo, build_codec, expected_cache_bits, needs_calibration
from kvcomp.codecs.base import StreamRequest
from kvcomp.codecs.int_token_head import rht_signs
from kvcomp.errors import ConfigError
from kvcomp.stages.hadamard import fwht
from kvcomp.stages.minifloat import e2m1_codes, e2m1_values
from kvcomp.stages.rope import apply_rope
from tests.helpers import info_of

MODEL = ModelInfo("m", num_layers=2, num_kv_heads=2, head_dim=64)


def _round_trip(codec, x, layer=0, kind="key"):
    payload = codec.encode(StreamRequest(layer, kind, tokens=x))
    return payload, codec.decode(payload, StreamRequest(layer, kind, dtype=torch.float32))


@pytest.mark.parametrize("fmt, dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_fp8_tensor_round_trip_is_torchs_cast_and_saturates(fmt, dtype):
    x = torch.randn(2, 2, 5, 64, generator=torch.Generator().manual_seed(0)) * 3
    _, decoded = _round_trip(build_codec({"name": "fp8", "format": fmt}, MODEL), x)
    assert torch.equal(decoded, x.to(dtype).float())
    peak = torch.finfo(dtype).max
    _, decoded = _round_trip(build_codec({"name": "fp8", "format": fmt}, MODEL), torch.full((1, 2, 1, 64), 4 * peak))
    assert torch.equal(decoded, torch.full_like(decoded, peak))  # saturated, not NaN or Inf


def test_fp8_token_head_scale_is_amax_over_448_per_token_and_head():
    x = torch.randn(1, 2, 3, 64, generator=torch.Generator().manual_seed(1))
    payload, decoded = _round_trip(build_codec({"name": "fp8", "scale": "token_head"}, MODEL), x)
    scale = x.abs().amax(-1, keepdim=True) / 448
    assert payload.tensors["scale"].dtype == torch.float32 and torch.equal(payload.tensors["scale"], scale)
    assert torch.equal(decoded, (x * (1.0 / scale)).to(torch.float8_e4m3fn).float() * scale)


def test_int8_rounds_halves_away_from_zero():
    x = torch.zeros(1, 1, 1, 64)
    x[..., :4] = torch.tensor([127.0, 2.5, -2.5, 0.499])  # scale amax / 127 = 1
    payload, _ = _round_trip(build_codec({"name": "int_token_head", "bits": 8}, MODEL), x)
    assert payload.tensors["codes"][0, 0, 0, :4].tolist() == [127, 3, -3, 0]  # torch.round: 2, -2


def test_int4_undoes_its_rotation_and_hides_the_zero_point_in_the_scale():
    """Rotated heads on the int4 grid (``y = (q - z) s``, ``s`` a power of two, codes 0 and 15 present) come back
    exactly: the rotation ``y = H (d_1 * x)`` is undone, ``z`` is read from the scale's low mantissa bits."""
    g = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (1, 2, 3, 64), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    zero = torch.randint(0, 16, (1, 2, 3, 1), generator=g).float()
    y = (q - zero) * 0.125
    x = fwht(y) * rht_signs(64) / 64  # the x whose rotation is y
    payload, decoded = _round_trip(build_codec({"name": "int_token_head", "bits": 4}, MODEL), x)
    assert torch.equal(decoded, x)
    stored = payload.tensors["scale"].view(torch.int32)
    assert torch.equal((stored & 0xF).float(), zero) and payload.tensors["codes"].shape == (1, 2, 3, 32)


@pytest.mark.parametrize("x, expected", [
    (0.25, 0.0), (0.26, 0.5), (0.75, 1.0), (1.25, 1.0), (1.3, 1.5), (1.75, 2.0), (2.5, 2.0), (2.6, 3.0),
    (3.5, 4.0), (5.0, 4.0), (5.01, 6.0), (9.0, 6.0), (-0.75, -1.0), (-3.5, -4.0)])
def test_e2m1_rounds_to_the_nearest_magnitude_ties_to_the_even_code(x, expected):
    assert e2m1_values(e2m1_codes(torch.tensor([x]))).item() == expected


def test_nvfp4_copies_its_e2m1_grid_to_a_device_once(monkeypatch):
    """Each decode step encodes its token: a host-to-device copy of the e2m1 grid per encode made the host wait for
    the GPU twice per layer and step (``host syncs per step`` 8 on 4 layers, ``benchmarks/bench_decode_e2e.py`` on an
    H100)."""
    from kvcomp.stages import minifloat

    copies = []
    to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **k: (copies.append(1) if t is minifloat.E2M1 else None,
                                                                 to(t, *a, **k))[1])
    minifloat._e2m1_grid.cache_clear()
    codec = build_codec({"name": "nvfp4"}, MODEL)
    for step in range(3):
        payload, _ = _round_trip(codec, torch.randn(1, 2, 1, 64), kind=("key", "value")[step % 2])
    assert len(copies) == 1


def test_nvfp4_stores_a_block_on_its_grid_exactly_low_nibble_first():
    """A block ``b * v`` (``v`` e2m1 values, max 6; ``b`` exact in e4m3) under global scale 1 comes back exactly,
    with block scale ``b`` and codes packed two per byte, the first value in the low nibble."""
    v = e2m1_values(torch.randint(0, 16, (1, 2, 1, 64), generator=torch.Generator().manual_seed(3)).to(torch.uint8))
    v[..., ::16] = 6.0
    payload, decoded = _round_trip(build_codec({"name": "nvfp4"}, MODEL), v * 0.375)
    assert torch.equal(decoded, v * 0.375)
    assert torch.equal(payload.tensors["scales"].view(torch.float8_e4m3fn).float(), torch.full((1, 2, 1, 4), 0.375))
    codes = e2m1_codes(v[0, 0, 0, :2])
    assert payload.tensors["codes"][0, 0, 0, 0].item() == codes[0].item() | codes[1].item() << 4


def test_nvfp4_4over6_errs_no_more_than_nvfp4_on_any_block():
    x = torch.randn(2, 2, 16, 64, generator=torch.Generator().manual_seed(4))
    errors = [(_round_trip(build_codec({"name": "nvfp4", "four_over_six": f}, MODEL), x)[1] - x)
              .pow(2).view(2, 2, 16, 4, 16).sum(-1) for f in (False, True)]
    assert (errors[1] <= errors[0]).all() and (errors[1] < errors[0]).any()


VLLM_BYTES = {  # bytes per token and KV head of one stream in vLLM's cache pages, head_dim d
    "fp8": lambda d: d,
    "fp8_token_head": lambda d: d + 4,  # + a float32 scale
    "int8_token_head": lambda d: d + 4,
    "int4_token_head": lambda d: d // 2 + 4,  # two codes per byte + the scale holding the zero-point
    "nvfp4": lambda d: d // 2 + d // 16,  # nvfp4_kv_cache_full_dim
}
CONFIGS = {
    "fp8": {"name": "fp8"}, "fp8_token_head": {"name": "fp8", "scale": "token_head"},
    "int8_token_head": {"name": "int_token_head", "bits": 8}, "int4_token_head": {"name": "int_token_head", "bits": 4},
    "nvfp4": {"name": "nvfp4"},
}


@pytest.mark.parametrize("preset", list(CONFIGS))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bytes_per_token_and_head_are_vllms_layout(preset, head_dim):
    codec = build_codec(CONFIGS[preset], ModelInfo("m", 2, 2, head_dim))
    payload, _ = _round_trip(codec, torch.randn(1, 2, 3, head_dim))
    assert payload.nbytes == 2 * 3 * VLLM_BYTES[preset](head_dim)
    assert codec.code_bits_per_value("key", 0) * head_dim == 8 * VLLM_BYTES[preset](head_dim)


@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_skipped_layers_stay_exact_and_count_16_bits(tiny_llama, config):
    codec = build_codec({**config, "skip_layers": [-2]}, info_of(tiny_llama))  # layer 0 of 2: its input is exact
    ids = torch.randint(1, 96, (2, 20), generator=torch.Generator().manual_seed(5))
    reference, cache = DynamicCache(config=tiny_llama.config), CompressedCache(codec, "simulated")
    with torch.no_grad():
        tiny_llama(ids, past_key_values=reference)
        tiny_llama(ids, past_key_values=cache)
    (kept, coded), (plain_kept, plain_coded) = cache.layers, reference.layers
    for stream, plain in ((kept.key_stream, plain_kept.keys), (kept.value_stream, plain_kept.values)):
        assert torch.equal(stream.materialize(), plain) and stream.num_encoded == 0
    assert coded.key_stream.num_encoded == 20 and not torch.equal(coded.key_stream.materialize(), plain_coded.keys)
    assert codec.code_bits_per_value("value", 0) == 16 > codec.code_bits_per_value("value", 1)
    assert cache.nbytes * 8 == expected_cache_bits(codec, 20, 2, fp_bits=32)


class _Windows(Activations):
    def __init__(self, fields, rope):
        self.fields, self.num_layers, self.rope = fields, len(fields), rope

    def layer(self, layer):
        return self.fields[layer]


@pytest.mark.parametrize("config, divisor", [
    ({"name": "fp8", "tensor_scale": "calibrated"}, 448.0),
    ({"name": "fp8", "format": "e5m2", "tensor_scale": "calibrated"}, 57344.0),
    ({"name": "nvfp4", "global_scale": "calibrated"}, 6 * 448.0)])
def test_a_calibrated_scale_is_the_calibration_amax_over_the_format_max(config, divisor):
    """Per layer and stream ``amax / divisor`` over the calibration tokens, keys after RoPE (as the cache holds them);
    the codec then encodes with it and counts it in its overhead."""
    g = torch.Generator().manual_seed(6)
    fields = tuple({"key": torch.randn(3, 2, 8, 64, generator=g) * (layer + 1),
                    "value": torch.randn(3, 2, 8, 64, generator=g) * 10} for layer in range(2))
    angles = torch.rand(8, 32, generator=g) * 6
    rope = (torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1))
    codec = build_codec(config, MODEL)
    assert needs_calibration(codec)
    codec.install_state(codec.fit(_Windows(fields, rope)))
    rotated = apply_rope(fields[1]["key"], *(t[None] for t in rope))
    assert rotated.abs().max() != fields[1]["key"].abs().max()
    assert codec.stream_scales.get(1, "key", torch.device("cpu")) == rotated.abs().max() / divisor
    assert codec.stream_scales.get(0, "value", torch.device("cpu")) == fields[0]["value"].abs().max() / divisor
    assert codec.overhead_bits() == 32 * 2 * 2
    if config["name"] == "fp8":
        x = torch.randn(1, 2, 4, 64, generator=g)
        scale = fields[0]["value"].abs().max() / divisor
        dtype = torch.float8_e4m3fn if divisor == 448.0 else torch.float8_e5m2
        assert torch.equal(_round_trip(codec, x, 0, "value")[1], (x / scale).to(dtype).float() * scale)


def test_uncalibrated_settings_fit_nothing():
    for config in ({"name": "fp8"}, {"name": "fp8", "scale": "token_head"}, {"name": "nvfp4"}):
        codec = build_codec(config, MODEL)
        assert not needs_calibration(codec) and codec.overhead_bits() == 0


@pytest.mark.parametrize("config, model, message", [
    ({"name": "fp8", "format": "e4m3fnuz"}, MODEL, r"unknown fp8 format 'e4m3fnuz'; valid choices: e4m3, e5m2"),
    ({"name": "fp8", "scale": "channel"}, MODEL, r"valid choices: tensor, token_head"),
    ({"name": "fp8", "scale": "token_head", "tensor_scale": "calibrated"}, MODEL, r"applies to scale=tensor only"),
    ({"name": "fp8", "skip_layers": [2]}, MODEL, r"skip_layers \[2\] are not layers of this model"),
    ({"name": "int_token_head", "bits": 2}, MODEL, r"bits=2 is not supported; valid: 8, 4"),
    ({"name": "int_token_head", "bits": 4}, ModelInfo("m", 2, 2, 48), r"power-of-two head_dim.*head_dim=48"),
    ({"name": "nvfp4"}, ModelInfo("m", 2, 2, 40), r"head_dim=40 is not a multiple of the NVFP4 block of 16"),
    ({"name": "nvfp4", "global_scale": "amax"}, MODEL, r"valid choices: calibrated, one"),
])
def test_bad_settings_are_refused_naming_the_choices(config, model, message):
    with pytest.raises(ConfigError, match=message):
        build_codec(config, model)
