"""A prompt pressed with a budget per KV head (AdaKV, ``press.head_budgets=adakv``), held ragged, and how later
forwards attend to it.

AdaKV (Feng et al. 2024, arXiv 2407.11550) keeps ``H k`` tokens per row and layer, as a uniform press does, but the
heads share them out: one head may keep most of its prompt and another little. kvpress simulates this by masking the
evicted keys of a full-size cache; here each head's kept tokens are stored end to end, ``[B, H k, D]`` (every row
holds the same ``H k``), with the count of each head, so the bytes held are those of the kept tokens only. Attention
reads them as ``[B, H, W, D]`` (``W``: the largest count of the prompt), each head's unused places masked: a copy made
in each forward's attention and dropped with it, never held by the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcomp.cache.reads import Reads


def _gathered(x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """Tokens ``flat [B, m]`` (indices ``h n + t``) of ``x [B, H, n, D]``, as ``[B, m, D]``."""
    b, h, n, d = x.shape
    return x.reshape(b, h * n, d).gather(1, flat[..., None].expand(-1, -1, d))


@dataclass(eq=False)
class HeadwisePrefix:
    """One row group's pressed prompt, each KV head its own count of tokens: ``keys`` and ``values`` ``[B, H k, D]``
    (head by head, each head's tokens in cache order), ``counts [B, H]`` (the tokens of each head) and ``width``, the
    largest count when it was pressed (an upper bound after rows are reselected)."""

    keys: torch.Tensor
    values: torch.Tensor
    counts: torch.Tensor
    width: int

    @classmethod
    def pressed(cls, keys: torch.Tensor, values: torch.Tensor, flat: torch.Tensor, counts: torch.Tensor) -> HeadwisePrefix:
        """The kept tokens ``flat`` and ``counts`` (:meth:`~kvcomp.presses.base.Press.keep_per_layer`) of the prompt's
        ``keys`` and ``values`` ``[B, H, n, D]``; reads the largest count once (a host sync per layer and prompt)."""
        return cls(_gathered(keys, flat), _gathered(values, flat), counts, int(counts.max()))

    @property
    def tokens_per_head(self) -> int:
        """``k``: the tokens held per row, over the heads."""
        return self.keys.shape[1] // self.counts.shape[1]

    @property
    def batch(self) -> int:
        return self.keys.shape[0]

    @property
    def num_values(self) -> int:
        """K or V elements held (batch x tokens of every head x head_dim)."""
        return self.keys.numel()

    @property
    def nbytes(self) -> int:
        """Bytes of the kept keys and values."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    @property
    def bookkeeping_nbytes(self) -> int:
        """Bytes of the counts per head."""
        return self.counts.numel() * self.counts.element_size()

    def select_rows(self, index: torch.Tensor) -> None:
        index = index.to(self.keys.device)
        self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)
        self.counts = self.counts.index_select(0, index)

    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, values)`` as ``[B, H, W, D]`` (zeros where a head holds fewer than ``W``) and which places hold a
        token, ``[B, H, W]``: a copy for one forward's attention."""
        b, m, d = self.keys.shape
        h, w = self.counts.shape[1], self.width
        ends = self.counts.cumsum(1)
        head = torch.searchsorted(ends, torch.arange(m, device=ends.device).expand(b, m).contiguous(), right=True)
        place = head * w + torch.arange(m, device=ends.device) - (ends - self.counts).gather(1, head)

        def spread(x: torch.Tensor) -> torch.Tensor:
            out = x.new_zeros(b, h * w, d)
            return out.scatter_(1, place[..., None].expand(-1, -1, d), x).view(b, h, w, d)

        valid = torch.arange(w, device=ends.device) < self.counts[..., None]
        return spread(self.keys), spread(self.values), valid


@dataclass
class HeadwiseReads(Reads):
    """A forward after a per-head pressed prompt: attention over the ``prefix`` (each head its own kept tokens) and
    the tokens held after it (``keys``/``values`` ``[B, H, t, D]``, the last ones this forward's). The mask's columns
    are the prompt's kept tokens (``k`` of them, every one visible to later queries) then the ``t`` later ones; the
    prefix is masked by its counts instead."""

    prefix: HeadwisePrefix
    keys: torch.Tensor
    values: torch.Tensor

    def attend(self, query, mask, scaling, forward):
        b, hq, q, _ = query.shape
        keys, values, valid = self.prefix.padded()
        t = self.keys.shape[2]
        if mask is None:  # causal over the later tokens
            later = torch.ones(q, t, dtype=torch.bool, device=query.device).tril(t - q)
        else:  # bool, or additive (its biases kept)
            later = mask[..., -t:]
        prefix = valid[:, :, None].expand(-1, -1, q, -1).repeat_interleave(hq // keys.shape[1], dim=1)
        if later.dtype != torch.bool:
            prefix = torch.zeros((), dtype=later.dtype, device=later.device).masked_fill(~prefix, torch.finfo(later.dtype).min)
        columns = torch.cat([prefix, later.expand(b, hq, q, t)], dim=-1)
        out = F.scaled_dot_product_attention(query, torch.cat([keys, self.keys], dim=2).to(query.dtype),
                                             torch.cat([values, self.values], dim=2).to(query.dtype), attn_mask=columns,
                                             scale=scaling, enable_gqa=keys.shape[1] != hq)
        return out.transpose(1, 2).contiguous(), None
