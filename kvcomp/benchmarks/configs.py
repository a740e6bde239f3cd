"""The benchmark configs (Hydra group ``benchmark``), one dataclass per benchmark (presets of lm-eval share
:class:`LMEvalConfig`); each benchmark class names its own (``config_class``). Plain dataclasses:
:mod:`kvcomp.config` gathers them for Hydra."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvcomp.errors import ConfigError
from kvcomp.schema import at_least


@dataclass
class PerplexityConfig:
    """Perplexity on non-overlapping windows of an evaluation split."""

    name: str = "perplexity"
    dataset: str = "enwiki"
    split: str = "evaluation"
    seq_len: int = 512
    num_windows: int = 32  # <= 0: every window of the split
    window_selection: str = "spread"  # spread (evenly over the split) | first
    batch_size: int = 1
    protocols: list[str] = field(default_factory=lambda: ["streaming", "simulated"])  # | chunked | context
    chunk_tokens: int = 32  # tokens per forward under the chunked and context protocols (AQUA-KV: 32)
    context_tokens: int = 0  # the context protocol's first forward (what a press evicts from); 0: half the window
    include_reference: bool = True  # also evaluate the uncompressed model (cached across runs)

    def __post_init__(self):
        at_least(self, 2, "seq_len")
        at_least(self, 1, "batch_size", "chunk_tokens")
        if not 0 <= self.context_tokens < self.seq_len:
            raise ConfigError(f"context_tokens={self.context_tokens}: valid: 0 (half the window) to seq_len - 1 "
                              f"({self.seq_len - 1})")
        if not isinstance(self.num_windows, int):
            raise ConfigError(f"num_windows={self.num_windows!r}: valid: an integer (<= 0: every window)")


RULER_TASKS = [
    "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
    "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2",
]


@dataclass
class RulerConfig:
    """RULER's synthetic tasks generated offline (:mod:`kvcomp.benchmarks.ruler`), scored by generation
    through the compressed cache (:mod:`kvcomp.benchmarks.generation`)."""

    name: str = "ruler"
    tasks: list[str] = field(default_factory=lambda: list(RULER_TASKS))
    lengths: list[int] = field(default_factory=lambda: [1024, 2048])  # RULER's max_seq_length: prompt + generation budget
    num_samples: int = 2  # per task and length
    haystack: str = "essays"  # RULER's Paul Graham essays, or a kvcomp corpus (evaluation split) replacing them
    seed: int = 42
    max_new_tokens: int | None = 64  # caps RULER's budget per task (niah 128, vt 30, cwe 120, fwe 50); None: uncapped
    chat_template: bool = True  # wrap prompts in the tokenizer's chat template when it has one
    batch_size: int = 4  # samples of one task and length have the same token count: batched without padding
    protocol: str = "exact_prefill"  # exact_prefill | streaming | simulated (how the prefill sees its own tokens)
    compress_generated: bool = True  # false: only the prompt is encoded ([REF] of the TemporalKV thesis)
    include_reference: bool = True

    def __post_init__(self):
        at_least(self, 1, "num_samples", "batch_size")
        at_least(self, 1, "max_new_tokens", optional=True)
        if not self.lengths or any(not isinstance(n, int) or n < 1 for n in self.lengths):
            raise ConfigError(f"lengths={list(self.lengths)!r} is out of range; valid: a non-empty list of positive integers")


@dataclass
class LMEvalConfig:
    """Any lm-eval task list, every request through a fresh compressed cache
    (:mod:`kvcomp.benchmarks.lm_eval_bridge`). Presets: ``longbench``, ``aime``, ``ruler_lmeval``."""

    name: str = "lm_eval"
    tasks: list[str] = field(default_factory=list)
    data: str = "auto"  # auto: the hub (offline: the local HF cache) if it has the data, else fixtures | hub | fixtures
    fixtures: dict[str, str] = field(default_factory=dict)  # task -> JSON-lines file (relative: kvcomp/benchmarks/fixtures)
    limit: int | None = None  # documents per task (None: all)
    num_fewshot: int | None = None
    batch_size: int = 1  # > 1 left-pads generation batches (the cache groups rows by their padding)
    max_length: int | None = None  # context + generation tokens (None: the model config's max_context)
    max_gen_toks: int | None = None  # caps each task's generation budget (None: the task's own)
    truncation: str = "left"  # left (lm-eval) | middle (LongBench: keep the first and last halves)
    chat_template: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)  # TaskManager metadata (RULER: max_seq_lengths)
    protocol: str = "exact_prefill"
    compress_generated: bool = True
    score_answers: bool = True  # each doc's gold teacher-forced after its compressed prompt (generation: one more prefill)
    include_reference: bool = True

    def __post_init__(self):
        at_least(self, 1, "batch_size")
        at_least(self, 1, "limit", "max_length", "max_gen_toks", optional=True)
        at_least(self, 0, "num_fewshot", optional=True)
