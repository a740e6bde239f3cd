"""Tensors that grow at one end (and may shrink at the other) along one dimension without copying what
they hold on every append.

A :class:`GrowingTensor` keeps a buffer with spare capacity (growing by :data:`GROWTH` when full), so
appending ``n`` entries costs ``O(n)`` amortised instead of the ``O(length)`` of ``torch.cat``;
:meth:`drop_front` forgets the oldest entries without a copy. Written entries are never overwritten, so a
:attr:`view` handed out earlier stays valid after later appends and drops. :attr:`nbytes` counts the
live entries (storage) and :attr:`reserved_nbytes` the rest of the buffer (spare capacity and dropped
entries: working memory), so the two together are exactly what the buffer occupies.
"""

from __future__ import annotations

import torch

GROWTH = 1.25  # capacity after a reallocation, relative to the entries kept: at most 20 % spare


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
            live = self.view
            shape = list(x.shape)
            shape[self.dim] = max(int(GROWTH * (self.length + n)), self.length + n, 16)
            grown = torch.empty(shape, dtype=dtype, device=x.device)  # a new buffer: earlier views keep the old one
            if self.length:
                grown.narrow(self.dim, 0, self.length).copy_(live)
            self.buffer, self.start, self.end = grown, 0, self.length
        self.buffer.narrow(self.dim, self.end, n).copy_(x)
        self.end += n

    def drop_front(self, n: int) -> None:
        """Forget the ``n`` oldest entries (no copy; their memory is reused at the next reallocation)."""
        self.start += min(n, self.length)

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
