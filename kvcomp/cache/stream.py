"""One layer's key or value stream: full-precision sinks, encoded blocks, full-precision tail."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcomp.cache.growing import GrowingTensor
from kvcomp.cache.rope import apply_rope, undo_rope
from kvcomp.codecs.base import Codec, Payload


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
    """Where one encoded block lies in a :class:`PayloadStore`: its first row of every payload tensor,
    its row counts, and its tokens (cache index of the first one, count). Holds no tensors."""

    rows: dict[str, int]
    sizes: dict[str, int]
    first: int
    count: int


class PayloadStore:
    """A stream's encoded blocks, appended in place (:class:`GrowingTensor` per payload tensor): an
    append never copies what is stored, and :meth:`view` is the whole payload without a copy."""

    def __init__(self):
        self.tensors: dict[str, GrowingTensor] = {}
        self.num_tokens = 0

    def append(self, payload: Payload, first: int) -> Block:
        rows = {k: self.tensors.setdefault(k, GrowingTensor(2)).length for k in payload.tensors}
        for k, t in payload.tensors.items():
            self.tensors[k].append(t)
        self.num_tokens += payload.num_tokens
        return Block(rows, {k: t.shape[2] for k, t in payload.tensors.items()}, first, payload.num_tokens)

    def view(self) -> Payload:
        return Payload({k: g.view for k, g in self.tensors.items()}, self.num_tokens)

    def block(self, block: Block) -> Payload:
        """One block's payload (views into the store)."""
        return Payload({k: g.view.narrow(2, block.rows[k], block.sizes[k]) for k, g in self.tensors.items()}, block.count)

    def map(self, fn) -> None:
        for g in self.tensors.values():
            g.map(fn)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.tensors.values())

    @property
    def reserved_nbytes(self) -> int:
        return sum(g.reserved_nbytes for g in self.tensors.values())


class KVStream:
    """Stores one stream following its codec policy; see :class:`~kvcomp.codecs.base.StreamPolicy`.

    Left padding: the first ``leading_pads`` cache positions (the most any row of the batch is padded)
    are kept with the sinks, so every row keeps at least ``policy.sinks`` real tokens in full precision
    and no pad token is ever encoded; a row padded by ``p`` keeps ``leading_pads - p`` more of its first
    tokens in full precision than it would alone (per-row schedules would make blocks ragged).

    The storage is ``sinks``, the encoded blocks (a :class:`PayloadStore`) and ``tail``; :attr:`nbytes`
    counts exactly these. Working memory, reported apart by :attr:`working_nbytes`: the store's spare
    capacity and, for the torch reference attention path, ``decoded``, the blocks decoded (and
    re-rotated) once, the first time attention reads them (blocks decode independently, so this equals
    decoding the whole payload at every step, without the per-step cost). ``decode_per_step=True``
    keeps no decoded copy: every read decodes the whole payload again (memory-true, slower). A stream
    whose attention reads the payload directly (:meth:`segments`, fused kernels) never decodes it.

    ``rope(first, count)`` returns the layer's cos/sin of cached tokens ``first .. first + count - 1``
    (pre-RoPE keys only): blocks are un-rotated before encoding and re-rotated when decoded, with the
    positions' own angles.
    """

    def __init__(self, codec: Codec, kind: str, layer_idx: int, rope=None, decode_per_step: bool = False):
        self.codec, self.kind, self.layer_idx = codec, kind, layer_idx
        self.rope, self.decode_per_step = rope, decode_per_step
        self.policy = codec.policy(kind, layer_idx)
        self.pre_rope = codec.pre_rope and kind == "key"
        self.sinks: torch.Tensor | None = None
        self.store = PayloadStore()
        self.decoded = GrowingTensor(2)  # the torch path's decoded blocks (working memory)
        self.pending: list[Block] = []  # encoded blocks not in ``decoded`` yet
        self.tail: torch.Tensor | None = None
        self.length = 0
        self.frozen = False  # True: keep every further token in the full-precision tail
        self.leading_pads = 0  # left padding of the batch: kept with the sinks, never encoded (set by the layer)

    def freeze(self) -> None:
        """Stop encoding: tokens appended from now on stay in full precision (the [REF] protocol that
        compresses the prompt only, never generated tokens)."""
        self.frozen = True

    @property
    def payload(self) -> Payload | None:
        """Every encoded block as one payload (views into the store, no copy); None before the first."""
        return self.store.view() if self.store.num_tokens else None

    @property
    def num_sinks(self) -> int:
        return 0 if self.sinks is None else self.sinks.shape[2]

    @property
    def num_encoded(self) -> int:
        return self.store.num_tokens

    @property
    def num_tail(self) -> int:
        return 0 if self.tail is None else self.tail.shape[2]

    def append(self, x: torch.Tensor) -> FreshlyEncoded | None:
        """Add ``x [B, H, n, D]``; encode every block the policy now allows."""
        self.length += x.shape[2]
        self.dtype = x.dtype
        take = min(x.shape[2], self.leading_pads + self.policy.sinks - self.num_sinks)
        if take > 0:
            self.sinks = _cat(self.sinks, x[:, :, :take])
            x = x[:, :, take:]
        if x.shape[2]:
            self.tail = _cat(self.tail, x)
        block = self.policy.block_size
        if block is None or self.frozen or self.num_tail < self.policy.window + block:
            return None
        count = (self.num_tail - self.policy.window) // block * block
        chunk, self.tail = self.tail[:, :, :count], self.tail[:, :, count:].clone()  # drop the encoded tokens
        first = self.num_sinks + self.num_encoded
        positions = torch.arange(first, first + count, device=x.device)
        to_encode = undo_rope(chunk, *self.rope(first, count)) if self.pre_rope else chunk
        encoded = self.codec.encode(to_encode, self.kind, self.layer_idx)
        self.pending.append(self.store.append(encoded, first))
        block_end = first + (positions - first) // block * block + block
        visible_from = block_end + self.policy.window - 1
        return FreshlyEncoded(positions, chunk, visible_from)

    def _decode(self, block: Block) -> torch.Tensor:
        decoded = self.codec.decode(self.store.block(block), self.kind, self.layer_idx, self.dtype)
        return apply_rope(decoded, *self.rope(block.first, block.count)) if self.pre_rope else decoded

    def decoded_blocks(self) -> torch.Tensor | None:
        """The payload decoded (keys re-rotated for pre-RoPE codecs); decodes only blocks not decoded
        before, or (``decode_per_step``) all of them, keeping nothing."""
        if self.decode_per_step:
            blocks = [self._decode(block) for block in self.pending]
            return torch.cat(blocks, dim=2) if blocks else None
        for block in self.pending:
            self.decoded.append(self._decode(block))
        self.pending = []
        return self.decoded.view

    def parts(self) -> list[torch.Tensor]:
        """The held pieces in token order: sinks, decoded blocks, tail (appends replace, never mutate, them)."""
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
        held = [t for t in (self.sinks, self.tail, *self.store.tensors.values()) if t is not None]
        if not held:
            return 0
        batch = (held[0].view if isinstance(held[0], GrowingTensor) else held[0]).shape[0]
        return batch * self.codec.model.num_kv_heads * self.codec.model.head_dim * self.length

    @property
    def nbytes(self) -> int:
        """Bytes of storage: full-precision sinks and tail plus the encoded payload."""
        held = [t for t in (self.sinks, self.tail) if t is not None]
        return sum(t.numel() * t.element_size() for t in held) + self.store.nbytes

    @property
    def working_nbytes(self) -> int:
        """Bytes held besides storage: the decoded copy of the torch path and the store's spare capacity."""
        return self.decoded.nbytes + self.decoded.reserved_nbytes + self.store.reserved_nbytes

    def map_batch(self, fn) -> None:
        """Apply a batch-dimension transform (beam reorder, repeat) to everything held."""
        self.sinks = None if self.sinks is None else fn(self.sinks)
        self.tail = None if self.tail is None else fn(self.tail)
        self.store.map(fn)
        self.decoded.map(fn)
