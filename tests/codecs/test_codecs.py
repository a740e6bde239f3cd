import pytest
import torch

from kvcomp.codecs import CODECS, CodecConfig, CodecState, ModelInfo, build_codec, expected_cache_bits
from kvcomp.codecs.base import StreamRequest
from kvcomp.errors import CalibrationMismatchError, ConfigError

MODEL = ModelInfo(name="tiny", num_layers=2, num_kv_heads=3, head_dim=64)
QUANTIZED = [
    {"name": "kivi", "bits": 2},
    {"name": "kivi", "bits": 4, "group_size": 16, "residual_length": 32},
    {"name": "uniform", "bits": 3, "group_size": 32},
    {"name": "uniform", "bits": 1, "group_size": 8, "key_axis": "per_channel", "value_axis": "per_channel"},
    {"name": "uniform", "bits": 8, "group_size": 64, "pre_rope": True},
]


def _block(codec, kind, blocks=2, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = blocks * codec.policy(kind, 0).block_size
    return torch.randn(batch, MODEL.num_kv_heads, tokens, MODEL.head_dim, generator=g) * 3 + 1


@pytest.mark.parametrize("config", QUANTIZED, ids=lambda c: str(c))
@pytest.mark.parametrize("kind", ["key", "value"])
def test_encode_decode_contract(config, kind):
    codec = build_codec(config, MODEL)
    x = _block(codec, kind)
    payload = codec.encode(StreamRequest(0, kind, tokens=x))
    assert payload.tensors["codes"].dtype == torch.uint8  # real packed storage
    assert payload.num_tokens == x.shape[2]
    assert all(t.shape[2] in (x.shape[2], x.shape[2] // codec.config.group_size) for t in payload.tensors.values())
    x_hat = codec.decode(payload, StreamRequest(0, kind, dtype=torch.float32))
    assert x_hat.shape == x.shape
    # round-to-nearest: error at most half a step (+ fp16 rounding of the parameters)
    step = payload.tensors["scale"].float().max()
    assert (x - x_hat).abs().max() <= 0.5 * step * 1.01 + 1e-2
    # exact bit accounting: payload bytes == bits per value x values
    assert payload.nbytes * 8 == pytest.approx(codec.code_bits_per_value(kind, 0) * x.numel())


@pytest.mark.parametrize("kind", ["key", "value"])
def test_payloads_concatenate_like_one_block(kind):
    codec = build_codec({"name": "kivi", "bits": 2, "group_size": 8, "residual_length": 16}, MODEL)
    x = _block(codec, kind, blocks=2)
    half = x.shape[2] // 2
    joined = codec.encode(StreamRequest(0, kind, tokens=x[:, :, :half])).concat(codec.encode(StreamRequest(0, kind, tokens=x[:, :, half:])))
    whole = codec.encode(StreamRequest(0, kind, tokens=x))
    assert joined.num_tokens == whole.num_tokens
    for name in whole.tensors:
        assert torch.equal(joined.tensors[name], whole.tensors[name])


def test_more_bits_less_error():
    errors = []
    for bits in (1, 2, 4, 8):
        codec = build_codec({"name": "uniform", "bits": bits, "group_size": 32}, MODEL)
        x = _block(codec, "key", blocks=16)
        errors.append((codec.decode(codec.encode(StreamRequest(0, "key", tokens=x)), StreamRequest(0, "key", dtype=torch.float32)) - x).pow(2).mean())
    assert errors == sorted(errors, reverse=True) and errors[-1] < 1e-3 * errors[0]


def test_kivi_bits_per_value_formula():
    for bits in (1, 2, 3, 4, 8):
        for group in (16, 32, 64):
            codec = build_codec({"name": "kivi", "bits": bits, "group_size": group, "residual_length": 128}, MODEL)
            assert codec.bits_per_value() == pytest.approx(bits + 32 / group)
    assert build_codec({"name": "fp16"}, MODEL).bits_per_value() == 16


def test_kivi_schedule_matches_reference_code():
    codec = build_codec({"name": "kivi", "bits": 2, "group_size": 32, "residual_length": 128}, MODEL)
    keys, values = codec.policy("key", 0), codec.policy("value", 0)
    # keys: quantized in whole residual blocks; 0..127 recent keys in full precision
    assert keys.split(300) == (0, 256, 44) and keys.split(127) == (0, 0, 127) and keys.split(128) == (0, 128, 0)
    # values: exactly the last 128 in full precision
    assert values.split(300) == (0, 172, 128) and values.split(100) == (0, 0, 100)


def test_expected_cache_bits_counts_full_precision_tokens():
    codec = build_codec({"name": "kivi", "bits": 2, "group_size": 32, "residual_length": 128}, MODEL)
    per_token = MODEL.num_kv_heads * MODEL.head_dim * MODEL.num_layers
    bits = expected_cache_bits(codec, 300, batch=1, fp_bits=16)
    assert bits == per_token * ((256 + 172) * 3 + (44 + 128) * 16)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"name": "kivi", "bits": 9}, "bits=9"),
        ({"name": "kivi", "bits": 0}, "bits=0"),
        ({"name": "uniform", "group_size": 48}, "does not divide head_dim=64"),
        ({"name": "kivi", "group_size": 32, "residual_length": 100}, "multiple of group_size"),
        ({"name": "uniform", "key_axis": "per_head"}, "valid choices: per_token, per_channel"),
        ({"name": "kivi", "bitz": 2}, "bitz"),
        ({"name": "kivi", "bits": "two"}, "bits"),
        ({"name": "zip"}, "valid choices: aquakv, channelkv, csr, eden, fp16, fp8, higgs, int_token_head, kivi, kvarn, kvquant, "
                          "kvtc, nvfp4, oscar, qjl, temporalkv, turboquant, uniform"),
    ],
)
def test_config_errors_name_the_problem(config, message):
    with pytest.raises(ConfigError, match=message):
        build_codec(config, MODEL)


def test_registry_has_the_foundation_codecs():
    assert {"fp16", "uniform", "kivi"} <= set(CODECS)


def test_a_codec_is_named_once_by_its_config():
    """``@register`` names the class after its config's ``name`` default and refuses a class that names itself."""
    from dataclasses import dataclass

    from kvcomp.codecs.fp16 import FullPrecisionCodec
    from kvcomp.codecs.registry import register

    assert all(cls.name == cls.config_class.name == name for name, cls in CODECS.items())

    @dataclass
    class NamedTwiceConfig(CodecConfig):
        name: str = "named_twice"

    class NamedTwice(FullPrecisionCodec):
        name = "named_twice"
        config_class = NamedTwiceConfig

    with pytest.raises(TypeError, match="named by its config's name default"):
        register(NamedTwice)
    assert "named_twice" not in CODECS


def test_registries_refuse_a_taken_name_and_list_the_known_ones():
    from kvcomp.registry import Registry

    class A:
        name = "a"

    class B:
        name = "a"

    class C:
        names = ("b", "c")

    registry = Registry("thing")
    assert registry.register(A) is A and registry.register(A) is A  # again: the same class
    with pytest.raises(TypeError, match="thing 'a' is taken by"):
        registry.register(B)
    with pytest.raises(ConfigError, match="unknown thing 'z'; valid choices: a$"):
        registry["z"]
    several = Registry("thing", names=lambda cls: cls.names)
    several.register(C)
    assert several["b"] is several["c"] is C


def test_pre_rope_codec_rejects_model_without_rope():
    no_rope = ModelInfo(name="alibi-model", num_layers=1, num_kv_heads=1, head_dim=64, has_rope=False)
    with pytest.raises(ConfigError, match="no RoPE"):
        build_codec({"name": "uniform", "pre_rope": True}, no_rope)


def test_state_round_trip_and_mismatch(tmp_path):
    fitted_for = {"model": "a", "codec": {"name": "kivi", "bits": 2}, "calibration": "enwiki"}
    state = CodecState({"centroids": torch.arange(6.0).view(2, 3)}, fitted_for)
    path = tmp_path / "state.safetensors"
    state.save(path)
    loaded = CodecState.load(path, fitted_for)
    assert torch.equal(loaded.tensors["centroids"], state.tensors["centroids"])
    other = {**fitted_for, "model": "b", "calibration": "lee"}
    with pytest.raises(CalibrationMismatchError, match=r"(?s)calibration: artifact has 'enwiki'.*model: artifact has 'a'"):
        CodecState.load(path, other)
