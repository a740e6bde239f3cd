"""Integration tests on the embedded SmolLM2-135M (fetched by scripts/setup.sh)."""


import pytest
import torch

from kvcomp.cache import CompressedCache
from kvcomp.codecs import ModelInfo, build_codec

pytestmark = pytest.mark.integration


def _long_prompts(tokenizer):
    from kvcomp.data import load_corpus

    article = load_corpus("enwiki", "evaluation")[3]
    ids = tokenizer(article)["input_ids"]
    texts = [tokenizer.decode(ids[:300]), tokenizer.decode(ids[400:640])]
    return tokenizer(texts, return_tensors="pt", padding=True)


@torch.no_grad()
def test_generate_through_compressed_cache(embedded):
    model, tokenizer = embedded
    batch = _long_prompts(tokenizer)
    assert (batch["attention_mask"][1] == 0).any()  # the second prompt is left padded
    kwargs = dict(**batch, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    info = ModelInfo.from_hf_config(model.config)
    plain = model.generate(**kwargs)
    assert torch.equal(model.generate(**kwargs, past_key_values=CompressedCache(build_codec({"name": "fp16"}, info))), plain)

    cache = CompressedCache(build_codec({"name": "kivi", "bits": 4}, info))
    kivi = model.generate(**kwargs, past_key_values=cache)
    assert cache.layers[0].key_stream.num_encoded >= 256 and cache.nbytes < 0.5 * 2 * 30 * 3 * 64 * 4 * kivi.shape[1] * 2
    # fluent: the plain model finds the KIVI-4 continuation about as likely as its own greedy one
    prompt_len = batch["input_ids"].shape[1]
    def continuation_nll(sequences):
        logits = model(sequences, attention_mask=torch.ones_like(sequences)).logits[:, prompt_len - 1 : -1]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), sequences[:, prompt_len:].flatten()).item()
    assert continuation_nll(kivi) < continuation_nll(plain) + 1.0
    assert (kivi[:, prompt_len : prompt_len + 4] == plain[:, prompt_len : prompt_len + 4]).float().mean() >= 0.5


@torch.no_grad()
def test_qjl_presets_on_smollm2(embedded):
    """QJL at the paper's 3 and 5 bits on the real model (streaming protocol): more bits, lower perplexity,
    both within a sane distance of the uncompressed model, and the cache holds what the codec counts."""
    from kvcomp.codecs import expected_cache_bits
    from kvcomp.data import load_corpus
    from tests.helpers import compose_config

    model, tokenizer = embedded
    ids = tokenizer(" ".join(load_corpus("enwiki", "evaluation")[:2]), return_tensors="pt").input_ids[:, :384]
    info = ModelInfo.from_hf_config(model.config)

    def perplexity(codec):
        cache = CompressedCache(codec, "streaming")
        loss = model(ids, past_key_values=cache, labels=ids).loss
        assert 8 * cache.nbytes == expected_cache_bits(codec, ids.shape[1], 1, 32)
        return loss.exp().item()

    plain = perplexity(build_codec({"name": "fp16"}, info))
    three, five = (perplexity(build_codec(compose_config(f"codec=qjl_{b}bit_d64", hydra_config=True).codec, info)) for b in (3, 5))
    assert plain < five < three < 3 * plain


@torch.no_grad()
def test_fused_decode_attention_on_smollm2(embedded):
    """KIVI-2 decode steps read by the fused Triton kernel (interpreter) on the real model (GQA 3:1,
    head_dim 64, 30 layers): the same logits as the torch path, and no payload block is ever decoded."""
    from kvcomp.cache import install
    from kvcomp.data import load_corpus

    model, tokenizer = embedded
    ids = tokenizer(load_corpus("enwiki", "evaluation")[0], return_tensors="pt").input_ids[:, :200]
    codec = build_codec({"name": "kivi", "bits": 2}, ModelInfo.from_hf_config(model.config))

    def generate(backend):
        install(model, kernel_backend=backend)
        try:
            cache = CompressedCache(codec, "exact_prefill")
            out = model.generate(ids, max_new_tokens=2, do_sample=False, past_key_values=cache,
                                 output_logits=True, return_dict_in_generate=True)
        finally:
            install(model, kernel_backend="torch")
        return torch.stack(out.logits, dim=1), cache

    reference, _ = generate("torch")
    fused, cache = generate("triton")
    torch.testing.assert_close(fused, reference, rtol=1e-3, atol=1e-3)
    assert all(layer.key_stream.decoded.length == 0 and layer.value_stream.decoded.length == 0 for layer in cache.layers)
    assert cache.layers[0].key_stream.num_encoded == 128


@pytest.mark.integration
def test_prefill_memo_benchmark_runs_and_agrees(embedded):
    from importlib import import_module

    body = import_module("benchmarks.bench_prefill_memo").main(["--tokens", "48", "--new", "3", "--codecs", "fp16", "kivi"])
    assert body.count("| yes |") == 2 and "| NO |" not in body


def test_calibration_documents_never_meet_the_evaluation_split_whatever_the_seed(embedded):
    """``calibration.seed`` moves the calibration windows, never the documents: those stay the split disjoint from
    the evaluation documents perplexity reads."""
    from kvcomp.calibration import CalibrationConfig
    from kvcomp.data import load_corpus, token_windows
    from kvcomp.runner import calibration_texts

    _, tokenizer = embedded
    evaluation = set(load_corpus("enwiki", "evaluation"))
    texts = {seed: calibration_texts(CalibrationConfig(seed=seed, num_samples=2, seq_len=64), tokenizer) for seed in (0, 3)}
    assert texts[0] == texts[3] and not set(texts[0]) & evaluation
    windows = [token_windows(texts[0], tokenizer, 64, 2, seed=seed, mode="random") for seed in (0, 3)]
    assert not torch.equal(*windows)  # the seed still places the windows
