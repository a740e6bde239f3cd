"""Sliding-window and hybrid attention: tiny random Gemma 3 (MQA, head_dim 256, q/k norms, local and global
layers with different RoPE bases), Mistral with a window on every layer and Qwen2 with sliding top layers.

Full-attention layers are encoded by the codec; sliding layers keep transformers' window-bounded cache unless
``compress_sliding``. Windows are 8 tokens, far shorter than the 30-token prompts (then 6-12 decode steps)."""

import pytest
import torch
from transformers import (
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from kvcomp.cache import CompressedCache, install
from kvcomp.calibration.collect import collect_kv
from kvcomp.codecs import ModelInfo, build_codec, expected_cache_bits
from kvcomp.errors import ConfigError
from tests.codec_matrix import MATRIX, calibration_windows, make_codec
from tests.helpers import TINY

WINDOW = 8
HYBRID = {
    # layer types: sliding, full, sliding, full; local RoPE base 10,000, global 1,000,000
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=256, sliding_window=WINDOW,
        sliding_window_pattern=2, query_pre_attn_scalar=256)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(TINY, num_hidden_layers=4, use_sliding_window=True,
                                                  sliding_window=WINDOW, max_window_layers=2)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(TINY, sliding_window=WINDOW)),  # every layer sliding
}
TYPES = {
    "gemma3": ["sliding_attention", "full_attention"] * 2,
    "qwen2": ["full_attention"] * 2 + ["sliding_attention"] * 2,
    "mistral": ["sliding_attention"] * 2,
}


pytestmark = pytest.mark.usefixtures("session_cache")


def _model(family: str):
    """The tiny model, named apart so that its calibration artifacts never meet another tiny model's."""
    config_cls, model_cls, kwargs = HYBRID[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs)).eval()
    model.config._name_or_path = f"tiny-hybrid-{family}"
    install(model)
    return model


@pytest.fixture(scope="module", params=list(HYBRID))
def hybrid(request):
    return request.param, _model(request.param)


def _needs_sliding(family: str) -> dict:
    """Mistral has no full-attention layer: the codec must be told to encode the sliding ones."""
    return {"compress_sliding": True} if family == "mistral" else {}


def _padded(batch=2, length=30, pad=8, seed=0):
    ids = torch.randint(1, 96, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[1, :pad], mask[1, :pad] = 0, 0
    return ids, mask


def test_layer_types_are_read_from_the_config(hybrid):
    family, model = hybrid
    info = ModelInfo.from_hf_config(model.config)
    assert list(info.layer_types) == TYPES[family] and info.sliding_window == WINDOW
    full = tuple(i for i, kind in enumerate(TYPES[family]) if kind == "full_attention")
    if full:
        assert info.encoding(False).model_layers == full and info.encoding(False).num_layers == len(full)
    else:
        with pytest.raises(ConfigError, match="compress_sliding=true"):
            info.encoding(False)
    assert info.encoding(True).model_layers == tuple(range(len(TYPES[family])))


@pytest.mark.parametrize("compress_sliding", [False, True])
def test_fp16_generation_with_left_padding_equals_the_uncompressed_model(hybrid, compress_sliding):
    family, model = hybrid
    if family == "mistral" and not compress_sliding:
        pytest.skip("every Mistral layer is sliding: nothing to compress without compress_sliding")
    ids, mask = _padded()
    codec = build_codec({"name": "fp16", "compress_sliding": compress_sliding}, ModelInfo.from_hf_config(model.config))
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        plain = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kwargs)
        cache = CompressedCache(codec)
        ours = model.generate(ids, past_key_values=cache, **kwargs)
    assert torch.equal(ours.sequences, plain.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(plain.logits), rtol=1e-5, atol=1e-5)
    windows = [layer for layer in cache.layers if layer not in cache.compressed_layers]
    assert len(windows) == (0 if compress_sliding else TYPES[family].count("sliding_attention"))
    assert all(w.keys.shape[2] == WINDOW - 1 for w in windows)  # bounded: 42 tokens seen, 7 kept


NEW_TOKENS = 6  # decode steps that flush blocks of the full-attention layers (KIVI's keys at 32 tokens in row 0)


@pytest.mark.parametrize("name", list(MATRIX))
def test_every_codec_runs_and_reports_bits_per_layer_type(hybrid, name):
    family, model = hybrid
    codec = make_codec(model, name, **_needs_sliding(family))
    ids, mask = _padded()
    cache = CompressedCache(codec)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0, past_key_values=cache)
    assert out.shape == (2, 30 + NEW_TOKENS)
    assert name == "fp16" or any(s.num_encoded for layer in cache.compressed_layers for s in layer.streams)
    bits = cache.bits_breakdown()
    assert set(bits) >= {f"bits_per_value_{kind}" for kind in set(TYPES[family])}
    assert sum(bits[f"kv_bytes_{kind}"] for kind in set(TYPES[family])) == cache.nbytes
    if family != "mistral":  # uncompressed windows: 32-bit values, 7 tokens per sliding layer
        sliding = TYPES[family].count("sliding_attention")
        assert bits["bits_per_value_sliding_attention"] == 32
        assert bits["kv_bytes_sliding_attention"] == sliding * 2 * 2 * codec.model.num_kv_heads * (WINDOW - 1) * codec.model.head_dim * 4
    try:
        expected = expected_cache_bits(codec, 29 + NEW_TOKENS, 2, fp_bits=32)
    except NotImplementedError:
        return
    unpadded = CompressedCache(codec)  # (left padding keeps the pads' columns with the sinks: not in the formula)
    with torch.no_grad():
        model(out[:, :29 + NEW_TOKENS], past_key_values=unpadded)
    assert (unpadded.nbytes - unpadded.state_nbytes) * 8 == pytest.approx(expected)


def test_pre_rope_codec_rotates_each_layer_with_its_own_rope():
    """Gemma 3's local layers use RoPE base 10,000 and its global layers 1,000,000: an 8-bit pre-RoPE
    cache over every layer must re-rotate each layer's keys with that layer's frequencies."""
    model = _model("gemma3")
    rotary = model.model.rotary_emb
    rotaries = install(model).rotaries  # by layer index
    assert torch.equal(rotaries[0].frequencies()[0], rotary.sliding_attention_inv_freq)
    assert torch.equal(rotaries[1].frequencies()[0], rotary.full_attention_inv_freq)
    assert not torch.equal(rotary.sliding_attention_inv_freq, rotary.full_attention_inv_freq)
    ids, mask = _padded()
    info = ModelInfo.from_hf_config(model.config)
    codec = build_codec({"name": "uniform", "bits": 8, "group_size": 32, "pre_rope": True, "compress_sliding": True}, info)
    with torch.no_grad():
        plain = model(ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config)).logits
        cache = CompressedCache(codec, "simulated")
        ours = model(ids, attention_mask=mask, past_key_values=cache).logits
    assert all(layer.positions.recomputed for layer in cache.compressed_layers)
    error = (ours - plain)[mask.bool()].norm() / plain[mask.bool()].norm()
    assert error < 0.02, error


def test_calibration_collects_only_the_encoded_layers():
    """Qwen2 with sliding layers 2-3: the collection holds layers 0 and 1, exactly (values need no un-rotation)."""
    model = _model("qwen2")
    codec = build_codec({"name": "fp16"}, ModelInfo.from_hf_config(model.config))
    windows = calibration_windows()[:2]
    collected = collect_kv(model, codec.model, windows, drop_first=2, fisher=False)
    assert collected.num_layers == 2
    reference = DynamicCache(config=model.config)
    with torch.no_grad():
        model(windows, past_key_values=reference)
    for layer in range(2):
        torch.testing.assert_close(collected.layer(layer)["value"].float(),
                                   reference.layers[layer].values[:, :, 2:].to(torch.bfloat16).float())


@pytest.mark.integration
def test_run_py_on_a_hybrid_model_prints_bits_per_layer_type(embedded, tmp_path):
    """``run.py`` on a local folder holding the tiny Gemma 3 (with the embedded tokenizer) and KIVI-2: perplexity
    runs, and the table shows the bits of the full-attention (encoded) and sliding-window (kept) layers."""
    import json

    from transformers import AutoTokenizer

    from tests.run_py import run_py

    _, tokenizer = embedded
    config_cls, model_cls, kwargs = HYBRID["gemma3"]
    torch.manual_seed(0)
    model_cls(config_cls(**(kwargs | {"vocab_size": len(tokenizer)}))).save_pretrained(tmp_path / "gemma3")
    AutoTokenizer.from_pretrained(tokenizer.name_or_path).save_pretrained(tmp_path / "gemma3")
    result = run_py(f"model.source={tmp_path / 'gemma3'}", "model.name=tiny_gemma3", "codec=kivi", "codec.residual_length=32",
                  "benchmark.num_windows=2", "benchmark.seq_len=96", f"hydra.run.dir={tmp_path / 'out'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bits/value full-attention layers" in result.stderr + result.stdout
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    kivi = next(row for row in rows if row["codec"].startswith("kivi"))
    assert kivi["bits_per_value_sliding_attention"] == 32  # fp32 windows of 7 tokens, kept as they are
    assert 3 < kivi["bits_per_value_full_attention"] < 32 and kivi["kv_bytes_sliding_attention"] > 0
