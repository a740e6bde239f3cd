"""Rows of a batch that share one schedule, so that a row is compressed by its own tokens only.

A left-padded batch holds rows whose first real token sits at different cache indices. A row's blocks
(sinks, then ``block_size`` tokens after them) must start at its own first real token, as when it runs
alone, or its compression would depend on the other rows' padding. The cache therefore groups rows by
their left padding (:class:`RowGroup`): each group has its own streams and scope, holds no pad token
(pads are masked out of attention anyway, and never stored or counted), and attends over its own columns
(:class:`ByRows`). A batch padded alike (no padding, or every row padded the same) is one group.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from kvcomp.cache.scopes import Scope
from kvcomp.cache.context import LayerContext, ForwardContext


@dataclass(eq=False)
class RowGroup:
    """Batch ``rows`` (None: every row) whose first ``pads`` cache positions are left padding, with the
    :class:`~kvcomp.cache.scopes.Scope` that schedules their blocks."""

    rows: list[int] | None
    pads: int
    scope: Scope
    indices: dict = field(default_factory=dict, repr=False)  # rows as a tensor, by device (made once: no copy per step)

    def move(self, rows: list[int] | None) -> None:
        """The group's rows are now ``rows`` (after a batch reorder)."""
        self.rows, self.indices = rows, {}

    def index(self, device: torch.device) -> torch.Tensor:
        if device not in self.indices:
            self.indices[device] = torch.tensor(self.rows, device=device)
        return self.indices[device]

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This group's rows of ``x`` (dim 0; a tensor broadcast over rows, batch 1, is kept)."""
        if self.rows is None or x.shape[0] == 1:
            return x
        return x.index_select(0, self.index(x.device))

    def tokens(self, x: torch.Tensor, first_forward: bool, dim: int) -> torch.Tensor:
        """This group's rows of a forward's tokens along ``dim``: the first forward's pads left out."""
        x = self.take(x)
        return x.narrow(dim, self.pads, x.shape[dim] - self.pads) if first_forward and self.pads else x

    def layer_context(self, context: LayerContext, first_forward: bool) -> LayerContext:
        """``context`` restricted to this group: its rows' and real tokens' position embeddings and ids."""
        rope = None if context.rope is None else tuple(self.tokens(t, first_forward, 1) for t in context.rope)
        positions = None if context.positions is None else self.tokens(context.positions, first_forward, 1)
        return replace(context, rope=rope, positions=positions)


def padding_groups(pads: list[int]) -> list[tuple[list[int] | None, int]]:
    """``(rows, pads)`` of each group of rows with the same left padding, by padding (one group, rows None,
    when every row is padded alike)."""
    distinct = sorted(set(pads))
    if len(distinct) <= 1:
        return [(None, distinct[0] if distinct else 0)]
    return [([r for r, p in enumerate(pads) if p == d], d) for d in distinct]


@dataclass
class ByRows:
    """What a grouped (or pressed) layer's attention reads: per :class:`RowGroup`, its read over its own cache
    columns (pads left out, and the ``evicted`` prompt tokens a press dropped before this forward), and whether this
    is the first forward (its pad queries are left out too and attend nothing: their output is zero)."""

    reads: list[tuple[RowGroup, object, int]]  # per row group: the group, its read, the prompt tokens it evicted
    first_forward: bool

    def attend(self, query: torch.Tensor, mask: torch.Tensor | None, forward: ForwardContext,
               attend: Callable[[torch.Tensor, torch.Tensor | None, object], torch.Tensor]) -> torch.Tensor:
        """Attention output ``[B, q, Hq, D]`` of ``query [B, Hq, q, D]``: ``attend(query, mask, read)`` per group."""
        b, hq, q, d = query.shape
        if len(self.reads) == 1 and self.reads[0][0].rows is None and not self.first_forward:
            group, read, evicted = self.reads[0]
            return attend(query, forward.columns(mask, group, self.first_forward, evicted), read)
        out = query.new_zeros(b, q, hq, d)
        for group, read, evicted in self.reads:
            skipped = group.pads if self.first_forward else 0
            got = attend(group.tokens(query, self.first_forward, 2), forward.columns(mask, group, self.first_forward, evicted),
                         read)
            rows = slice(None) if group.rows is None else group.index(query.device)
            out[rows, skipped:] = got
        return out
