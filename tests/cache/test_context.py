"""The forward context: built once per forward, passed explicitly, and gone with the forward.

Nothing is left on the model, on the masks of a forward or on the cache between forwards (the state a hook
would hand to another); :func:`kvcomp.cache.install` is scoped as well as global."""

import gc

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvcomp.cache import CompressedCache, install
from kvcomp.cache.attention import _INSTALLED
from kvcomp.cache.layer import CompressedLayer
from kvcomp.cache.reads import Reads
from kvcomp.cache.context import LayerContext, ForwardContext
from kvcomp.cache.stream import FreshlyEncoded
from kvcomp.codecs import build_codec
from tests.helpers import TINY, info_of

PRE_ROPE = {"name": "uniform", "bits": 4, "group_size": 8, "sinks": 2, "window": 4, "pre_rope": True}


def _forward_objects() -> list:
    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, (ForwardContext, LayerContext, Reads, FreshlyEncoded))]


def _kvcomp_attributes(obj) -> list[str]:
    return [name for name in vars(obj) if "kvcomp" in name.lower()]


@torch.no_grad()
def test_generate_leaves_nothing_on_the_model_its_masks_or_the_cache(tiny_llama):
    """A left-padded generate with a pre-RoPE codec under the streaming protocol (blocks encoded within the
    prefill, positions recorded, left padding counted): afterwards no module or mask carries kvcomp attributes,
    and no context, read or fresh encoding of any forward is alive (nothing was stashed for a later hook)."""
    masks = []
    handles = [m.register_forward_pre_hook(lambda mod, args, kwargs: masks.append(kwargs.get("attention_mask")),
                                           with_kwargs=True) for m in tiny_llama.modules() if type(m).__name__ == "LlamaAttention"]
    ids = torch.randint(3, 90, (2, 30))
    padding = torch.ones_like(ids)
    padding[1, :5] = 0
    cache = CompressedCache(build_codec(PRE_ROPE, info_of(tiny_llama)), "streaming")
    try:
        tiny_llama.generate(input_ids=ids, attention_mask=padding, past_key_values=cache, max_new_tokens=12, min_new_tokens=12,
                            do_sample=False, pad_token_id=0)
    finally:
        for handle in handles:
            handle.remove()
    assert [(g.rows, g.pads) for g in cache.groups] == [([0], 0), ([1], 5)]
    assert all(part.schedule.key_stream.num_encoded > 0 for part in cache.layers[0].parts)
    assert len(masks) == 2 * 12 and all(isinstance(m, torch.Tensor) for m in masks)
    assert [m for m in tiny_llama.modules() if _kvcomp_attributes(m)] == []
    assert [vars(m) for m in [padding, *masks] if vars(m)] == []
    assert _forward_objects() == []


@torch.no_grad()
def test_one_context_per_forward_shared_by_every_layer(tiny_llama, monkeypatch):
    seen = []
    update = CompressedLayer.update_in_context
    monkeypatch.setattr(CompressedLayer, "update_in_context",
                        lambda self, k, v, context, query=None: (seen.append((self.layer_idx, context)), update(self, k, v, context, query))[1])
    cache = CompressedCache(build_codec(PRE_ROPE, info_of(tiny_llama)))
    for ids in (torch.randint(3, 90, (1, 20)), torch.randint(3, 90, (1, 1))):
        tiny_llama(ids, past_key_values=cache)
    assert [i for i, _ in seen] == [0, 1, 0, 1]
    first, second = seen[0][1], seen[2][1]
    assert seen[1][1].forward is first.forward and seen[3][1].forward is second.forward and first.forward is not second.forward
    assert first.layer is cache.layers[0] and seen[1][1].layer is cache.layers[1]
    assert first.rope is not None and first.rotary is not None and first.positions.shape[-1] == 20


def _hooks(model) -> int:
    return sum(len(m._forward_pre_hooks) for m in model.modules())


def test_install_is_scoped_and_restores_what_was_there():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    before = model.config._attn_implementation
    with install(model, "triton") as outer:
        assert model.config._attn_implementation == "kvcomp" and _hooks(model) == 1 + TINY["num_hidden_layers"]
        with install(model) as inner:  # replaces the hooks, e.g. with another backend
            assert _INSTALLED[model] is inner and inner.kernel_backend == "torch" and _hooks(model) == 1 + TINY["num_hidden_layers"]
            with pytest.raises(RuntimeError, match="latest"):
                outer.remove()
        assert _INSTALLED[model] is outer and _hooks(model) == 1 + TINY["num_hidden_layers"]
    assert model.config._attn_implementation == before and _hooks(model) == 0 and model not in _INSTALLED
    ids = torch.randint(3, 90, (1, 12))
    cache = CompressedCache(build_codec(PRE_ROPE, info_of(model)))
    with pytest.raises(Exception, match="install"):  # pre-RoPE keys need the context's position embeddings
        model(ids, past_key_values=cache)


def test_an_installed_model_is_freed_with_its_last_reference():
    """The registry of installations keeps no model alive: a sweep loads one model per member, in one process."""
    import gc
    import weakref

    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcomp.cache import install
    from tests.helpers import TINY

    model = LlamaForCausalLM(LlamaConfig(**TINY))
    install(model)
    install(model, "torch")  # a second installation over the first
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None
