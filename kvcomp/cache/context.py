"""The context of one model forward, passed explicitly to every cache layer that asks for it.

:func:`~kvcomp.cache.attention.install` hooks two modules, as vLLM hands one ``attn_metadata`` to every
layer of a forward:

- the decoder's pre-hook builds one :class:`ForwardContext` per forward (the kernel backend) and adds it to that forward's
  arguments; transformers passes keyword arguments down to every attention module. A first forward's left
  padding goes to the cache before (:meth:`PaddedRows.group_rows`);
- each attention module's pre-hook adds its own part (:class:`LayerContext`: the position embeddings and
  position ids it received, its RoPE frequencies) and, for a :class:`ContextLayer`, takes the cache out of the
  module's arguments: the module then skips ``cache.update`` and the registered attention function
  receives the fresh keys and values with the :class:`LayerContext`, which names the layer. That layer stores
  them and returns what attention reads (:meth:`ContextLayer.update_in_context`).

Nothing is kept on modules, masks or layers between the hooks; a context lives as long as its forward.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers.cache_utils import CacheLayerMixin

from kvcomp.kernels.valid_tokens import ValidTokens
from kvcomp.kernels.decode_plan import DecodePlans


def allowed(mask: torch.Tensor) -> torch.Tensor:
    """Which positions a bool or additive (0 / -inf-like) 4-D attention mask lets through, as bool."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def row_pads(mask: torch.Tensor | None) -> list[int]:
    """The left padding of each row, from the padding mask ``[B, L]`` a model is called with (1: a token), or a
    4-D mask ``[B, 1, Q, L]`` (a column is padding when no query sees it; a sliding window hides old columns
    from late queries, never from all); a row with no token counts as unpadded. One host sync."""
    if not isinstance(mask, torch.Tensor):
        return []
    valid = mask.bool() if mask.dim() == 2 else allowed(mask[:, 0]).any(dim=-2)
    return valid.int().argmax(-1).tolist()


@dataclass
class ForwardContext:
    """One model forward: what every layer shares. ``decode``: the fused kernels' launch plans, made by the first
    layer that needs them and run by every layer in the installation's workspace (flashinfer's ``plan`` once per
    step); ``valid``: the fused kernels' valid tokens, read once per forward (:meth:`valid_tokens`); ``masks``: the
    mask's columns of each row group (:meth:`columns`), cut once per forward."""

    kernel_backend: str = "torch"
    decode: DecodePlans = field(default_factory=DecodePlans)
    valid: dict = field(default_factory=dict)
    masks: dict = field(default_factory=dict)

    def valid_tokens(self, mask: torch.Tensor | None, length: int, batch: int) -> ValidTokens | None:
        """The cached tokens each row attends to in a decode step, from its 4-D mask (bool or additive): every
        layer of one attention type receives the same mask object, so it is read once per step and type."""
        if mask is None:
            return None
        key = (id(mask), length)
        if key not in self.valid:  # the mask is kept with its tokens, so its id cannot be reused within the forward
            self.valid[key] = (mask, ValidTokens(allowed(mask[:, 0, -1, :length]).expand(batch, length)))
        return self.valid[key][1]

    def columns(self, mask: torch.Tensor | None, group, first_forward: bool, evicted: int = 0) -> torch.Tensor | None:
        """The part of a 4-D mask a :class:`~kvcomp.cache.rows.RowGroup` attends with: its rows, its cache
        columns after its pads and (``first_forward``) its real queries; the same object for every layer. A press
        that ``evicted`` prompt tokens leaves as many fewer columns: every later query sees every prompt column,
        so the first ``evicted`` after the pads stand for them."""
        if mask is None or (group.rows is None and not group.pads and not evicted):
            return mask
        key = (id(mask), id(group), first_forward, evicted)
        if key not in self.masks:  # kept with the mask: ids stay unique within the forward
            cut = group.take(mask)[..., group.pads + evicted:]
            if first_forward and group.pads:
                cut = cut[..., group.pads:, :]
            self.masks[key] = (mask, group, cut)
        return self.masks[key][2]


@dataclass
class Rotary:
    """RoPE frequencies fixed for the whole sequence, as a fused kernel recomputes the angles:
    ``cos = cos(pos * inv_freq) * scaling`` rounded to ``dtype`` (the model's cos/sin dtype)."""

    inv_freq: torch.Tensor
    scaling: float
    dtype: torch.dtype


@dataclass
class LayerContext:
    """One attention layer's part of a :class:`ForwardContext`: the ``layer`` it reads, the position embeddings
    (``rope``: cos/sin ``[B or 1, n, D]``) and position ids of the forward's tokens, and ``frequencies``, which
    reads the model's RoPE frequencies ``(inv_freq, attention_scaling)`` when they do not depend on the sequence
    (None: cos/sin must be kept)."""

    forward: ForwardContext
    layer: "ContextLayer"
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    positions: torch.Tensor | None = None
    frequencies: "Callable[[], tuple[torch.Tensor, float]] | None" = None

    @property
    def kernel_backend(self) -> str:
        return self.forward.kernel_backend

    @property
    def rotary(self) -> Rotary | None:
        """The fixed RoPE frequencies on this layer's device, in its cos/sin dtype (read when asked: only
        pre-RoPE codecs need them)."""
        if self.rope is None or self.frequencies is None:
            return None
        inv_freq, scaling = self.frequencies()  # the rotary module may sit on another device
        return Rotary(inv_freq.to(self.rope[0].device), scaling, self.rope[0].dtype)


class ContextLayer(CacheLayerMixin):
    """A cache layer that stores a forward's keys and values with its :class:`LayerContext` and says what
    attention reads; the kvcomp attention function calls :meth:`update_in_context` instead of transformers'
    ``update`` (which such a layer still serves when the model's attention is not kvcomp's). It holds every token
    given (``length``, left padding included): unbounded, and never cropped."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    length = 0

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # transformers < 5.20 name of get_max_length
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a compressed cache cannot drop encoded tokens (no assisted decoding)")

    @abstractmethod
    def update_in_context(self, key_states: torch.Tensor, value_states: torch.Tensor, context: LayerContext,
                       query: torch.Tensor | None = None):
        """Store the fresh K/V; return ``(keys, values)`` for SDPA, or a :class:`~kvcomp.cache.reads.Reads`.
        ``query``: the forward's queries (what a press scores a prompt with)."""


class PaddedRows(ABC):
    """A cache that schedules the rows of a left-padded batch by their own tokens (:mod:`kvcomp.cache.rows`)."""

    @abstractmethod
    def group_rows(self, pads: list[int]) -> None:
        """Before an empty cache's first forward: the left padding of each row (empty: none)."""
