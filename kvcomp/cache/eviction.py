"""A press's side of a compressed layer (token eviction, :mod:`kvcomp.presses`): the prompt as the press keeps it,
pressing while decoding, and :func:`check_press`, which refuses a press the cache cannot evict with.

Each :class:`~kvcomp.cache.layer.LayerPart` keeps its own eviction state: ``evicted`` (prompt tokens dropped per row
and KV head), ``last_query`` (what a press that reads queries scores with while decoding) and ``prefix`` (a prompt
kept with a budget per head, held apart from the streams)."""

from __future__ import annotations

from dataclasses import replace

import torch

from kvcomp.cache.headwise import HeadwisePrefix
from kvcomp.cache.context import LayerContext
from kvcomp.codecs.base import FULL, Codec, keeps_state
from kvcomp.errors import ConfigError
from kvcomp.presses import Prefill, Press


def _kept(x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Tokens ``kept [B, H or 1, k]`` (a press's choice) of ``x [B, H, T, D]``, each KV head its own or all the same."""
    return x.gather(2, kept[..., None].expand(-1, x.shape[1], -1, x.shape[-1]))


class Eviction:
    """What one layer's ``press`` does to its row groups' parts, around the layer's own storing."""

    def __init__(self, press: Press):
        self.press = press

    @property
    def decodes(self) -> bool:
        """Whether the press also presses while decoding (kvpress's ``DecodingPress``)."""
        return bool(self.press.config.decoding_size)

    def prompt(self, part, key_states: torch.Tensor, value_states: torch.Tensor, context: LayerContext,
               query: torch.Tensor | None):
        """A row group's prompt as the press keeps it: ``(keys, values, context)`` of the kept tokens (positions and
        RoPE of a selection shared by the heads), ``()`` when they are held apart (``part.prefix``, a budget per
        head), or None when the press keeps every token."""
        press = self.press
        if query is None:
            raise RuntimeError(f"press {press.name} scores the prompt with its queries: call the cache through "
                               "kvcomp's attention (kvcomp.cache.install)")
        rotary = context.rotary if context.frequencies is not None and context.rope is not None else None
        prefill = Prefill(query, key_states, value_states, context.rope, rotary)
        if press.adaptive:
            selection = press.keep_per_layer(prefill)
            if selection is None:
                return None
            part.prefix = HeadwisePrefix.pressed(key_states, value_states, *selection)
            part.evicted = key_states.shape[2] - part.prefix.tokens_per_head
            return ()  # the streams hold the tokens after the prompt
        kept = press.keep(prefill)
        if kept is None:
            return None
        part.evicted = key_states.shape[2] - kept.shape[-1]
        key_states, value_states = _kept(key_states, kept), _kept(value_states, kept)
        if press.shared_across_heads and part.streams[0].rotates:  # the kept tokens' positions and angles
            rows = kept[:, 0]
            rope = None if context.rope is None else tuple(
                t.expand(rows.shape[0], -1, -1).gather(1, rows[..., None].expand(-1, -1, t.shape[-1])) for t in context.rope)
            positions = None if context.positions is None else context.positions.expand(rows.shape[0], -1).gather(1, rows)
            context = replace(context, rope=rope, positions=positions)
        return key_states, value_states, context

    def press_held(self, part) -> None:
        """Pressing while decoding: once the row group holds ``decoding_size + decoding_interval`` tokens, the press
        keeps ``decoding_size`` of them, before this forward's tokens are stored (one that reads queries scores with
        the previous forward's last query, ``part.last_query``). The kept tokens stay in the buffers that hold them
        (:func:`keep_tokens`: nothing quantized again; :func:`check_press` refuses
        codecs whose tokens cannot be dropped in place)."""
        press, cfg, (key_stream, value_stream) = self.press, self.press.config, part.streams
        if key_stream.length < cfg.decoding_size + cfg.decoding_interval:
            return
        if press.reads_queries and part.last_query is None:
            raise RuntimeError(f"press {press.name} scores held tokens with the last forward's query: call the "
                               "cache through kvcomp's attention (kvcomp.cache.install)")
        copies = [stream.decoded.length > 0 for stream in part.streams]  # the torch path's: scoring decodes every block
        keys, values = key_stream.materialize(), value_stream.materialize()
        query = part.last_query if press.reads_queries else None
        kept = press.keep(Prefill(query, keys, values), count=cfg.decoding_size)
        part.evicted += key_stream.length - cfg.decoding_size
        for stream, copy in zip(part.streams, copies):
            keep_tokens(stream, kept, copy)

    def remember_queries(self, parts, queries) -> None:
        """Keep each row group's last query of this forward, which the next decoding press scores with."""
        if self.press.reads_queries and self.decodes:
            for part, query in zip(parts, queries):
                part.last_query = None if query is None else query[:, :, -1:].clone()  # not the prompt's


def drops_in_place(stream) -> bool:
    """Whether a :class:`~kvcomp.cache.stream.KVStream`'s held tokens can be dropped where they are
    (:func:`keep_tokens`): a stream that never encodes and holds no sinks (its tail is every token), or one whose every
    held token is encoded, one payload row per token in every payload tensor (a per-token codec with no sinks or
    window); keys neither rotated back nor offset by position (which would tie them to cache indices)."""
    if stream.rotates or stream.num_sinks:
        return False
    if stream.policy.block_size is None:
        return True
    return (stream.num_tail == 0 and stream.store.layout == "tokens" and stream.state is None
            and all(g.length == stream.num_encoded for g in stream.store.tensors.values()))


def keep_tokens(stream, kept: torch.Tensor, keep_decoded: bool) -> None:
    """Keep a stream's held tokens ``kept [B, H or 1, k]`` (ascending, every KV head its own or all the same) and drop
    the rest, gathered to the front of the buffers that hold them (:func:`drops_in_place`): the tail of a stream that
    never encodes, else the payload rows, nothing encoded again. ``keep_decoded``: the torch path's complete decoded
    copy keeps its kept rows too."""
    where = f"{stream.codec.name} {stream.kind} stream"
    if not drops_in_place(stream):
        raise RuntimeError(f"{where}: its held tokens cannot be dropped in place")

    def gather(t: torch.Tensor) -> torch.Tensor:
        if kept.shape[1] not in (1, t.shape[1]):
            raise RuntimeError(f"{where}: a tensor of {t.shape[1]} heads; a press kept tokens for {kept.shape[1]}")
        index = kept.to(t.device).expand(t.shape[0], t.shape[1], -1)
        return t.gather(2, index.reshape(*index.shape, *(1,) * (t.dim() - 3)).expand(*index.shape, *t.shape[3:]))

    count = kept.shape[-1]
    if stream.policy.block_size is None:
        stream.tail_buffer.keep(gather)
    else:
        stream.blocks = [stream.store.keep(gather, count)]
        stream.decoded.keep(gather, stream.blocks, keep_decoded and stream.decoded.length == stream.num_encoded)
        stream.num_encoded = count
    stream.length = count


def check_press(press: Press | None, codec: Codec, protocol: str, compress_generated: bool = True) -> None:
    """Raise :class:`ConfigError` when ``press`` cannot evict from this cache: it evicts after an exact prefill
    (``exact_prefill``); each layer keeps its own tokens, which layer- and model-scope codecs (one block across
    layers) cannot code; a selection per KV head has no single position per token, which pre-RoPE codecs and rotated
    key offsets (``center``, known before calibration) need, and budgets per head (``head_budgets=adakv``) the
    uncompressed cache only; a sliding-window layer hides old tokens by position,
    which a cache of evicted tokens no longer lines up with its mask (codecs that encode them: ``compress_sliding``)."""
    if press is None:
        return
    info = codec.model
    if info.layer_types and any(info.layer_types[m] != FULL for m in info.model_layers):
        raise ConfigError(f"press {press.name}: codec {codec.name} encodes sliding-window layers (compress_sliding), "
                          "whose window the kept tokens no longer line up with; leave compress_sliding false")
    if protocol != "exact_prefill":
        raise ConfigError(f"press {press.name} evicts prompt tokens after an exact prefill, as kvpress does: use "
                          f"protocol exact_prefill, not {protocol!r}")
    if codec.scope != "stream":
        raise ConfigError(f"press {press.name}: codec {codec.name} codes a block across {codec.scope}s, but each layer "
                          "keeps its own tokens; choose a stream-scope codec")
    if press.adaptive and not _full_precision(codec):
        raise ConfigError(f"press {press.name}: head_budgets=adakv holds each KV head's kept tokens ragged, which only "
                          f"the uncompressed cache stores (codec=fp16), not codec {codec.name}; or use "
                          "head_budgets=uniform, which composes with stream-scope codecs")
    offsets = getattr(codec.config, "center", "none") != "none" or any(
        codec.rotated_key_offset(layer) is not None for layer in range(codec.model.num_layers))
    if press.config.decoding_size and not compress_generated and not _full_precision(codec):
        raise ConfigError(f"press {press.name} presses while decoding (decoding_size), but compress_generated=False keeps "
                          f"generated tokens in full precision beside codec {codec.name}'s encoded prompt, so a layer's "
                          "held tokens cannot be dropped in place; leave compress_generated true or use codec=fp16")
    if press.config.decoding_size and not _drops_in_place(codec, offsets):
        raise ConfigError(f"press {press.name} presses while decoding (decoding_size) by dropping held tokens in place, "
                          f"which needs every token of codec {codec.name} encoded one by one (block_size 1, no sinks, no "
                          "full-precision window, no per-sequence state, post-RoPE keys without a rotated offset: e.g. "
                          "fp8, int_token_head, nvfp4, turboquant, eden, uniform), or the uncompressed cache (fp16); "
                          "others would quantize their kept tokens again")
    if not press.shared_across_heads and (codec.pre_rope or offsets):
        raise ConfigError(f"press {press.name} keeps different tokens in each KV head, but codec {codec.name} "
                          f"{'encodes keys before RoPE' if codec.pre_rope else 'rotates a key offset'} with one position "
                          "per token and row; choose a press that keeps the same tokens in every head (streaming_llm, tova) "
                          "or a post-RoPE codec")


def _full_precision(codec: Codec) -> bool:
    """Whether no stream of ``codec`` ever encodes (the uncompressed cache)."""
    return all(codec.policy(kind, layer).block_size is None for kind in ("key", "value")
               for layer in range(codec.model.num_layers))


def _drops_in_place(codec: Codec, offsets: bool) -> bool:
    """Whether every stream holds its tokens as :func:`drops_in_place` needs: in full
    precision without sinks, or encoded one by one (a post-RoPE, stateless per-token codec)."""
    policies = [codec.policy(kind, layer) for kind in ("key", "value") for layer in range(codec.model.num_layers)]
    if codec.pre_rope or offsets or any(p.sinks for p in policies):  # tokens tied to their cache index, or sinks
        return False
    if _full_precision(codec):
        return True
    return (not keeps_state(codec) and codec.payload_layout == "tokens"
            and all(p.block_size is None or p.block_size == 1 and p.window == 0 for p in policies))
