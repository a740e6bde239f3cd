"""Tensors that grow along one dimension without copying what they hold on every append.

A :class:`GrowingTensor` keeps a buffer with spare capacity (doubling when full), so appending ``n``
entries costs ``O(n)`` amortised instead of the ``O(length)`` of ``torch.cat``. :attr:`view` is the used
part (a view, no copy); :attr:`nbytes` counts the used part (storage) and :attr:`reserved_nbytes` the
spare capacity (working memory), so the two together are exactly what the buffer occupies.
"""

from __future__ import annotations

import torch


class GrowingTensor:
    """A tensor that grows along ``dim``; read it through :attr:`view`."""

    def __init__(self, dim: int):
        self.dim = dim
        self.buffer: torch.Tensor | None = None
        self.length = 0

    @property
    def view(self) -> torch.Tensor | None:
        return None if self.buffer is None else self.buffer.narrow(self.dim, 0, self.length)

    def append(self, x: torch.Tensor) -> None:
        n = x.shape[self.dim]
        dtype = x.dtype if self.buffer is None else torch.promote_types(self.buffer.dtype, x.dtype)
        if self.buffer is not None and dtype != self.buffer.dtype:  # e.g. float16 params promoted by one block
            self.buffer = self.buffer.to(dtype)
        if self.buffer is None or self.length + n > self.buffer.shape[self.dim]:
            capacity = max(2 * self.length, self.length + n, 16)
            shape = list(x.shape)
            shape[self.dim] = capacity
            grown = torch.empty(shape, dtype=dtype, device=x.device)
            if self.length:
                grown.narrow(self.dim, 0, self.length).copy_(self.view)
            self.buffer = grown
        self.buffer.narrow(self.dim, self.length, n).copy_(x)
        self.length += n

    def map(self, fn) -> None:
        """Replace the content by ``fn(view)`` (batch reorder / select / repeat), without spare capacity."""
        if self.buffer is not None:
            self.buffer = fn(self.view).contiguous()
            self.length = self.buffer.shape[self.dim]

    @property
    def nbytes(self) -> int:
        view = self.view
        return 0 if view is None else view.numel() * view.element_size()

    @property
    def reserved_nbytes(self) -> int:
        """Spare capacity: allocated but holding nothing yet."""
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size() - self.nbytes
