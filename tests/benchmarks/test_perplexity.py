"""The perplexity protocols on a tiny random model: ``chunked`` (AQUA-KV's) against ``streaming`` and the
uncompressed model; bad settings are clear errors."""

import math

import pytest
import torch
import torch.nn.functional as F

from kvcomp.benchmarks.distribution import output_logits
from kvcomp.benchmarks.perplexity import _window_states, evaluate_perplexity, reference_perplexity
from kvcomp.cache import CompressedCache
from kvcomp.codecs import build_codec
from kvcomp.config import PerplexityConfig
from kvcomp.errors import ConfigError
from tests.helpers import info_of
from tests.toy_codecs import DeflatedModelCodec, make_toy

SEQ_LEN = 40
KIVI = {"name": "kivi", "group_size": 8, "residual_length": 16}  # 40 tokens encode several blocks


def _windows(count=3):
    return torch.randint(0, 96, (count, SEQ_LEN), generator=torch.Generator().manual_seed(2))


def _ppl(model, codec_config, protocol, **config):
    codec = build_codec(codec_config, info_of(model))
    config = PerplexityConfig(seq_len=SEQ_LEN, protocols=[protocol], **config)
    return evaluate_perplexity(model, codec, _windows(), config)[f"ppl_{protocol}"]


def test_chunked_with_the_fp16_codec_is_streaming(tiny_model):
    streaming = _ppl(tiny_model, {"name": "fp16"}, "streaming")
    for chunk_tokens in (1, 7, 32):
        assert _ppl(tiny_model, {"name": "fp16"}, "chunked", chunk_tokens=chunk_tokens) == pytest.approx(streaming, rel=1e-5)
    # nothing is ever encoded: the later protocol copies the first one's number
    codec = build_codec({"name": "fp16"}, info_of(tiny_model))
    both = evaluate_perplexity(tiny_model, codec, _windows(), PerplexityConfig(seq_len=SEQ_LEN, protocols=["streaming", "chunked"]))
    assert both["ppl_chunked"] == both["ppl_streaming"]


@torch.no_grad()
def test_chunked_one_token_at_a_time_departs_from_streaming_at_the_first_encode(tiny_llama):
    """One token per forward is not ``streaming``: a forward that encodes tokens attends to them in full
    precision (AQUA-KV's cache returns the original K/V for that step), while under ``streaming`` the
    query of the token that completes a block already sees it encoded. Logits agree up to that token."""
    codec = build_codec(KIVI, info_of(tiny_llama))
    windows = _windows()
    chunked, cache = _window_states(tiny_llama, codec, windows, "chunked", 1)
    streaming, _ = _window_states(tiny_llama, codec, windows, "streaming", 1)
    first = KIVI["residual_length"] - 1  # the token that completes KIVI's first key block (residual_length tokens)
    torch.testing.assert_close(chunked[:, :first], streaming[:, :first], rtol=1e-5, atol=1e-5)
    assert (chunked[:, first] - streaming[:, first]).abs().max() > 1e-4
    assert cache.payload_nbytes > 0
    # a model-scope codec encodes after the forward's last layer: there one token per forward is a token-by-token feed
    toy = make_toy(DeflatedModelCodec, tiny_llama)
    fed = CompressedCache(toy, "streaming")
    by_token = torch.cat([tiny_llama(windows[:, i : i + 1], past_key_values=fed).logits for i in range(SEQ_LEN)], dim=1)
    torch.testing.assert_close(output_logits(tiny_llama, _window_states(tiny_llama, toy, windows, "chunked", 1)[0]), by_token)


@torch.no_grad()
def test_one_chunk_per_window_is_the_uncompressed_model(tiny_llama):
    """A single exact_prefill forward never reads the compressed cache."""
    windows = _windows()
    logits = tiny_llama(windows).logits.float()
    plain = math.exp(F.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten()).item())
    assert _ppl(tiny_llama, KIVI, "chunked", chunk_tokens=SEQ_LEN) == pytest.approx(plain, rel=1e-5)
    assert _ppl(tiny_llama, KIVI, "streaming") != pytest.approx(plain, rel=1e-5)  # the codec is lossy


def test_bad_chunk_tokens_and_unknown_protocols_are_config_errors(tiny_llama):
    with pytest.raises(ConfigError, match="chunk_tokens=0 is out of range; valid: an integer >= 1"):
        PerplexityConfig(chunk_tokens=0)
    codec = build_codec({"name": "fp16"}, info_of(tiny_llama))
    with pytest.raises(ConfigError, match="choose from streaming, simulated, chunked"):
        evaluate_perplexity(tiny_llama, codec, _windows(), PerplexityConfig(seq_len=SEQ_LEN, protocols=["aqua"]))


def test_each_row_keeps_per_window_nll_and_a_bootstrap_interval_around_its_perplexity(tiny_llama):
    """``nll_<protocol>`` sums to the perplexity; ``ppl_<protocol>_ci95`` contains it, narrows with more windows'
    agreement and is reproducible (seeded); paired with the reference on the same windows, an uncompressed row's
    change is exactly 0, and a 2-bit KIVI row's interval holds its change and is narrower than its own spread."""
    from kvcomp.benchmarks.intervals import pair_with_reference, ppl_interval

    config = PerplexityConfig(seq_len=SEQ_LEN, protocols=["streaming", "chunked"])
    windows = _windows(8)
    rows = []
    for name, codec_config in (("fp16", {"name": "fp16"}), ("kivi", {**KIVI, "bits": 2})):
        row = evaluate_perplexity(tiny_llama, build_codec(codec_config, info_of(tiny_llama)), windows, config)
        rows.append({"benchmark": "same windows", "codec": name, **row})
    reference, kivi = rows
    for row in rows:
        for protocol in config.protocols:
            nll, low_high = row[f"nll_{protocol}"], row[f"ppl_{protocol}_ci95"]
            assert len(nll) == 8 and row["tokens_per_window"] == [SEQ_LEN - 1] * 8
            assert math.exp(sum(nll) / (8 * (SEQ_LEN - 1))) == pytest.approx(row[f"ppl_{protocol}"], rel=1e-9)
            assert low_high[0] < row[f"ppl_{protocol}"] < low_high[1]
            assert ppl_interval(nll, row["tokens_per_window"]) == low_high  # seeded: the same draws
    assert ppl_interval([30.0] * 8, [10] * 8) == pytest.approx([math.exp(3)] * 2)  # identical windows: no spread
    paired = pair_with_reference([{**reference, "reference_key": "r"}, kivi, {**reference, "codec": "fp16 again"}])
    assert "ppl_streaming_vs_reference_ci95" not in paired[0]  # the reference itself
    assert paired[2]["ppl_streaming_vs_reference_ci95"] == [0.0, 0.0]
    low, high = paired[1]["ppl_chunked_vs_reference_ci95"]
    change = kivi["ppl_chunked"] / reference["ppl_chunked"] - 1
    assert low <= change <= high
    own_low, own_high = kivi["ppl_chunked_ci95"]
    assert high - low < (own_high - own_low) / kivi["ppl_chunked"]  # pairing removes the windows' own spread


def test_distribution_metrics_against_the_reference_are_exact(tiny_model):
    """The reference keeps its states once; an identical evaluation then has KL 0 and agreement 1 exactly, and a 2-bit
    KIVI row's KL, agreement and log-probability change equal a direct full-vocabulary computation from the two models'
    logits, each inside its interval."""
    from kvcomp.artifacts import ArtifactError

    config = PerplexityConfig(seq_len=SEQ_LEN, protocols=["streaming", "chunked"])
    windows, info = _windows(4), info_of(tiny_model)
    reference, states = reference_perplexity(tiny_model, build_codec({"name": "fp16"}, info), windows, config)
    assert set(states) == {"states_streaming", "states_chunked"} and "kld_mean_streaming" not in reference
    same = evaluate_perplexity(tiny_model, build_codec({"name": "fp16"}, info), windows, config, reference=states)
    assert same["ppl_streaming"] == reference["ppl_streaming"]
    for protocol in config.protocols:
        assert same[f"kld_mean_{protocol}"] == same[f"kld_p99_{protocol}"] == same[f"dlogp_mean_{protocol}"] == 0
        assert same[f"top1_agreement_{protocol}"] == 1 and same[f"kld_mean_{protocol}_ci95"] == [0.0, 0.0]
    kivi = build_codec({**KIVI, "bits": 2}, info)
    row = evaluate_perplexity(tiny_model, kivi, windows, config, reference=states)
    logp = F.log_softmax(output_logits(tiny_model, _window_states(tiny_model, kivi, windows, "streaming", 1)[0])[:, :-1], -1)
    ref = F.log_softmax(tiny_model(windows).logits.float()[:, :-1], -1)  # streaming's reference: the plain model
    kld = (ref.exp() * (ref - logp)).sum(-1)
    true = windows[:, 1:, None]
    assert row["kld_mean_streaming"] == pytest.approx(kld.mean().item(), rel=1e-4) and row["kld_mean_streaming"] > 0
    assert row["kld_p99_streaming"] == pytest.approx(torch.quantile(kld.flatten().double(), 0.99).item(), rel=1e-3)
    agreement = (ref.argmax(-1) == logp.argmax(-1)).double().mean().item()
    assert row["top1_agreement_streaming"] == pytest.approx(agreement, abs=1e-12) and agreement < 1
    assert row["dlogp_mean_streaming"] == pytest.approx((logp.gather(-1, true) - ref.gather(-1, true)).mean().item(),
                                                        abs=1e-6)
    for name in ("kld_mean", "kld_median", "kld_p99", "top1_agreement", "dlogp_mean"):
        low, high = row[f"{name}_streaming_ci95"]
        assert low <= row[f"{name}_streaming"] <= high
    assert len(row["kld_chunked"]) == len(row["top1_chunked"]) == 4
    with pytest.raises(ArtifactError, match=r"states of protocol streaming are \[4, 40, 64\], not \[3, 40, 64\]"):
        evaluate_perplexity(tiny_model, kivi, windows[:3], config, reference=states)
