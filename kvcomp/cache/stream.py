"""One layer's key or value stream: full-precision sinks, encoded blocks, full-precision tail."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    return b if a is None else torch.cat([a, b], dim=2)


class KVStream:
    """Stores one stream following its codec policy; see :class:`~kvcomp.codecs.base.StreamPolicy`.

    The storage is ``sinks``, ``payload`` and ``tail`` (what :attr:`nbytes` counts). For the torch
    reference attention path the stream also keeps ``decoded``, the payload's blocks decoded (and
    re-rotated) once, the first time attention reads them: blocks decode independently, so this equals
    decoding the whole payload at every step, without the per-step cost. It is working memory of the
    reference path, like the K/V tensor SDPA needs anyway, not cache storage; a stream whose attention
    reads the payload directly (:meth:`segments`, fused score kernels) never builds it.
    """

    def __init__(self, codec: Codec, kind: str, layer_idx: int):
        self.codec, self.kind, self.layer_idx = codec, kind, layer_idx
        self.policy = codec.policy(kind, layer_idx)
        self.pre_rope = codec.pre_rope and kind == "key"
        self.sinks: torch.Tensor | None = None
        self.payload: Payload | None = None
        self.decoded: torch.Tensor | None = None
        self.undecoded: list[tuple[Payload, tuple[torch.Tensor, torch.Tensor] | None]] = []  # blocks not in decoded yet
        self.tail: torch.Tensor | None = None
        self.length = 0
        self.frozen = False  # True: keep every further token in the full-precision tail

    def freeze(self) -> None:
        """Stop encoding: tokens appended from now on stay in full precision (the [REF] protocol that
        compresses the prompt only, never generated tokens)."""
        self.frozen = True

    @property
    def num_sinks(self) -> int:
        return 0 if self.sinks is None else self.sinks.shape[2]

    @property
    def num_encoded(self) -> int:
        return 0 if self.payload is None else self.payload.num_tokens

    @property
    def num_tail(self) -> int:
        return 0 if self.tail is None else self.tail.shape[2]

    def append(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> FreshlyEncoded | None:
        """Add ``x [B, H, n, D]``; encode every block the policy now allows. ``rope``: cos/sin of all
        cache positions so far ``[B, L, D]`` (needed for pre-RoPE keys only)."""
        self.length += x.shape[2]
        take = min(x.shape[2], self.policy.sinks - self.num_sinks)
        if take > 0:
            self.sinks = _cat(self.sinks, x[:, :, :take])
            x = x[:, :, take:]
        if x.shape[2]:
            self.tail = _cat(self.tail, x)
        block = self.policy.block_size
        if block is None or self.frozen or self.num_tail < self.policy.window + block:
            return None
        count = (self.num_tail - self.policy.window) // block * block
        chunk, self.tail = self.tail[:, :, :count], self.tail[:, :, count:]
        first = self.num_sinks + self.num_encoded
        positions = torch.arange(first, first + count, device=x.device)
        to_encode, block_rope = chunk, None
        if self.pre_rope:
            block_rope = tuple(t[:, first : first + count] for t in rope)
            to_encode = undo_rope(chunk, *block_rope)
        encoded = self.codec.encode(to_encode, self.kind, self.layer_idx)
        self.payload = encoded if self.payload is None else self.payload.concat(encoded)
        self.undecoded.append((encoded, block_rope))
        self.dtype = x.dtype
        block_end = first + (positions - first) // block * block + block
        visible_from = block_end + self.policy.window - 1
        return FreshlyEncoded(positions, chunk, visible_from)

    def decoded_blocks(self) -> torch.Tensor | None:
        """The payload decoded (keys re-rotated for pre-RoPE codecs); decodes only blocks not decoded before."""
        for encoded, block_rope in self.undecoded:
            decoded = self.codec.decode(encoded, self.kind, self.layer_idx, self.dtype)
            if block_rope is not None:
                decoded = apply_rope(decoded, *block_rope)
            self.decoded = _cat(self.decoded, decoded)
        self.undecoded = []
        return self.decoded

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
        held = [t for t in (self.sinks, self.tail) if t is not None]
        if self.payload is not None:
            held.append(next(iter(self.payload.tensors.values())))
        if not held:
            return 0
        return held[0].shape[0] * self.codec.model.num_kv_heads * self.codec.model.head_dim * self.length

    @property
    def nbytes(self) -> int:
        """Bytes held: full-precision sinks and tail plus the encoded payload."""
        held = [t for t in (self.sinks, self.tail) if t is not None]
        fp = sum(t.numel() * t.element_size() for t in held)
        return fp + (0 if self.payload is None else self.payload.nbytes)

    def map_batch(self, fn) -> None:
        """Apply a batch-dimension transform (beam reorder, repeat) to everything held."""
        self.sinks = None if self.sinks is None else fn(self.sinks)
        self.tail = None if self.tail is None else fn(self.tail)
        self.payload = None if self.payload is None else self.payload.map(fn)
        self.decoded = None if self.decoded is None else fn(self.decoded)
        self.undecoded = [
            (encoded.map(fn), None if block_rope is None else tuple(fn(t) for t in block_rope))
            for encoded, block_rope in self.undecoded
        ]
