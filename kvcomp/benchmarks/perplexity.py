"""Perplexity through the compressed cache, under four evaluation protocols.

``streaming``: each window is one forward through an empty :class:`CompressedCache`; the kvcomp
attention function shows every query the cache as it was when its token arrived (blocks encoded only
once complete, see :mod:`kvcomp.cache.attention`), which equals feeding the window token by token.
``simulated``: the seeds' protocol; every query attends to the cache state after the whole window
(blocks quantized with statistics that include later tokens).
``chunked``: AQUA-KV's protocol (arXiv 2501.19392, ``evaluate_perplexity.py``): the window is fed in
forwards of ``chunk_tokens`` tokens through an ``exact_prefill`` cache, so each forward attends to its
own tokens in full precision and to everything cached before it as stored (a deployed chunked prefill).
``context``: the window's first ``context_tokens`` tokens (0: half the window) are one exact forward (a prefill: what a
press evicts from, :mod:`kvcomp.presses`), the rest follow in forwards of ``chunk_tokens`` as under ``chunked``; the
perplexity is of the tokens after the context only, each predicted from the context as stored. A run with a press
measures this protocol (:func:`kvcomp.runner.check_benchmark_press`), its reference row too.

A model-scope codec (kvtc) encodes a block once every layer has appended it, after the forward that
completed it, so a single forward never reads its own blocks: for such codecs ``streaming`` and
``simulated`` would measure the uncompressed model, and :func:`protocols_for` replaces them by ``chunked``.

``ppl = exp(sum of next-token NLL / number of predicted tokens)`` over all windows (``context``: over the tokens
after each window's context). Each row also keeps every window's summed NLL (``nll_<protocol>``) and the 95 %
bootstrap interval over windows (``ppl_<protocol>_ci95``; paired with the reference: :mod:`kvcomp.benchmarks.intervals`).
A compressed row evaluated beside the reference's kept states also gets the KL divergence, top-1 agreement and
log-probability change against it on the same tokens (:mod:`kvcomp.benchmarks.distribution`), with intervals.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import asdict

import torch

from kvcomp.benchmarks.base import Benchmark, example_summary, register
from kvcomp.benchmarks.configs import PerplexityConfig
from kvcomp.artifacts import ArtifactError
from kvcomp.benchmarks.distribution import WindowScores, score_window
from kvcomp.benchmarks.intervals import ppl_interval, quantile_interval, ratio_interval
from kvcomp.cache import CompressedCache, with_cache
from kvcomp.codecs import Codec, expected_cache_bits
from kvcomp.errors import ConfigError, unknown_choice
from kvcomp.presses import Press
from kvcomp.progress import progress_bar

PERPLEXITY_PROTOCOLS = ("streaming", "simulated", "chunked", "context")
WINDOW_SELECTIONS = ("spread", "first")
LOW_ENCODED_SHARE = 0.5  # rows whose cache holds less than this share encoded get a note and a warning

log = logging.getLogger(__name__)


@register
class PerplexityBenchmark(Benchmark):
    """Perplexity on ``num_windows`` windows of a corpus split (one row)."""

    names = ("perplexity",)
    config_class = PerplexityConfig

    def check(self, model_cfg) -> None:
        from kvcomp.data import check_corpus_available

        _check_settings(self.config, model_cfg)
        check_corpus_available(self.config.dataset, split=self.config.split)

    def prepare(self, model, tokenizer, model_cfg) -> None:
        self.windows = evaluation_windows(self.config, tokenizer, model_cfg)

    def fingerprint(self) -> dict:
        return {
            "windows": hashlib.sha256(self.windows.numpy().tobytes()).hexdigest(),
            "benchmark": asdict(self.config) | {"include_reference": None},
        }

    def evaluate(self, model, codec, press=None, reference=None) -> list[dict]:
        return [{"benchmark": self._label(), **evaluate_perplexity(model, codec, self.windows, self.config, press, reference)}]

    def evaluate_reference(self, model, codec) -> tuple[list[dict], dict]:
        metrics, states = reference_perplexity(model, codec, self.windows, self.config)
        return [{"benchmark": self._label(), **metrics}], states

    def _label(self) -> str:
        c, w = self.config, self.windows
        return f"{c.name}:{c.dataset}/{c.split} {len(w)}x{w.shape[1]}"


def evaluation_windows(config: PerplexityConfig, tokenizer, model_cfg) -> torch.Tensor:
    """``num_windows`` non-overlapping windows of the evaluation split: the first ones, or (``spread``)
    evenly spaced over the whole split so that a few windows represent all of its documents."""
    from kvcomp.data import load_corpus, token_windows

    _check_settings(config, model_cfg)
    texts = load_corpus(config.dataset, config.split)
    tag = f"{config.dataset}-{config.split}"
    if config.window_selection == "first":
        return token_windows(texts, tokenizer, config.seq_len, config.num_windows, cache_tag=tag)
    windows = token_windows(texts, tokenizer, config.seq_len, None, cache_tag=tag)
    if config.num_windows <= 0 or config.num_windows >= len(windows):
        log.info("perplexity: all %d windows of %d tokens of %s (num_windows=%d), %d protocol(s) each",
                 len(windows), config.seq_len, tag, config.num_windows, len(config.protocols))
        return windows
    return windows[torch.linspace(0, len(windows) - 1, config.num_windows).round().long()]


def _check_settings(config: PerplexityConfig, model_cfg) -> None:
    if config.seq_len > model_cfg.max_context:
        raise ConfigError(f"benchmark.seq_len={config.seq_len} exceeds {model_cfg.name}'s max_context={model_cfg.max_context}")
    if config.window_selection not in WINDOW_SELECTIONS:
        raise unknown_choice("window_selection", config.window_selection, WINDOW_SELECTIONS)


def protocols_for(protocols: list[str], encodes_after_forward: bool) -> list[str]:
    """The protocols that measure a codec (``encodes_after_forward``: a model-scope one; see the module docstring)."""
    if not encodes_after_forward or all(p == "chunked" for p in protocols):
        return list(protocols)
    log.info("perplexity: a model-scope codec never reads its blocks within one forward; protocols %s -> [chunked]",
             list(protocols))
    return ["chunked"]


def codec_never_encodes(codec: Codec) -> bool:
    """True when no stream ever encodes a block (all protocols then give identical numbers)."""
    return all(
        codec.policy(kind, layer).block_size is None
        for kind in ("key", "value")
        for layer in range(codec.model.num_layers)
    )


def evaluate_perplexity(model, codec: Codec, windows: torch.Tensor, config: PerplexityConfig,
                        press: Press | None = None, reference: dict[str, torch.Tensor] | None = None) -> dict:
    """Perplexity of ``model`` with ``codec`` (and ``press``: protocol ``context`` only) on token ``windows
    [n, seq_len]``, per protocol; given the ``reference``'s kept states (:func:`reference_perplexity`), also the
    distribution metrics against it (:mod:`~kvcomp.benchmarks.distribution`).

    Also returns the cache bytes measured after one full window (batch 1), the bits per value they
    imply, and the bits the codec's formula predicts for the same window.
    """
    return _evaluate(model, codec, windows, config, press, reference, keep_states=False)[0]


def reference_perplexity(model, codec: Codec, windows: torch.Tensor, config: PerplexityConfig) -> tuple[dict, dict]:
    """The reference row's metrics (as :func:`evaluate_perplexity`) and the states later rows are compared with:
    ``states_<protocol> [n, seq_len, hidden]``, each window's final hidden states under that protocol."""
    return _evaluate(model, codec, windows, config, None, None, keep_states=True)


@torch.no_grad()
def _evaluate(model, codec: Codec, windows: torch.Tensor, config: PerplexityConfig, press: Press | None,
              reference: dict[str, torch.Tensor] | None, keep_states: bool) -> tuple[dict, dict]:
    unknown = [p for p in config.protocols if p not in PERPLEXITY_PROTOCOLS]
    if unknown or not config.protocols:
        raise ConfigError(
            f"perplexity protocols {list(config.protocols)}: choose from {', '.join(PERPLEXITY_PROTOCOLS)}"
        )
    if "context" in config.protocols and len(config.protocols) > 1:
        raise ConfigError(f"perplexity protocols {list(config.protocols)}: context scores other tokens (those after the "
                          "context) than the others; run it alone")
    if press is not None and list(config.protocols) != ["context"]:
        raise ConfigError(f"press {press.name} evicts from a prefill: perplexity protocols [context], not "
                          f"{list(config.protocols)}")
    device = next(model.parameters()).device
    context = context_length(config, windows.shape[1])
    metrics: dict = {}
    states: dict[str, torch.Tensor] = {}
    cache_stats: dict = {}
    examples: list[dict] = []
    shortcut = codec_never_encodes(codec) and press is None
    first_protocol = config.protocols[0]
    for i, protocol in enumerate(config.protocols):
        compared = _reference_states(reference, protocol, windows, model) if reference is not None else None
        if shortcut and i > 0:  # nothing is ever encoded: the protocols cannot differ
            metrics |= {name.format(protocol): value for name, value in per_protocol.items()}
            if keep_states:
                states[f"states_{protocol}"] = states[f"states_{first_protocol}"].clone()
            continue
        start = time.perf_counter()
        scores: list[WindowScores] = []
        kept: list[torch.Tensor] = []
        first = context if protocol == "context" else 1  # the first token scored
        bar = progress_bar(len(windows), f"perplexity {codec.name} ({protocol})", "window")
        for batch in windows.split(config.batch_size):
            rows = slice(len(scores), len(scores) + batch.shape[0])
            batch = batch.to(device)
            hidden, cache = _window_states(model, codec, batch, protocol, config.chunk_tokens, context, press)
            for b in range(batch.shape[0]):
                scores.append(score_window(model, hidden[b, first - 1:-1], batch[b, first:],
                                           None if compared is None else compared[rows][b, first - 1:-1]))
            if keep_states:
                kept.append(hidden.cpu())
            if not cache_stats:
                cache_stats = _cache_stats(cache, codec, batch.shape[0], windows.shape[1], model.dtype, press is None)
            if i == 0:
                examples.append(codec.example_metrics(cache.statistics()))
            bar.update(batch.shape[0])
        bar.close()
        per_protocol = _protocol_metrics(scores, windows.shape[1] - first)
        metrics |= {name.format(protocol): value for name, value in per_protocol.items()}
        metrics[f"eval_seconds_{protocol}"] = round(time.perf_counter() - start, 2)
        if keep_states:
            states[f"states_{protocol}"] = torch.cat(kept)
    metrics["tokens_scored"] = int(windows[:, (context if config.protocols == ["context"] else 1):].numel())
    metrics["tokens_per_window"] = [metrics["tokens_scored"] // len(windows)] * len(windows)
    share = cache_stats["encoded_share"]
    if share < LOW_ENCODED_SHARE and not codec_never_encodes(codec):
        metrics["note"] = (f"only {share:.0%} of the cached values were encoded (the rest stayed in full precision): "
                           f"the row says little about {codec.name}; raise benchmark.seq_len")
        log.warning("perplexity %s with %s: %s", codec.describe(), f"seq_len={windows.shape[1]}", metrics["note"])
    return {**metrics, **cache_stats, **example_summary(examples)}, states


def _protocol_metrics(scores: list[WindowScores], scored: int) -> dict:
    """One protocol's metrics (names with ``{}`` for the protocol) from its windows' scores, each with its 95 %
    bootstrap interval over windows (:mod:`~kvcomp.benchmarks.intervals`); with a reference, the distribution metrics."""
    nll, tokens = [s.nll for s in scores], [scored] * len(scores)
    total = scored * len(scores)
    metrics = {"ppl_{}": math.exp(sum(nll) / total), "ppl_{}_ci95": ppl_interval(nll, tokens), "nll_{}": nll}
    if scores[0].kld is None:
        return metrics
    kld, top1, dlogp = [s.kld for s in scores], [s.top1 for s in scores], [s.dlogp for s in scores]
    token_kld = [s.token_kld for s in scores]
    pooled = torch.cat(token_kld).double()
    for name, q in (("median", 0.5), ("p99", 0.99)):
        metrics[f"kld_{name}_{{}}"] = torch.quantile(pooled, q).item()
        metrics[f"kld_{name}_{{}}_ci95"] = quantile_interval(token_kld, q)
    for name, sums in (("kld_mean", kld), ("top1_agreement", top1), ("dlogp_mean", dlogp)):
        metrics[name + "_{}"] = sum(sums) / total
        metrics[name + "_{}_ci95"] = ratio_interval(sums, tokens)
    return metrics | {"kld_{}": kld, "top1_{}": top1}


def _reference_states(reference: dict[str, torch.Tensor], protocol: str, windows: torch.Tensor, model) -> torch.Tensor:
    """The reference's kept states of ``protocol``, checked against the windows and the model they must describe."""
    states = reference.get(f"states_{protocol}")
    hidden = model.get_output_embeddings().in_features
    if states is None or tuple(states.shape) != (*windows.shape, hidden):
        held = "none" if states is None else list(states.shape)
        raise ArtifactError(f"the reference's kept states of protocol {protocol} are {held}, not "
                            f"[{windows.shape[0]}, {windows.shape[1]}, {hidden}] (these windows and this model); run with force=true to "
                            "recompute the reference")
    return states


def context_length(config: PerplexityConfig, seq_len: int) -> int:
    """The ``context`` protocol's first forward: ``context_tokens``, or half the window."""
    return config.context_tokens or seq_len // 2


def _window_states(model, codec: Codec, batch: torch.Tensor, protocol: str, chunk_tokens: int, context: int = 0,
                   press: Press | None = None):
    """The decoder's final hidden states of ``batch [B, L]`` through a fresh cache (the output head's input, ``[B, L,
    hidden]``), and that cache: one forward, or (``chunked``) forwards of ``chunk_tokens`` tokens through an
    ``exact_prefill`` cache, or (``context``) the first ``context`` tokens (``press`` evicting from them) and then such
    forwards; states joined along tokens."""
    stepwise = protocol in ("chunked", "context")
    cache = CompressedCache(codec, "exact_prefill" if stepwise else protocol, press=press)
    if protocol == "context":
        parts = (batch[:, :context], *batch[:, context:].split(chunk_tokens, dim=1))
    else:
        parts = batch.split(chunk_tokens if stepwise else batch.shape[1], dim=1)
    decoder = model.get_decoder()
    hidden = [decoder(part, **with_cache(decoder, cache), use_cache=True).last_hidden_state for part in parts]
    return torch.cat(hidden, dim=1), cache


def _cache_stats(cache: CompressedCache, codec: Codec, batch: int, seq_len: int, dtype: torch.dtype,
                 every_token: bool = True) -> dict:
    """Measured storage of one window's cache, apart: encoded payload bits per encoded value, per-sequence
    state, everything per cached value, and the codec's model-level overhead amortised over one window.
    ``every_token`` False (a press evicted some): no formula's expectation, and ``bits_per_value_seen``, everything
    per value of every token of the window, evicted ones included (the byte axis eviction and quantization share;
    without a press it is ``bits_per_value_measured``)."""
    fp_bits = torch.finfo(dtype).bits
    try:
        expected = expected_cache_bits(codec, seq_len, batch, fp_bits) / 8 / batch if every_token else None
    except NotImplementedError:  # variable-rate codecs: only measured bytes
        expected = None
    values = 2 * codec.model.num_layers * codec.model.num_kv_heads * codec.model.head_dim * seq_len
    seen = {} if every_token else {"bits_per_value_seen": cache.bits_per_value_seen()}
    return {
        "cache_bytes_per_window": cache.nbytes // batch,
        "cache_bytes_expected": expected,
        **cache.bits_breakdown(),
        **seen,
        "overhead_bits_per_value_per_window": codec.overhead_bits() / values,
        "full_precision_bits": fp_bits,
    }
