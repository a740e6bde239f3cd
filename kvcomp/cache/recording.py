"""A one-forward cache that records what each layer's attention received through kvcomp's attention, and attends
to it unchanged: calibration collects keys and values with it (:mod:`kvcomp.calibration.collect`), the prefill memo
records prompts (:mod:`kvcomp.benchmarks.prefill`)."""

from __future__ import annotations

from transformers.cache_utils import Cache

from kvcomp.cache.context import LayerContext, ContextLayer
from kvcomp.errors import ConfigError


class RecordingLayer(ContextLayer):
    """Keeps one forward's ``(keys, values, rope, positions)`` as its :class:`~kvcomp.cache.context.LayerContext` gave them
    (``recorded``; not the context itself, which names this layer and reads the model's RoPE frequencies), and returns
    the keys and values for SDPA; ``retain_grad``: their gradients are kept too (Fisher weights)."""

    is_sliding = False
    is_compileable = False

    def __init__(self, retain_grad: bool = False):
        super().__init__()
        self.retain_grad, self.recorded = retain_grad, None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise ConfigError("recording K/V needs the model's position embeddings: call kvcomp.cache.install(model) first")

    def update_in_context(self, key_states, value_states, context: LayerContext, query=None):
        if self.retain_grad and key_states.requires_grad:
            key_states.retain_grad()
            value_states.retain_grad()
        self.recorded = (key_states, value_states, context.rope, context.positions)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return 0 if self.recorded is None else self.recorded[0].shape[2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1


class RecordingCache(Cache):
    """A :class:`RecordingLayer` per layer."""

    def __init__(self, num_layers: int, retain_grad: bool = False):
        super().__init__(layers=[RecordingLayer(retain_grad) for _ in range(num_layers)])
