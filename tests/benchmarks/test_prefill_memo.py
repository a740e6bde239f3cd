"""The prefill memo (:mod:`kvcomp.benchmarks.prefill`): a prompt's exact prefill recorded once and replayed into each
codec's cache gives the same new tokens, cache bytes and metrics as running the prefill, codec by codec and family by
family; it runs one prefill forward per prompt, keeps within its budget, and stands aside where a replay would not
be the same (batches, presses, other protocols, logits processors)."""

import pytest
import torch

from kvcomp.benchmarks.generation import GenerationProtocol, generate_greedy
from kvcomp.benchmarks.prefill import PrefillMemo
from kvcomp.codecs import build_codec
from kvcomp.presses import build_press
from tests.codec_matrix import fitted
from tests.helpers import info_of

pytestmark = pytest.mark.usefixtures("session_cache")

CODECS = {
    "fp16": {"name": "fp16"},
    "kivi": {"name": "kivi", "group_size": 8, "residual_length": 16},
    "uniform-pre-rope": {"name": "uniform", "bits": 3, "group_size": 8, "pre_rope": True, "sinks": 2},
    "qjl": {"name": "qjl", "sketch_dim": 32, "outlier_sketch_dim": 16, "initial_layers": 1, "initial_sketch_dim": 48,
            "initial_outlier_sketch_dim": 8, "outlier_channels": 2, "group_size": 4, "key_buffer": 8,
            "value_group_size": 8, "value_window": 5},
    "turboquant": {"name": "turboquant", "key_bits": 3, "value_bits": 2},
    "nvfp4": {"name": "nvfp4"},
}


def _ids(n=40, seed=3):
    return torch.randint(1, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def _run(model, codec, ids, memo=None, steps=6, eos=(0,)):
    metrics = []
    new = generate_greedy(model, codec, ids, max_new_tokens=steps, eos_token_ids=list(eos), metrics=metrics, memo=memo)
    return new, metrics[0]


def _prefill_forwards(model):
    """A list that gets one entry per forward of more than one token (a prefill), and the hook's handle."""
    seen = []
    hook = lambda m, args: seen.append(1) if args[0].shape[1] > 1 else None  # noqa: E731
    return seen, model.get_input_embeddings().register_forward_pre_hook(hook)


@pytest.mark.parametrize("name", list(CODECS))
def test_a_replayed_prefill_gives_what_running_it_gives(tiny_model, name):
    ids = _ids()
    plain = _run(tiny_model, build_codec(CODECS[name], info_of(tiny_model)), ids)
    memo = PrefillMemo(budget=10**9, by_object=True)
    recorded = _run(tiny_model, build_codec(CODECS[name], info_of(tiny_model)), ids, memo)
    replayed = _run(tiny_model, build_codec(CODECS[name], info_of(tiny_model)), ids, memo)
    assert len(memo.entries) == 1
    for new, metrics in (recorded, replayed):
        assert torch.equal(new, plain[0]) and metrics == plain[1]


def test_a_calibrated_pre_rope_codec_and_every_prompt_forward_once(tiny_llama):
    """TemporalKV (calibrated codebooks, keys before RoPE) replayed after fp16 recorded the prompt: one prefill
    forward for both."""
    ids = _ids(seed=5)
    codec = fitted(tiny_llama, "temporalkv")
    plain = _run(tiny_llama, codec, ids)
    memo = PrefillMemo(budget=10**9, by_object=True)
    _run(tiny_llama, build_codec({"name": "fp16"}, info_of(tiny_llama)), ids, memo)
    forwards, hook = _prefill_forwards(tiny_llama)
    try:
        replayed = _run(tiny_llama, codec, ids, memo)
    finally:
        hook.remove()
    assert forwards == [] and torch.equal(replayed[0], plain[0]) and replayed[1] == plain[1]


def test_the_first_token_ends_generation_when_it_is_eos(tiny_llama):
    ids = _ids()
    first = _run(tiny_llama, build_codec({"name": "fp16"}, info_of(tiny_llama)), ids, steps=1)[0]
    eos = (int(first),)
    plain = _run(tiny_llama, build_codec({"name": "fp16"}, info_of(tiny_llama)), ids, eos=eos)
    memo = PrefillMemo(budget=10**9, by_object=True)
    for _ in range(2):
        new, metrics = _run(tiny_llama, build_codec({"name": "fp16"}, info_of(tiny_llama)), ids, memo, eos=eos)
        assert torch.equal(new, plain[0]) and new.shape == (1, 1) and metrics == plain[1]


def test_the_memo_keeps_within_its_budget_and_stands_aside_where_a_replay_differs(tiny_llama):
    info = info_of(tiny_llama)
    memo = PrefillMemo(budget=0, by_object=True)  # no room: every prompt runs its prefill, nothing recorded
    forwards, hook = _prefill_forwards(tiny_llama)
    try:
        _run(tiny_llama, build_codec({"name": "fp16"}, info), _ids(), memo)
    finally:
        hook.remove()
    assert memo.entries == {} and forwards == [1]
    memo = PrefillMemo(budget=10**9, by_object=True)
    codec = build_codec({"name": "fp16"}, info)
    batch = torch.cat([_ids(), _ids(seed=4)])
    generate_greedy(tiny_llama, codec, batch, max_new_tokens=2, eos_token_ids=[0], memo=memo)  # two prompts at once
    pressed = GenerationProtocol(press=build_press({"name": "knorm", "ratio": 0.5}, info))
    generate_greedy(tiny_llama, codec, _ids(), max_new_tokens=2, eos_token_ids=[0], memo=memo, protocol=pressed)
    generate_greedy(tiny_llama, codec, _ids(), max_new_tokens=2, eos_token_ids=[0], memo=memo,
                    protocol=GenerationProtocol(protocol="streaming"))
    fingerprinted_only = PrefillMemo(budget=10**9)  # the runner's: this model has no fingerprint
    generate_greedy(tiny_llama, codec, _ids(), max_new_tokens=2, eos_token_ids=[0], memo=fingerprinted_only)
    assert memo.entries == {} and fingerprinted_only.entries == {}
    tiny_llama.generation_config.repetition_penalty = 1.2  # a logits processor: the first token is not the argmax
    try:
        generate_greedy(tiny_llama, codec, _ids(), max_new_tokens=2, eos_token_ids=[0], memo=memo)
    finally:
        tiny_llama.generation_config.repetition_penalty = 1.0
    assert memo.entries == {}


def test_a_prefill_recorded_with_one_model_object_replays_into_the_next_one_of_the_same_fingerprint():
    """A sweep loads its model again for each member: the prefill recorded with the first object (freed since) replays
    into the second one's cache, a pre-RoPE codec reading the second model's RoPE frequencies."""
    import gc
    import weakref

    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcomp.codecs import ModelInfo
    from tests.helpers import build_tiny

    def loaded():
        model = build_tiny(LlamaConfig, LlamaForCausalLM)  # seeded: the same weights each time
        return model, ModelInfo.from_hf_config(model.config, name="tiny", fingerprint="same-weights")

    spec, ids, memo = CODECS["uniform-pre-rope"], _ids(seed=6), PrefillMemo(budget=10**9)
    first, info = loaded()
    _run(first, build_codec(spec, info), ids, memo)
    gone = weakref.ref(first)
    del first
    gc.collect()
    second, info = loaded()
    replayed = _run(second, build_codec(spec, info), ids, memo)
    plain = _run(second, build_codec(spec, info), ids)
    assert gone() is None and len(memo.entries) == 1
    assert torch.equal(replayed[0], plain[0]) and replayed[1] == plain[1]
