"""Greedy generation through a fresh compressed cache: the protocol of every generation benchmark.

The prompt is prefilled into an empty :class:`~kvcomp.cache.CompressedCache` (how the prefill's own
attention sees the tokens it brings in is the cache ``protocol``: ``exact_prefill`` as a deployed
prefill, ``streaming`` token by token, ``simulated`` as the seeds), the cache policy encodes it
(sinks, blocks, window), then tokens are decoded greedily through the cache; each new token enters the
full-precision tail and is encoded when its block fills (``compress_generated=False``: never).

With a press (:mod:`kvcomp.presses`), the prompt's context is prefilled alone, and the press evicts from it; the
rest of the prompt (the question) follows in a second forward, uncompressed, as kvpress's pipeline keeps the
question out of the compression (its README: with the question inside, a press like SnapKV would be favoured).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcomp.benchmarks.prefill import PrefillMemo
from kvcomp.cache import PROTOCOLS, CompressedCache, with_cache
from kvcomp.codecs import Codec
from kvcomp.errors import ConfigError
from kvcomp.presses import Press


@dataclass(frozen=True)
class GenerationProtocol:
    """How generation benchmarks use the cache (see the module docstring)."""

    protocol: str = "exact_prefill"
    compress_generated: bool = True
    press: Press | None = None  # token eviction from each prompt's context (exact_prefill only)

    def __post_init__(self):
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"generation protocol {self.protocol!r}: choose from {', '.join(PROTOCOLS)}")

    def new_cache(self, codec: Codec, capacity: int | None = None) -> CompressedCache:
        """A fresh cache for one request (or one batch of requests); ``capacity``: tokens per sequence to
        preallocate (prompt + new tokens: decode steps then allocate no storage)."""
        return CompressedCache(codec, self.protocol, compress_generated=self.compress_generated, capacity=capacity,
                               press=self.press)


@torch.no_grad()
def generate_greedy(
    model,
    codec: Codec,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_ids: list[int],
    protocol: GenerationProtocol = GenerationProtocol(),
    attention_mask: torch.Tensor | None = None,
    metrics: list[dict] | None = None,
    context_length: int | None = None,
    memo: PrefillMemo | None = None,
) -> torch.Tensor:
    """Greedy continuation of ``input_ids [B, T]`` (left-padded when ``attention_mask`` is given) through
    a fresh compressed cache, preallocated for the prompt and ``max_new_tokens``; returns the new tokens ``[B, <= max_new_tokens]`` (padded with the first
    EOS id after a row stops). ``metrics``: gets the codec's :meth:`~kvcomp.codecs.base.Codec.example_metrics`
    of the filled cache and the :func:`generation_metrics` appended. ``context_length``: with the protocol's press, the prompt's first tokens (the
    context, what the press evicts from) are prefilled alone, before the rest. ``memo``: where it applies
    (:meth:`~kvcomp.benchmarks.prefill.PrefillMemo.applies`), the prompt's prefill is recorded into it or replayed
    from it and the first token taken from its logits, generation going on from there (the same tokens and cache)."""
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    cache = protocol.new_cache(codec, input_ids.shape[1] + max_new_tokens)
    attention_mask = attention_mask.to(device)
    last = _replayed_or_context(model, cache, input_ids, attention_mask, protocol, context_length, memo)
    first = None  # the first new token, where the prefill is replayed from the memo
    if last is not None:
        first = last[:, -1].float().argmax(-1, keepdim=True)
        input_ids, attention_mask = torch.cat([input_ids, first], 1), torch.cat([attention_mask, attention_mask[:, -1:]], 1)
    if first is not None and (max_new_tokens == 1 or first.item() in eos_token_ids):
        new = first
    else:
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            **with_cache(model, cache),
            max_new_tokens=max_new_tokens - (first is not None),
            do_sample=False,
            num_beams=1,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=eos_token_ids,
            pad_token_id=eos_token_ids[0],
        )
        new = out[:, input_ids.shape[1] - (first is not None):]
    if metrics is not None:
        metrics.append({**codec.example_metrics(cache.statistics()), **generation_metrics(new, eos_token_ids, cache)})
    return new


def _replayed_or_context(model, cache: CompressedCache, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         protocol: GenerationProtocol, context_length: int | None, memo: PrefillMemo | None):
    """The start of a prompt's prefill into the empty ``cache``: with the protocol's press, the context alone (the
    press evicts from it only); where ``memo`` applies, the whole prefill replayed, returning its last logits ``[B, 1,
    V]`` (else None: the rest of the prompt is still to run)."""
    if protocol.press is not None and context_length:
        model(input_ids[:, :context_length], attention_mask=attention_mask[:, :context_length],
              **with_cache(model, cache), use_cache=True, logits_to_keep=1)
    if memo is not None and memo.applies(model, cache, input_ids, attention_mask):
        return memo.prefill(model, cache, input_ids, attention_mask)
    return None


@torch.no_grad()
def answer_logprob(model, codec: Codec, input_ids: torch.Tensor, answer_ids: list[int], *,
                   protocol: GenerationProtocol = GenerationProtocol(), context_length: int | None = None,
                   memo: PrefillMemo | None = None) -> float:
    """The mean log-probability per token of the gold ``answer_ids`` teacher-forced after the prompt ``input_ids [1,
    T]`` prefilled as :func:`generate_greedy` does (its cache compressed by the same protocol): one forward of the
    answer after the prefill. Where greedy output is all or nothing, this moves with every change of the cache."""
    device = next(model.parameters()).device
    input_ids, answer = input_ids.to(device), torch.tensor([answer_ids], device=device)
    mask = torch.ones_like(input_ids)
    cache = protocol.new_cache(codec, input_ids.shape[1] + len(answer_ids))
    last = _replayed_or_context(model, cache, input_ids, mask, protocol, context_length, memo)
    if last is None:
        start = context_length if protocol.press is not None and context_length else 0
        last = model(input_ids[:, start:], **with_cache(model, cache), use_cache=True, logits_to_keep=1).logits
    logits = [last[:, -1:]]
    if len(answer_ids) > 1:
        logits.append(model(answer[:, :-1], **with_cache(model, cache), use_cache=True).logits)
    logp = torch.cat(logits, 1).float().log_softmax(-1).gather(-1, answer[..., None])
    return logp.mean().item()


def repetition_rate(tokens: list[int], n: int = 4) -> float:
    """The share of an output's ``n``-grams that repeat an earlier one of the same output (0 when it has none): near 0
    for an answer, near 1 for a loop."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return (len(grams) - len(set(grams))) / len(grams) if grams else 0.0


def generation_metrics(new: torch.Tensor, eos_token_ids: list[int], cache: CompressedCache) -> dict:
    """``output_tokens``: the mean tokens a row generated before its first EOS (a compressed cache can lengthen
    outputs); ``bits_per_value_measured``: what the cache held after the generation, per value held
    (:meth:`~kvcomp.cache.CompressedCache.bits_breakdown`); with a press, ``bits_per_value_seen``: per value of every
    token the cache was given, evicted ones included (:meth:`~kvcomp.cache.CompressedCache.bits_per_value_seen`)."""
    stops = torch.isin(new, torch.tensor(eos_token_ids, device=new.device))
    lengths = torch.where(stops.any(-1), stops.int().argmax(-1), new.shape[1])
    metrics = {"output_tokens": lengths.float().mean().item(),
               "bits_per_value_measured": cache.bits_breakdown()["bits_per_value_measured"]}
    if cache.press is not None:
        metrics["bits_per_value_seen"] = cache.bits_per_value_seen()
    return metrics


def eos_ids(tokenizer, model) -> list[int]:
    """Token ids that end a generation: the tokenizer's EOS plus the model's generation-config EOS ids."""
    ids = []
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        ids += source if isinstance(source, list) else [source] if source is not None else []
    if not ids:
        raise ConfigError("the tokenizer and model define no EOS token: generation could not stop")
    return list(dict.fromkeys(ids))
