"""Token eviction ("presses", as kvpress calls them): which prompt tokens a cache keeps, before any codec codes them.

A press scores every token of a prefill per KV head (higher: kept) and keeps the ``int(n (1 - ratio))`` best of
the ``n`` (kvpress's ``compression_ratio``: the fraction removed), each KV head its own tokens unless the press
selects tokens shared by the heads (:attr:`Press.shared_across_heads`, e.g. StreamingLLM's sinks and window).
``head_budgets=adakv`` (AdaKV, Feng et al. 2024, arXiv 2407.11550, Alg. 1) keeps the same ``H k`` tokens per row and
layer but lets the heads share them: the best ``H k`` scores among all heads of the layer, each head keeping at least
``int(alpha_safeguard k)`` of its own best (kvpress's ``AdaKVPress`` safeguard); the cache holds each head's kept
tokens as they are, ragged (:class:`~kvcomp.cache.headwise.HeadwisePrefix`).
The cache (:class:`~kvcomp.cache.CompressedCache`, ``press=...``) stores only the kept tokens, in their order,
and the codec codes only those: evicted tokens are freed, not masked. The prefill itself attends to every
token exactly (``exact_prefill``); later forwards see the kept tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, replace

import torch

from kvcomp.codecs.base import ModelInfo
from kvcomp.errors import ConfigError
from kvcomp.registry import Registry
from kvcomp.schema import structured

PRESSES = Registry("press")
register = PRESSES.register  # class decorator: make a press buildable by its ``name``
HEAD_BUDGETS = ("uniform", "adakv")


@dataclass
class Prefill:
    """What a press sees of one layer's prefill: ``query [B, Hq, n, D]`` and ``keys``/``values [B, H, n, D]`` (both after
    RoPE, as attention received them); ``rope`` the cos/sin ``[B or 1, n, D]`` the model applied, and ``rotary`` its
    fixed RoPE frequencies (:class:`~kvcomp.cache.context.Rotary`; None where they change with the length), for
    presses that reason about queries before RoPE or at future positions."""

    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    rotary: object | None = None
    kept: int = 0  # how many tokens the press keeps (set by Press.keep)

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def grouped_query(self) -> torch.Tensor:
        """The queries as ``[B, H, Hq/H, n, D]`` (the query heads of each KV head together)."""
        b, hq, n, d = self.query.shape
        return self.query.view(b, self.keys.shape[1], hq // self.keys.shape[1], n, d)


@dataclass
class PressConfig:
    name: str = "none"
    ratio: float = 0.0  # the fraction of prompt tokens evicted (kvpress's compression_ratio)
    # during decoding too (kvpress's DecodingPress): once a layer holds decoding_size + decoding_interval tokens, press
    # it back to decoding_size; 0: the prefill only
    decoding_size: int = 0
    decoding_interval: int = 64
    # uniform: every KV head keeps k of its n tokens; adakv: the layer's H k are shared out among its heads by score
    # (AdaKV), each head keeping at least int(alpha_safeguard k)
    head_budgets: str = "uniform"
    alpha_safeguard: float = 0.2

    def __post_init__(self):
        if self.head_budgets not in HEAD_BUDGETS:
            raise ConfigError(f"head_budgets={self.head_budgets!r}; choose one of "
                              f"{', '.join(HEAD_BUDGETS)}")
        if not 0.0 <= self.alpha_safeguard <= 1.0:
            raise ConfigError(f"alpha_safeguard={self.alpha_safeguard!r} is the least share of its "
                              "budget each head keeps under head_budgets=adakv; choose a value in [0, 1]")
        if not 0.0 <= self.ratio < 1.0:
            raise ConfigError(f"ratio={self.ratio!r} is the fraction of prompt tokens evicted; "
                              "choose a value in [0, 1)")
        if self.decoding_size < 0 or self.decoding_interval < 1:
            raise ConfigError(f"decoding_size={self.decoding_size} must be >= 0 (0: the prefill only) "
                              f"and decoding_interval={self.decoding_interval} >= 1")

    def min_prompt(self) -> tuple[int, str]:
        """``(tokens, why)``: the shortest prompt the press can score; a shorter one is a :class:`ConfigError`, checked
        before the model loads where the benchmark knows its prompts (perplexity's context) and at the prefill."""
        return 1, "one token"


class Press(ABC):
    """Scores prompt tokens (:meth:`scores`) and keeps the best (:meth:`keep`)."""

    name: str
    config_class: type = PressConfig
    shared_across_heads = False  # True: one selection for every KV head of a row (scores ``[B, 1, n]``)
    reads_queries = True  # False: its scores read keys (and values) only
    # True: it can press while decoding (decoding_size), its scores reading no queries or, for a press defined at decode
    # steps (TOVA), the previous forward's last query, after that forward's attention saw every token
    decodes = False

    def __init__(self, config: PressConfig, model: ModelInfo):
        self.config, self.model = config, model
        if config.decoding_size and not self.decodes:
            raise ConfigError(f"press {self.name} cannot press while decoding (decoding_size > 0): its scores need a "
                              "window of queries, which one decode step does not have; presses that can: "
                              f"{', '.join(n for n, c in PRESSES.items() if c.decodes)}")
        if self.adaptive and self.shared_across_heads:
            raise ConfigError(f"press {self.name} keeps the same tokens in every KV head, so head_budgets=adakv has no "
                              f"budgets to share out; presses with scores per head: "
                              f"{', '.join(n for n, c in PRESSES.items() if not c.shared_across_heads)}")
        if self.adaptive and config.decoding_size:
            raise ConfigError(f"press {self.name}: head_budgets=adakv presses the prompt only (AdaKV); leave "
                              "decoding_size 0 or use head_budgets=uniform")
        self.validate()

    @property
    def adaptive(self) -> bool:
        """Whether the heads of a layer share its budget (``head_budgets=adakv``)."""
        return self.config.head_budgets == "adakv"

    def validate(self) -> None:
        """Raise :class:`ConfigError` for settings this press cannot use."""

    def describe(self) -> str:
        """``name(field=value, ...)``, as results rows show it."""
        shown = {k: v for k, v in asdict(self.config).items()
                 if k != "name" and not (k.startswith("decoding_") and not self.config.decoding_size)
                 and not (k in ("head_budgets", "alpha_safeguard") and not self.adaptive)}
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in shown.items())})"

    def kept_count(self, n: int) -> int:
        """Tokens kept of ``n`` (kvpress: ``int(n * (1 - ratio))``, at least one)."""
        return max(1, int(n * (1.0 - self.config.ratio)))

    @abstractmethod
    def scores(self, prefill: Prefill) -> torch.Tensor:
        """Scores ``[B, H, n]`` (or ``[B, 1, n]`` when :attr:`shared_across_heads`) of the prefill's tokens, higher
        kept."""

    def keep(self, prefill: Prefill, count: int | None = None) -> torch.Tensor | None:
        """Indices ``[B, H or 1, k]`` of the tokens kept, in cache order (kvpress keeps them in score order, which
        attention does not see), or None when every token is (ratio 0, or too few tokens to evict one). ``count``:
        keep that many (pressing while decoding) instead of the ratio's share."""
        n = prefill.length
        k = self.kept_count(n) if count is None else count
        if k >= n:
            return None
        return self._scores(replace(prefill, kept=k)).topk(k, dim=-1).indices.sort(dim=-1).values

    def _scores(self, prefill: Prefill) -> torch.Tensor:
        """:meth:`scores` in float32, of a prompt no shorter than :meth:`PressConfig.min_prompt`."""
        least, why = self.config.min_prompt()
        if prefill.length < least:
            raise ConfigError(f"press {self.name}: a prompt of {prefill.length} tokens is shorter than the {least} it "
                              f"needs ({why}); use longer prompts or change the press's settings")
        return self.scores(prefill).float()

    def keep_per_layer(self, prefill: Prefill) -> tuple[torch.Tensor, torch.Tensor] | None:
        """AdaKV's selection (``head_budgets=adakv``): indices ``[B, H k]`` into the prompt's tokens of every head laid
        end to end (``h n + t``), ascending (head by head, each in cache order), and the tokens each head keeps
        ``[B, H]``; None when every token is kept. Each head's best ``int(alpha_safeguard k)`` scores are raised above
        all others, then the row keeps the best ``H k`` of the layer (Alg. 1)."""
        n = prefill.length
        k = self.kept_count(n)
        if k >= n:
            return None
        scores = self._scores(replace(prefill, kept=k))
        b, h, _ = scores.shape
        safe = int(k * self.config.alpha_safeguard)
        if safe:
            scores = scores.scatter(-1, scores.topk(safe, dim=-1).indices, float("inf"))
        flat = scores.reshape(b, h * n).topk(h * k, dim=-1).indices.sort(dim=-1).values
        counts = torch.zeros(b, h, dtype=torch.long, device=flat.device).scatter_add_(1, flat // n, torch.ones_like(flat))
        return flat, counts


def window_attention(prefill: Prefill, window: int) -> torch.Tensor:
    """Attention weights ``[B, Hq, window, n]`` (float32) of the last ``window`` queries over every prefill token,
    causal, each query head over its KV head's keys, softmax over all ``n`` keys (SnapKV's observation window;
    TOVA's last query)."""
    keys = prefill.keys.float().repeat_interleave(prefill.query.shape[1] // prefill.keys.shape[1], dim=1)
    query = prefill.query[:, :, -window:].float()
    n, d = prefill.length, keys.shape[-1]
    logits = query @ keys.transpose(-1, -2) / d**0.5
    future = torch.ones(window, n, dtype=torch.bool, device=keys.device).triu(n - window + 1)
    return logits.masked_fill(future, float("-inf")).softmax(dim=-1)


def kept_first(scores: torch.Tensor, count: int, at_end: bool) -> torch.Tensor:
    """``scores [..., m]`` with ``count`` tokens joined before them (or after, ``at_end``) scored above every other:
    tokens a press always keeps (kvpress pads them with ``max + 1``)."""
    top = scores.max() + 1 if scores.numel() else torch.ones((), device=scores.device)
    kept = top.expand(*scores.shape[:-1], count)
    return torch.cat([scores, kept] if at_end else [kept, scores], dim=-1)


def press_class(name: str) -> type:
    """The press class registered as ``name`` (an unknown name is a :class:`ConfigError`)."""
    return PRESSES[name]


def press_config(config) -> PressConfig | None:
    """A press config (a mapping, Hydra group or :class:`PressConfig`) as its dataclass, None for ``name: none``;
    unknown or mistyped fields are refused (:func:`~kvcomp.schema.structured`)."""
    if config is None or isinstance(config, PressConfig):
        return None if config is None or config.name == "none" else config
    name = config.get("name", "none")
    if name == "none":
        if config.get("ratio", 0.0):
            raise ConfigError(f"press=none evicts nothing, but ratio={config['ratio']} was given: choose a press "
                              f"({', '.join(sorted(PRESSES))})")
        return None
    return structured(press_class(name).config_class, config, f"press {name}")


def build_press(config, model: ModelInfo) -> Press | None:
    """The press a config names (:func:`press_config`), for ``model``; None for ``name: none``."""
    typed = press_config(config)
    return None if typed is None else press_class(typed.name)(typed, model)
