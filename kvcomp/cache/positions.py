"""RoPE bookkeeping of one cache layer (pre-RoPE codecs, rotated key offsets): where its cached tokens sit."""

from __future__ import annotations

import torch

from kvcomp.cache.growing import GrowingTensor
from kvcomp.cache.context import LayerContext, Rotary
from kvcomp.errors import ConfigError
from kvcomp.kernels.formats import RotaryPositions


class Positions:
    """The position id of every cached token ``[B, L]`` and, only when their angles cannot be recomputed from
    those ids, their cos/sin ``[B, L, D]``: a pre-RoPE codec's keys are un-rotated before encoding and
    re-rotated when decoded with the angles of their own positions (a post-RoPE codec's key offset is rotated to them).

    The angles are recomputed (:attr:`recomputed`) when the model's RoPE has fixed frequencies
    (:class:`~kvcomp.cache.context.Rotary`) and every forward gave position ids; otherwise the cos/sin the model
    used are kept (RoPE types whose frequencies change with the length, forwards without position ids)."""

    def __init__(self, capacity: int = 0):
        self.capacity = capacity
        self.reset()

    def reset(self) -> None:
        self.ids = GrowingTensor(1, self.capacity)
        self.cos, self.sin = GrowingTensor(1, self.capacity), GrowingTensor(1, self.capacity)
        self.known = True  # False once a forward came without position ids
        self.rotary: Rotary | None = None

    def record(self, context: LayerContext | None, batch: int, count: int, where: str) -> None:
        """Keep the positions of a forward's ``count`` new tokens, from its :class:`LayerContext`."""
        if context is None or context.rope is None:
            raise ConfigError(f"{where} needs its keys' RoPE angles (pre-RoPE keys or a rotated key offset), but received "
                              "no position embeddings: "
                              "call kvcomp.cache.install(model) before using the cache")
        self.rotary = context.rotary
        cos, sin = (t.expand(batch, count, -1) for t in context.rope)
        if context.positions is not None and self.known:
            self.ids.append(context.positions.to(torch.int32).expand(batch, count))
        elif self.known:  # from now on the angles cannot be recomputed: keep those of the earlier tokens
            if self.recomputed and self.ids.length:
                for grown, earlier in zip((self.cos, self.sin), self.rope(0, self.ids.length)):
                    grown.append(earlier.to(cos.dtype))
            self.known = False
        if not self.recomputed:
            self.cos.append(cos)
            self.sin.append(sin)

    @property
    def recomputed(self) -> bool:
        """Whether :meth:`rope` recomputes cos/sin from the position ids (nothing but the ids is kept); what
        a fused kernel that rotates keys in registers needs."""
        return self.rotary is not None and self.known

    def rope(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[B, count, D]`` of cached tokens ``first .. first + count - 1``."""
        if self.recomputed:
            return self.key_rope(first).cos_sin(count)
        return self.cos.view.narrow(1, first, count), self.sin.view.narrow(1, first, count)

    def key_rope(self, first: int) -> RotaryPositions:
        """The rotation of cached tokens from ``first`` on, as fused kernels apply it (needs :attr:`recomputed`)."""
        r = self.rotary
        return RotaryPositions(self.ids.view, first, r.inv_freq, r.scaling, r.dtype)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in (self.cos, self.sin, self.ids))

    @property
    def reserved_nbytes(self) -> int:
        return sum(g.reserved_nbytes for g in (self.cos, self.sin, self.ids))

    def select_rows(self, index: torch.Tensor) -> None:
        for grown in (self.cos, self.sin, self.ids):
            grown.map(lambda t: t.index_select(0, index.to(t.device)))
