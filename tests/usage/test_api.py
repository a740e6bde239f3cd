"""The Python API (:mod:`kvcomp.api`) on tiny random models: caches that generate as the uncompressed model does
where nothing is lost, hold encoded payloads where something is, an attention hook scoped to a block, codecs fitted
from given activations, and bad arguments refused with the valid choices."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvcomp.api import attention, compose, compressed_cache, load_codec, load_press
from kvcomp.cache import CompressedCache, install
from kvcomp.cache.attention import installation
from kvcomp.calibration import CalibrationData
from kvcomp.errors import ConfigError
from tests.helpers import TINY

pytestmark = pytest.mark.usefixtures("session_cache")


@pytest.fixture
def fresh_llama():
    """A tiny Llama with no kvcomp attention installed."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY)).eval()


def _generate(model, cache, prompt):
    kwargs = {} if cache is None else {"cache": cache}
    return model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, **kwargs)


def test_a_lossless_cache_generates_what_the_model_generates_and_installs_attention_once(fresh_llama):
    prompt = torch.randint(1, TINY["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    expected = _generate(fresh_llama, None, prompt)
    assert installation(fresh_llama) is None
    cache = compressed_cache(fresh_llama, "fp16")
    assert isinstance(cache, CompressedCache) and installation(fresh_llama) is not None
    first = installation(fresh_llama)
    torch.testing.assert_close(_generate(fresh_llama, cache, prompt), expected, rtol=0, atol=0)
    compressed_cache(fresh_llama, "fp16")
    assert installation(fresh_llama) is first  # a second cache does not install again
    assert _generate(fresh_llama, DynamicCache(), prompt).equal(expected)  # other caches: the model's own attention


def test_a_compressing_cache_holds_codes_and_its_options_reach_the_codec(fresh_llama):
    prompt = torch.randint(1, TINY["vocab_size"], (1, 60), generator=torch.Generator().manual_seed(2))
    cache = compressed_cache(fresh_llama, "kivi", bits=2, group_size=16, residual_length=16)
    assert cache.codec.config.bits == 2 and cache.codec.config.residual_length == 16
    out = _generate(fresh_llama, cache, prompt)
    assert out.shape == (1, 72)
    bits = cache.bits_breakdown()
    assert bits["encoded_share"] > 0.5 and bits["code_bits_per_value"] == pytest.approx(4.0)  # 2 + 2 x 16 / 16
    assert bits["bits_per_value_measured"] < 16  # a float32 model: 32 bits per value uncompressed


def test_a_built_codec_is_reused_and_a_press_evicts(fresh_llama):
    codec = load_codec(fresh_llama, "kivi", bits=4, group_size=16, residual_length=16)
    prompt = torch.randint(1, TINY["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(3))
    pressed = compressed_cache(fresh_llama, codec, press=load_press(fresh_llama, "knorm", ratio=0.5))
    with torch.no_grad():
        fresh_llama(prompt, cache=pressed, use_cache=True)
    assert pressed.get_seq_length() == 64  # positions go on: evicted tokens keep their place
    kept = compressed_cache(fresh_llama, codec)
    with torch.no_grad():
        fresh_llama(prompt, cache=kept, use_cache=True)
    assert pressed.nbytes < 0.75 * kept.nbytes  # half the prompt evicted (the 16-token window stays)
    with pytest.raises(ConfigError, match="already built"):
        compressed_cache(fresh_llama, codec, bits=2)


def test_attention_is_scoped_to_a_block_and_restores_what_was_installed(fresh_llama):
    with attention(fresh_llama) as inner:
        assert installation(fresh_llama) is inner
        compressed_cache(fresh_llama, "fp16")
        assert installation(fresh_llama) is inner  # the block's installation serves the cache
    assert installation(fresh_llama) is None
    outer = install(fresh_llama)
    with attention(fresh_llama):
        pass
    assert installation(fresh_llama) is outer
    outer.remove()


def test_a_calibrated_codec_is_fitted_from_given_activations(fresh_llama):
    windows = torch.randint(1, TINY["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(4))
    probe = load_codec(fresh_llama, "fp8")  # tensor_scale=one: no fit
    activations = CalibrationData(fresh_llama, None, windows, None).activations(probe)
    one = load_codec(fresh_llama, "fp8")
    fitted = load_codec(fresh_llama, "fp8", tensor_scale="calibrated", activations=activations)
    prompt = windows[:1]
    caches = {name: compressed_cache(fresh_llama, codec, protocol="streaming") for name, codec in (("one", one), ("fitted", fitted))}
    with torch.no_grad():
        logits = {name: fresh_llama(prompt, cache=cache, use_cache=True).logits for name, cache in caches.items()}
        exact = fresh_llama(prompt).logits
    assert not torch.equal(logits["one"], logits["fitted"])  # the fitted scales change the stored values
    assert (logits["fitted"] - exact).abs().max() < 0.5


def test_bad_arguments_are_refused_with_the_valid_choices(fresh_llama):
    with pytest.raises(ConfigError, match="kivi"):
        load_codec(fresh_llama, "nosuch")
    with pytest.raises(ConfigError, match="bogus"):
        load_codec(fresh_llama, "kivi", bogus=1)
    with pytest.raises(ConfigError, match="tokenizer=.*activations="):
        load_codec(fresh_llama, "fp8", tensor_scale="calibrated")
    with pytest.raises(ConfigError, match="snapkv"):
        load_press(fresh_llama, "nosuch")
    with pytest.raises(ConfigError, match="protocol"):
        compressed_cache(fresh_llama, "fp16", protocol="nosuch")
    assert installation(fresh_llama) is None  # refused before anything was installed


def test_compose_makes_the_command_lines_configuration():
    cfg = compose("codec=kivi", "codec.bits=4", "benchmark.num_windows=4")
    assert cfg.codec.name == "kivi" and cfg.codec.bits == 4 and cfg.benchmark.num_windows == 4
    assert cfg.model.name == "smollm2_135m" and cfg.codec.group_size == 32  # the defaults the CLI composes
    with pytest.raises(Exception, match="bogus"):
        compose("codec.bogus=1")


def test_a_preset_is_named_as_on_the_command_line(fresh_llama):
    """``kivi_4bit`` is ``conf/codec/kivi_4bit.yaml`` composed as ``codec=kivi_4bit`` is, the options over it."""
    preset = load_codec(fresh_llama, "kivi_4bit", group_size=16, residual_length=16)
    assert preset.name == "kivi" and preset.config.bits == 4 and preset.config.group_size == 16
    assert compose("codec=kivi_4bit").codec.bits == 4


@pytest.mark.parametrize("other, message", [
    ({"head_dim": 8}, r"codec uniform was built for llama, whose layer 0 has 2 KV heads of size 16, but this model's "
                      r"keys are \(1, 2, 10, 8\)"),
    ({"num_key_value_heads": 4}, r"2 KV heads of size 16, but this model's keys are \(1, 4, 10, 16\)"),
    ({"num_hidden_layers": TINY["num_hidden_layers"] + 1},
     rf"the cache has {TINY['num_hidden_layers']} layers \(its codec uniform was built for llama\), but this model "
     rf"({TINY['num_hidden_layers'] + 1}|has a layer {TINY['num_hidden_layers']}):"),
])
@pytest.mark.parametrize("installed", [True, False])
def test_a_codec_built_for_another_model_is_named_at_the_first_forward(fresh_llama, other, message, installed):
    codec = load_codec(fresh_llama, "uniform", bits=4, group_size=8)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **other})).eval()
    if installed:
        install(model)
    cache = CompressedCache(codec, "simulated") if not installed else compressed_cache(model, codec)
    with pytest.raises(ConfigError, match=message), torch.no_grad():
        model(torch.randint(0, 50, (1, 10)), past_key_values=cache)
