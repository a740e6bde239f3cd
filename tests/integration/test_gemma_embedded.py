"""The embedded Gemma-3-270M (base model): skipped unless it is already converted in the kvcomp cache
(``python scripts/fetch_assets.py --all`` fetches it), so no test here downloads."""

import pytest
import torch

from kvcomp.cache import CompressedCache, install
from kvcomp.codecs import ModelInfo, build_codec
from kvcomp.data.assets import embedded_model_dir
from kvcomp.models import load_model, model_summary

pytestmark = pytest.mark.integration


@torch.no_grad()
def test_the_converted_gemma3_has_its_hybrid_layers_and_the_fp16_cache_changes_nothing():
    if not (embedded_model_dir("gemma3_270m") / "model.safetensors").is_file():
        pytest.skip("Gemma-3-270M not fetched (python scripts/fetch_assets.py --all)")
    model, tokenizer = load_model("embedded", embedded="gemma3_270m", dtype="float32", device="cpu")
    install(model)
    summary = model_summary(model)
    assert (summary["model_type"], summary["n_layers"], summary["n_heads"], summary["n_kv_heads"], summary["head_dim"],
            summary["vocab_size"]) == ("gemma3_text", 18, 4, 1, 256, 262144)
    info = ModelInfo.from_hf_config(model.config)
    assert [i for i, kind in enumerate(info.layer_types) if kind == "full_attention"] == [5, 11, 17]
    assert info.sliding_window == 512 and model.config.tie_word_embeddings and tokenizer.chat_template is None
    assert {kind: p["rope_theta"] for kind, p in model.config.rope_parameters.items()} == {
        "full_attention": 1e6, "sliding_attention": 1e4}
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    assert ids[0, 0] == tokenizer.bos_token_id
    cache = CompressedCache(build_codec({"name": "fp16"}, info))
    assert torch.equal(model(ids, past_key_values=cache).logits, model(ids).logits)
    assert len(cache.window_layers) == 15 and len(cache.compressed_layers) == 3
