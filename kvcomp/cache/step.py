"""The context of one model forward, passed explicitly to every cache layer that asks for it.

:func:`~kvcomp.cache.attention.install` hooks two modules, as vLLM hands one ``attn_metadata`` to every
layer of a step:

- the decoder's pre-hook builds one :class:`Step` per forward from that forward's arguments (the kernel
  backend, the left padding of a first forward) and adds it to them; transformers passes keyword
  arguments down to every attention module;
- each attention module's pre-hook adds its own part (:class:`LayerStep`: the position embeddings and
  position ids it received, its RoPE frequencies) and, for a :class:`StepLayer`, takes the cache out of the
  module's arguments: the module then skips ``cache.update`` and the registered attention function
  receives the fresh keys and values with the :class:`LayerStep`, which names the layer. That layer stores
  them and returns what attention reads (:meth:`StepLayer.update_in_step`).

Nothing is kept on modules, masks or layers between the hooks; a step lives as long as its forward.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers.cache_utils import CacheLayerMixin

from kvcomp.kernels.decode_attention import ValidTokens


def allowed(mask: torch.Tensor) -> torch.Tensor:
    """Which positions a bool or additive (0 / -inf-like) 4-D attention mask lets through, as bool."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def leading_pads(mask: torch.Tensor | None) -> int:
    """The most left padding of any row: the padding mask ``[B, L]`` a model is called with (1: a token), or a
    4-D mask ``[B, 1, Q, L]`` (a column is padding when no query sees it; a sliding window hides old columns
    from late queries, never from all). One host sync."""
    if not isinstance(mask, torch.Tensor):
        return 0
    valid = mask.bool() if mask.dim() == 2 else allowed(mask[:, 0]).any(dim=-2)
    return int(valid.int().argmax(-1).max()) if valid.any() else 0


@dataclass
class Step:
    """One model forward: what every layer shares. ``left_pads``: the most left padding of any row, counted
    once in a first forward (0 after); ``plans``: the fused kernels' valid tokens, made by the first layer that
    needs them and reused by the others (:meth:`valid_tokens`; flashinfer's ``plan`` once per step)."""

    kernel_backend: str = "torch"
    left_pads: int = 0
    plans: dict = field(default_factory=dict)

    def valid_tokens(self, mask: torch.Tensor | None, length: int, batch: int) -> ValidTokens | None:
        """The cached tokens each row attends to in a decode step, from its 4-D mask (bool or additive): every
        layer of one attention type receives the same mask object, so it is read once per step and type."""
        if mask is None:
            return None
        key = (id(mask), length)
        if key not in self.plans:  # the mask is kept with its plan, so its id cannot be reused within the step
            self.plans[key] = (mask, ValidTokens(allowed(mask[:, 0, -1, :length]).expand(batch, length)))
        return self.plans[key][1]


@dataclass
class Rotary:
    """RoPE frequencies fixed for the whole sequence, as a fused kernel recomputes the angles:
    ``cos = cos(pos * inv_freq) * scaling`` rounded to ``dtype`` (the model's cos/sin dtype)."""

    inv_freq: torch.Tensor
    scaling: float
    dtype: torch.dtype


@dataclass
class LayerStep:
    """One attention layer's part of a :class:`Step`: the ``layer`` it reads, the position embeddings
    (``rope``: cos/sin ``[B or 1, n, D]``) and position ids of the forward's tokens, and ``frequencies``, which
    reads the model's RoPE frequencies ``(inv_freq, attention_scaling)`` when they do not depend on the sequence
    (None: cos/sin must be kept)."""

    step: Step
    layer: "StepLayer"
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    positions: torch.Tensor | None = None
    frequencies: "Callable[[], tuple[torch.Tensor, float]] | None" = None

    @property
    def kernel_backend(self) -> str:
        return self.step.kernel_backend

    @property
    def rotary(self) -> Rotary | None:
        """The fixed RoPE frequencies on this layer's device, in its cos/sin dtype (read when asked: only
        pre-RoPE codecs need them)."""
        if self.rope is None or self.frequencies is None:
            return None
        inv_freq, scaling = self.frequencies()  # the rotary module may sit on another device
        return Rotary(inv_freq.to(self.rope[0].device), scaling, self.rope[0].dtype)


class StepLayer(CacheLayerMixin):
    """A cache layer that stores a forward's keys and values with its :class:`LayerStep` and says what
    attention reads; the kvcomp attention function calls :meth:`update_in_step` instead of transformers'
    ``update`` (which such a layer still serves when the model's attention is not kvcomp's)."""

    @abstractmethod
    def update_in_step(self, key_states: torch.Tensor, value_states: torch.Tensor, step: LayerStep):
        """Store the fresh K/V; return ``(keys, values)`` for SDPA, or a :class:`~kvcomp.cache.reads.Reads`."""
