import inspect
import math

import pytest
import torch
from transformers import DynamicCache

from kvcomp.cache import CompressedCache, install
from kvcomp.codecs import ModelInfo, build_codec, expected_cache_bits
from kvcomp.codecs.base import StreamRequest
from kvcomp.errors import ConfigError, NonFiniteKVError
from kvcomp.stages.rope import apply_rope, rotate_half, undo_rope
from tests.helpers import info_of

SCHEDULES = [
    {"name": "kivi", "bits": 2, "group_size": 4, "residual_length": 8},
    {"name": "uniform", "bits": 3, "group_size": 4, "key_axis": "per_channel", "window": 5, "sinks": 3},
    {"name": "uniform", "bits": 2, "group_size": 8, "pre_rope": True, "sinks": 2},
    {"name": "qjl", "sketch_dim": 32, "outlier_sketch_dim": 16, "initial_layers": 1, "initial_sketch_dim": 48,
     "initial_outlier_sketch_dim": 8, "outlier_channels": 2, "group_size": 4, "key_buffer": 8,
     "value_group_size": 8, "value_window": 5},
]


def _ids(batch=2, length=37, seed=1):
    return torch.randint(0, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def _forward(model, ids, cache, chunk):
    return torch.cat(
        [model(ids[:, i : i + chunk], past_key_values=cache, use_cache=True).logits for i in range(0, ids.shape[1], chunk)],
        dim=1,
    )


@torch.no_grad()
def test_fp16_codec_is_exactly_the_plain_model(tiny_model):
    ids = _ids()
    codec = build_codec({"name": "fp16"}, info_of(tiny_model))
    plain = tiny_model(ids).logits
    dynamic = tiny_model(ids, past_key_values=DynamicCache(config=tiny_model.config)).logits
    assert torch.equal(tiny_model(ids, past_key_values=CompressedCache(codec)).logits, plain)
    assert torch.equal(dynamic, plain)


@torch.no_grad()
@pytest.mark.parametrize("config", SCHEDULES, ids=lambda c: c["name"] + ("-prerope" if c.get("pre_rope") else ""))
def test_streaming_protocol_equals_token_by_token(tiny_model, config):
    """One forward under `streaming` gives the logits of feeding tokens one at a time."""
    ids = _ids()
    codec = build_codec(config, info_of(tiny_model))
    step = _forward(tiny_model, ids, CompressedCache(codec, "streaming"), chunk=1)
    one_shot = _forward(tiny_model, ids, CompressedCache(codec, "streaming"), chunk=ids.shape[1])
    chunked = _forward(tiny_model, ids, CompressedCache(codec, "streaming"), chunk=11)
    torch.testing.assert_close(one_shot, step, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chunked, step, rtol=1e-4, atol=1e-4)
    # the codec really changes the output (it is not silently bypassed)
    assert (one_shot - tiny_model(ids).logits).abs().max() > 1e-3


@torch.no_grad()
def test_simulated_protocol_quantizes_the_whole_prompt(tiny_model):
    ids = _ids()
    codec = build_codec(SCHEDULES[0], info_of(tiny_model))
    streaming = _forward(tiny_model, ids, CompressedCache(codec, "streaming"), chunk=ids.shape[1])
    simulated = _forward(tiny_model, ids, CompressedCache(codec, "simulated"), chunk=ids.shape[1])
    # early queries see quantized blocks built with later tokens' statistics under `simulated` only
    assert (simulated[:, :8] - streaming[:, :8]).abs().max() > 1e-3
    # one token at a time the two protocols coincide
    step_sim = _forward(tiny_model, ids, CompressedCache(codec, "simulated"), chunk=1)
    step_stream = _forward(tiny_model, ids, CompressedCache(codec, "streaming"), chunk=1)
    torch.testing.assert_close(step_sim, step_stream)


@torch.no_grad()
@pytest.mark.parametrize("config", SCHEDULES + [{"name": "fp16"}], ids=lambda c: c["name"])
@pytest.mark.parametrize("length", [1, 7, 8, 16, 37])
def test_measured_bytes_match_the_formula(tiny_llama, config, length):
    codec = build_codec(config, info_of(tiny_llama))
    cache = CompressedCache(codec)
    tiny_llama(_ids(length=length), past_key_values=cache)
    assert cache.nbytes * 8 == expected_cache_bits(codec, length, batch=2, fp_bits=32)
    for layer in cache.layers:
        for kind, stream in (("key", layer.key_stream), ("value", layer.value_stream)):
            assert (stream.num_sinks, stream.num_encoded, stream.num_tail) == codec.policy(kind, 0).split(length)


@torch.no_grad()
def test_generate_fp16_codec_matches_plain_model_with_left_padding(tiny_model):
    ids = _ids(length=12)
    mask = torch.ones_like(ids)
    ids[0, :4], mask[0, :4] = 0, 0  # left padding on the first row
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    plain = tiny_model.generate(**kwargs)
    codec = build_codec({"name": "fp16"}, info_of(tiny_model))
    compressed = tiny_model.generate(**kwargs, past_key_values=CompressedCache(codec))
    assert torch.equal(plain, compressed)


@torch.no_grad()
def test_beam_search_reorders_the_compressed_cache(tiny_llama):
    ids = _ids(batch=1, length=10)
    kwargs = dict(input_ids=ids, max_new_tokens=8, do_sample=False, num_beams=3, pad_token_id=0)
    codec = build_codec({"name": "fp16"}, info_of(tiny_llama))
    assert torch.equal(tiny_llama.generate(**kwargs), tiny_llama.generate(**kwargs, past_key_values=CompressedCache(codec)))


@torch.no_grad()
def test_generated_tokens_are_encoded_as_blocks_fill(tiny_llama):
    codec = build_codec(SCHEDULES[0], info_of(tiny_llama))
    cache = CompressedCache(codec)
    out = tiny_llama.generate(_ids(length=10), max_new_tokens=15, do_sample=False, past_key_values=cache, pad_token_id=0)
    stored = out.shape[1] - 1  # the last generated token is never fed back
    layer = cache.layers[0]
    assert layer.get_seq_length() == stored
    assert (layer.key_stream.num_encoded, layer.key_stream.num_tail) == codec.policy("key", 0).split(stored)[1:]
    assert (layer.value_stream.num_encoded, layer.value_stream.num_tail) == codec.policy("value", 0).split(stored)[1:]


@torch.no_grad()
def test_pre_rope_keys_are_rerotated(tiny_llama):
    """8-bit pre-RoPE keys come back close to the post-RoPE originals (they would not without re-rotation)."""
    codec = build_codec({"name": "uniform", "bits": 8, "group_size": 16, "pre_rope": True}, info_of(tiny_llama))
    ids = _ids(length=20)
    reference = DynamicCache(config=tiny_llama.config)
    tiny_llama(ids, past_key_values=reference)
    cache = CompressedCache(codec)
    tiny_llama(ids, past_key_values=cache)
    keys = cache.layers[1].key_stream.materialize()
    original = reference.layers[1].keys
    assert cache.layers[1].key_stream.num_encoded == 20
    assert (keys - original).abs().max() < 0.02 * original.abs().max()
    assert cache.bookkeeping_nbytes > 0


def test_rope_inverse():
    x = torch.randn(2, 3, 5, 16)
    angles = torch.rand(2, 5, 8) * 10
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    torch.testing.assert_close(undo_rope(apply_rope(x, cos, sin), cos, sin), x, atol=1e-5, rtol=1e-5)
    assert torch.equal(undo_rope(x, cos, sin), x * cos[:, None] - rotate_half(x) * sin[:, None])  # no scaling: as is
    scaled = (1.2 * cos, 1.2 * sin)  # YaRN's attention scaling in the model's cos/sin
    torch.testing.assert_close(undo_rope(apply_rope(x, *scaled), *scaled), x, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_keys_coded_before_rope_are_restored_under_a_scaled_rope():
    """YaRN multiplies cos/sin by its attention scaling (here 1.14): keys coded before RoPE are un-rotated by the exact
    inverse, so that the 8-bit codec's decoded keys are the model's keys, as a post-RoPE codec's are."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers import build_tiny

    model = build_tiny(LlamaConfig, LlamaForCausalLM, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                                  "factor": 4.0, "original_max_position_embeddings": 64})
    assert model.model.rotary_emb.attention_scaling == pytest.approx(1 + 0.1 * math.log(4))
    ids = torch.randint(1, 96, (1, 48), generator=torch.Generator().manual_seed(2))
    reference = DynamicCache(config=model.config)
    model(ids, past_key_values=reference)
    info = ModelInfo.from_hf_config(model.config)
    for pre_rope in (False, True):
        codec = build_codec({"name": "uniform", "bits": 8, "group_size": 16, "pre_rope": pre_rope},
                            info)
        cache = CompressedCache(codec)
        model(ids, past_key_values=cache)
        keys, original = cache.layers[1].key_stream.materialize(), reference.layers[1].keys
        assert cache.layers[1].key_stream.num_encoded == 48
        assert (keys - original).abs().max() < 0.02 * original.abs().max(), pre_rope


@torch.no_grad()
def test_nan_in_kv_is_an_error():
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers import TINY, build_tiny

    model = build_tiny(LlamaConfig, LlamaForCausalLM)
    model.model.layers[1].self_attn.v_proj.weight.data[0, 0] = float("nan")
    codec = build_codec({"name": "kivi", "group_size": 4, "residual_length": 8}, info_of(model))
    assert TINY["num_hidden_layers"] == 2
    with pytest.raises(NonFiniteKVError, match="layer 1: NaN or Inf in incoming values"):
        model(_ids(), past_key_values=CompressedCache(codec))


@torch.no_grad()
def test_a_deferred_finiteness_check_reports_one_forward_later():
    """check_finite="deferred": no verdict is read in the forward that brings the NaN (no host sync on a
    GPU); the next forward of that layer, or raise_if_nonfinite(), raises with the positions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers import build_tiny

    model = build_tiny(LlamaConfig, LlamaForCausalLM)
    codec = build_codec({"name": "kivi", "group_size": 4, "residual_length": 8}, info_of(model))
    cache = CompressedCache(codec, check_finite="deferred")
    ids = _ids()
    model(ids, past_key_values=cache)
    cache.raise_if_nonfinite()  # finite: nothing to report
    model.model.layers[1].self_attn.v_proj.weight.data[0, 0] = float("nan")
    try:
        model(ids[:, :1], past_key_values=cache)  # the NaN arrives, and is not read yet
        with pytest.raises(NonFiniteKVError, match=r"layer 1: NaN or Inf .* earlier forward \(cache positions 37..37"):
            model(ids[:, :1], past_key_values=cache)
    finally:
        model.model.layers[1].self_attn.v_proj.weight.data[0, 0] = 0.0
    with pytest.raises(ConfigError, match="valid choices: True, False, 'deferred'"):
        CompressedCache(codec, check_finite="later")


def test_deferred_checks_also_defer_the_float16_range_check_of_kivi_scales():
    """Under check_finite="deferred" a KIVI encode stores float16 scales without reading whether they fit
    (no host sync); values beyond float16's range are reported at the layer's next forward. With the
    immediate check, the same block falls back to float32 scales."""
    info = ModelInfo("tiny", 1, 2, 16)
    codec = build_codec({"name": "kivi", "group_size": 4, "residual_length": 4}, info)
    huge = torch.full((1, 2, 1, 16), 1e5)
    huge[..., ::2] = -1e5  # a per-token group range of 2e5: float16 holds at most 65504
    small = torch.randn(1, 2, 5, 16)
    immediate = CompressedCache(codec, protocol="exact_prefill")
    immediate.update(small, small, 0)
    immediate.update(huge, huge, 0)
    immediate.update(small[:, :, :1], small[:, :, :1], 0)  # encodes more values: the huge one included
    deferred = CompressedCache(codec, protocol="exact_prefill", check_finite="deferred")
    for step in (small, huge, small[:, :, :1], small[:, :, :1], small[:, :, :1], small[:, :, :1]):
        try:
            deferred.update(step, step, 0)
        except NonFiniteKVError as error:
            assert "overflowed its storage dtype" in str(error) and "param_dtype=float32" in str(error)
            break
    else:
        pytest.fail("the float16 overflow was never reported")


def test_install_refuses_layer_types_it_cannot_cache():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from kvcomp.cache import with_cache
    from tests.helpers import TINY

    model = Qwen2ForCausalLM(Qwen2Config(**TINY, layer_types=["full_attention", "chunked_attention"]))
    with pytest.raises(NotImplementedError, match=r"layer types \['chunked_attention'\].*supported: full_attention"):
        install(model)
    assert set(with_cache(model, None)) <= {"cache", "past_key_values"}
    assert next(iter(with_cache(model, None))) in inspect.signature(type(model).forward).parameters


@torch.no_grad()
def test_streaming_without_the_attention_hook_is_an_error():
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcomp.errors import ConfigError
    from tests.helpers import TINY

    torch.manual_seed(0)
    plain = LlamaForCausalLM(LlamaConfig(**TINY)).eval()  # kvcomp.cache.install not called
    codec = build_codec(SCHEDULES[0], info_of(plain))
    with pytest.raises(ConfigError, match="install"):
        plain(_ids(), past_key_values=CompressedCache(codec, "streaming"))
    plain(_ids(), past_key_values=CompressedCache(codec, "simulated"))  # needs no hook


@torch.no_grad()
def test_exact_prefill_sees_its_own_tokens_uncompressed_and_later_ones_stored(tiny_llama):
    """exact_prefill: the prefill's logits are the plain model's even with a destructive codec; the next
    forward reads the encoded prefix, stored exactly as the streaming protocol stores it."""
    codec = build_codec({"name": "uniform", "bits": 1, "group_size": 4}, info_of(tiny_llama))
    ids = _ids(length=24)
    plain = tiny_llama(ids).logits
    cache = CompressedCache(codec, "exact_prefill")
    assert torch.allclose(tiny_llama(ids[:, :20], past_key_values=cache).logits, plain[:, :20], atol=1e-5)
    after = tiny_llama(ids[:, 20:], past_key_values=cache).logits
    assert not torch.allclose(after, plain[:, 20:], atol=1e-2)
    streaming = CompressedCache(codec, "streaming")
    tiny_llama(ids, past_key_values=streaming)
    assert cache.nbytes == streaming.nbytes
    exact, streamed = cache.layers[0], streaming.layers[0]  # deeper layers' inputs differ by design
    assert torch.equal(exact.key_stream.materialize(), streamed.key_stream.materialize())


@torch.no_grad()
def test_compress_generated_false_encodes_the_prompt_only(tiny_llama):
    codec = build_codec(SCHEDULES[0], info_of(tiny_llama))
    cache = CompressedCache(codec, "exact_prefill", compress_generated=False)
    tiny_llama.generate(_ids(length=30), max_new_tokens=20, do_sample=False, past_key_values=cache, pad_token_id=0)
    stream = cache.layers[0].key_stream
    assert stream.num_encoded == codec.policy("key", 0).split(30)[1] > 0
    assert stream.num_tail == stream.length - stream.num_encoded == 30 + 19 - stream.num_encoded


@torch.no_grad()
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_decoded_blocks_equal_decoding_the_whole_payload(tiny_llama, schedule):
    """The reference path decodes each block once; that equals decoding the stored payload in one go."""
    codec = build_codec(schedule, info_of(tiny_llama))
    cache = CompressedCache(codec)
    tiny_llama.generate(_ids(length=21), max_new_tokens=30, do_sample=False, past_key_values=cache, pad_token_id=0)
    layer = cache.layers[1]
    for stream in (layer.key_stream, layer.value_stream):
        whole = codec.decode(stream.payload, StreamRequest(1, stream.kind, dtype=torch.float32))
        if stream.rotation.pre_rope:
            lo, hi = stream.num_sinks, stream.num_sinks + stream.num_encoded
            whole = apply_rope(whole, *layer.positions.rope(lo, hi - lo))
        stream.pieces()  # the torch path's read: every block decoded once, into the stream's decoded copy
        assert torch.allclose(stream.decoded.view, whole, atol=1e-6)
