"""One layer's key or value stream: full-precision sinks, encoded blocks, full-precision tail."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvcomp.cache.growing import GrowingTensor
from kvcomp.cache.payload_store import Block, PayloadStore
from kvcomp.cache.rotation import KeyRotation
from kvcomp.codecs.base import Codec, Payload, SequenceState


@dataclass
class FreshlyEncoded:
    """Tokens one update moved from the tail into encoded blocks.

    ``positions``: their cache indices; ``full_precision``: their values before encoding
    ``[B, H, n, D]``; ``visible_from``: the cache index of the first query that sees the encoded
    version (the query whose token completed the block's schedule). Earlier queries of the same
    update saw the full-precision version in a streaming deployment.
    """

    positions: torch.Tensor
    full_precision: torch.Tensor
    visible_from: torch.Tensor


def _cat(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    """``a`` then ``b`` along tokens; a slice is copied so that it does not keep its whole base alive."""
    if a is not None:
        return torch.cat([a, b], dim=2)
    whole = b.untyped_storage().nbytes() == b.numel() * b.element_size()
    return b if whole else b.clone()


class DecodedCopy:
    """The torch path's decoded blocks (working memory): each block decoded (and re-rotated) the first time attention
    reads it and appended to ``tensor``; blocks decode independently, so this equals decoding every block at every
    step, without the per-step cost. ``pending``: blocks not decoded yet. ``per_step=True`` keeps nothing: every read
    decodes every block again (memory-true, slower)."""

    def __init__(self, capacity: int, per_step: bool):
        self.capacity, self.per_step = capacity, per_step
        self.tensor = GrowingTensor(2, capacity)
        self.pending: list[Block] = []

    @property
    def length(self) -> int:
        return self.tensor.length

    @property
    def view(self) -> torch.Tensor | None:
        return self.tensor.view

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes

    def read(self, blocks: list[Block], decode: Callable[[Block], torch.Tensor]) -> torch.Tensor | None:
        """Every block decoded, in order: only the pending ones are decoded now (or, ``per_step``, all of them)."""
        if self.per_step:
            decoded = [decode(block) for block in blocks]
            return torch.cat(decoded, dim=2) if decoded else None
        for block in self.pending:
            self.tensor.append(decode(block))
        self.pending = []
        return self.tensor.view

    def forget(self, blocks: list[Block]) -> None:
        """Free the copy; ``blocks`` are decoded again when a read needs them."""
        if self.tensor.buffer is not None:
            self.tensor, self.pending = GrowingTensor(2, self.capacity), list(blocks)

    def keep(self, gather, blocks: list[Block], complete: bool) -> None:
        """After a press kept some tokens (``blocks`` now): a ``complete`` copy keeps their rows (``gather``); any
        other is freed and they are decoded when a read needs them."""
        if complete and not self.pending:
            self.tensor.keep(gather)
        else:
            self.tensor, self.pending = GrowingTensor(2, self.capacity), list(blocks)


class KVStream:
    """Stores one stream following its codec policy; see :class:`~kvcomp.codecs.base.StreamPolicy`.

    The storage is ``sinks``, the encoded blocks and the tail: a stream-scope codec's blocks (and per-sequence state)
    live in the stream's own :class:`~kvcomp.cache.payload_store.PayloadStore`, a layer-scope codec's too (its state
    in the layer), a model-scope codec's in the cache; :attr:`blocks` lists them in token order either way. Working
    memory: spare capacity of growing buffers and the torch path's :class:`DecodedCopy` (``decoded``); a stream whose
    attention reads the payload directly (:meth:`segments`, fused kernels) never decodes it.

    ``capacity``: tokens (per sequence) to preallocate: the store, the decoded copy and (two small buffers,
    :meth:`tail_reserve`) the tail are reserved at their first append, so later updates within ``capacity`` tokens
    allocate no storage (:mod:`kvcomp.cache.growing`); 0: buffers grow as needed. Keys are rotated by position as
    :class:`~kvcomp.cache.rotation.KeyRotation` says (``rope``); ``decoder(block)`` decodes one block (un-rotated), as
    the layer's :class:`~kvcomp.cache.scopes.Schedule` does; the schedule also encodes (:meth:`take`,
    :meth:`add_block`). Left padding is never held: rows padded alike get their own streams (:mod:`kvcomp.cache.rows`).
    """

    def __init__(self, codec: Codec, kind: str, layer_idx: int, rope, decode_per_step: bool,
                 decoder: Callable[[Block], torch.Tensor], capacity: int = 0):
        self.codec, self.kind, self.layer_idx, self.capacity = codec, kind, layer_idx, capacity
        self.decoder = decoder
        self.policy = codec.policy(kind, layer_idx)
        self.rotation = KeyRotation(codec, kind, layer_idx, rope)
        self.sinks: torch.Tensor | None = None
        self.store = PayloadStore(codec.payload_layout, capacity)
        self.state: SequenceState | None = None  # per-sequence codec state of a stream-scope unit (kvcomp.cache.scopes)
        self.blocks: list[Block] = []  # every encoded block, in token order
        self.decoded = DecodedCopy(capacity, decode_per_step)
        # appended in place: no copy of the tail per step (with a capacity: two buffers, see tail_reserve)
        self.tail_buffer = GrowingTensor(2, self.tail_reserve(capacity), standby=self.policy.block_size is not None)
        self.length = self.num_encoded = self.batch = 0
        self.frozen = False  # True: keep every further token in the full-precision tail

    def tail_reserve(self, capacity: int) -> int:
        """Tail entries preallocated for a cache of ``capacity`` tokens: all of them when the stream never
        encodes, else ``window + 2 block_size + 16`` (at most ``window + block_size`` are live after an
        update, so the tail moves between its two buffers every ``block_size + 16`` or more appends)."""
        block = self.policy.block_size
        return capacity if not capacity or block is None else min(capacity, self.policy.window + 2 * block + 16)

    def freeze(self) -> None:
        """Stop encoding: tokens appended from now on stay in full precision (the [REF] protocol that compresses the
        prompt only). A preallocated tail is reserved again for the whole capacity (it now keeps every later token)."""
        if not self.frozen and self.tail_buffer.keeps_standby:
            tail, self.tail_buffer = self.tail_buffer, GrowingTensor(2, self.capacity)
            if tail.length:
                self.tail_buffer.append(tail.view)
        self.frozen = True

    @property
    def rotates(self) -> bool:
        return self.rotation.rotates

    @property
    def payload(self) -> Payload | None:
        """Every encoded block as one payload (views into the store, no copy); None before the first."""
        return self.store.view() if self.store.num_tokens else None

    @property
    def num_sinks(self) -> int:
        return 0 if self.sinks is None else self.sinks.shape[2]

    @property
    def tail(self) -> torch.Tensor | None:
        """The full-precision tail (a view of its buffer); None when empty."""
        return self.tail_buffer.view if self.tail_buffer.length else None

    @property
    def num_tail(self) -> int:
        return self.tail_buffer.length

    def append(self, x: torch.Tensor) -> None:
        """Add ``x [B, H, n, D]`` to the sinks and the tail (encoding is the layer's schedule's)."""
        self.length += x.shape[2]
        self.dtype, self.device, self.batch = x.dtype, x.device, x.shape[0]
        take = min(x.shape[2], self.policy.sinks - self.num_sinks)
        if take > 0:
            self.sinks = _cat(self.sinks, x[:, :, :take])
            x = x[:, :, take:]
        if x.shape[2]:
            self.tail_buffer.append(x)

    def _encodable(self, tail: int) -> int:
        """How many of the oldest of ``tail`` tail tokens the policy encodes (a multiple of the block size)."""
        block = self.policy.block_size
        if block is None or self.frozen or tail < self.policy.window + block:
            return 0
        return (tail - self.policy.window) // block * block

    def ready(self) -> int:
        """How many of the oldest tail tokens the policy encodes now."""
        return self._encodable(self.num_tail)

    def ready_after(self, n: int) -> bool:
        """Whether appending ``n`` more tokens would let :meth:`ready` encode (decided before the append)."""
        to_sinks = max(0, min(n, self.policy.sinks - self.num_sinks))
        return self._encodable(self.num_tail + n - to_sinks) > 0

    def held(self) -> torch.Tensor:
        """Every full-precision token held (sinks, tail) before the first encode, keys un-rotated: what a
        stateful codec's :meth:`~kvcomp.codecs.base.Codec.init_state` sees (e.g. the prompt)."""
        return self.rotation.to_encode(torch.cat([t for t in (self.sinks, self.tail) if t is not None], dim=2), 0)

    def take(self, count: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Remove the ``count`` oldest tail tokens: ``(first cache index, tokens as stored, tokens to encode)``."""
        chunk = self.tail[:, :, :count]  # stays valid until the tail's next append (kvcomp.cache.growing)
        self.tail_buffer.drop_front(count)
        first = self.num_sinks + self.num_encoded
        return first, chunk, self.rotation.to_encode(chunk, first)

    def add_block(self, block: Block, chunk: torch.Tensor) -> FreshlyEncoded:
        """Record an encoded block (its payload already stored) that replaces ``chunk``."""
        self.blocks.append(block)
        self.decoded.pending.append(block)
        self.num_encoded += block.count
        positions = torch.arange(block.first, block.first + block.count, device=chunk.device)
        size = self.policy.block_size
        block_end = block.first + (positions - block.first) // size * size + size
        return FreshlyEncoded(positions, chunk, block_end + self.policy.window - 1)

    def pieces(self) -> list[torch.Tensor]:
        """The held pieces in token order: sinks, decoded blocks, tail (views: valid until the next append)."""
        blocks = self.decoded.read(self.blocks, lambda b: self.rotation.from_decoded(self.decoder(b), b.first))
        return [t for t in (self.sinks, blocks, self.tail) if t is not None]

    def segments(self) -> list[torch.Tensor | Payload]:
        """The held pieces in token order with the encoded blocks as their payload (for fused kernels)."""
        return [t for t in (self.sinks, self.payload, self.tail) if t is not None]

    def materialize(self) -> torch.Tensor | None:
        """The stream as attention sees it now: ``[sinks, decode(blocks), tail]`` (None when empty)."""
        pieces = self.pieces()
        return torch.cat(pieces, dim=2) if pieces else None

    def forget_decoded(self) -> None:
        """Free the torch path's decoded copy (a stream read from its payload needs none)."""
        self.decoded.forget(self.blocks)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (beam reorder, batch select / repeat) of everything held."""
        pick = lambda t: t.index_select(0, index.to(t.device))  # noqa: E731
        self.sinks = None if self.sinks is None else pick(self.sinks)
        self.tail_buffer.map(pick)
        self.store.select_rows(index)
        self.decoded.tensor.map(pick)
        self.batch = len(index)
        if self.state is not None:
            self.state.select_rows(index)
