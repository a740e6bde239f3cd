"""TOVA (Oren et al. 2024, "Transformers are Multi-State RNNs", arXiv 2401.06104; kvpress's ``TOVAPress``): at the end
of the prefill, the last token's attention over the prompt, averaged over all query heads of the layer, scores
every token, and every KV head keeps the same ones; the last token is always kept (kvpress). While decoding
(``decoding_size``; ``decoding_interval=1`` is the authors' cache, one token evicted per step once full), the held
tokens are scored the same way by the last query of the previous forward, whose attention had seen all of them: the
authors evict after each step's attention, which the next step's press does here."""

from __future__ import annotations

import torch

from kvcomp.presses.base import Prefill, Press, kept_first, register, window_attention


@register
class TOVAPress(Press):
    name = "tova"
    shared_across_heads = True
    decodes = True

    def scores(self, prefill: Prefill) -> torch.Tensor:
        weights = window_attention(prefill, 1)[:, :, 0, :-1]  # [B, Hq, n - 1]: the last query, without itself
        return kept_first(weights.mean(dim=1, keepdim=True), 1, at_end=True)
