"""Token eviction ("presses", as kvpress calls them): which prompt tokens a cache keeps, before any codec codes them.

A press scores every token of a prefill per KV head (higher: kept) and keeps the ``int(n (1 - ratio))`` best of
the ``n`` (kvpress's ``compression_ratio``: the fraction removed), each KV head its own tokens unless the press
selects tokens shared by the heads (:attr:`Press.shared_across_heads`, e.g. StreamingLLM's sinks and window).
The cache (:class:`~kvcomp.cache.CompressedCache`, ``press=...``) stores only the kept tokens, in their order,
and the codec codes only those: evicted tokens are freed, not masked. The prefill itself attends to every
token exactly (``exact_prefill``); later forwards see the kept tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, replace

import torch

from kvcomp.codecs.base import ModelInfo
from kvcomp.errors import ConfigError, unknown_choice
from kvcomp.schema import structured

PRESSES: dict[str, type] = {}


def register(cls):
    """Class decorator: make ``cls`` buildable by its ``name``."""
    PRESSES[cls.name] = cls
    return cls


@dataclass
class Prefill:
    """What a press sees of one layer's prefill: ``query [B, Hq, n, D]`` and ``keys``/``values [B, H, n, D]`` (both after
    RoPE, as attention received them); ``rope`` the cos/sin ``[B or 1, n, D]`` the model applied, and ``rotary`` its
    fixed RoPE frequencies (:class:`~kvcomp.cache.step.Rotary`; None where they change with the length), for
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

    def __post_init__(self):
        if not 0.0 <= self.ratio < 1.0:
            raise ConfigError(f"press {self.name}: ratio={self.ratio!r} is the fraction of prompt tokens evicted; "
                              "choose a value in [0, 1)")
        if self.decoding_size < 0 or self.decoding_interval < 1:
            raise ConfigError(f"press {self.name}: decoding_size={self.decoding_size} must be >= 0 (0: the prefill only) "
                              f"and decoding_interval={self.decoding_interval} >= 1")


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
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` for settings this press cannot use."""

    def describe(self) -> str:
        """``name(field=value, ...)``, as results rows show it."""
        shown = {k: v for k, v in asdict(self.config).items()
                 if k != "name" and not (k.startswith("decoding_") and not self.config.decoding_size)}
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
        return self.scores(replace(prefill, kept=k)).float().topk(k, dim=-1).indices.sort(dim=-1).values


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
    if name not in PRESSES:
        raise unknown_choice("press", name, PRESSES)
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
