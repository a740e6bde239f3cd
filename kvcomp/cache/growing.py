"""Tensors that grow at one end (and may shrink at the other) along one dimension without copying what
they hold on every append.

A :class:`GrowingTensor` keeps a buffer with spare capacity (:func:`spare`: 1/8 of what it holds, at
most 256 entries), so appending one entry costs ``O(1)`` amortised copies (``O(length / 256)`` for
long buffers) instead of the ``O(length)`` of ``torch.cat``; :meth:`drop_front` forgets the oldest entries
and moves the live ones to a fitting buffer once the dropped ones outnumber them. Written entries are
never overwritten (a move allocates a new buffer), so a :attr:`view` handed out earlier stays valid.
:attr:`nbytes` counts the live entries (storage) and :attr:`reserved_nbytes` the rest of the buffer
(spare capacity and dropped entries: working memory), so the two together are what the buffer occupies.
"""

from __future__ import annotations

import torch

SPARE_FRACTION, SPARE_MAX = 0.125, 256


def spare(length: int) -> int:
    """Spare entries allocated beyond ``length``: 1/8 of it, between 16 and :data:`SPARE_MAX`."""
    return min(SPARE_MAX, max(16, int(SPARE_FRACTION * length)))


class GrowingTensor:
    """A tensor that grows along ``dim``; read it through :attr:`view`."""

    def __init__(self, dim: int):
        self.dim = dim
        self.buffer: torch.Tensor | None = None
        self.start = 0  # first live entry of the buffer
        self.end = 0  # one past the last written entry

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

    def _move(self, need: int, dtype: torch.dtype, like: torch.Tensor) -> None:
        """Put the live entries at the start of a new buffer for ``need`` entries plus :func:`spare` (earlier
        views keep the old buffer)."""
        shape = list(like.shape)
        shape[self.dim] = need + spare(need)
        moved = torch.empty(shape, dtype=dtype, device=like.device)
        if self.length:
            moved.narrow(self.dim, 0, self.length).copy_(self.view)
        self.buffer, self.start, self.end = moved, 0, self.length

    def drop_front(self, n: int) -> None:
        """Forget the ``n`` oldest entries; once the dropped entries outnumber the live ones (and 16), move
        the live ones to a fitting buffer, freeing the rest."""
        self.start += min(n, self.length)
        if self.start > max(self.length, 16):
            self._move(self.length, self.buffer.dtype, self.buffer)

    def map(self, fn) -> None:
        """Replace the content by ``fn(view)`` (batch reorder / select / repeat), without spare capacity."""
        if self.buffer is not None:
            self.buffer = fn(self.view).contiguous()
            self.start, self.end = 0, self.buffer.shape[self.dim]

    @property
    def nbytes(self) -> int:
        view = self.view
        return 0 if view is None else view.numel() * view.element_size()

    @property
    def reserved_nbytes(self) -> int:
        """Spare capacity and dropped entries: allocated but holding nothing live."""
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size() - self.nbytes
