"""Multi-turn conversations through a stored cache (kvtc's store/restore mode, spec §5.1 item 6): the bytes
a conversation's cache costs between turns, how fast the next turn starts, and what compression does to it.

A conversation is a prompt of ``prompt_tokens`` tokens, then ``turns`` turns of ``turn_tokens`` tokens each
(offline text, teacher forced). After every turn the whole compressed cache (``flush``: its full-precision
window compressed too) is stored (:func:`kvcomp.cache.offload.store`: a safetensors file, or CPU memory)
and the next turn starts from it. Each turn after the prompt is started three ways, each timed to its first
next-token logits (the time to first token, TTFT; median of ``repeats``):

- ``restore``: load the stored bytes (from the file, when stored on disk), rebuild the cache and forward the
  turn's tokens; the blocks are decoded when attention first reads them;
- ``recompute``: prefill the whole history and the turn with no cache kept;
- ``uncompressed``: forward the turn's tokens on a ``DynamicCache`` kept between turns.

Accuracy: perplexity of each turn's tokens (from the turn's forward) on the restored and the uncompressed
path, and the top-1 agreement of their next-token predictions.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from kvcomp.cache import CompressedCache, with_cache
from kvcomp.cache.offload import StoredCache, restore, store
from kvcomp.codecs import Codec
from kvcomp.errors import ConfigError


@dataclass
class MultiTurnConfig:
    prompt_tokens: int = 1024
    turn_tokens: int = 64
    turns: int = 3
    repeats: int = 3
    on_disk: bool = True  # store to a safetensors file (else CPU memory)
    flush: bool = True  # compress the window too before storing (the whole cache stored compressed)

    def __post_init__(self):
        counts = {"prompt_tokens": 1, "turn_tokens": 2, "turns": 1, "repeats": 1}  # a turn's NLL needs 2 tokens
        bad = {name: getattr(self, name) for name, least in counts.items() if getattr(self, name) < least}
        if bad:
            raise ConfigError(f"multi-turn benchmark: {bad} below the least values {counts}")


def _timed(fn, repeats: int):
    """``(median seconds, last result)`` of ``repeats`` calls of ``fn``."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _turn_metrics(logits: torch.Tensor, turn: torch.Tensor) -> tuple[float, int]:
    """Summed NLL of ``turn[:, 1:]`` from ``logits`` of the turn's forward, and the number of tokens."""
    nll = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), turn[:, 1:].flatten(), reduction="sum")
    return nll.item(), turn[:, 1:].numel()


@torch.no_grad()
def run_conversation(model, codec: Codec, ids: torch.Tensor, config: MultiTurnConfig, directory: Path) -> list[dict]:
    """One conversation ``ids [1, prompt + turns * turn_tokens]``: a row per turn after the prompt."""
    device = next(model.parameters()).device
    ids = ids.to(device)
    prompt = ids[:, : config.prompt_tokens]
    compressed = CompressedCache(codec, "exact_prefill")
    model(prompt, **with_cache(model, compressed), use_cache=True)
    kept = DynamicCache()
    model(prompt, **with_cache(model, kept), use_cache=True)
    rows = []
    for n in range(config.turns):
        start = config.prompt_tokens + n * config.turn_tokens
        turn = ids[:, start:start + config.turn_tokens]
        stored = store(compressed, flush=config.flush)
        store_start = time.perf_counter()
        path = stored.save(directory / "conversation.safetensors") if config.on_disk else None
        save_seconds = time.perf_counter() - store_start

        def restored_turn():
            loaded = StoredCache.load(path) if path is not None else stored
            cache = restore(loaded, codec, device)
            return cache, model(turn, **with_cache(model, cache), use_cache=True).logits

        def recomputed_turn():
            return model(ids[:, :start + config.turn_tokens], **with_cache(model, DynamicCache()), use_cache=True).logits

        def uncompressed_turn():
            cache = copy.deepcopy(kept)
            return cache, model(turn, **with_cache(model, cache), use_cache=True).logits

        ttft_restore, (compressed, logits_restored) = _timed(restored_turn, config.repeats)
        ttft_recompute, logits_recomputed = _timed(recomputed_turn, config.repeats)
        ttft_uncompressed, (kept_next, logits_kept) = _timed(uncompressed_turn, config.repeats)
        kept_bytes = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in kept.layers)
        nll_restored, count = _turn_metrics(logits_restored, turn)
        nll_kept, _ = _turn_metrics(logits_kept, turn)
        rows.append({
            "turn": n + 1, "context_tokens": start, "stored_bytes": stored.nbytes,
            "file_bytes": path.stat().st_size if path is not None else None, "save_seconds": save_seconds,
            "uncompressed_bytes": kept_bytes,
            "uncompressed_bytes_16bit": kept_bytes * 16 // torch.finfo(model.dtype).bits,
            "ttft_restore": ttft_restore, "ttft_recompute": ttft_recompute, "ttft_uncompressed": ttft_uncompressed,
            "nll_restored": nll_restored, "nll_uncompressed": nll_kept, "tokens": count,
            "agreement": (logits_restored.argmax(-1) == logits_kept.argmax(-1)).float().mean().item(),
            "recompute_check": (logits_recomputed[:, -turn.shape[1]:].argmax(-1) == logits_kept.argmax(-1)).float().mean().item(),
        })
        kept = kept_next
    return rows


def evaluate_multiturn(model, codec: Codec, conversations: torch.Tensor, config: MultiTurnConfig) -> list[dict]:
    """Rows per turn over ``conversations [C, prompt + turns * turn_tokens]``: medians of the timings and
    bytes, pooled perplexities and agreement."""
    per_turn: dict[int, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="kvcomp-multiturn-") as tmp:
        for ids in conversations:
            for row in run_conversation(model, codec, ids[None], config, Path(tmp)):
                per_turn.setdefault(row["turn"], []).append(row)
    rows = []
    for turn, group in sorted(per_turn.items()):
        median = {k: statistics.median(r[k] for r in group) for k in group[0]
                  if k not in ("turn", "nll_restored", "nll_uncompressed", "tokens") and group[0][k] is not None}
        tokens = sum(r["tokens"] for r in group)
        rows.append({**median, "turn": turn, "conversations": len(group),
                     "ppl_restored": float(torch.tensor(sum(r["nll_restored"] for r in group) / tokens).exp()),
                     "ppl_uncompressed": float(torch.tensor(sum(r["nll_uncompressed"] for r in group) / tokens).exp())})
    return rows
