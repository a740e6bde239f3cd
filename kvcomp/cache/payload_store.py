"""Where a stream's (or a model-scope unit's) encoded blocks are held: a :class:`PayloadStore`, and each block's
place in it (:class:`Block`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcomp.cache.growing import GrowingTensor
from kvcomp.codecs.base import Payload


@dataclass(frozen=True)
class Block:
    """Where one encoded block lies in a :class:`PayloadStore`: its index in the store, its first row of
    every payload tensor and row counts (``payload_layout="tokens"``), and its tokens (cache index of
    the first one, count). Holds no tensors."""

    index: int
    rows: dict[str, int]
    sizes: dict[str, int]
    first: int
    count: int


class PayloadStore:
    """Encoded blocks, appended without copying what is stored.

    ``layout="tokens"``: one :class:`GrowingTensor` per payload tensor (blocks concatenate along dim 2),
    so :meth:`view` is every block as one payload without a copy (what fused kernels read).
    ``layout="blocks"``: a list of payloads, each kept as encoded (variable-length, ragged rows).
    ``capacity``: tokens to preallocate (``"tokens"`` layout): each tensor's buffer is reserved, at its
    first append, for that many tokens at the rows per token of that block.
    """

    def __init__(self, layout: str = "tokens", capacity: int = 0):
        self.layout, self.capacity = layout, capacity
        self.tensors: dict[str, GrowingTensor] = {}
        self.payloads: list[Payload] = []
        self.num_tokens = self.num_blocks = 0

    def append(self, payload: Payload, first: int) -> Block:
        rows, sizes = {}, {}
        if self.layout == "blocks":
            self.payloads.append(payload)
        else:
            if payload.ragged:
                raise ValueError("a payload with ragged rows needs payload_layout='blocks'")
            for k, t in payload.tensors.items():
                grown = self.tensor(k, t.shape[2], payload.num_tokens)
                rows[k], sizes[k] = grown.length, t.shape[2]
                grown.append(t)
        self.num_tokens += payload.num_tokens
        self.num_blocks += 1
        return Block(self.num_blocks - 1, rows, sizes, first, payload.num_tokens)

    def tensor(self, name: str, rows: int, tokens: int) -> GrowingTensor:
        """The growing tensor of payload tensor ``name``, created for ``rows`` rows per ``tokens`` tokens."""
        if name not in self.tensors:
            self.tensors[name] = GrowingTensor(2, -(-self.capacity * rows // max(tokens, 1)) if self.capacity else 0)
        return self.tensors[name]

    def view(self) -> Payload:
        if self.layout == "blocks":
            raise ValueError("payload_layout='blocks' keeps blocks apart: read them with block()")
        return Payload({k: g.view for k, g in self.tensors.items()}, self.num_tokens)

    def block(self, block: Block) -> Payload:
        """One block's payload (views into the store)."""
        if self.layout == "blocks":
            return self.payloads[block.index]
        return Payload({k: g.view.narrow(2, block.rows[k], block.sizes[k]) for k, g in self.tensors.items()}, block.count)

    def select_rows(self, index: torch.Tensor) -> None:
        for g in self.tensors.values():
            g.map(lambda t: t.index_select(0, index.to(t.device)))
        self.payloads = [p.select_rows(index) for p in self.payloads]

    def keep(self, gather, count: int) -> Block:
        """Keep ``count`` tokens of a store with one row per token in every payload tensor, gathered to the front
        (``gather``: a press's kept tokens, :func:`~kvcomp.cache.eviction.keep_tokens`); they become one
        block."""
        for grown in self.tensors.values():
            grown.keep(gather)
        self.num_tokens, self.num_blocks = count, 1
        return Block(0, dict.fromkeys(self.tensors, 0), dict.fromkeys(self.tensors, count), 0, count)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.tensors.values()) + sum(p.nbytes for p in self.payloads)

    @property
    def reserved_nbytes(self) -> int:
        return sum(g.reserved_nbytes for g in self.tensors.values())
