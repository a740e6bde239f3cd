"""``center`` (HIGGS, AQUA-KV) and AQUA-KV's ``damping_basis``: options beyond the papers for keys on a large
constant offset (Qwen2.5's k_proj biases). A tiny Qwen2 whose k_proj/v_proj biases are 30x its K/V spread shows
them: per-token HIGGS codes the offset and loses the deviation, centred it keeps it."""

import pytest
import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from kvcomp.cache import CompressedCache, install
from kvcomp.cache.offload import restore, store
from kvcomp.calibration import CalibrationData, calibrate
from kvcomp.codecs import build_codec
from kvcomp.codecs.base import StreamRequest
from kvcomp.errors import ConfigError
from kvcomp.stages.ridge import RidgeFit
from kvcomp.stages.rope import apply_rope
from tests.codec_matrix import CALIBRATION, calibration_windows
from tests.helpers import TINY, build_tiny, info_of, reads_taken

pytestmark = pytest.mark.usefixtures("session_cache")


@pytest.fixture(scope="module")
def offset_qwen():
    """A tiny Qwen2 whose keys and values sit on constant offsets 30x (keys) and 10x (values) their spread."""
    model = build_tiny(Qwen2Config, Qwen2ForCausalLM, use_sliding_window=False)
    # its own name: calibration collections and artifacts are keyed by it (tests' tiny models have no fingerprint),
    # so that those of the other tiny Qwen2 models of the session are not reused for this one, nor the other way
    model.config._name_or_path = "tiny-qwen2-offset-biases"
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.k_proj.bias.copy_(30 * torch.randn_like(attn.k_proj.bias).sign() * attn.k_proj.weight.norm(dim=1))
            attn.v_proj.bias.copy_(10 * torch.randn_like(attn.v_proj.bias).sign() * attn.v_proj.weight.norm(dim=1))
    return model


IDS = torch.randint(1, TINY["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(7))


def _fitted(model, config: dict):
    codec = build_codec(config, info_of(model))
    windows = calibration_windows()
    calibrate(codec, CALIBRATION, lambda: CalibrationData(model, None, windows, None).activations(codec))
    return codec


@torch.no_grad()
def _key_error(model, codec, layer: int = 0) -> float:
    """Squared error of the cached keys (blocks encoded, as attention read them, post-RoPE) over their spread
    around the per-channel mean (the rotated offset included: a scale common to the codecs compared)."""
    plain = DynamicCache(config=model.config)
    model(IDS, past_key_values=plain)
    cache = CompressedCache(codec, "simulated")
    model(IDS, past_key_values=cache)
    stream = cache.layers[layer].key_stream
    first, count = stream.num_sinks, stream.num_encoded
    assert count >= 16
    exact = plain.layers[layer].keys[:, :, first:first + count]
    got = stream.materialize()[:, :, first:first + count]
    spread = (exact - exact.mean(dim=(0, 2), keepdim=True)).square().sum()
    return float((got - exact).square().sum() / spread)


HIGGS = {"name": "higgs", "bits": 2, "sinks": 2, "buffer": 8}


def test_higgs_center_keeps_the_deviation_of_offset_keys(offset_qwen):
    plain = _key_error(offset_qwen, build_codec(HIGGS, info_of(offset_qwen)))
    errors = {center: _key_error(offset_qwen, _fitted(offset_qwen, {**HIGGS, "center": center}))
              for center in ("calibration", "bias")}
    assert all(e < 0.1 * plain for e in errors.values()), (plain, errors)


def test_center_vectors_are_counted_and_stored(offset_qwen):
    codec = _fitted(offset_qwen, {**HIGGS, "center": "bias"})
    info = info_of(offset_qwen)
    vectors = 2 * info.num_layers * info.num_kv_heads * info.head_dim
    assert codec.overhead_bits() == build_codec(HIGGS, info).overhead_bits() + 32 * vectors
    bias = offset_qwen.model.layers[1].self_attn.k_proj.bias.view(info.num_kv_heads, info.head_dim)
    torch.testing.assert_close(codec.offsets.vectors[(1, "key")], bias)


def test_aquakv_center_codes_layer_zero_around_its_mean(offset_qwen):
    config = {"name": "aquakv", "bits": 2, "sinks": 2, "buffer": 8, "first_layer_bits": 2}
    plain = _key_error(offset_qwen, _fitted(offset_qwen, config))
    centred = _key_error(offset_qwen, _fitted(offset_qwen, {**config, "center": "calibration"}))
    assert centred < 0.3 * plain, (plain, centred)


def test_center_is_refused_where_it_cannot_work(tiny_llama):
    with pytest.raises(ConfigError, match="needs pre_rope=true"):
        build_codec({**HIGGS, "center": "calibration", "pre_rope": False}, info_of(tiny_llama))
    with pytest.raises(ConfigError, match="valid choices: bias, calibration, none"):
        build_codec({**HIGGS, "center": "mean"}, info_of(tiny_llama))
    with pytest.raises(ConfigError, match="this model has none"):  # Llama: no k_proj/v_proj biases
        _fitted(tiny_llama, {**HIGGS, "center": "bias"})


def test_centred_damping_does_not_over_regularise_offset_inputs():
    """Inputs on an offset 100x their spread: damping scaled by the uncentred X^T X shrinks the map; by the
    centred covariance it fits the planted map (held-out error 20x lower)."""
    gen = torch.Generator().manual_seed(0)
    x = 100 + torch.randn(4000, 16, generator=gen)
    a = torch.randn(16, 8, generator=gen)
    y = x @ a + 0.01 * torch.randn(4000, 8, generator=gen)
    ridge = RidgeFit(16, 8)
    ridge.add(x[:3000], y[:3000])
    errors = {basis: float((ridge.solve(1e-3, basis=basis)(x[3000:]) - y[3000:]).square().mean())
              for basis in ("uncentred", "centred")}
    assert errors["centred"] < errors["uncentred"] / 20, errors
    centred = x[:3000] - x[:3000].mean(0)
    torch.testing.assert_close(ridge.damping_scale("centred"), centred.double().square().sum(0).mean(), rtol=1e-6, atol=0)


def test_aquakv_centred_damping_predicts_offset_keys_better(offset_qwen):
    """The predictors' inputs (layer l-1's keys) sit on the offset: damped by the uncentred X^T X, the fit is
    shrunk towards its intercept; by the centred covariance it predicts the deviation (held-out relative MSE)."""
    # damping 0.05 (the paper: 1e-3, where this tiny model shows 1.4x) makes the shrinkage plain: 4.5x
    config = {"name": "aquakv", "bits": 2, "sinks": 2, "buffer": 8, "damping": 0.05}
    errors = {basis: _fitted(offset_qwen, {**config, "damping_basis": basis}).metrics[1:, 0, 1].mean().item()
              for basis in ("uncentred", "centred")}
    assert errors["centred"] < 0.5 * errors["uncentred"], errors


def test_aquakv_bias_center_applies_to_layer_zero_only(offset_qwen):
    codec = _fitted(offset_qwen, {"name": "aquakv", "bits": 2, "sinks": 2, "buffer": 8, "center": "bias"})
    assert sorted(codec.offsets.vectors) == [(0, "key"), (0, "value")]  # later layers: the predictors' intercepts
    bias = offset_qwen.model.layers[0].self_attn.v_proj.bias.view(2, 16)
    torch.testing.assert_close(codec.offsets.vectors[(0, "value")], bias)


# QJL on post-RoPE keys: the offset is rotated to each token's position (8-token blocks, no outlier split)
QJL = {"name": "qjl", "sketch_dim": 64, "initial_layers": 0, "outlier_channels": 0, "group_size": 8, "key_buffer": 8,
       "value_group_size": 8, "value_window": 4}


def test_qjl_center_keeps_the_deviation_of_offset_keys(offset_qwen):
    plain = _key_error(offset_qwen, build_codec(QJL, info_of(offset_qwen)))
    errors = {center: _key_error(offset_qwen, _fitted(offset_qwen, {**QJL, "center": center}))
              for center in ("calibration", "bias")}
    assert all(e < 0.1 * plain for e in errors.values()), (plain, errors)


@torch.no_grad()
def test_qjl_centred_keys_take_the_reference_path_under_triton(offset_qwen):
    """No kernel adds ``<q, R_p c>``: with kernel_backend=triton a centred QJL's decode steps read decoded keys,
    and generate the same tokens' logits as the torch path."""
    pytest.importorskip("triton")
    codec = _fitted(offset_qwen, {**QJL, "center": "calibration"})

    def generate():
        out = offset_qwen.generate(IDS[:, :20], max_new_tokens=6, do_sample=False, past_key_values=CompressedCache(
            codec, "exact_prefill"), pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        return torch.stack(out.logits, dim=1)

    reference = generate()
    install(offset_qwen, kernel_backend="triton")
    try:
        with reads_taken() as taken:
            triton = generate()
    finally:
        install(offset_qwen, kernel_backend="torch")
    assert {read for _, read in taken} == {"tuple"}
    torch.testing.assert_close(triton, reference)


@torch.no_grad()
def test_a_centred_qjl_cache_is_stored_with_its_positions(offset_qwen):
    """A restored centred cache rotates the offset to the stored positions: the next turn's logits are those of
    the cache that was never stored."""
    codec = _fitted(offset_qwen, {**QJL, "center": "calibration"})
    cache = CompressedCache(codec, "exact_prefill")
    offset_qwen(IDS[:, :30], past_key_values=cache)
    stored = store(cache)
    assert stored.tensors["layer0.position_ids"].shape == (2, 30)
    restored = restore(stored, codec)
    expected = offset_qwen(IDS[:, 30:], past_key_values=cache).logits
    torch.testing.assert_close(offset_qwen(IDS[:, 30:], past_key_values=restored).logits, expected, rtol=0, atol=0)


# TurboQuant and EDEN: post-RoPE keys centred like QJL's (the offset rotated to each position), values as HIGGS'
ROTATED = {"turboquant": {"name": "turboquant", "key_bits": 2, "value_bits": 2},
           "eden": {"name": "eden", "key_bits": 2, "value_bits": 2}}


@torch.no_grad()
def _value_error(model, codec, layer: int = 0) -> float:
    """:func:`_key_error` for the cached values."""
    plain = DynamicCache(config=model.config)
    model(IDS, past_key_values=plain)
    cache = CompressedCache(codec, "simulated")
    model(IDS, past_key_values=cache)
    exact = plain.layers[layer].values
    spread = (exact - exact.mean(dim=(0, 2), keepdim=True)).square().sum()
    return float((cache.layers[layer].value_stream.materialize() - exact).square().sum() / spread)


@pytest.mark.parametrize("name", list(ROTATED))
def test_rotated_codecs_center_keeps_the_deviation_of_offset_keys_and_values(offset_qwen, name):
    config = ROTATED[name]
    plain = build_codec(config, info_of(offset_qwen))
    errors = {center: _fitted(offset_qwen, {**config, "center": center}) for center in ("calibration", "bias")}
    for measure in (_key_error, _value_error):
        before = measure(offset_qwen, plain)
        after = {center: measure(offset_qwen, codec) for center, codec in errors.items()}
        assert all(e < 0.1 * before for e in after.values()), (measure.__name__, before, after)


@pytest.mark.parametrize("config", [QJL, ROTATED["turboquant"]], ids=["qjl", "turboquant"])
@torch.no_grad()
def test_center_rotates_the_key_offset_to_each_position(offset_qwen, config):
    """Post-RoPE codecs: the cached keys are ``R_p c + k_hat(k - R_p c)``, ``R_p`` the RoPE rotation of the token's
    own position (a second forward continues from position 40), with ``c`` the k_proj bias (layer 0: its keys do not
    depend on the compressed cache)."""
    codec = _fitted(offset_qwen, {**config, "center": "bias"})
    info, layer = info_of(offset_qwen), 0
    plain, cache = DynamicCache(config=offset_qwen.config), CompressedCache(codec, "simulated")
    for part in (IDS, IDS[:, :16]):
        offset_qwen(part, past_key_values=plain)
        offset_qwen(part, past_key_values=cache)
    stream = cache.layers[layer].key_stream
    assert stream.num_encoded == 56
    exact = plain.layers[layer].keys
    cos, sin = offset_qwen.model.rotary_emb(exact, torch.arange(56)[None].expand(2, -1))
    bias = offset_qwen.model.layers[layer].self_attn.k_proj.bias.view(info.num_kv_heads, info.head_dim)
    rotated = apply_rope(bias[None, :, None].expand(2, -1, 56, -1), cos, sin)
    request = StreamRequest(layer=layer, kind="key", tokens=exact - rotated, dtype=torch.float32)
    expected = rotated + codec.decode(codec.encode(request), request)
    torch.testing.assert_close(stream.materialize(), expected, rtol=1e-5, atol=1e-5)


CENTRED_FUSED = {"turboquant": ROTATED["turboquant"], "eden": ROTATED["eden"],
                 "vllm-k8v4": {"name": "turboquant", "values": "uniform", "rotation": "plain_hadamard",
                               "density": "gaussian", "key_bits": 8, "value_bits": 4}}


@torch.no_grad()
def test_a_centred_codecs_calls_are_captured_in_cuda_graphs(offset_qwen, monkeypatch):
    """EDEN with ``center`` under CUDA graphs (a stand-in capture): its key offset is scored against the model's query,
    which each call derives from the payload's rotated query (``CallQuery``), so its calls are captured and replayed by
    their inputs; the logits equal the torch path's."""
    from tests.kernels.generation import check_graphed_generation

    check_graphed_generation(offset_qwen, _fitted(offset_qwen, {**CENTRED_FUSED["eden"], "center": "bias"}), monkeypatch)


# Where the offsets come from (the calibration mean or the model's bias) is settled when the codec is fitted (both are
# checked above for TurboQuant and EDEN); the fused path then reads the same float32 vectors either way: each codec
# runs it with one of them, and each source is run by two codecs.
FUSED_CENTERS = [("turboquant", "calibration"), ("eden", "bias"), ("vllm-k8v4", "calibration"), ("prod", "bias")]


@pytest.mark.parametrize("name, center", FUSED_CENTERS, ids=lambda v: v)
@torch.no_grad()
def test_centred_codecs_decode_on_the_fused_path(offset_qwen, name, center):
    """``center`` on the fused decode kernel: it adds the key offset's score ``q . R_p c`` (``R_p`` recomputed from the
    position ids) and the value offset to the output; every generated token's logits equal the torch path's (which
    decodes the keys and adds the offsets back), with left padding, nothing decoded; vLLM's k8v4 preset rotates
    nothing and is fused too; so is TurboQuant-prod, whose residual sketches the kernel reads as well."""
    config = CENTRED_FUSED.get(name, {**ROTATED["turboquant"], "variant": "prod"})
    from tests.kernels.generation import check_fused_generation

    codec = _fitted(offset_qwen, {**config, "center": center})
    assert codec.fused_attention_supported(0) and codec.rotated_key_offset(0) is not None
    assert codec.value_offset(0) is not None
    layer = check_fused_generation(offset_qwen, codec)
    assert layer.key_stream.num_encoded == 37 + 5 and layer.key_stream.decoded.length == 0
    assert layer.value_stream.decoded.length == 0
