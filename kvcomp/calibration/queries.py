"""The queries' second moments, per layer and KV head: what attention-aware codecs (OSCAR) fit their rotations on.

A key error ``e`` changes the logit of a query ``q`` by ``q^T e``, whose mean square over the queries a KV head meets is
``e^T E[q q^T] e``. :func:`query_moments` runs one forward per calibration window through transformers' attention
interface with an attention function that adds up ``q q^T`` over the post-RoPE queries (as attention receives them) of
every KV head's query group (GQA: query heads ``h g .. h g + g - 1`` read KV head ``h``, as ``repeat_kv`` orders them)
and the window's positions from ``drop_first`` on, then attends with transformers' SDPA; the model's own attention
implementation is back afterwards. Queries are never stored: only the ``[kv_heads, head_dim, head_dim]`` sums.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvcomp.codecs import ModelInfo
from kvcomp.progress import progress

QUERY_ATTENTION = "kvcomp_queries"  # the attention implementation registered while queries are recorded


class _QuerySums:
    """Per model layer, ``sum q q^T`` (float64) over each KV head's query group, and how many queries it adds up."""

    def __init__(self, info: ModelInfo, drop_first: int):
        self.layers, self.heads, self.drop_first = set(info.model_layers), info.num_kv_heads, drop_first
        self.sums: dict[int, torch.Tensor] = {}
        self.counts: dict[int, int] = {}

    def attention(self, module, query, key, value, attention_mask, **kwargs):
        layer = getattr(module, "layer_idx", None)
        if layer in self.layers:
            batch, query_heads, _, head_dim = query.shape
            q = query[:, :, self.drop_first:].detach().double()
            q = q.reshape(batch, self.heads, query_heads // self.heads, -1, head_dim).transpose(0, 1)
            q = q.reshape(self.heads, -1, head_dim)  # [kv_heads, queries of the group, head_dim]
            self.sums[layer] = q.transpose(1, 2) @ q + self.sums.get(layer, 0)
            self.counts[layer] = self.counts.get(layer, 0) + q.shape[1]
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def query_moments(model, info: ModelInfo, windows: torch.Tensor, drop_first: int = 0) -> dict[int, torch.Tensor]:
    """``E[q q^T]`` float32 ``[kv_heads, head_dim, head_dim]`` (CPU) per codec layer of ``info``, over the post-RoPE
    queries of ``windows`` ``[num_windows, seq_len]`` from position ``drop_first`` on."""
    from transformers import AttentionInterface  # transformers' model stack (seconds to import): only when used
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    recorder = _QuerySums(info, drop_first)
    AttentionInterface.register(QUERY_ATTENTION, recorder.attention)
    AttentionMaskInterface.register(QUERY_ATTENTION, sdpa_mask)
    device = next(model.parameters()).device
    before = model.config._attn_implementation
    model.set_attn_implementation(QUERY_ATTENTION)
    try:
        with torch.no_grad():
            for window in progress(windows, "calibration queries", unit="window"):
                model(window[None].to(device), use_cache=False)
    finally:
        model.set_attn_implementation(before)
    return {layer: (recorder.sums[model_layer] / recorder.counts[model_layer]).float().cpu()
            for layer, model_layer in enumerate(info.model_layers)}
