"""Token eviction (presses, :mod:`kvcomp.presses`) and its composition with codecs: the scores each press computes
against direct computations, the cache keeping only the kept tokens (bytes fall, held bytes equal reported bytes),
decode steps equal attention with the evicted tokens masked out, and the refusals."""

import pytest
import torch
from transformers import DynamicCache

from kvcomp.cache import CompressedCache
from kvcomp.cache.accounting import layer_bytes
from kvcomp.cache.eviction import drops_in_place
from kvcomp.cache.memory import held_nbytes, model_storages
from kvcomp.codecs import Codec, ModelInfo, build_codec
from kvcomp.errors import ConfigError
from kvcomp.presses import Prefill, build_press
from kvcomp.stages.rope import apply_rope
from tests.codec_matrix import fitted
from tests.helpers import info_of

INFO = ModelInfo("tiny", 2, 2, 16)
KIVI = {"name": "kivi", "group_size": 8, "residual_length": 16}


def _prefill(b=2, h=2, r=2, n=40, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return Prefill(torch.randn(b, h * r, n, d, generator=gen), torch.randn(b, h, n, d, generator=gen),
                   torch.randn(b, h, n, d, generator=gen))


def test_kept_counts_and_simple_selections():
    """kvpress's count ``int(n (1 - ratio))``; knorm keeps each head's lowest-norm keys; StreamingLLM the sinks and
    the most recent tokens, the same in every head."""
    prefill = _prefill()
    knorm = build_press({"name": "knorm", "ratio": 0.3}, INFO)
    kept = knorm.keep(prefill)
    assert kept.shape == (2, 2, 28)
    norms = prefill.keys.norm(dim=-1)
    expected = norms.topk(28, dim=-1, largest=False).indices.sort(-1).values
    assert torch.equal(kept, expected) and not torch.equal(kept[:, 0], kept[:, 1])  # each head its own tokens
    streaming = build_press({"name": "streaming_llm", "ratio": 0.5, "sinks": 3}, INFO).keep(prefill)
    assert streaming.shape == (2, 1, 20)
    assert streaming[0, 0].tolist() == [0, 1, 2, *range(23, 40)]
    assert build_press({"name": "knorm", "ratio": 0.0}, INFO).keep(prefill) is None
    assert build_press({"name": "knorm", "ratio": 0.01}, INFO).keep(prefill).shape[-1] == 39  # int(39.6)


def test_snapkv_scores_equal_a_direct_computation():
    """The observation window's causal attention over the prompt (softmax over every token), its own columns
    dropped, averaged over the window, average-pooled (zero padding counted), averaged over each KV head's query
    heads; the window scored above everything."""
    prefill = _prefill(b=1, n=30)
    w, k, n, d = 6, 3, 30, 16
    press = build_press({"name": "snapkv", "ratio": 0.5, "window_size": w, "kernel_size": k}, INFO)
    expected = torch.zeros(1, 2, n - w)
    for head in range(2):
        for q_head in (2 * head, 2 * head + 1):
            votes = torch.zeros(n - w)
            for i in range(n - w, n):  # each window query attends to tokens 0..i
                logits = prefill.query[0, q_head, i] @ prefill.keys[0, head, : i + 1].T / d**0.5
                votes += logits.softmax(-1)[: n - w] / w
            padded = torch.cat([torch.zeros(1), votes, torch.zeros(1)])
            expected[0, head] += torch.stack([padded[j: j + k].sum() / k for j in range(n - w)]) / 2
    scores = press.scores(prefill)
    torch.testing.assert_close(scores[..., : n - w], expected, rtol=1e-5, atol=1e-6)
    assert (scores[..., n - w:] > scores[..., : n - w].max()).all()
    with pytest.raises(ConfigError, match=f"a prompt of {w} tokens is shorter than the {w + 1} it needs .its observation"):
        press.keep(_prefill(n=w))


def test_expected_attention_scores_equal_averaged_rotation_matrices():
    """The Gaussian of the prefill's pre-RoPE queries (sinks left out), moved by the mean of the RoPE matrices of
    the next positions, its expected logits softmaxed and weighted by the value norms; the sinks scored first."""
    n, d, future, sinks = 24, 8, 5, 2
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)

    def cos_sin(positions):
        angles = positions.float()[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], -1)
        return angles.cos()[None], angles.sin()[None]

    raw = _prefill(b=1, h=1, r=2, n=n, d=d, seed=3)
    rope = cos_sin(torch.arange(n))
    rotary = type("Rotary", (), {"inv_freq": inv_freq, "scaling": 1.0})()
    prefill = Prefill(apply_rope(raw.query, *rope), raw.keys, raw.values, rope, rotary)
    press = build_press({"name": "expected_attention", "ratio": 0.5, "n_future_positions": future, "sinks": sinks},
                        ModelInfo("tiny", 1, 1, d))
    # R_p as a matrix (R_p x = RoPE of the column vector x at position p), averaged over the future positions
    rotation = torch.stack([apply_rope(torch.eye(d)[None, None], *cos_sin(torch.full((d,), p)))[0, 0].T
                            for p in range(n, n + future)]).mean(0)
    expected = []
    for q_head in range(2):
        q = raw.query[0, q_head, sinks:]
        mu, centred = q.mean(0), q - q.mean(0)
        cov = rotation @ (centred.T @ centred / centred.shape[0]) @ rotation.T
        keys = raw.keys[0, 0, sinks:]
        logits = keys @ (rotation @ mu) / d**0.5 + ((keys @ cov) * keys).sum(-1) / (2 * d)
        expected.append(logits.softmax(-1))
    expected = torch.stack(expected).mean(0) * raw.values[0, 0, sinks:].norm(dim=-1)
    scores = press.scores(prefill)
    torch.testing.assert_close(scores[0, 0, sinks:], expected, rtol=1e-4, atol=1e-6)
    assert (scores[0, 0, :sinks] > expected.max()).all()


def test_tova_keeps_what_the_last_token_attends_to_in_every_head():
    prefill = _prefill(b=1, n=20)
    scores = build_press({"name": "tova", "ratio": 0.5}, INFO).scores(prefill)
    keys = prefill.keys.repeat_interleave(2, dim=1)
    weights = (prefill.query[0, :, -1:] @ keys[0].transpose(-1, -2) / 4).softmax(-1)[:, 0, :-1].mean(0)
    torch.testing.assert_close(scores[0, 0, :-1], weights)
    assert scores.shape == (1, 1, 20) and scores[0, 0, -1] > weights.max()


@pytest.mark.parametrize("config, match", [
    ({"name": "h2o"}, "unknown press"), ({"name": "knorm", "ratio": 1.0}, r"\[0, 1\)"),
    ({"name": "knorm", "window": 3}, "field 'window'"), ({"name": "knorm", "ratio": "x"}, "ratio"), ({"name": "none", "ratio": 0.5}, "evicts nothing"),
    ({"name": "snapkv", "kernel_size": 4}, "odd"),
])
def test_bad_press_configs_are_refused_with_the_choices(config, match):
    with pytest.raises(ConfigError, match=match):
        build_press(config, INFO)


def test_presses_refuse_caches_they_cannot_evict_from(tiny_llama):
    info = info_of(tiny_llama)
    knorm = build_press({"name": "knorm", "ratio": 0.5}, info)
    with pytest.raises(ConfigError, match="exact_prefill"):
        CompressedCache(build_codec(KIVI, info), "streaming", press=knorm)
    with pytest.raises(ConfigError, match="before RoPE"):
        CompressedCache(build_codec({"name": "temporalkv"}, info), "exact_prefill", press=knorm)
    with pytest.raises(ConfigError, match="stream-scope"):
        CompressedCache(build_codec({"name": "aquakv"}, info), "exact_prefill", press=knorm)


def _ids(batch=2, n=40, pad=5):
    ids = torch.randint(1, 96, (batch, n), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :pad] = 0
    return ids, mask


@torch.no_grad()
def _generate(model, codec, press, ids, mask, steps=6):
    cache = CompressedCache(codec, "exact_prefill", press=press)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=steps, min_new_tokens=steps,
                         do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return torch.stack(out.logits), out.sequences, cache


@pytest.mark.parametrize("name", ["knorm", "snapkv", "expected_attention"])
def test_ratio_zero_is_no_press_bitwise(tiny_llama, name):
    info = info_of(tiny_llama)
    ids, mask = _ids()
    plain, _, plain_cache = _generate(tiny_llama, build_codec(KIVI, info), None, ids, mask)
    press = build_press({"name": name, "ratio": 0.0, **({"window_size": 8} if name == "snapkv" else {})}, info)
    pressed, _, cache = _generate(tiny_llama, build_codec(KIVI, info), press, ids, mask)
    assert torch.equal(plain, pressed) and cache.nbytes == plain_cache.nbytes


@pytest.fixture(scope="module")
def one_layer_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers import build_tiny

    return build_tiny(LlamaConfig, LlamaForCausalLM, num_hidden_layers=1)


@pytest.mark.parametrize("name", ["streaming_llm", "tova"])
@torch.no_grad()
def test_decode_steps_equal_attention_with_the_evicted_tokens_masked(one_layer_llama, name):
    """A press that keeps the same tokens in every head, on the uncompressed codec, in a one-layer model (so that one
    attention mask says what the layer evicted): each step's logits equal those of an uncompressed cache whose evicted
    prompt tokens are masked out after the exact prefill, the new tokens at their original positions."""
    model, info = one_layer_llama, info_of(one_layer_llama)
    ids, mask = _ids(batch=1)
    pressed, sequences, cache = _generate(model, build_codec({"name": "fp16"}, info),
                                          build_press({"name": name, "ratio": 0.5}, info), ids, mask, steps=4)
    layer = cache.layers[0]
    assert layer.parts[0].evicted == 20 and layer.key_stream.length == 20 + 3 and cache.get_seq_length() == 43
    reference = DynamicCache(config=model.config)
    logits = [model(ids, past_key_values=reference, use_cache=True).logits[:, -1]]
    held = torch.cat([t for t in layer.key_stream.pieces() if t.shape[2]], dim=2)[0, 0, :20]  # the kept prompt keys
    prompt_keys = reference.layers[0].keys[0, 0]
    kept = (held[:, None] == prompt_keys[None]).all(-1).any(0)  # which prompt tokens the layer holds
    assert kept.sum() == 20
    visible = torch.cat([kept.long(), torch.ones(4, dtype=torch.long)])[None]
    for i, token in enumerate(sequences[0, 40:43]):
        out = model(token.view(1, 1), past_key_values=reference, use_cache=True, attention_mask=visible[:, : 41 + i],
                    position_ids=torch.tensor([[40 + i]]))
        logits.append(out.logits[:, -1])
    torch.testing.assert_close(pressed[:, 0], torch.cat(logits), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("codec", [{"name": "fp16"}, KIVI], ids=["fp16", "kivi-2"])
@torch.no_grad()
def test_held_bytes_fall_with_the_ratio_and_are_what_the_cache_holds(tiny_llama, codec):
    """knorm at ratios 0, 0.25, 0.5, 0.75 on a left-padded batch: each row group evicts from its own tokens, every
    tensor the cache holds is counted, and the uncompressed cache's bytes fall with the ratio (KIVI's need not at this
    size: what is kept may fit its full-precision residual)."""
    info = info_of(tiny_llama)
    ids, mask = _ids()
    exclude = model_storages(tiny_llama)
    sizes = []
    for ratio in (0.0, 0.25, 0.5, 0.75):
        press = build_press({"name": "knorm", "ratio": ratio}, info) if ratio else None
        _, _, cache = _generate(tiny_llama, build_codec(codec, info), press, ids, mask)
        held = held_nbytes(cache, exclude, skip=(Codec,))
        assert held == pytest.approx(cache.nbytes + cache.bookkeeping_nbytes + cache.working_nbytes, rel=0.01)
        assert [p.evicted for p in cache.layers[0].parts] == [40 - int(40 * (1 - ratio)), 35 - int(35 * (1 - ratio))]
        sizes.append(cache.nbytes)
    if codec["name"] == "fp16":
        assert sizes == sorted(sizes, reverse=True) and sizes[-1] < 0.4 * sizes[0]


@torch.no_grad()
def test_streaming_llm_composes_with_a_pre_rope_codec(tiny_llama):
    """StreamingLLM + TemporalKV-2 (keys coded before RoPE): the kept tokens' own positions are recorded, so decoded
    keys are re-rotated to where they were; the generation runs with left padding."""
    codec = fitted(tiny_llama, "temporalkv", sinks=4)
    ids, mask = _ids()
    press = build_press({"name": "streaming_llm", "ratio": 0.5}, info_of(tiny_llama))
    _, _, cache = _generate(tiny_llama, codec, press, ids, mask, steps=3)
    positions = [p.positions.ids.view for p in cache.layers[0].parts]
    assert positions[0][0].tolist() == [0, 1, 2, 3, *range(24, 40), 40, 41]
    assert positions[1][0].tolist() == [0, 1, 2, 3, *range(22, 35), 35, 36]  # 17 of 35 real tokens kept


def test_every_press_option_composes_and_the_runner_checks_it():
    """``press=<name>`` composes against its dataclass; a press runs perplexity under the context protocol, RULER
    under exact_prefill only, and is refused before any work by benchmarks that do not evaluate presses."""
    from kvcomp.presses import PRESSES, press_config
    from kvcomp.runner import check_config
    from tests.helpers import CONF, compose_config

    assert sorted(p.stem for p in (CONF / "press").glob("*.yaml")) == sorted([*PRESSES, "none"])
    for name in PRESSES:
        assert type(press_config(compose_config(f"press={name}").press)) is PRESSES[name].config_class
    assert check_config(compose_config()).press is None
    plan = check_config(compose_config("press=snapkv", "press.ratio=0.5"))
    assert plan.press.ratio == 0.5 and plan.benchmark.protocols == ["context"]
    assert check_config(compose_config("benchmark=ruler", "press=knorm", "press.ratio=0.25")).press.name == "knorm"
    with pytest.raises(ConfigError, match="exact_prefill"):
        check_config(compose_config("benchmark=ruler", "benchmark.protocol=streaming", "press=knorm"))
    assert check_config(compose_config("benchmark=longbench", "press=knorm")).press.name == "knorm"
    with pytest.raises(ConfigError, match="exact_prefill"):
        check_config(compose_config("benchmark=aime", "benchmark.protocol=streaming", "press=knorm"))
    with pytest.raises(ConfigError, match="press.ratio|ratio"):
        check_config(compose_config("press=knorm", "press.ratio=1.5"))


@torch.no_grad()
def test_context_perplexity_scores_the_tokens_after_the_pressed_context(tiny_llama):
    """The context protocol: the first forward is the context (what the press evicts from), only later tokens are
    scored; at ratio 0 it equals no press; the row carries the bits per value of every token seen."""
    from kvcomp.benchmarks.configs import PerplexityConfig
    from kvcomp.benchmarks.perplexity import evaluate_perplexity

    info = info_of(tiny_llama)
    windows = torch.randint(1, 96, (2, 64), generator=torch.Generator().manual_seed(6))
    config = PerplexityConfig(seq_len=64, protocols=["context"], chunk_tokens=8, context_tokens=40)
    plain = evaluate_perplexity(tiny_llama, build_codec({"name": "fp16"}, info), windows, config)
    zero = evaluate_perplexity(tiny_llama, build_codec({"name": "fp16"}, info), windows, config,
                               build_press({"name": "knorm", "ratio": 0.0}, info))
    half = evaluate_perplexity(tiny_llama, build_codec({"name": "fp16"}, info), windows, config,
                               build_press({"name": "knorm", "ratio": 0.5}, info))
    assert plain["tokens_scored"] == 2 * 24 and plain["ppl_context"] == zero["ppl_context"] != half["ppl_context"]
    assert "bits_per_value_seen" not in plain and zero["bits_per_value_seen"] == pytest.approx(32.0)
    assert half["bits_per_value_seen"] == pytest.approx(32.0 * (20 + 24) / 64)  # 20 of 40 context tokens kept
    full_safeguard = build_press({"name": "knorm", "ratio": 0.5, "head_budgets": "adakv", "alpha_safeguard": 1.0}, info)
    ada = evaluate_perplexity(tiny_llama, build_codec({"name": "fp16"}, info), windows, config, full_safeguard)
    assert ada["ppl_context"] == pytest.approx(half["ppl_context"], rel=1e-5)  # 8-token forwards over the ragged prefix
    assert ada["bits_per_value_seen"] == half["bits_per_value_seen"]
    with pytest.raises(ConfigError, match=r"protocols \[context\]"):
        evaluate_perplexity(tiny_llama, build_codec({"name": "fp16"}, info), windows,
                            PerplexityConfig(seq_len=64, protocols=["chunked"]), build_press({"name": "knorm"}, info))


@torch.no_grad()
def test_generation_presses_the_context_and_keeps_the_question(tiny_llama):
    """With a press, the prompt's context is prefilled alone and pressed; the question follows uncompressed."""
    from kvcomp.benchmarks.generation import GenerationProtocol, generate_greedy

    info = info_of(tiny_llama)
    ids = torch.randint(1, 96, (1, 48), generator=torch.Generator().manual_seed(8))
    caches = []
    protocol = GenerationProtocol(press=build_press({"name": "knorm", "ratio": 0.5}, info))
    original = protocol.new_cache
    object.__setattr__(protocol, "new_cache", lambda codec, capacity=None: caches.append(original(codec, capacity)) or caches[-1])
    metrics = []
    new = generate_greedy(tiny_llama, build_codec({"name": "fp16"}, info), ids, max_new_tokens=3, eos_token_ids=[0],
                          protocol=protocol, context_length=40, metrics=metrics)
    layer = caches[0].layers[0]
    assert new.shape == (1, 3) and layer.parts[0].evicted == 20  # half of the 40 context tokens, none of the 8 others
    assert layer.key_stream.length == 20 + 8 + 2 and caches[0].get_seq_length() == 48 + 2
    assert metrics[0]["bits_per_value_measured"] == 32.0
    assert metrics[0]["bits_per_value_seen"] == pytest.approx(32.0 * (20 + 8 + 2) / (48 + 2))  # evicted ones counted
    assert metrics[0]["output_tokens"] == (3 if 0 not in new[0].tolist() else new[0].tolist().index(0))


PRESS_CONFIGS = {"knorm": {}, "streaming_llm": {}, "snapkv": {"window_size": 8}, "tova": {}, "expected_attention": {}}


@pytest.mark.parametrize("codec", [KIVI, {"name": "turboquant", "key_bits": 4, "value_bits": 2}], ids=["kivi-2", "turboquant"])
@pytest.mark.parametrize("name", list(PRESS_CONFIGS))
@torch.no_grad()
def test_every_press_composes_with_codecs_under_padding_beams_and_capacity(tiny_llama, name, codec):
    """Each press with two codecs: a left-padded batch decoded by beam search through a preallocated cache; the
    evicted counts are each row group's, and every tensor the cache holds is counted."""
    info = info_of(tiny_llama)
    ids, mask = _ids()
    press = build_press({"name": name, "ratio": 0.5, **PRESS_CONFIGS[name]}, info)
    cache = CompressedCache(build_codec(codec, info), "exact_prefill", press=press, capacity=40 + 6)
    out = tiny_llama.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6, min_new_tokens=6,
                              num_beams=2, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 46)
    assert sorted(p.evicted for p in cache.layers[0].parts) == [18, 20]
    held = held_nbytes(cache, model_storages(tiny_llama), skip=(Codec,))
    assert held == pytest.approx(cache.nbytes + cache.bookkeeping_nbytes + cache.working_nbytes, rel=0.01)


def test_output_length_counts_the_tokens_before_the_first_eos():
    from kvcomp.benchmarks.generation import generation_metrics

    cache = CompressedCache(build_codec({"name": "fp16"}, INFO))
    new = torch.tensor([[5, 0, 7, 0], [3, 4, 6, 2], [9, 9, 1, 0]])
    assert generation_metrics(new, [0, 1], cache)["output_tokens"] == pytest.approx((1 + 4 + 2) / 3)


def test_presses_refuse_centred_codecs_before_calibration_and_compressed_sliding_layers():
    """A centred codec rotates its key offset to each token's position: a per-head press is refused already before
    the offset is fitted; a codec that encodes sliding-window layers is refused any press."""
    from kvcomp.cache import check_press

    info = ModelInfo("tiny", 2, 2, 16)
    knorm = build_press({"name": "knorm", "ratio": 0.5}, info)
    with pytest.raises(ConfigError, match="rotates a key offset"):
        check_press(knorm, build_codec({"name": "turboquant", "center": "calibration"}, info), "exact_prefill")
    hybrid = ModelInfo("hybrid", 2, 2, 16, layer_types=("sliding_attention", "full_attention"), sliding_window=8)
    with pytest.raises(ConfigError, match="sliding-window"):
        check_press(build_press({"name": "streaming_llm", "ratio": 0.5}, hybrid),
                    build_codec({**KIVI, "compress_sliding": True}, hybrid), "exact_prefill")
    check_press(knorm, build_codec(KIVI, hybrid), "exact_prefill")  # the window layers stay uncompressed


@torch.no_grad()
def test_pressing_while_decoding_equals_masking_what_it_evicted(one_layer_llama):
    """kvpress's DecodingPress with StreamingLLM (the same tokens in every head, so one mask says what was evicted):
    once a layer holds decoding_size + decoding_interval tokens, it keeps decoding_size before the current token is
    stored. On the uncompressed codec in a one-layer model, every step's logits equal an uncompressed cache that
    masks what the press evicted (read back from the keys the layer holds), new tokens at their own positions; the
    cache never holds more than size + interval tokens."""
    name = "streaming_llm"
    model, info = one_layer_llama, info_of(one_layer_llama)
    ids, _ = _ids(batch=1, n=30)
    press = build_press({"name": name, "decoding_size": 16, "decoding_interval": 6}, info)
    cache = CompressedCache(build_codec({"name": "fp16"}, info), "exact_prefill", press=press)
    reference = DynamicCache(config=model.config)
    out, expected = (model(ids, past_key_values=c, use_cache=True) for c in (cache, reference))
    torch.testing.assert_close(out.logits, expected.logits)
    layer, pressed = cache.layers[0], 0
    for position in range(30, 42):
        token = out.logits[:, -1:].argmax(-1)
        out = model(token, past_key_values=cache, use_cache=True, position_ids=torch.tensor([[position]]))
        held = layer.key_stream.materialize()[0, 0, :-1]  # before this token: what the press left
        earlier = reference.layers[0].keys[0, 0]  # every earlier token's key
        matches = (held[:, None] == earlier[None]).all(-1)
        assert (matches.sum(-1) == 1).all() and layer.key_stream.length <= 16 + 6
        visible = torch.cat([matches.any(0), torch.ones(1, dtype=torch.bool)]).long()[None]
        expected = model(token, past_key_values=reference, use_cache=True, attention_mask=visible,
                         position_ids=torch.tensor([[position]]))
        torch.testing.assert_close(out.logits, expected.logits, rtol=1e-5, atol=1e-5)
        pressed += int(visible.sum() < position + 1)
    assert pressed == 12 and layer.parts[0].evicted > 0 and cache.get_seq_length() == 42


@torch.no_grad()
def test_tova_evicts_at_each_step_the_token_the_last_query_attended_least(one_layer_llama):
    """TOVA's own cache (decoding_interval 1): once full, each step first evicts the held token (not the newest) with
    the least attention from the previous step's query, averaged over query heads; that query is the model's own
    (recomputed here from the layer's weights), and the logits equal an uncompressed cache masking what was evicted."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model, info = one_layer_llama, info_of(one_layer_llama)
    attention = model.model.layers[0].self_attn
    ids, _ = _ids(batch=1, n=20)
    press = build_press({"name": "tova", "decoding_size": 12, "decoding_interval": 1}, info)
    cache = CompressedCache(build_codec({"name": "fp16"}, info), "exact_prefill", press=press)
    reference = DynamicCache(config=model.config)
    out, _ = (model(ids, past_key_values=c, use_cache=True) for c in (cache, reference))
    layer, hq, d = cache.layers[0], info.num_kv_heads * 2, info.head_dim
    token, previous = out.logits[:, -1:].argmax(-1), ids[:, -1:]  # the next token; the one the last forward brought
    for position in range(20, 30):
        held = layer.key_stream.materialize()[0]  # [H, n, D]
        query = layer.parts[0].last_query[0, :, 0]  # [Hq, D]: the previous forward's last query
        hidden = model.model.embed_tokens(previous)
        cos, sin = model.model.rotary_emb(hidden, torch.tensor([[position - 1]]))
        q = attention.q_proj(model.model.layers[0].input_layernorm(hidden)).view(1, 1, hq, d).transpose(1, 2)
        torch.testing.assert_close(query, apply_rotary_pos_emb(q, q, cos, sin)[0][0, :, 0])
        weights = (query.view(held.shape[0], -1, d) @ held.transpose(-1, -2) / d**0.5).softmax(-1).mean((0, 1))
        expected = held[:, weights[:-1].argmin()] if held.shape[1] == 13 else None  # full: 12 kept + the newest
        previous, buffer = token, layer.key_stream.tail_buffer.buffer.data_ptr()
        out = model(token, past_key_values=cache, use_cache=True, position_ids=torch.tensor([[position]]))
        assert layer.key_stream.tail_buffer.buffer.data_ptr() == buffer  # kept in place, nothing allocated
        now = layer.key_stream.materialize()[0, :, :-1]
        assert now.shape[1] == min(12, held.shape[1])
        if expected is not None:
            assert not (now == expected[:, None]).all(-1).any(-1).any()
        earlier = reference.layers[0].keys[0, 0]
        matches = (now[0][:, None] == earlier[None]).all(-1)
        visible = torch.cat([matches.any(0), torch.ones(1, dtype=torch.bool)]).long()[None]
        reference_out = model(token, past_key_values=reference, use_cache=True, attention_mask=visible,
                              position_ids=torch.tensor([[position]]))
        torch.testing.assert_close(out.logits, reference_out.logits, rtol=1e-5, atol=1e-5)
        token = out.logits[:, -1:].argmax(-1)
    assert layer.parts[0].evicted == 20 + 10 - 12 - 1


@pytest.mark.parametrize("name, codec", [("knorm", "int_token_head"), ("tova", "nvfp4")])
@torch.no_grad()
def test_pressing_a_per_token_codec_while_decoding_drops_payload_rows_without_quantizing_again(one_layer_llama, name,
                                                                                                codec):
    """A per-token codec's held tokens are dropped in place: after each press every held token decodes to exactly the
    key it decoded to before (nothing encoded twice, the torch path's decoded copy gathered, not decoded again), the
    payload stays in its buffers, the layer never holds more than size + interval tokens, and knorm keeps each head's
    lowest-norm decoded keys (the decoded copy kept: ``decoded_copy=True``)."""
    model, info = one_layer_llama, info_of(one_layer_llama)
    ids, _ = _ids(batch=1, n=24)
    press = build_press({"name": name, "decoding_size": 16, "decoding_interval": 3}, info)
    cache = CompressedCache(build_codec({"name": codec}, info), "exact_prefill", press=press, decoded_copy=True)
    out = model(ids, past_key_values=cache, use_cache=True)
    encoded, encode = [], cache.codec.encode
    cache.codec.encode = lambda request: (encoded.append(request.tokens.shape[2]), encode(request))[1]
    decoded, decode = [], cache.codec.decode
    cache.codec.decode = lambda payload, request: (decoded.append(payload.num_tokens), decode(payload, request))[1]
    layer, pressed = cache.layers[0], 0
    for position in range(24, 34):
        if position > 25:  # after the prompt's first read, each read decodes only the newest token
            assert set(decoded) == {1}, decoded
        decoded.clear()
        before = [layer.key_stream.materialize()[0], layer.value_stream.materialize()[0]]
        buffers = {name: g.buffer.data_ptr() for name, g in layer.key_stream.store.tensors.items()}
        out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True,
                    position_ids=torch.tensor([[position]]))
        # the kept rows moved to the front of the same buffers (this one-step forward fits their spare capacity)
        assert {name: g.buffer.data_ptr() for name, g in layer.key_stream.store.tensors.items()} == buffers
        assert drops_in_place(layer.key_stream) and layer.key_stream.length <= 16 + 3
        for held, earlier in zip((layer.key_stream.materialize()[0, :, :-1], layer.value_stream.materialize()[0, :, :-1]),
                                 before):
            matches = (held[:, :, None] == earlier[:, None]).all(-1)  # [H, now, before]
            assert (matches.sum(-1) >= 1).all()  # every held token decodes as it did
        if held.shape[1] < before[0].shape[1]:
            pressed += 1
            if name == "knorm":
                norms = before[0].float().norm(dim=-1)
                expected = norms.topk(16, largest=False).indices.sort(-1).values
                kept = layer.key_stream.materialize()[0, :, :-1]
                torch.testing.assert_close(kept, before[0].gather(1, expected[..., None].expand(-1, -1, kept.shape[-1])))
    assert pressed >= 2 and layer.parts[0].evicted > 0 and set(encoded) == {1}  # only each step's own token


@torch.no_grad()
def test_a_pressed_cache_is_not_stored(tiny_llama):
    from kvcomp.cache.offload import store

    info = info_of(tiny_llama)
    cache = CompressedCache(build_codec({"name": "fp16"}, info), "exact_prefill",
                            press=build_press({"name": "knorm", "ratio": 0.5}, info))
    tiny_llama(_ids(batch=1, n=12)[0], past_key_values=cache, use_cache=True)
    with pytest.raises(NotImplementedError, match="with a press"):
        store(cache)


@torch.no_grad()
def test_the_last_query_follows_its_row_when_beams_are_reordered(tiny_llama):
    """TOVA's last query is per row: a beam reorder (or batch select) moves it with the row's cache."""
    info = info_of(tiny_llama)
    cache = CompressedCache(build_codec({"name": "fp16"}, info), "exact_prefill",
                            press=build_press({"name": "tova", "decoding_size": 16}, info))
    ids, _ = _ids(batch=2, n=12)
    tiny_llama(ids, past_key_values=cache, use_cache=True)
    layer = cache.layers[1]
    before = layer.parts[0].last_query.clone()
    assert before.shape[0] == 2 and not torch.equal(before[0], before[1])
    cache.reorder_cache(torch.tensor([1, 1]))
    assert torch.equal(layer.parts[0].last_query, before[[1, 1]])


@torch.no_grad()
def test_tokens_decoded_around_a_press_are_still_checked_for_finiteness(one_layer_llama):
    """A press rewrites the torch path's decoded copy in place; the finiteness check then reads it whole again, so a
    token the codec decodes to NaN during the press's scoring or the forward after it is still refused (TOVA's own
    setting, one token evicted per step)."""
    from kvcomp.errors import NonFiniteKVError

    model, info = one_layer_llama, info_of(one_layer_llama)
    codec = build_codec({"name": "int_token_head"}, info)
    press = build_press({"name": "knorm", "decoding_size": 16, "decoding_interval": 1}, info)
    cache = CompressedCache(codec, "exact_prefill", press=press, check_finite=True, decoded_copy=True)
    decode, poisoned = codec.decode, []

    def nan_once(payload, request):  # the first single token decoded after the press began: NaN
        x = decode(payload, request)
        if payload.num_tokens == 1 and cache.layers[0].parts[0].evicted and not poisoned:
            poisoned.append(True)
            x = x.clone()
            x[..., 0] = float("nan")
        return x

    codec.decode = nan_once
    out = model(_ids(batch=1, n=24)[0], past_key_values=cache, use_cache=True)
    with pytest.raises(NonFiniteKVError, match="decoded NaN or Inf"):
        for position in range(24, 34):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True,
                        position_ids=torch.tensor([[position]]))
    assert poisoned


def test_presses_that_read_a_window_of_queries_cannot_press_while_decoding(tiny_llama):
    """SnapKV's observation window and Expected Attention's query statistics need many queries, which a decode step
    does not have (TOVA's one last query can); a quantized codec would quantize its kept tokens again at every
    rebuild."""
    for name in ("snapkv", "expected_attention"):
        with pytest.raises(ConfigError, match="cannot press while decoding.*knorm, streaming_llm, tova"):
            build_press({"name": name, "decoding_size": 64}, INFO)
    info = info_of(tiny_llama)
    with pytest.raises(ConfigError, match="compress_generated=False keeps generated tokens in full precision"):
        CompressedCache(build_codec({"name": "int_token_head"}, info), "exact_prefill", compress_generated=False,
                        press=build_press({"name": "knorm", "decoding_size": 8}, info))
    info = info_of(tiny_llama)
    with pytest.raises(ConfigError, match="quantize"):
        CompressedCache(build_codec(KIVI, info), "exact_prefill", press=build_press({"name": "knorm", "decoding_size": 8}, info))
    with pytest.raises(ConfigError, match="decoding_interval"):
        build_press({"name": "knorm", "decoding_size": 64, "decoding_interval": 0}, INFO)


@pytest.mark.parametrize("name, codec", [("knorm", "fp16"), ("streaming_llm", "fp16"), ("tova", "fp16"),
                                         ("knorm", "int_token_head"), ("tova", "fp8"), ("streaming_llm", "turboquant"),
                                         ("knorm", "nvfp4 skip_layers=[0]")])
@torch.no_grad()
def test_pressing_while_decoding_under_padding_beams_and_capacity(tiny_llama, name, codec):
    """A pressed prefill, then pressed while decoding, under left padding, beam search and a preallocated cache, on the
    uncompressed cache and on per-token codecs (their payload rows dropped in place; a skipped layer rebuilt in full
    precision): each row group holds at most size + interval tokens, every tensor held is counted, and the only
    multi-token encodes are the prefill's, one per layer, stream and row group (nothing quantized again)."""
    info = info_of(tiny_llama)
    ids, mask = _ids()
    press = build_press({"name": name, "ratio": 0.25, "decoding_size": 24, "decoding_interval": 4}, info)
    config = {"name": codec.split()[0], **({"skip_layers": [0]} if "skip_layers" in codec else {})}
    codec = build_codec(config, info)
    encoded, encode = [], codec.encode
    codec.encode = lambda request: (encoded.append(request.tokens.shape[2]), encode(request))[1]
    cache = CompressedCache(codec, "exact_prefill", press=press, capacity=40 + 10)
    out = tiny_llama.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=10, min_new_tokens=10,
                              num_beams=2, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 50)
    for part in cache.layers[0].parts:
        assert part.schedule.key_stream.length <= 24 + 4 and part.evicted > 0
    held = held_nbytes(cache, model_storages(tiny_llama), skip=(Codec,))
    assert held == pytest.approx(cache.nbytes + cache.bookkeeping_nbytes + cache.working_nbytes, rel=0.01)
    coded_layers = sum(codec.policy("key", layer).block_size is not None for layer in range(info.num_layers))
    assert sum(n > 1 for n in encoded) == coded_layers * 2 * len(cache.layers[0].parts)


def test_adakv_shares_the_layer_budget_out_among_heads_with_a_safeguard():
    """AdaKV (``head_budgets=adakv``): each row keeps ``H k`` tokens of the layer, the best scores among all heads,
    and each head at least ``int(alpha k)`` of its own best; with ``alpha = 1`` every head keeps its own ``k`` best,
    as the uniform press."""
    prefill = _prefill(b=2, h=2, n=40)
    prefill.keys[:, 0] *= 0.1  # head 0's keys have small norms: knorm scores them all above head 1's
    uniform = build_press({"name": "knorm", "ratio": 0.5}, INFO)
    flat, counts = build_press({"name": "knorm", "ratio": 0.5, "head_budgets": "adakv"}, INFO).keep_per_layer(prefill)
    assert flat.shape == (2, 40) and counts.sum(1).tolist() == [40, 40]
    assert counts[:, 1].tolist() == [int(20 * 0.2)] * 2 and counts[:, 0].tolist() == [40 - 4] * 2  # head 1 at its floor
    assert torch.equal(counts, torch.stack([(flat < 40).sum(1), (flat >= 40).sum(1)], dim=1))
    assert (flat.diff(dim=1) > 0).all()  # head by head, each in cache order
    flat, counts = build_press({"name": "knorm", "ratio": 0.5, "head_budgets": "adakv", "alpha_safeguard": 1.0},
                               INFO).keep_per_layer(prefill)
    kept = uniform.keep(prefill)
    assert counts.tolist() == [[20, 20]] * 2 and torch.equal(flat.view(2, 2, 20) % 40, kept)
    assert build_press({"name": "knorm", "ratio": 0.0, "head_budgets": "adakv"}, INFO).keep_per_layer(prefill) is None


@pytest.mark.parametrize("config, match", [
    ({"name": "knorm", "head_budgets": "ada"}, "uniform, adakv"),
    ({"name": "knorm", "head_budgets": "adakv", "alpha_safeguard": 1.5}, r"\[0, 1\]"),
    ({"name": "streaming_llm", "head_budgets": "adakv"}, "same tokens in every KV head"),
    ({"name": "knorm", "head_budgets": "adakv", "decoding_size": 16}, "prompt only"),
])
def test_bad_head_budgets_are_refused(config, match):
    with pytest.raises(ConfigError, match=match):
        build_press(config, INFO)


def test_head_budgets_hold_uncompressed_tokens_only(tiny_llama):
    info = info_of(tiny_llama)
    press = build_press({"name": "knorm", "ratio": 0.5, "head_budgets": "adakv"}, info)
    with pytest.raises(ConfigError, match="codec=fp16"):
        CompressedCache(build_codec(KIVI, info), "exact_prefill", press=press)


@torch.no_grad()
def test_adakv_with_a_full_safeguard_equals_the_uniform_press(tiny_model):
    """With ``alpha_safeguard = 1`` AdaKV keeps what the uniform press keeps: the same logits through the ragged prefix
    (left-padded rows, their own groups) as through the streams, and the same bytes, in each family."""
    info, (ids, mask) = info_of(tiny_model), _ids()
    uniform, _, plain = _generate(tiny_model, build_codec({"name": "fp16"}, info),
                                  build_press({"name": "snapkv", "ratio": 0.5, "window_size": 8}, info), ids, mask)
    ada, _, cache = _generate(tiny_model, build_codec({"name": "fp16"}, info),
                              build_press({"name": "snapkv", "ratio": 0.5, "window_size": 8, "head_budgets": "adakv",
                                           "alpha_safeguard": 1.0}, info), ids, mask)
    assert all(part.prefix is not None for part in cache.layers[0].parts)
    torch.testing.assert_close(ada, uniform, rtol=1e-5, atol=1e-5)
    assert cache.nbytes == plain.nbytes and cache.bits_per_value_seen() == plain.bits_per_value_seen()


@pytest.mark.parametrize("name", ["knorm", "snapkv", "expected_attention"])
@torch.no_grad()
def test_adakv_holds_ragged_heads_under_padding_beams_and_capacity(tiny_llama, name):
    """AdaKV over each press that scores per head: a left-padded batch decoded by beam search through a preallocated
    cache; heads hold different counts, each row the uniform press's total, and every tensor the cache holds is
    counted (the counts as bookkeeping)."""
    info = info_of(tiny_llama)
    ids, mask = _ids()
    press = build_press({"name": name, "ratio": 0.5, "head_budgets": "adakv", **PRESS_CONFIGS[name]}, info)
    cache = CompressedCache(build_codec({"name": "fp16"}, info), "exact_prefill", press=press, capacity=40 + 6)
    out = tiny_llama.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6, min_new_tokens=6,
                              num_beams=2, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 46)
    parts = cache.layers[0].parts
    assert sorted(p.evicted for p in parts) == [18, 20] and sorted(p.held_tokens for p in parts) == [17 + 5, 20 + 5]
    assert all(p.prefix.counts.sum(1).eq(2 * p.prefix.tokens_per_head).all() for p in parts)
    held = held_nbytes(cache, model_storages(tiny_llama), skip=(Codec,))
    assert held == cache.nbytes + cache.bookkeeping_nbytes + cache.working_nbytes


@torch.no_grad()
def test_adakv_decode_steps_equal_attention_with_each_heads_evicted_tokens_masked(one_layer_llama):
    """A one-layer model: each step's attention over the ragged prefix equals the uncompressed layer's attention with
    every head's evicted prompt tokens masked out of that head (kvpress's simulation of AdaKV), and the bytes held
    are the kept tokens'."""
    model, info = one_layer_llama, info_of(one_layer_llama)
    ids, _ = _ids(batch=1)
    press = build_press({"name": "knorm", "ratio": 0.5, "head_budgets": "adakv", "alpha_safeguard": 0.0}, info)
    pressed, sequences, cache = _generate(model, build_codec({"name": "fp16"}, info), press, ids, None, steps=4)
    prefix = cache.layers[0].parts[0].prefix
    assert prefix.counts.sum() == 40 and prefix.counts.min() < 20  # ragged: one head keeps more
    attn = model.model.layers[0].self_attn
    reference = DynamicCache(config=model.config)
    logits = [model(ids, past_key_values=reference, use_cache=True).logits[:, -1]]
    keys = reference.layers[0].keys[0]  # [H, 40, D]
    kept = torch.zeros(2, 40, dtype=torch.bool)
    for h in range(2):
        held = prefix.keys[0, int(prefix.counts[0, :h].sum()):int(prefix.counts[0, :h + 1].sum())]
        kept[h] = (held[:, None] == keys[h][None]).all(-1).any(0)
    assert kept.sum(1).tolist() == prefix.counts[0].tolist()
    masked = []

    def hook(module, args, kwargs):  # every head's evicted prompt columns masked, later columns visible
        n = kwargs.get("cache", kwargs.get("past_key_values")).get_seq_length() + 1
        visible = torch.cat([kept, torch.ones(2, n - 40, dtype=torch.bool)], dim=1).repeat_interleave(2, dim=0)
        kwargs["attention_mask"] = visible[None, :, None]
        masked.append(n)
        return args, kwargs

    handle = attn.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for i, token in enumerate(sequences[0, 40:43]):
            logits.append(model(token.view(1, 1), past_key_values=reference, use_cache=True,
                                position_ids=torch.tensor([[40 + i]])).logits[:, -1])
    finally:
        handle.remove()
    assert masked == [41, 42, 43]
    torch.testing.assert_close(pressed[:, 0], torch.cat(logits), rtol=1e-5, atol=1e-5)
    assert layer_bytes(cache.layers[0]).full_precision == 2 * 4 * (40 + 3 * 2) * 16


@torch.no_grad()
def test_a_prompt_pressed_per_head_alone_keeps_its_rows(tiny_llama):
    """Right after an AdaKV prompt the streams hold nothing: rows, statistics and batch maps go by the prefix."""
    info = info_of(tiny_llama)
    ids, _ = _ids()
    press = build_press({"name": "knorm", "ratio": 0.5, "head_budgets": "adakv"}, info)
    cache = CompressedCache(build_codec({"name": "fp16"}, info), "exact_prefill", press=press)
    tiny_llama(ids, past_key_values=cache, use_cache=True)
    held = cache.nbytes
    assert cache.layers[0].batch == 2 and cache.statistics().batch == 2 and cache.statistics().cached_tokens == 2 * 2 * 20
    cache.batch_repeat_interleave(2)
    assert cache.layers[0].batch == 4 and cache.nbytes == 2 * held
