"""What a compressed layer's attention reads in one forward (:class:`Reads`), and how it attends.

The kvcomp attention function hands a layer the fresh keys and values with its context
(:meth:`~kvcomp.cache.context.ContextLayer.update_in_context`); the layer stores them and returns what attention reads.
For decode steps and the ``simulated`` protocol that is ``(keys, values)`` for SDPA, over
``[sinks, decoded blocks, tail]``.

Under the ``streaming`` protocol a multi-token forward (prefill, chunked perplexity) must show each
query the cache *as it was when that query's token arrived*: a block encoded within the forward is
seen in full precision by the queries before the token that completed its schedule, and encoded by
that query and later ones. Keys and values may follow different schedules, so a freshly encoded token
can be in up to three states (both full precision; one encoded; both encoded). The function appends
the earlier states as extra key/value columns and masks every column to the queries that would have
seen it, which gives exactly the logits of feeding the tokens one by one.

Decode steps read the payloads directly when ``install(model, kernel_backend="triton")`` selected kernels
(:func:`payload_read`): the layer returns its key and
value segments (sinks, payload, tail, plus the fresh token under ``exact_prefill``) and

- codecs with a payload reader (:class:`~kvcomp.codecs.base.FusedPayload`: uniform/KIVI, the codebook codecs, QJL,
  and the 2026 baselines' fp8, int_token_head, nvfp4, TurboQuant, EDEN, KVarN, OSCAR) run the fused
  decode-attention kernel (:mod:`kvcomp.kernels.decode_attention`; :class:`FusedDecode`): K and V decoded in registers (QJL's
  keys scored from their sign bits), never in memory;
- codecs with a fused score path (``payload_scores``) whose format the kernel cannot read (QJL with groups
  that are not a power of two of at least 16 tokens) score the encoded keys with their kernel and decode
  the values (:class:`FromSegments`);
- codecs with a payload value path (``payload_values``, CSR's ``D u`` with ``desparse=fused``, on any
  backend) decode the keys and weight the encoded values without decoding them (:class:`FromSegments`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcomp.cache.context import LayerContext, ForwardContext
from kvcomp.cache.stream import FreshlyEncoded
from kvcomp.codecs.base import Codec, Payload, SequenceState, reads_fused, scores_from_payload, values_from_payload
from kvcomp.kernels.decode_attention import decode_attention
from kvcomp.cache.tiles import decode_attention_tiles
from kvcomp.kernels.formats import RotaryPositions


class Reads(ABC):
    """What one layer's attention reads in a forward beyond plain SDPA over ``(keys, values)``."""

    @abstractmethod
    def attend(self, query: torch.Tensor, mask: torch.Tensor | None, scaling: float | None,
               forward: ForwardContext) -> tuple[torch.Tensor, None]:
        """Attention output ``[B, q, Hq, D]`` of ``query [B, Hq, q, D]``."""


@dataclass
class Streaming(Reads):
    """A multi-token forward under the ``streaming`` protocol that encoded blocks: the cache as stored
    (``keys``, ``values``) and, per stream, the tokens this forward encoded (see the module docstring)."""

    keys: torch.Tensor
    values: torch.Tensor
    fresh_keys: FreshlyEncoded | None
    fresh_values: FreshlyEncoded | None

    def attend(self, query, mask, scaling, forward):
        key, value, mask = _streaming_columns(query, self.keys, self.values, mask, self.fresh_keys, self.fresh_values)
        mask = mask | ~mask.any(-1, keepdim=True)  # rows with nothing to attend (left padding) stay finite
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                             enable_gqa=key.shape[1] != query.shape[1])
        return out.transpose(1, 2).contiguous(), None


@dataclass
class FromSegments(Reads):
    """Key and value segments in cache order (full-precision tensors: sinks, decoded blocks, tail, fresh
    tokens; or payloads): encoded keys are scored by the codec's kernel (``payload_scores``), encoded values
    weighted by ``payload_values`` (with the value stream's state), the rest by matmuls."""

    keys: list
    values: list
    codec: Codec
    layer_idx: int
    kernel_backend: str
    value_state: SequenceState | None

    def attend(self, query, mask, scaling, forward):
        return _attention_from_segments(self, query, self.keys, self.values, mask, scaling)


@dataclass
class FusedDecode(Reads):
    """One decode step read straight from the payloads by the fused decode-attention kernel
    (:mod:`kvcomp.kernels.decode_attention`): ``length`` cached tokens; the mask's valid tokens become one range
    per sequence, planned once per step (:meth:`~kvcomp.cache.context.Step.valid_tokens`); ``key_rope`` rotates
    pre-RoPE keys (or the key offset of a post-RoPE codec's ``center``)."""

    keys: list
    values: list
    codec: Codec
    layer_idx: int
    kernel_backend: str
    key_rope: RotaryPositions | None
    length: int

    def attend(self, query, mask, scaling, forward):
        def readers(segments, kind):
            return [self.codec.fused_reader(s, kind, self.layer_idx) if isinstance(s, Payload) else s for s in segments]

        b, _, _, d = query.shape
        scale = d**-0.5 if scaling is None else scaling
        if self.kernel_backend == "torch":  # read tile by tile, nothing decoded beyond a tile
            valid = forward.valid_tokens(mask, self.length, b)
            out = decode_attention_tiles(query[:, :, 0], self.keys, self.values, self.codec.model.num_kv_heads, scale,
                                         None if valid is None else valid.mask, self.key_rope,
                                         lambda payload, kind: self.codec.fused_reader(payload, kind, self.layer_idx))
            return out[:, None], None
        out = decode_attention(query[:, :, 0], readers(self.keys, "key"), readers(self.values, "value"),
                               scale, forward.valid_tokens(mask, self.length, b),
                               self.key_rope, self.kernel_backend, step=forward.decode)
        return out[:, None], None



def payload_read(codec: Codec, layer_idx: int, part, context: LayerContext | None, tiles: bool) -> str | None:
    """How a decode step reads a row group's streams (``part``, a :class:`~kvcomp.cache.layer.LayerPart`):
    ``"attention"``: both payloads are read where they are stored (:class:`~kvcomp.codecs.base.FusedPayload`; pre-RoPE
    keys need fixed RoPE frequencies and every token's position), by the fused decode-attention kernel
    (``kernel_backend="triton"``) or, on the torch backend where ``tiles``, tile by tile
    (:mod:`kvcomp.cache.tiles`); ``"scores"`` (where the kernel cannot read the format): the codec's kernel
    scores the key payload (:class:`~kvcomp.codecs.base.PayloadScores`), values are decoded; ``"values"`` (any
    backend, :class:`~kvcomp.codecs.base.PayloadValues`): keys are decoded, the codec weights the value payload;
    ``None``: the decoded blocks (also without kvcomp's attention, ``context`` None). Keys with a rotated offset are
    read by the fused kernel only (it adds the offset's score, with the same needs as pre-RoPE keys)."""
    if context is None or part.prefix is not None:
        return None
    if values_from_payload(codec):
        return "values"
    in_place = (not part.streams[0].rotates or part.positions.recomputed) and reads_fused(codec, layer_idx)
    if context.kernel_backend != "triton":
        return "attention" if tiles and in_place else None
    if in_place:
        return "attention"
    if part.streams[0].rotation.offset is not None:
        return None
    return "scores" if scores_from_payload(codec) else None

def _attention_from_segments(read: "FromSegments", query, keys, values, attention_mask, scaling):
    """Attention over key and value segments in cache order (full-precision tensors: sinks, decoded blocks, tail,
    fresh tokens; or payloads): encoded keys are scored by the codec's kernel (``payload_scores``), encoded
    values weighted by ``payload_values``, the rest by matmuls. Columns are in cache order, as the mask expects."""
    b, hq, tq, d = query.shape
    h = read.codec.model.num_kv_heads
    grouped = query.float().reshape(b, h, (hq // h) * tq, d)
    columns = []
    for segment in keys:
        if isinstance(segment, Payload):
            columns.append(read.codec.payload_scores(query, segment, read.layer_idx, read.kernel_backend))
        else:
            columns.append((grouped @ segment.float().transpose(-1, -2)).reshape(b, hq, tq, -1))
    logits = torch.cat(columns, dim=-1) * (d**-0.5 if scaling is None else scaling)
    if attention_mask is not None:
        mask = attention_mask[..., : logits.shape[-1]]
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    probs = torch.softmax(logits, dim=-1)
    out, first = 0.0, 0
    for segment in values:
        count = segment.num_tokens if isinstance(segment, Payload) else segment.shape[2]
        weights = probs[..., first:first + count]
        if isinstance(segment, Payload):
            out = out + read.codec.payload_values(weights, segment, read.layer_idx, read.value_state)
        else:
            out = out + (weights.reshape(b, h, -1, count) @ segment.float()).reshape(b, hq, tq, d)
        first += count
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _streaming_columns(query, key, value, attention_mask, fresh_keys, fresh_values):
    """Extend K/V with the pre-encoding states of freshly encoded tokens and build the matching mask."""
    q_len, kv_len = query.shape[2], key.shape[2]
    device = key.device
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    if attention_mask is None:
        base = (torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None])[None, None]
    else:
        base = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    base = base[..., :kv_len]

    # visible_from per cache position; -1: this stream's state does not change during the forward
    t_key = torch.full((kv_len,), -1, device=device)
    t_value = torch.full((kv_len,), -1, device=device)
    for t, fresh in ((t_key, fresh_keys), (t_value, fresh_values)):
        if fresh is not None:
            t[fresh.positions] = fresh.visible_from
    changed = torch.nonzero((t_key >= 0) | (t_value >= 0)).squeeze(1)

    def before_encoding(x, fresh):
        """States of the changed positions before this forward encoded them."""
        states = x[:, :, changed].clone()
        if fresh is not None:
            states[:, :, torch.searchsorted(changed, fresh.positions)] = fresh.full_precision.to(x.dtype)
        return states

    early_key, early_value = before_encoding(key, fresh_keys), before_encoding(value, fresh_values)
    lo = torch.minimum(t_key, t_value)[changed]
    hi = torch.maximum(t_key, t_value)[changed]
    q = q_pos[:, None]

    final_mask = base.clone()
    final_mask[..., changed] &= q >= hi
    # before either stream encoded the token: both full precision (or unchanged)
    early_mask = base[..., changed] & (q < lo)
    # between the two encodings: the later-encoded stream is still full precision
    middle_mask = base[..., changed] & (q >= lo) & (q < hi)
    key_later = (t_key > t_value)[changed][None, None, :, None]
    value_later = (t_value > t_key)[changed][None, None, :, None]
    middle_key = torch.where(key_later, early_key, key[:, :, changed])
    middle_value = torch.where(value_later, early_value, value[:, :, changed])

    keys = torch.cat([key, early_key, middle_key], dim=2)
    values = torch.cat([value, early_value, middle_value], dim=2)
    batch = max(base.shape[0], query.shape[0])
    mask = torch.cat([m.expand(batch, 1, q_len, -1) for m in (final_mask, early_mask, middle_mask)], dim=-1)
    return keys, values, mask
