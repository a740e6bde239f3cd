"""KVQuant, ChannelKV and TemporalKV on tiny random models: calibration, coding, cache, bits, errors."""

import pytest
import torch
from transformers import DynamicCache

from kvcomp.cache import CompressedCache
from kvcomp.calibration import CalibrationData, calibrate
from kvcomp.calibration.collect import collect_kv
from kvcomp.codecs import ModelInfo, build_codec, expected_cache_bits
from kvcomp.codecs.base import StreamRequest
from kvcomp.config import CalibrationConfig
from kvcomp.errors import CalibrationMismatchError, ConfigError
from kvcomp.stages.rope import apply_rope
from tests.codec_matrix import fitted
from tests.helpers import info_of

CODECS = ("kvquant", "channelkv", "temporalkv")


pytestmark = pytest.mark.usefixtures("session_cache")


def calibration_windows(seed=0):
    return torch.randint(0, 96, (8, 72), generator=torch.Generator().manual_seed(seed))


def stream_error(codec, x, kind="key", layer=0):
    decoded = codec.decode(codec.encode(StreamRequest(layer, kind, tokens=x)), StreamRequest(layer, kind, dtype=torch.float32))
    return (decoded - x).square().mean().item()


def test_collector_records_pre_rope_keys_and_their_fisher_weights(tiny_llama):
    info = info_of(tiny_llama)
    windows = calibration_windows()[:2]
    acts = collect_kv(tiny_llama, info, windows, drop_first=8)
    # keys: re-rotating the recorded pre-RoPE keys gives the keys a plain cache stores
    cache = DynamicCache()
    with torch.no_grad():
        tiny_llama(windows[:1], past_key_values=cache, use_cache=True)
    position_ids = torch.arange(72)[None]
    cos, sin = tiny_llama.model.rotary_emb(cache.layers[1].keys, position_ids)
    recorded = acts.tensor(1, "key")[:1].float()
    rotated = apply_rope(recorded, cos[:, 8:], sin[:, 8:])
    assert torch.allclose(rotated, cache.layers[1].keys[:, :, 8:], atol=0.05, rtol=0.02)
    # Fisher: squared gradient of the mean CE w.r.t. the k_proj output (= pre-RoPE key for Llama)
    captured = {}

    def keep(module, args, output):
        output.retain_grad()
        captured["k"] = output

    handle = tiny_llama.model.layers[1].self_attn.k_proj.register_forward_hook(keep)
    try:
        tiny_llama.zero_grad()
        tiny_llama(windows[:1], labels=windows[:1]).loss.backward()
    finally:
        handle.remove()
        tiny_llama.zero_grad(set_to_none=True)
    grad = captured["k"].grad.view(1, 72, info.num_kv_heads, info.head_dim).transpose(1, 2)[:, :, 8:]
    assert torch.allclose(acts.tensor(1, "key_grad2")[:1].float(), grad.square(), rtol=0.02, atol=1e-12)


@pytest.mark.parametrize("name", CODECS)
def test_error_shrinks_with_more_bits_on_every_family(tiny_model, name):
    x = torch.randn(1, 2, 32, 16)
    errors = [stream_error(fitted(tiny_model, name, bits=bits), x, kind) for bits in (4, 1) for kind in ("key",)]
    assert errors[0] < errors[1]


@pytest.mark.parametrize("rule", ["token_topk", "reference"])
@pytest.mark.parametrize("name", CODECS)
def test_bits_and_measured_cache_bytes(tiny_llama, name, rule):
    codec = fitted(tiny_llama, name, bits=2, outliers=0.02, outlier_rule=rule)
    assert codec.paper_bits_per_value() == pytest.approx(2 + 0.02 * 16)
    h, d = codec.model.num_kv_heads, codec.model.head_dim
    outlier_bits = 1 * 32 / (h * d)  # round(0.02 * 32) = 1 outlier per token: bf16 value + int16 index
    token_params = 16 / (h * d) if name == "kvquant" else 0  # KVQuant-1%: one 16-bit value scale per token
    assert codec.code_bits_per_value("key", 1) == pytest.approx(2 + outlier_bits)
    assert codec.code_bits_per_value("value", 1) == pytest.approx(2 + outlier_bits + token_params)
    assert codec.overhead_bits() > 0
    cache = CompressedCache(codec, "simulated")
    with torch.no_grad():
        tiny_llama(torch.randint(0, 96, (2, 43)), past_key_values=cache, use_cache=True)
    assert cache.nbytes * 8 == pytest.approx(expected_cache_bits(codec, 43, 2, 32))


def test_temporal_chunks_buffer_generated_tokens(tiny_llama):
    codec = fitted(tiny_llama, "temporalkv", bits=2, hybrid="off")  # chunks of 4 tokens
    cache = CompressedCache(codec, "streaming")
    ids = torch.randint(0, 96, (1, 30))
    with torch.no_grad():
        one_shot = tiny_llama(ids, past_key_values=CompressedCache(codec, "streaming"), use_cache=True).logits
        steps = []
        for t in range(30):
            steps.append(tiny_llama(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
            stream = cache.layers[0].key_stream
            n = t + 1
            assert stream.num_sinks == min(n, 8)
            assert stream.num_encoded == max(0, (n - 8) // 4 * 4)
            assert stream.num_tail == n - stream.num_sinks - stream.num_encoded < 4
    # one streaming forward = token-by-token decoding with the chunk buffer
    assert torch.allclose(torch.cat(steps, 1), one_shot, atol=1e-4)
    # and differs from the simulated (non-causal) protocol, where queries see their own chunk encoded
    with torch.no_grad():
        simulated = tiny_llama(ids, past_key_values=CompressedCache(codec, "simulated"), use_cache=True).logits
    assert not torch.allclose(simulated, one_shot, atol=1e-4)


def test_outliers_are_restored_exactly(tiny_llama):
    codec = fitted(tiny_llama, "channelkv", bits=1, outliers=0.05)
    x = torch.randn(1, 2, 8, 16)
    x[0, 1, 3, 5] = 60.0
    decoded = codec.decode(codec.encode(StreamRequest(0, "value", tokens=x)), StreamRequest(0, "value", dtype=torch.float32))
    assert decoded[0, 1, 3, 5] == 60.0
    plain = fitted(tiny_llama, "channelkv", bits=1)
    assert plain.decode(plain.encode(StreamRequest(0, "value", tokens=x)), StreamRequest(0, "value", dtype=torch.float32))[0, 1, 3, 5] < 30


def test_hybrid_preset_and_auto(tiny_llama):
    preset = fitted(tiny_llama, "temporalkv", bits=2, hybrid="preset", hybrid_layers=[1])
    assert preset.policy("key", 0).block_size == 4 and preset.policy("key", 1).block_size == 1
    auto = fitted(tiny_llama, "temporalkv", bits=2)
    for layer in range(2):
        for kind in ("key", "value"):
            errors = {n: float(auto.tensors[f"layer{layer}.{kind}.mse.{n}"]) for n in ("temporal", "channel")}
            chosen = "temporal" if auto.policy(kind, layer).block_size == 4 else "channel"
            assert errors[chosen] == min(errors.values())
    assert "paper_bits_per_value" in auto.summary()


def test_artifacts_are_reused_shared_across_outlier_settings_and_checked(tiny_llama, tmp_path):
    info = info_of(tiny_llama)
    windows = calibration_windows()
    def data(codec):
        return lambda: CalibrationData(tiny_llama, None, windows, None).activations(codec)

    calibration = CalibrationConfig(num_samples=8, seq_len=72)
    first = build_codec({"name": "temporalkv", "bits": 2, "kmeans_iters": 5}, info)
    assert calibrate(first, calibration, data(first))["reused"] is False
    second = build_codec({"name": "temporalkv", "bits": 2, "kmeans_iters": 5, "outliers": 0.01, "sinks": 0}, info)
    report = calibrate(second, calibration, data(second))
    assert report["reused"] is True  # outliers (not clamped) and sinks do not change the codebooks
    x = torch.randn(1, 2, 16, 16)
    request = StreamRequest(1, "key", tokens=x)
    assert torch.equal(first.encode(request).tensors["codes"], second.encode(request).tensors["codes"])
    kvquant = build_codec({"name": "kvquant", "bits": 2, "kmeans_iters": 5}, info)
    kvquant_outliers = build_codec({"name": "kvquant", "bits": 2, "kmeans_iters": 5, "outliers": 0.01}, info)
    assert calibrate(kvquant, calibration, data(kvquant), path=tmp_path / "a.safetensors")["reused"] is False
    with pytest.raises(CalibrationMismatchError, match="outliers"):
        calibrate(kvquant_outliers, calibration, data(kvquant_outliers), path=tmp_path / "a.safetensors")
    other_model = ModelInfo(name="other", num_layers=2, num_kv_heads=2, head_dim=16)
    with pytest.raises(CalibrationMismatchError, match="model"):
        calibrate(build_codec({"name": "kvquant", "bits": 2, "kmeans_iters": 5}, other_model), calibration,
                  lambda: pytest.fail("must not fit"), path=tmp_path / "a.safetensors")


def test_bad_configurations_are_clear_errors():
    info = ModelInfo(name="m", num_layers=2, num_kv_heads=2, head_dim=16)
    with pytest.raises(ConfigError, match="bits=3"):
        build_codec({"name": "temporalkv", "bits": 3}, info)
    with pytest.raises(ConfigError, match="head_dim=12"):
        build_codec({"name": "channelkv", "bits": 1}, ModelInfo(name="m", num_layers=1, num_kv_heads=1, head_dim=12))
    with pytest.raises(ConfigError, match="no RoPE"):
        build_codec({"name": "kvquant"}, ModelInfo(name="m", num_layers=1, num_kv_heads=1, head_dim=16, has_rope=False))
    with pytest.raises(ConfigError, match="hybrid_layers"):
        build_codec({"name": "temporalkv", "hybrid": "preset", "hybrid_layers": [5]}, info)
    with pytest.raises(ConfigError, match="calibrate first"):
        build_codec({"name": "temporalkv"}, info).policy("key", 0)
    with pytest.raises(ConfigError, match="no calibration state"):
        build_codec({"name": "channelkv"}, info).encode(StreamRequest(0, "key", tokens=torch.zeros(1, 2, 4, 16)))


def test_too_little_calibration_data_is_a_clear_error(tiny_llama):
    codec = build_codec({"name": "channelkv", "bits": 2}, info_of(tiny_llama))
    windows = calibration_windows()[:2, :40]
    with pytest.raises(ConfigError, match="raise calibration.num_samples"):
        codec.fit(CalibrationData(tiny_llama, None, windows, None).activations(codec))


def test_fisher_weights_are_collected_only_for_codecs_that_ask(tiny_llama, monkeypatch):
    """No backward pass for a codec that uses no Fisher weights; a collection with them serves it too."""
    windows = calibration_windows(seed=5)
    plain = build_codec({"name": "kvquant", "bits": 2, "kmeans_iters": 5, "fisher": False}, info_of(tiny_llama))
    assert not plain.needs_fisher and fitted(tiny_llama, "temporalkv").needs_fisher
    backward = torch.Tensor.backward
    monkeypatch.setattr(torch.Tensor, "backward", lambda *a, **k: pytest.fail("no backward pass without Fisher"))
    acts = CalibrationData(tiny_llama, None, windows, None).activations(plain)
    assert not acts.fisher and set(acts.layer(1)) == {"key", "value"}
    assert plain.fit(acts).tensors  # fits on forward passes alone
    monkeypatch.setattr(torch.Tensor, "backward", backward)
    weighted = build_codec({"name": "kvquant", "bits": 2, "kmeans_iters": 5}, info_of(tiny_llama))
    rich = CalibrationData(tiny_llama, None, windows, None).activations(weighted)
    assert rich.fisher and {"key_grad2", "value_grad2"} <= set(rich.layer(0)) and rich.folder != acts.folder
    # the no-Fisher keys/values equal those of the Fisher collection, which later requests reuse
    assert torch.equal(acts.layer(1)["key"], rich.layer(1)["key"])
    monkeypatch.setattr(torch.Tensor, "backward", lambda *a, **k: pytest.fail("reused, not collected"))
    assert CalibrationData(tiny_llama, None, calibration_windows(seed=5), None).activations(plain).folder == rich.folder


def test_closed_loop_fitting_sees_earlier_reconstructions():
    from kvcomp.codecs import fit_layer_by_layer

    class Fake:
        num_layers = 3

        def layer(self, layer):
            return {"key": torch.full((1,), float(layer))}

    seen = []

    def fit_layer(layer, fields, previous):
        seen.append(previous)
        return f"fitted{layer}", fields["key"] + (0 if previous is None else previous) + 0.5

    assert fit_layer_by_layer(Fake(), fit_layer) == ["fitted0", "fitted1", "fitted2"]
    assert seen[0] is None and seen[1].item() == 0.5 and seen[2].item() == 2.0  # 1 + 0.5 + 0.5
