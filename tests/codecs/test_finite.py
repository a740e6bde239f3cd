"""Finite in, finite out: every codec of the matrix, fed K/V with large finite values in the cache
dtype, gives finite reads or refuses them with a :class:`KVCompError` that names the layer and the codec; a codec
that turns finite input into NaN/Inf is reported at the layer where it happens (the last one included)."""

from unittest import mock

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvcomp.cache import CompressedCache
from kvcomp.cache.layer import CompressedLayer
from kvcomp.codecs.base import StreamRequest
from kvcomp.errors import NonFiniteKVError
from tests.codec_matrix import MATRIX, make_codec
from tests.helpers import build_tiny

CASES = {  # cache dtype, magnitude of the K/V fed to every layer
    "fp32-1e5": (torch.float32, 1e5),
    "fp32-1e30": (torch.float32, 1e30),
    "fp16-6e4": (torch.float16, 6e4),  # near float16's max, 65504
    "bf16-1e30": (torch.bfloat16, 1e30),
    "bf16-3.3e38": (torch.bfloat16, 3.3e38),  # near bfloat16's max, 3.39e38
}
# What cannot be stored is refused, naming the layer and the codec: near float32's max (which bfloat16 shares),
# group ranges (uniform, KIVI, QJL's values), rotations (KVarN's and int4's Hadamard, OSCAR's fitted one), TurboQuant's
# and EDEN's norms and reconstructions (the others) overflow float32; kvtc stores its PCA coefficients, shifts and
# scales in float16, which none of these inputs fit.
REFUSED = {name: ("bf16-3.3e38",) for name in ("uniform", "kivi", "qjl", "kvquant", "higgs", "aquakv", "csr", "kvarn",
                                               "int_token_head", "turboquant", "eden", "oscar")}
REFUSED["kvtc"] = tuple(CASES)
# fitted on the model's K/V (codebooks, AQUA-KV's predictors, fp8's and NVFP4's calibrated per-tensor scales, at
# which they saturate), far beyond them: finite, no closer than the input's size
FITTED_TO_THE_MODEL = ("temporalkv", "channelkv", "kvquant", "aquakv", "fp8", "nvfp4")


pytestmark = pytest.mark.usefixtures("session_cache")


@pytest.fixture(scope="module")
def codecs(tiny_llama):
    made = {}
    return lambda name: made.get(name) or made.setdefault(name, make_codec(tiny_llama, name))


@pytest.fixture(scope="module")
def models():
    made = {}
    return lambda dtype: made.get(dtype) or made.setdefault(dtype, build_tiny(LlamaConfig, LlamaForCausalLM).to(dtype))


def _feed(model, cache, magnitude, layers=None, forwards=2):
    """Run ``forwards`` forwards (a 40-token prompt, then single tokens) whose K/V reaching the layers in
    ``layers`` (None: all) are replaced by uniform draws in ``[-magnitude, magnitude]``; returns those K/V per layer."""
    fed, original = {}, CompressedLayer.update_in_context

    def replaced(self, key_states, value_states, step, query=None):
        if layers is None or self.layer_idx in layers:
            g = torch.Generator().manual_seed(10 * self.layer_idx + key_states.shape[2])
            key_states, value_states = (((torch.rand(key_states.shape, generator=g) * 2 - 1) * magnitude)
                                        .to(key_states.dtype) for _ in range(2))
            fed.setdefault(self.layer_idx, []).append((key_states, value_states))
        return original(self, key_states, value_states, step, query)

    ids = torch.randint(1, 96, (2, 40), generator=torch.Generator().manual_seed(0))
    with mock.patch.object(CompressedLayer, "update_in_context", replaced), torch.no_grad():
        model(ids, past_key_values=cache)
        for _ in range(forwards - 1):
            model(ids[:, :1], past_key_values=cache)
    return fed


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", list(MATRIX))
def test_large_finite_kv_read_back_finite_or_refused_naming_layer_and_codec(codecs, models, name, case):
    dtype, magnitude = CASES[case]
    codec = codecs(name)
    cache = CompressedCache(codec, "simulated")
    if case in REFUSED.get(name, ()):
        layer = r"\d+" if codec.scope == "model" else "0"  # a model-scope codec encodes after the last layer
        with pytest.raises(NonFiniteKVError, match=rf"^layer {layer}[,:] codec {name}"):
            _feed(models(dtype), cache, magnitude)
        return
    fed = _feed(models(dtype), cache, magnitude)
    bound = 1.0 if name in FITTED_TO_THE_MODEL else 1.2 * MATRIX[name].error
    for layer in cache.layers:
        for stream, i in ((layer.key_stream, 0), (layer.value_stream, 1)):
            original = torch.cat([kv[i] for kv in fed[layer.layer_idx]], dim=2).double()
            read = stream.materialize()
            assert read.dtype == dtype and torch.isfinite(read).all(), (layer.layer_idx, stream.kind)
            assert name == "fp16" or stream.num_encoded > 0
            error = (read.double() - original).pow(2).mean().sqrt() / original.pow(2).mean().sqrt()
            assert error <= bound, (layer.layer_idx, stream.kind, float(error))


def test_refusals_name_a_real_matrix_case():
    assert set(REFUSED) <= set(MATRIX) and all(set(cases) <= set(CASES) for cases in REFUSED.values())


@pytest.mark.parametrize("check_finite", [True, "deferred"])
def test_a_codec_that_decodes_nan_is_reported_at_its_layer_even_the_last(codecs, models, check_finite, monkeypatch):
    """Layer 1 (the last) decodes NaN from finite input: the error names layer 1 and the codec (before, the
    logits were NaN silently); under ``"deferred"`` at that layer's next forward or :meth:`raise_if_nonfinite`."""
    codec = codecs("uniform")
    decode = type(codec).decode
    monkeypatch.setattr(codec, "decode", lambda payload, request: decode(codec, payload, request) * (
        float("nan") if request.layer == 1 else 1.0))
    cache = CompressedCache(codec, "simulated", check_finite=check_finite)
    with pytest.raises(NonFiniteKVError, match=r"^layer 1: codec uniform decoded NaN or Inf keys and values from "
                                               r"finite input"):
        _feed(models(torch.float32), cache, 1.0)
        cache.raise_if_nonfinite()


def test_the_finiteness_check_holds_sums_beyond_float32(codecs, models):
    """bfloat16 K/V near its max are finite: their float32 sum overflowed, which was reported as NaN/Inf."""
    cache = CompressedCache(codecs("fp16"), "simulated")
    _feed(models(torch.bfloat16), cache, 3.3e38)
    assert all(torch.isfinite(s.materialize()).all() for layer in cache.layers for s in layer.streams)


def test_deferred_checks_report_a_16_bit_norm_overflow_at_the_layers_next_forward(codecs, models):
    """Under ``check_finite="deferred"`` QJL's key norms stay float16 (no host sync to choose float32): keys at
    1e5 overflow them, reported with the layer, the codec and the remedy one forward later."""
    cache = CompressedCache(codecs("qjl"), "simulated", check_finite="deferred")
    with pytest.raises(NonFiniteKVError, match=r"^layer 0, codec qjl: a scale or norm overflowed .*norm_dtype=float32"):
        _feed(models(torch.float32), cache, 1e5, forwards=3)


def test_fields_beyond_float16_are_stored_in_float32_and_counted(codecs, models):
    """A block whose norms float16 cannot hold keeps them in float32, and the measured bytes count them; normal
    inputs keep float16 (the nominal bits)."""
    held = {}
    for magnitude in (1.0, 1e5):
        cache = CompressedCache(codecs("qjl"), "simulated")
        _feed(models(torch.float32), cache, magnitude)
        norms = cache.layers[0].key_stream.payload.tensors["inlier_norm"]
        held[magnitude] = norms.dtype, cache.payload_nbytes
    assert held[1.0][0] == torch.float16 and held[1e5][0] == torch.float32
    assert held[1e5][1] > held[1.0][1]


def test_float32_norms_are_scored_alike_by_the_triton_kernel_and_torch(codecs):
    """QJL's score kernel reads the float32 norms of keys beyond float16 as the torch path does."""
    pytest.importorskip("triton")
    codec = codecs("qjl")
    keys = (torch.rand(1, 2, 8, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1) * 1e5
    payload = codec.encode(StreamRequest(1, "key", tokens=keys))
    assert payload.tensors["inlier_norm"].dtype == torch.float32
    query = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(1))
    reference = codec.payload_scores(query, payload, 1, "torch")
    kernel = codec.payload_scores(query, payload, 1, "triton")
    assert torch.isfinite(reference).all()
    torch.testing.assert_close(kernel, reference, rtol=1e-4, atol=1e-4 * float(reference.abs().max()))
