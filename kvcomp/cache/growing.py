"""Tensors that grow at one end (and may shrink at the other) along one dimension without copying what
they hold on every append.

A :class:`GrowingTensor` keeps a buffer with spare capacity (:func:`spare`: 1/8 of what it holds, at
most 256 entries), so appending one entry costs ``O(1)`` amortised copies (``O(length / 256)`` for
long buffers) instead of the ``O(length)`` of ``torch.cat``; :meth:`drop_front` forgets the oldest entries
and moves the live ones to a fitting buffer once the dropped ones outnumber them. Without a reserve,
appended entries are never overwritten (a move allocates a new buffer), so a :attr:`view` handed out
earlier stays valid; only :meth:`keep` (a press's kept entries) rewrites the buffer in place, and counts it in
:attr:`generation`.
:attr:`nbytes` counts the live entries (storage) and :attr:`reserved_nbytes` the rest of the buffer
(spare capacity and dropped entries: working memory), so the two together are what the buffer occupies.

Preallocated capacity (``reserve``, :class:`~kvcomp.cache.CompressedCache`'s ``capacity``): the first
buffer holds ``reserve`` entries (more only for a longer first append), so appends within it never
allocate. A tensor that also drops
(``standby=True``: a stream's full-precision tail, a window sliding over the sequence) keeps a second
buffer of ``reserve`` entries: when an append does not fit at the end, the live entries move to the other
buffer and the two swap, so a steady stream of appends and drops allocates nothing. Entries are then
overwritten, but never those of the buffer in use: a view stays valid until the tensor has moved twice,
i.e. at least until its next append (what a cache layer's views need within one forward).
A reserved buffer of :data:`CHECKED_FROM` bytes or more that exceeds the memory its device has available is
refused (:class:`~kvcomp.errors.ConfigError` with both numbers) before it is allocated.
"""

from __future__ import annotations

import torch

from kvcomp.cache.memory import check_fits

SPARE_FRACTION, SPARE_MAX = 0.125, 256
CHECKED_FROM = 1 << 24  # bytes: smaller reservations are not checked against available memory (cheaper to try)


def spare(length: int) -> int:
    """Spare entries allocated beyond ``length``: 1/8 of it, between 16 and :data:`SPARE_MAX`."""
    return min(SPARE_MAX, max(16, int(SPARE_FRACTION * length)))


class GrowingTensor:
    """A tensor that grows along ``dim``; read it through :attr:`view`. ``reserve`` / ``standby``:
    preallocated capacity (see the module docstring)."""

    def __init__(self, dim: int, reserve: int = 0, standby: bool = False):
        self.dim, self.reserve, self.keeps_standby = dim, reserve, standby and reserve > 0
        self.buffer: torch.Tensor | None = None
        self.standby: torch.Tensor | None = None  # the second buffer of ``reserve`` entries (standby=True)
        self.start = 0  # first live entry of the buffer
        self.end = 0  # one past the last written entry
        self.generation = 0  # counts keep(): entries rewritten in place, which readers of new entries must look at again

    @property
    def length(self) -> int:
        """Number of live entries."""
        return self.end - self.start

    @property
    def view(self) -> torch.Tensor | None:
        return None if self.buffer is None else self.buffer.narrow(self.dim, self.start, self.length)

    def append(self, x: torch.Tensor) -> None:
        n = x.shape[self.dim]
        dtype = x.dtype if self.buffer is None else torch.promote_types(self.buffer.dtype, x.dtype)
        if self.buffer is None or dtype != self.buffer.dtype or self.end + n > self.buffer.shape[self.dim]:
            self._move(self.length + n, dtype, x)
        self.buffer.narrow(self.dim, self.end, n).copy_(x)
        self.end += n

    def _empty(self, entries: int, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
        shape = list(like.shape)
        shape[self.dim] = entries
        return torch.empty(shape, dtype=dtype, device=like.device)

    def _reserved(self, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
        """A buffer of ``reserve`` entries, refused before allocating when its device cannot hold it."""
        shape = list(like.shape)
        shape[self.dim] = self.reserve
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if nbytes >= CHECKED_FROM:
            check_fits(nbytes, like.device, f"reserving {self.reserve} entries (a {dtype} buffer of shape {shape})",
                       "lower CompressedCache(capacity=...) (tokens per sequence) or the batch size, or leave "
                       "capacity=None to grow as needed")
        return self._empty(self.reserve, dtype, like)

    def _fits_standby(self, need: int, dtype: torch.dtype) -> bool:
        return self.standby is not None and need <= self.reserve and self.standby.dtype == dtype

    def _move(self, need: int, dtype: torch.dtype, like: torch.Tensor) -> None:
        """Put the live entries at the start of a buffer for ``need`` entries: the standby buffer where they
        fit (the two swap), else a new one of ``reserve`` entries where they fit, else of ``need`` plus
        :func:`spare` (earlier views keep the old buffer)."""
        old = self.buffer
        if self._fits_standby(need, dtype):
            moved, self.standby = self.standby, old if old.shape[self.dim] == self.reserve else None
        else:
            moved = self._reserved(dtype, like) if need <= self.reserve else self._empty(need + spare(need), dtype, like)
        if self.length:
            moved.narrow(self.dim, 0, self.length).copy_(self.view)
        self.buffer, self.start, self.end = moved, 0, self.length
        if self.keeps_standby and (self.standby is None or self.standby.dtype != dtype):
            self.standby = self._reserved(dtype, like)

    def drop_front(self, n: int) -> None:
        """Forget the ``n`` oldest entries; once the dropped entries outnumber the live ones (and 16), move
        the live ones to a fitting buffer, freeing the rest. With a standby buffer, only a buffer larger
        than ``reserve`` (after a long append) moves, to the standby one, once the live entries fit it."""
        if self.buffer is None:
            return
        self.start += min(n, self.length)
        if self.keeps_standby:
            if self.buffer.shape[self.dim] > self.reserve and self.length <= self.reserve:
                self._move(self.length, self.buffer.dtype, self.buffer)
        elif self.start > max(self.length, 16):
            self._move(self.length, self.buffer.dtype, self.buffer)

    def map(self, fn) -> None:
        """Replace the content by ``fn(view)`` (batch reorder / select / repeat), without spare capacity;
        with a reserve, the result is copied into newly reserved buffers instead."""
        if self.buffer is None:
            return
        mapped = fn(self.view)
        self.buffer, self.standby, self.start, self.end = None, None, 0, 0
        if self.reserve:
            self.append(mapped)
        else:
            self.buffer, self.end = mapped.contiguous(), mapped.shape[self.dim]

    def keep(self, fn) -> None:
        """Replace the content by ``fn(view)``, no longer than it (a press's kept entries), written over the front of
        the buffer in place (views handed out earlier see the overwritten entries: a cache layer presses before it
        hands out the views of a forward); without a reserve, a buffer that would then be mostly empty (as
        :meth:`drop_front` decides) is replaced by one that fits."""
        if self.buffer is None:
            return
        kept = fn(self.view)
        n = kept.shape[self.dim]
        if not self.reserve and self.buffer.shape[self.dim] - n > max(n, 16) + spare(n):
            self.buffer = self._empty(n + spare(n), self.buffer.dtype, self.buffer)
        self.buffer.narrow(self.dim, 0, n).copy_(kept)
        self.start, self.end = 0, n
        self.generation += 1

    @property
    def nbytes(self) -> int:
        view = self.view
        return 0 if view is None else view.numel() * view.element_size()

    @property
    def reserved_nbytes(self) -> int:
        """Spare capacity, dropped entries and the standby buffer: allocated but holding nothing live."""
        held = sum(t.numel() * t.element_size() for t in (self.buffer, self.standby) if t is not None)
        return held - self.nbytes
