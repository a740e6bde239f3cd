"""``outlier_rule``: each token's top entries (``token_topk``) or the KVQuant reference's thresholds
(``reference``: keys outside their channel's calibration quantiles, values at or beyond the token's own)."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from kvcomp.codecs import build_codec
from kvcomp.codecs.base import Payload, StreamRequest
from kvcomp.errors import ConfigError
from tests.codec_matrix import fitted
from tests.helpers import build_tiny, info_of

pytestmark = pytest.mark.usefixtures("session_cache")


HEAVY = (0, 3)  # (KV head, channel) of the value channel offset far above the others


@pytest.fixture(scope="module")
def heavy_value_qwen():
    """A tiny Qwen2 whose values carry one channel of huge magnitude in every token (v_proj bias +20)."""
    model = build_tiny(Qwen2Config, Qwen2ForCausalLM, use_sliding_window=False)
    model.config._name_or_path = "tiny-heavy-value"  # its own calibration artifacts
    head, channel = HEAVY
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.bias[head * 16 + channel] += 20.0
    return model


def round_trip(codec, x, kind, layer=0):
    payload = codec.encode(StreamRequest(layer, kind, tokens=x))
    return payload.tensors, codec.decode(payload, StreamRequest(layer, kind, dtype=torch.float32))


def decoded_without_patch(codec, stored, kind, layer=0):
    """The same payload decoded with its outlier side list left out."""
    codes = {k: v for k, v in stored.items() if not k.startswith("outlier_")}
    return codec.decode(Payload(codes, num_tokens=stored["codes"].shape[2]), StreamRequest(layer, kind, dtype=torch.float32))


def values_of(model, layer=0):
    """The values of ``layer`` for a fresh prompt, ``[1, H, T, D]``."""
    captured = {}
    handle = model.model.layers[layer].self_attn.v_proj.register_forward_hook(lambda m, a, out: captured.setdefault("v", out))
    try:
        with torch.no_grad():
            model(torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(5)))
    finally:
        handle.remove()
    return captured["v"].view(1, 40, 2, 16).transpose(1, 2)


def test_reference_values_keep_the_heavy_channel_that_token_topk_normalises_away(heavy_value_qwen):
    """Per-token quantiles over raw values flag the heavy channel in every token (it is each token's largest
    entry); token_topk's channel-normalised score seldom does. Kept entries decode to their bf16 values,
    every other entry as the payload decodes without its side list."""
    x = values_of(heavy_value_qwen)
    head, channel = HEAVY
    assert (x[0, head, :, channel] > 5 * x[0, 1 - head].abs().amax(-1)).all()  # the model shows it
    kept = {}
    for rule in ("token_topk", "reference"):
        codec = fitted(heavy_value_qwen, "kvquant", bits=2, outliers=0.02, outlier_rule=rule)  # 1 slot per token
        stored, decoded = round_trip(codec, x, "value")
        mask = codec.outlier_selector.mask(x, stored)
        assert mask.sum() == 40  # one per token under both rules here
        kept[rule] = mask[0, head, :, channel]
        assert torch.equal(decoded[mask], x[mask].to(torch.bfloat16).float())
        assert torch.equal(decoded[~mask], decoded_without_patch(codec, stored, "value")[~mask])
    assert kept["reference"].all()
    assert kept["token_topk"].float().mean() < 0.25


def test_reference_keys_keep_only_entries_outside_their_channel_range(tiny_llama):
    """Keys at their channel means hold no outliers under the reference rule (slots unused: index H*D),
    and the two entries pushed past their channel's calibration quantiles are kept exactly; every other
    entry decodes as without outliers. token_topk fills every token's slot."""
    reference = fitted(tiny_llama, "temporalkv", bits=2, hybrid="off", outliers=0.02, outlier_rule="reference")
    plain = fitted(tiny_llama, "temporalkv", bits=2, hybrid="off", outliers=0.0)
    topk = fitted(tiny_llama, "temporalkv", bits=2, hybrid="off", outliers=0.02)
    stats = reference.stats[(0, "key")]
    x = stats.mean[None, :, None, :].expand(2, 2, 8, 16).clone()
    x[0, 1, 2, 5] = stats.high[1, 5] + 1.0
    x[1, 0, 6, 9] = stats.low[0, 9] - 2.0
    stored, decoded = round_trip(reference, x, "key")
    mask = reference.outlier_selector.mask(x, stored)
    assert mask.sum() == 2 and mask[0, 1, 2, 5] and mask[1, 0, 6, 9]
    assert (stored["outlier_index"] == 2 * 16).sum() == 2 * 8 - 2  # the other tokens' slots are unused
    assert torch.equal(decoded[mask], x[mask].to(torch.bfloat16).float())
    _, without = round_trip(plain, x, "key")
    assert torch.equal(decoded[~mask], without[~mask])  # same codebooks: nothing else changes
    topk_stored, _ = round_trip(topk, x, "key")
    assert topk.outlier_selector.mask(x, topk_stored).sum() == 2 * 8  # one entry per token, always
    assert (topk_stored["outlier_index"] < 2 * 16).all()


def test_reference_keeps_at_most_the_cap_most_beyond_their_threshold(tiny_llama):
    """Three entries of one token beyond their thresholds and one slot: the one furthest past (in half
    ranges) is kept."""
    codec = fitted(tiny_llama, "temporalkv", bits=2, hybrid="off", outliers=0.02, outlier_rule="reference")
    stats = codec.stats[(0, "key")]
    x = stats.mean[None, :, None, :].expand(1, 2, 4, 16).clone()
    for (h, c), half_ranges in zip(((0, 1), (1, 4), (0, 7)), (1.0, 3.0, 2.0)):
        x[0, h, 1, c] = stats.high[h, c] + half_ranges * stats.half_range[h, c]
    stored = codec.outlier_selector.select(x, stats, "key")
    assert stored["outlier_index"][0, 0, 1].tolist() == [1 * 16 + 4]


def test_reference_selection_is_token_local_and_bytes_are_those_of_token_topk(tiny_llama):
    """Selecting a slice of tokens gives the slice of the whole selection (streaming == one-shot), and the
    payload holds exactly what token_topk's does."""
    codec = fitted(tiny_llama, "kvquant", bits=2, outliers=0.05, outlier_rule="reference")
    topk = fitted(tiny_llama, "kvquant", bits=2, outliers=0.05)
    x = 3 * torch.randn(2, 2, 12, 16, generator=torch.Generator().manual_seed(1))
    for kind in ("key", "value"):
        stats = codec.stats[(0, kind)]
        whole = codec.outlier_selector.select(x, stats, kind)
        part = codec.outlier_selector.select(x[:, :, 4:9], stats, kind)
        assert all(torch.equal(whole[k][:, :, 4:9], part[k]) for k in whole)
        ref_bytes = codec.encode(StreamRequest(0, kind, tokens=x)).nbytes
        assert ref_bytes == topk.encode(StreamRequest(0, kind, tokens=x)).nbytes
        assert ref_bytes * 8 == pytest.approx(codec.code_bits_per_value(kind, 0) * x.numel())


def test_outlier_rule_is_checked_and_enters_the_calibration_key_only_when_it_changes_the_fit(tiny_llama):
    info = info_of(tiny_llama)
    with pytest.raises(ConfigError, match="outlier_rule 'channel' unknown; valid: token_topk, reference"):
        build_codec({"name": "kvquant", "outliers": 0.01, "outlier_rule": "channel"}, info)
    key = build_codec({"name": "kvquant", "outliers": 0.01, "outlier_rule": "reference"}, info).calibration_key()
    assert key["outlier_rule"] == "reference"  # outliers are left out of KVQuant's k-means
    for config in ({"name": "kvquant", "outliers": 0.01}, {"name": "kvquant", "outlier_rule": "reference"},
                   {"name": "temporalkv", "outliers": 0.01, "outlier_rule": "reference"}):
        assert "outlier_rule" not in build_codec(config, info).calibration_key()  # artifacts keep their keys
    described = build_codec({"name": "channelkv", "outliers": 0.01, "outlier_rule": "reference"}, info).describe()
    assert described == "channelkv(bits=2, outliers=0.01, outlier_rule=reference)"
    assert "outlier_rule" not in build_codec({"name": "channelkv", "outliers": 0.01}, info).describe()
