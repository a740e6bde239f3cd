"""Exact prefills computed once and replayed into every codec's cache.

Under ``exact_prefill`` a prompt's forward attends to its own keys and values uncompressed, so what it computes (the
keys and values of every layer, the logits of its last token) does not depend on the codec; only what the cache
then does with those keys and values does. A benchmark that runs many codecs on the same prompts (RULER in a
sweep, whose members run one after another in one process) pays the prefill, about nine tenths of a RULER sample
on a CPU, once per prompt: :class:`PrefillMemo` records the first codec's prefill (the keys, values and step context
each layer received, the last logits) and replays it into the next codecs' caches, layer by layer, as the forward
would have (the same :meth:`~kvcomp.cache.context.ContextLayer.update_in_context` calls with the same tensors, strides
included), then generation continues from the recorded logits. The tokens, the cache's bytes and every metric are
those of running the prefill (``tests/benchmarks/test_prefill_memo.py`` compares them codec by codec).

A recording is kept while the memo's byte budget allows (a quarter of the available host memory, at most 3 GB: the
13 prompts of the leaderboard's RULER at 4K on SmolLM2 take 2.4 GB in float32; none on a GPU, where a prefill is
cheap and memory is the cache's), for one model identity (its fingerprint: the runner's models; a model without one
is recognised as the same object only). It applies to one prompt at a time (``batch_size: 1``), without a press,
under ``exact_prefill`` and plain greedy decoding (:meth:`PrefillMemo.applies`); RULER uses it.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass

import torch

from kvcomp.cache.attention import installation
from kvcomp.cache.memory import available_bytes
from kvcomp.cache.recording import RecordingCache
from kvcomp.cache.context import LayerContext, PaddedRows, ForwardContext, row_pads

MAX_BUDGET = 3 * 10**9
# generation settings that would change the first token's choice from the logits' argmax
PROCESSOR_FIELDS = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0,
                    "bad_words_ids": None, "min_length": 0, "min_new_tokens": None, "forced_bos_token_id": None,
                    "forced_eos_token_id": None, "suppress_tokens": None, "begin_suppress_tokens": None,
                    "sequence_bias": None, "exponential_decay_length_penalty": None, "renormalize_logits": False,
                    "remove_invalid_values": False, "guidance_scale": 1.0, "watermarking_config": None,
                    "prefill_chunk_size": None}


@dataclass
class RecordedPrefill:
    """One prompt's prefill: per cache layer ``(keys, values, rope, positions)`` as its attention received them, and
    the logits of the last token ``[B, 1, V]``; ``model``: the model it was recorded from, where the memo
    recognises models as objects (``by_object``)."""

    layers: list[tuple]
    logits: torch.Tensor
    model: weakref.ref | None = None

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v, *_ in self.layers) + self.logits.nbytes


def plain_greedy(model) -> bool:
    """Whether greedy generation takes the argmax of the raw logits (no logits processor in the model's generation
    config, no chunked prefill), as :func:`~kvcomp.benchmarks.generation.generate_greedy` does for the first token."""
    config = model.generation_config
    return all(getattr(config, name, default) in (default, None) for name, default in PROCESSOR_FIELDS.items())


class PrefillMemo:
    """Recorded prefills by model and prompt (see the module docstring); ``budget``: bytes it may hold (None: a
    quarter of the host memory available, at most :data:`MAX_BUDGET`, and nothing on a GPU); ``by_object``: also for
    models without a fingerprint, recognised as the same object (tests; their weights must not change in between).
    Entries are kept first come, first kept: none is evicted for a later prompt."""

    def __init__(self, budget: int | None = None, by_object: bool = False):
        self.budget, self.by_object = budget, by_object
        self.entries: dict[tuple, RecordedPrefill] = {}

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries.values())

    def _budget(self, device: torch.device) -> int:
        if self.budget is not None:
            return self.budget
        if device.type != "cpu":
            return 0
        return min(MAX_BUDGET, (available_bytes(device) or 0) // 4)

    def applies(self, model, cache, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> bool:
        """Whether the prefill of ``input_ids`` into ``cache`` is replayed from this memo: one prompt, ``exact_prefill``,
        no press, every layer compressed (no sliding-window layer), kvcomp's attention installed, plain greedy
        decoding, a model known by its fingerprint (or ``by_object``), and its recording held or fitting the budget
        (else the prefill simply runs: recording without keeping would only hold every layer's K/V at once)."""
        if not (input_ids.shape[0] == 1 and cache.protocol == "exact_prefill" and cache.press is None
                and not cache.window_layers and installation(model) is not None and plain_greedy(model)
                and (bool(cache.codec.model.fingerprint) or self.by_object)):
            return False
        if self._held(model, self._key(model, cache.codec, input_ids, attention_mask)) is not None:
            return True
        info, element = cache.codec.model, next(model.parameters()).element_size()
        estimate = 2 * info.total_layers * info.num_kv_heads * info.head_dim * input_ids.shape[1] * element
        return self.nbytes + estimate <= self._budget(input_ids.device)

    def _key(self, model, codec, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple:
        info = codec.model
        who = info.identity if info.fingerprint else f"object:{id(model)}"
        digest = hashlib.sha256(input_ids.cpu().numpy().tobytes() + attention_mask.cpu().numpy().tobytes()).hexdigest()
        return who, str(next(model.parameters()).dtype), str(input_ids.device), digest

    def _held(self, model, key: tuple) -> RecordedPrefill | None:
        """The recording under ``key`` (:meth:`_key`), if held (by object: from this very object, still alive)."""
        entry = self.entries.get(key)
        if entry is not None and entry.model is not None and entry.model() is not model:
            return None
        return entry

    def prefill(self, model, cache, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Fill the empty ``cache`` with the prefill of ``input_ids`` (recorded now and kept, or replayed); return the
        logits of the last token ``[B, 1, V]``."""
        key = self._key(model, cache.codec, input_ids, attention_mask)
        entry = self._held(model, key)
        if entry is None:
            entry = self._record(model, input_ids, attention_mask, by_object=not cache.codec.model.fingerprint)
            self.entries[key] = entry
        self._replay(entry, model, cache, attention_mask)
        return entry.logits

    @torch.no_grad()
    def _record(self, model, input_ids, attention_mask, by_object: bool) -> RecordedPrefill:
        from kvcomp.cache import with_cache

        recording = RecordingCache(model.config.get_text_config(decoder=True).num_hidden_layers)
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)  # as generate's
        out = model(input_ids, attention_mask=attention_mask, position_ids=positions, **with_cache(model, recording),
                    use_cache=True, logits_to_keep=1)
        return RecordedPrefill([layer.recorded for layer in recording.layers], out.logits,
                               weakref.ref(model) if by_object else None)

    @staticmethod
    def _replay(entry: RecordedPrefill, model, cache, attention_mask) -> None:
        """The recorded forward's calls of the cache, in its layers' order (kvcomp's step context rebuilt)."""
        if len(entry.layers) != len(cache.layers):
            raise RuntimeError(f"a prefill of {len(entry.layers)} layers replayed into a cache of {len(cache.layers)}")
        if isinstance(cache, PaddedRows) and cache.get_seq_length() == 0:
            cache.group_rows(row_pads(attention_mask))
        installed = installation(model)  # this model's RoPE frequencies (the recording's model may be gone)
        step = ForwardContext(installed.kernel_backend)
        for index, (layer, (keys, values, rope, positions)) in enumerate(zip(cache.layers, entry.layers)):
            rotary = installed.rotaries.get(index)
            layer.update_in_context(keys, values, LayerContext(step, layer, rope, positions,
                                                         None if rotary is None else rotary.frequencies))


PREFILLS = PrefillMemo()  # the process's memo: sweep members run one after another in one process
