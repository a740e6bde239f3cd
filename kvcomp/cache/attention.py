"""The ``kvcomp`` attention function and the hooks that connect it to a :class:`CompressedCache`.

Transformers calls the registered attention function after ``cache.update`` with the keys/values the
layer returned. For decode steps and the ``simulated`` protocol that is all it needs: SDPA over
``[sinks, decoded blocks, tail]``.

Under the ``streaming`` protocol a multi-token forward (prefill, chunked perplexity) must show each
query the cache *as it was when that query's token arrived*: a block encoded within the forward is
seen in full precision by the queries before the token that completed its schedule, and encoded by
that query and later ones. Keys and values may follow different schedules, so a freshly encoded token
can be in up to three states (both full precision; one encoded; both encoded). The function appends
the earlier states as extra key/value columns and masks every column to the queries that would have
seen it, which gives exactly the logits of feeding the tokens one by one.

Decode steps read the payloads directly when ``install(model, kernel_backend="triton")`` selected kernels
(:attr:`~kvcomp.cache.compressed_cache.CompressedLayer.fused_decode`): the layer hands over its key and
value segments (sinks, payload, tail, plus the fresh token under ``exact_prefill``) and

- codecs with a payload reader (uniform/KIVI, TemporalKV, ChannelKV, KVQuant, QJL) run the fused
  decode-attention kernel (:mod:`kvcomp.kernels.decode_attention`): K and V decoded in registers (QJL's
  keys scored from their sign bits), never in memory;
- codecs with a fused score path (``payload_scores``) whose format the kernel cannot read (QJL with groups
  that are not a power of two of at least 16 tokens) score the encoded keys with their kernel and decode
  the values;
- codecs with a payload value path (``payload_values``, CSR's ``D u`` with ``desparse=fused``, on any
  backend) decode the keys and weight the encoded values without decoding them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvcomp.cache.compressed_cache import LastUpdate
from kvcomp.codecs.base import Payload, attention_layer_types
from kvcomp.errors import unknown_choice
from kvcomp.kernels import KERNEL_BACKENDS
from kvcomp.kernels.decode_attention import ValidTokens, decode_attention

ATTENTION_NAME = "kvcomp"


def compressed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """Attention over the compressed cache; see the module docstring for the streaming protocol."""
    layer = getattr(module, "_kvcomp_layer", None)
    record: LastUpdate | None = None
    if layer is not None:
        record, layer.last_update = layer.last_update, None  # release the full-precision copies
        step = getattr(layer, "fused_step", None)  # only a CompressedLayer's fused decode steps
        if step is not None:
            layer.fused_step = None
            if step.mode in ("scores", "values"):
                return _attention_from_segments(layer, query, step.keys, step.values, attention_mask, scaling)
            return _fused_decode_attention(layer, query, step.keys, step.values, attention_mask, scaling)
    if record is None or (record.keys is None and record.values is None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    key, value, mask = _streaming_columns(query, key, value, attention_mask, record)
    mask = mask | ~mask.any(-1, keepdim=True)  # rows with nothing to attend (left padding) stay finite
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


def _attention_from_segments(layer, query, keys, values, attention_mask, scaling):
    """Attention over key and value segments in cache order (full-precision tensors: sinks, decoded blocks, tail,
    fresh tokens; or payloads): encoded keys are scored by the codec's kernel (``payload_scores``), encoded
    values weighted by ``payload_values``, the rest by matmuls. Columns are in cache order, as the mask expects."""
    b, hq, tq, d = query.shape
    h = layer.codec.model.num_kv_heads
    grouped = query.float().reshape(b, h, (hq // h) * tq, d)
    columns = []
    for segment in keys:
        if isinstance(segment, Payload):
            columns.append(layer.codec.payload_scores(query, segment, layer.layer_idx, layer.kernel_backend))
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
            out = out + layer.codec.payload_values(weights, segment, layer.layer_idx, layer.value_stream.state)
        else:
            out = out + (weights.reshape(b, h, -1, count) @ segment.float()).reshape(b, hq, tq, d)
        first += count
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _fused_decode_attention(layer, query, keys, values, attention_mask, scaling):
    """One decode step read straight from the payloads by the fused decode-attention kernel
    (:mod:`kvcomp.kernels.decode_attention`); the mask's valid tokens become one range per sequence,
    computed by the step's first layer and reused by the others."""
    codec, index = layer.codec, layer.layer_idx

    def readers(segments, kind):
        return [codec.payload_reader(s, kind, index) if isinstance(s, Payload) else s for s in segments]

    b, _, _, d = query.shape
    out = decode_attention(
        query[:, :, 0], readers(keys, "key"), readers(values, "value"), d**-0.5 if scaling is None else scaling,
        _valid_tokens(layer, attention_mask, b), layer.key_rope(), layer.kernel_backend,
    )
    return out[:, None], None


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    """Which positions a bool or additive (0 / -inf-like) attention mask lets through, as bool."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def _valid_tokens(layer, attention_mask, batch: int) -> ValidTokens | None:
    """The step's :class:`ValidTokens` from its 4-D mask (bool or additive). Every layer of a step receives
    the same mask object, so the result is kept on it (made once per step, freed with the mask; no host
    sync: the kernels read it per token)."""
    if attention_mask is None:
        return None
    length = layer.get_seq_length()
    memo = getattr(attention_mask, "_kvcomp_valid", None)
    if memo is not None and memo[0] == length:
        return memo[1]
    tokens = ValidTokens(_allowed(attention_mask[:, 0, -1, :length]).expand(batch, length))
    attention_mask._kvcomp_valid = (length, tokens)
    return tokens


def _streaming_columns(query, key, value, attention_mask, record: LastUpdate):
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
    for t, fresh in ((t_key, record.keys), (t_value, record.values)):
        if fresh is not None:
            t[fresh.positions] = fresh.visible_from
    changed = torch.nonzero((t_key >= 0) | (t_value >= 0)).squeeze(1)

    def before_encoding(x, fresh):
        """States of the changed positions before this forward encoded them."""
        states = x[:, :, changed].clone()
        if fresh is not None:
            states[:, :, torch.searchsorted(changed, fresh.positions)] = fresh.full_precision.to(x.dtype)
        return states

    early_key, early_value = before_encoding(key, record.keys), before_encoding(value, record.values)
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


def _capture_cache_layer(module, args, kwargs):
    """Forward pre-hook on each attention module: expose this layer's compressed cache to the attention
    function and hand it the position embeddings (cos/sin) for pre-RoPE codecs. Caches that want this
    (:class:`CompressedCache`, the calibration recorder) set ``receives_position_embeddings``."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers >= 5.24 names it ``cache``
    layer = cache.layers[module.layer_idx] if getattr(cache, "receives_position_embeddings", False) else None
    if hasattr(layer, "attention_hooked"):  # not an uncompressed sliding-window layer
        layer.incoming_rope = kwargs.get("position_embeddings")
        layer.attention_hooked = True
        layer.kernel_backend = getattr(module, "_kvcomp_kernel_backend", "torch")
        layer.incoming_positions = kwargs.get("position_ids")
        if layer.get_seq_length() == 0:
            layer.incoming_pads = _leading_pads(kwargs.get("attention_mask"))
        rotary = getattr(module, "_kvcomp_rotary", None)
        if rotary is not None and layer.incoming_rope is not None:
            cos = layer.incoming_rope[0]  # on this layer's device (the rotary module may sit on another GPU)
            inv_freq, scaling = rotary.frequencies()
            layer.rotary = (inv_freq.to(cos.device), scaling, cos.dtype)
        module.__dict__["_kvcomp_layer"] = layer  # not nn.Module.__setattr__: a plain attribute, set every forward
    else:
        module.__dict__["_kvcomp_layer"] = None


def _leading_pads(mask) -> int:
    """The most left padding of any row in a first forward's 4-D mask (bool, or additive float): pad
    columns are masked for every query (a sliding-window mask also hides old columns from late queries,
    never from all). One host sync per forward and mask (kept on the mask object, which every layer of
    its attention type receives), not per layer."""
    if mask is None:
        return 0
    if not hasattr(mask, "_kvcomp_pads"):
        valid = _allowed(mask[:, 0]).any(dim=-2)
        mask._kvcomp_pads = int(valid.int().argmax(-1).max()) if valid.any() else 0
    return mask._kvcomp_pads


def decode_step_mask(*args, **kwargs):
    """transformers' ``sdpa_mask``, always materialised for single-token forwards that carry a padding
    mask: its test whether the mask can be skipped reads that mask on the host (``padding_mask.all()``, a
    host sync every decode step on a GPU, e.g. in ``generate``), and the fused kernels read the mask per
    token on the device anyway. Without a padding mask the test reads no data, and longer forwards keep
    the skip (SDPA's causal kernels for prefill). ``generate`` always passes a padding mask, so its decode
    steps on the torch path run SDPA with a mask. The query length is ``q_length`` (transformers >= 5.3)
    or the length of ``cache_position`` (earlier 5.x)."""
    positions = kwargs.get("cache_position")
    q_length = kwargs.get("q_length", None if positions is None else positions.shape[0])
    if q_length == 1 and kwargs.get("attention_mask") is not None:
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def _attention_modules(model):
    return [m for name, m in model.named_modules() if name.endswith("self_attn") and hasattr(m, "layer_idx")]


STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # inv_freq fixed for the whole sequence


class _Rotary:
    """The RoPE frequencies of one layer type, read from the model's rotary module at every use (it may
    have moved device): ``inv_freq`` and ``attention_scaling``, or ``<layer type>_inv_freq`` / ``..._scaling``
    where the module keeps one RoPE per layer type (Gemma 3: local and global bases)."""

    def __init__(self, module, prefix: str = ""):
        self.module, self.prefix = module, prefix

    def frequencies(self) -> tuple[torch.Tensor, float]:
        return (getattr(self.module, f"{self.prefix}inv_freq"),
                float(getattr(self.module, f"{self.prefix}attention_scaling", 1.0)))


def _layer_rotary(model, layer_type: str | None) -> _Rotary | None:
    """The rotary embedding of layers of ``layer_type`` when fused kernels can recompute its angles
    (``pos * inv_freq``, times ``attention_scaling``); ``None`` for RoPE types whose frequencies change with
    the sequence length (their cos/sin are kept instead)."""
    for name, module in model.named_modules():
        if not name.endswith("rotary_emb"):
            continue
        rope_type = getattr(module, "rope_type", None)
        if layer_type is not None and hasattr(module, f"{layer_type}_inv_freq"):
            kind = rope_type.get(layer_type) if isinstance(rope_type, dict) else rope_type
            return _Rotary(module, f"{layer_type}_") if kind in STATIC_ROPE_TYPES else None
        if hasattr(module, "inv_freq"):
            return _Rotary(module) if rope_type in STATIC_ROPE_TYPES else None
    return None


def install(model, kernel_backend: str = "torch") -> None:
    """Route ``model``'s attention through kvcomp (idempotent). Works with any cache; the compressed
    path switches on when a :class:`CompressedCache` is passed as ``past_key_values``.
    ``kernel_backend="triton"``: decode steps use a codec's fused kernel where it has one."""
    if kernel_backend not in KERNEL_BACKENDS:
        raise unknown_choice("kernel backend", kernel_backend, KERNEL_BACKENDS)
    AttentionInterface.register(ATTENTION_NAME, compressed_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, decode_step_mask)
    layer_types = attention_layer_types(model.config.get_text_config(decoder=True))  # refuses unsupported kinds
    model.set_attn_implementation(ATTENTION_NAME)
    modules = _attention_modules(model)
    if not modules:
        raise NotImplementedError(f"{type(model).__name__}: no attention modules named '*self_attn' with a layer_idx")
    rotaries = {kind: _layer_rotary(model, kind) for kind in set(layer_types)}
    for module in modules:
        module._kvcomp_kernel_backend = kernel_backend
        module._kvcomp_rotary = rotaries[layer_types[module.layer_idx]]
        if not getattr(module, "_kvcomp_hooked", False):
            module.register_forward_pre_hook(_capture_cache_layer, with_kwargs=True)
            module._kvcomp_hooked = True
