"""One layer's key or value stream: full-precision sinks, encoded blocks, full-precision tail."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvcomp.cache.growing import GrowingTensor
from kvcomp.codecs.base import Codec, Payload, SequenceState
from kvcomp.stages.ranges import saturated
from kvcomp.stages.rope import apply_rope, undo_rope


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

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.tensors.values()) + sum(p.nbytes for p in self.payloads)

    @property
    def reserved_nbytes(self) -> int:
        return sum(g.reserved_nbytes for g in self.tensors.values())


class KVStream:
    """Stores one stream following its codec policy; see :class:`~kvcomp.codecs.base.StreamPolicy`.

    The storage is ``sinks``, the encoded blocks and ``tail``: a stream-scope codec's blocks (and
    per-sequence state) live in the stream's own :class:`PayloadStore`, a layer-scope codec's too (its
    state in the layer), a model-scope codec's in the cache; :attr:`blocks` lists them in token order
    either way, and :attr:`nbytes` counts what the stream itself holds. Working memory, reported apart by
    :attr:`working_nbytes`: spare capacity of growing buffers and, for the torch reference attention path,
    ``decoded``, the blocks decoded (and re-rotated) once, the first time attention reads them (blocks
    decode independently, so this equals decoding every block at every step, without the per-step cost).
    ``decode_per_step=True`` keeps no decoded copy: every read decodes every block again (memory-true,
    slower). A stream whose attention reads the payload directly (:meth:`segments`, fused kernels)
    never decodes it.

    ``capacity``: tokens (per sequence) to preallocate: the store, the decoded copy and (two small
    buffers, :meth:`tail_reserve`) the tail are reserved at their first append, so later updates within
    ``capacity`` tokens allocate no storage (:mod:`kvcomp.cache.growing`); 0: buffers grow as needed.

    ``rope(first, count)`` returns the layer's cos/sin of cached tokens ``first .. first + count - 1``
    (pre-RoPE keys, and keys with a :meth:`~kvcomp.codecs.base.Codec.rotated_key_offset`): pre-RoPE blocks are
    un-rotated before encoding and re-rotated when decoded, with the positions' own angles; a post-RoPE codec's
    offset ``c`` is rotated to each token's position, ``R_p c``, subtracted before encoding and added back after
    decoding (:attr:`offset`). ``decoder(block)`` decodes one block (un-rotated), as the layer's
    :class:`~kvcomp.cache.scopes.Schedule` does; the schedule also encodes (:meth:`take`, :meth:`add_block`).

    Left padding is never held: the cache gives rows padded alike their own streams (:mod:`kvcomp.cache.rows`).
    """

    def __init__(self, codec: Codec, kind: str, layer_idx: int, rope, decode_per_step: bool,
                 decoder: Callable[[Block], torch.Tensor], capacity: int = 0):
        self.codec, self.kind, self.layer_idx = codec, kind, layer_idx
        self.rope, self.decode_per_step, self.capacity = rope, decode_per_step, capacity
        self.decoder = decoder
        self.policy = codec.policy(kind, layer_idx)
        self.pre_rope = codec.pre_rope and kind == "key"
        self.offset = codec.rotated_key_offset(layer_idx) if kind == "key" and not self.pre_rope else None
        self.sinks: torch.Tensor | None = None
        self.store = PayloadStore(codec.payload_layout, capacity)
        self.state: SequenceState | None = None  # per-sequence codec state of a stream-scope unit (kvcomp.cache.scopes)
        self.blocks: list[Block] = []  # every encoded block, in token order
        self.decoded = GrowingTensor(2, capacity)  # the torch path's decoded blocks (working memory)
        self.pending: list[Block] = []  # encoded blocks not in ``decoded`` yet
        # appended in place: no copy of the tail per step (with a capacity: two buffers, see tail_reserve)
        self.tail_buffer = GrowingTensor(2, self.tail_reserve(capacity), standby=self.policy.block_size is not None)
        self.length = self.num_encoded = self.batch = 0
        self.frozen = False  # True: keep every further token in the full-precision tail

    def tail_reserve(self, capacity: int) -> int:
        """Tail entries preallocated for a cache of ``capacity`` tokens: all of them when the stream never
        encodes, else ``window + 2 block_size + 16`` (at most ``window + block_size`` are live after an
        update, so the tail moves between its two buffers every ``block_size + 16`` or more appends)."""
        block = self.policy.block_size
        if not capacity or block is None:
            return capacity
        return min(capacity, self.policy.window + 2 * block + 16)

    def freeze(self) -> None:
        """Stop encoding: tokens appended from now on stay in full precision (the [REF] protocol that
        compresses the prompt only, never generated tokens). A preallocated tail is reserved again for the
        whole capacity (it now keeps every later token)."""
        if not self.frozen and self.tail_buffer.keeps_standby:
            tail, self.tail_buffer = self.tail_buffer, GrowingTensor(2, self.capacity)
            if tail.length:
                self.tail_buffer.append(tail.view)
        self.frozen = True

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

    @property
    def rotates(self) -> bool:
        """Whether the stream needs its tokens' RoPE angles (``rope``)."""
        return self.pre_rope or self.offset is not None

    def _rotated_offset(self, first: int, count: int, like: torch.Tensor) -> torch.Tensor:
        """``R_p c`` of cached tokens ``first .. first + count - 1``, float32 ``[B, H, count, D]``."""
        if self.offset.device != like.device:
            self.offset = self.offset.to(like.device)
        c = self.offset.float()[None, :, None, :].expand(like.shape[0], -1, count, -1)
        return apply_rope(c, *self.rope(first, count))

    def _to_encode(self, x: torch.Tensor, first: int) -> torch.Tensor:
        """Tokens from cache index ``first`` as the codec encodes them: un-rotated (pre-RoPE keys) or less their
        rotated offset."""
        if self.pre_rope:
            return undo_rope(x, *self.rope(first, x.shape[2]))
        if self.offset is not None:
            return saturated(x.float() - self._rotated_offset(first, x.shape[2], x), x.dtype)
        return x

    def held(self) -> torch.Tensor:
        """Every full-precision token held (sinks, tail) before the first encode, keys un-rotated: what a
        stateful codec's :meth:`~kvcomp.codecs.base.Codec.init_state` sees (e.g. the prompt)."""
        return self._to_encode(torch.cat([t for t in (self.sinks, self.tail) if t is not None], dim=2), 0)

    def take(self, count: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Remove the ``count`` oldest tail tokens: ``(first cache index, tokens as stored, tokens to encode)``
        (:meth:`_to_encode`)."""
        chunk = self.tail[:, :, :count]  # stays valid until the tail's next append (kvcomp.cache.growing)
        self.tail_buffer.drop_front(count)
        first = self.num_sinks + self.num_encoded
        return first, chunk, self._to_encode(chunk, first)

    def add_block(self, block: Block, chunk: torch.Tensor) -> FreshlyEncoded:
        """Record an encoded block (its payload already stored) that replaces ``chunk``."""
        self.blocks.append(block)
        self.pending.append(block)
        self.num_encoded += block.count
        positions = torch.arange(block.first, block.first + block.count, device=chunk.device)
        size = self.policy.block_size
        block_end = block.first + (positions - block.first) // size * size + size
        return FreshlyEncoded(positions, chunk, block_end + self.policy.window - 1)

    def _decode(self, block: Block) -> torch.Tensor:
        decoded = self.decoder(block)
        if self.pre_rope:
            return apply_rope(decoded, *self.rope(block.first, block.count))
        if self.offset is not None:
            return saturated(decoded.float() + self._rotated_offset(block.first, block.count, decoded), decoded.dtype)
        return decoded

    def decoded_blocks(self) -> torch.Tensor | None:
        """The encoded blocks decoded (keys re-rotated for pre-RoPE codecs); decodes only blocks not decoded
        before, or (``decode_per_step``) all of them, keeping nothing."""
        if self.decode_per_step:
            blocks = [self._decode(block) for block in self.blocks]
            return torch.cat(blocks, dim=2) if blocks else None
        for block in self.pending:
            self.decoded.append(self._decode(block))
        self.pending = []
        return self.decoded.view

    def parts(self) -> list[torch.Tensor]:
        """The held pieces in token order: sinks, decoded blocks, tail (views: valid until the next append)."""
        return [t for t in (self.sinks, self.decoded_blocks(), self.tail) if t is not None]

    def segments(self) -> list[torch.Tensor | Payload]:
        """The held pieces in token order with the encoded blocks as their payload (for fused kernels)."""
        return [t for t in (self.sinks, self.payload, self.tail) if t is not None]

    def materialize(self) -> torch.Tensor | None:
        """The stream as attention sees it now: ``[sinks, decode(blocks), tail]`` (None when empty)."""
        parts = self.parts()
        return torch.cat(parts, dim=2) if parts else None

    @property
    def num_values(self) -> int:
        """Number of K or V elements represented (batch x heads x tokens x head_dim)."""
        return self.batch * self.codec.model.num_kv_heads * self.codec.model.head_dim * self.length

    @property
    def full_precision_nbytes(self) -> int:
        """Bytes of the full-precision sinks and tail."""
        return sum(t.numel() * t.element_size() for t in (self.sinks, self.tail) if t is not None)

    @property
    def state_nbytes(self) -> int:
        return 0 if self.state is None else self.state.nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of storage held by the stream: full-precision sinks and tail, its encoded payloads, its state."""
        return self.full_precision_nbytes + self.store.nbytes + self.state_nbytes

    @property
    def working_nbytes(self) -> int:
        """Bytes held besides storage: the decoded copy of the torch path and spare capacity."""
        buffers = (self.decoded, self.tail_buffer)
        return self.decoded.nbytes + sum(g.reserved_nbytes for g in buffers) + self.store.reserved_nbytes

    @property
    def drops_in_place(self) -> bool:
        """Whether held tokens can be dropped where they are (:meth:`keep_tokens`): a stream that never encodes and
        holds no sinks (its tail is every token), or one whose every held token is encoded, one payload row per
        token in every payload tensor (a per-token codec with no sinks or window); keys neither rotated back nor
        offset by position (which would tie them to cache indices)."""
        if self.rotates or self.num_sinks:
            return False
        if self.policy.block_size is None:
            return True
        return (self.num_tail == 0 and self.store.layout == "tokens" and self.state is None
                and all(g.length == self.num_encoded for g in self.store.tensors.values()))

    def keep_tokens(self, kept: torch.Tensor, keep_decoded: bool) -> None:
        """Keep the held tokens ``kept [B, H or 1, k]`` (ascending indices, every KV head its own or all the same) and
        drop the rest, gathered to the front of the buffers that hold them (:attr:`drops_in_place`): the tail of a
        stream that never encodes, else the payload rows, nothing encoded again. ``keep_decoded``: the torch path's
        decoded copy (complete) keeps its kept rows too; else it is freed and the kept tokens are decoded when a read
        needs them."""
        if not self.drops_in_place:
            raise RuntimeError(f"{self.codec.name} {self.kind} stream: its held tokens cannot be dropped in place")

        def gather(t: torch.Tensor) -> torch.Tensor:
            if kept.shape[1] not in (1, t.shape[1]):
                raise RuntimeError(f"{self.codec.name} {self.kind} stream: a tensor of {t.shape[1]} heads; a press kept "
                                   f"tokens for {kept.shape[1]}")
            index = kept.to(t.device).expand(t.shape[0], t.shape[1], -1)
            return t.gather(2, index.reshape(*index.shape, *(1,) * (t.dim() - 3)).expand(*index.shape, *t.shape[3:]))

        count = kept.shape[-1]
        if self.policy.block_size is None:
            self.tail_buffer.keep(gather)
            self.length = count
            return
        for grown in self.store.tensors.values():
            grown.keep(gather)
        self.store.num_tokens, self.store.num_blocks = count, 1
        self.blocks = [Block(0, dict.fromkeys(self.store.tensors, 0), dict.fromkeys(self.store.tensors, count), 0, count)]
        if keep_decoded and not self.pending and self.decoded.length == self.num_encoded:
            self.decoded.keep(gather)
        else:
            self.decoded, self.pending = GrowingTensor(2, self.capacity), list(self.blocks)
        self.num_encoded = self.length = count

    def forget_decoded(self) -> None:
        """Free the torch path's decoded copy (a stream read from its payload needs none); its blocks are decoded
        again when that path reads them (every block is pending while nothing is decoded)."""
        if self.decoded.buffer is not None:
            self.decoded, self.pending = GrowingTensor(2, self.capacity), list(self.blocks)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (beam reorder, batch select / repeat) of everything held."""
        pick = lambda t: t.index_select(0, index.to(t.device))  # noqa: E731
        self.sinks = None if self.sinks is None else pick(self.sinks)
        self.tail_buffer.map(pick)
        self.store.select_rows(index)
        self.decoded.map(pick)
        self.batch = len(index)
        if self.state is not None:
            self.state.select_rows(index)
