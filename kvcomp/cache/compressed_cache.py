"""A transformers 5.x ``Cache`` whose layers hold codec payloads instead of full K/V tensors."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from kvcomp.cache.checks import CHECK_FINITE, FiniteChecks
from kvcomp.cache.headwise import HeadwiseReads, HeadwisePrefix
from kvcomp.cache.positions import Positions
from kvcomp.cache.reads import FromSegments, FusedDecode, Reads, Streaming
from kvcomp.cache.rows import ByRows, RowGroup, padding_groups
from kvcomp.cache.scopes import Schedule, Scope, make_scope
from kvcomp.cache.step import LayerStep, PaddedRows, StepLayer
from kvcomp.cache.stream import KVStream
from kvcomp.codecs.base import (FULL, CacheStatistics, Codec, keeps_state, reads_fused, scores_from_payload,
                                values_from_payload)
from kvcomp.errors import ConfigError
from kvcomp.presses import Prefill, Press

PROTOCOLS = ("streaming", "simulated", "exact_prefill")


def _row_index(indices: torch.Tensor) -> torch.Tensor:
    """Batch rows to keep, from transformers' indices or boolean mask."""
    return indices.nonzero().squeeze(-1) if indices.dtype == torch.bool else indices


def _kept(x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Tokens ``kept [B, H or 1, k]`` (a press's choice) of ``x [B, H, T, D]``, each KV head its own or all the same."""
    return x.gather(2, kept[..., None].expand(-1, x.shape[1], -1, x.shape[-1]))


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts along tokens; a single part as it is (no copy: e.g. the fp16 codec's tail)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


@dataclass(eq=False)
class LayerPart:
    """One :class:`~kvcomp.cache.rows.RowGroup`'s share of a layer: the schedule of its key and value streams, the
    positions of its tokens (pre-RoPE codecs), how many prompt tokens a press ``evicted`` (per row and KV head), and
    the ``last_query [B, Hq, 1, D]`` of the latest forward, which a press that reads queries scores the held tokens
    with while decoding (TOVA); ``prefix``: the prompt a press with a budget per head kept (``head_budgets=adakv``),
    held apart from the streams, which then hold the later tokens."""

    group: RowGroup
    schedule: Schedule
    positions: Positions
    evicted: int = 0
    last_query: torch.Tensor | None = None
    prefix: HeadwisePrefix | None = None

    @property
    def streams(self) -> tuple[KVStream, KVStream]:
        return self.schedule.streams

    @property
    def held_tokens(self) -> int:
        """Tokens held per row and KV head (a per-head prefix's on average over the heads)."""
        return self.schedule.key_stream.length + (0 if self.prefix is None else self.prefix.tokens_per_head)

    @property
    def batch(self) -> int:
        return self.prefix.batch if self.prefix is not None else self.schedule.key_stream.batch

    @property
    def num_values(self) -> int:
        """K and V elements held (batch x heads x tokens x head_dim, both streams)."""
        return sum(s.num_values for s in self.streams) + (0 if self.prefix is None else 2 * self.prefix.num_values)

    def select_rows(self, index: torch.Tensor) -> None:
        self.schedule.select_rows(index)
        self.positions.select_rows(index)
        if self.prefix is not None:
            self.prefix.select_rows(index)
        if self.last_query is not None:
            self.last_query = self.last_query.index_select(0, index.to(self.last_query.device))


class CompressedLayer(StepLayer):
    """One decoder layer: per group of rows padded alike (``parts``: one unless a first forward came
    left-padded unevenly, :mod:`kvcomp.cache.rows`), a key and a value stream following the codec's policy,
    encoded and decoded as the codec's scope says, with the positions of its tokens (pre-RoPE codecs); and its
    finiteness ``checks``.

    Each forward's K/V come with the step (:meth:`update_in_step`), which returns what attention reads:
    full-precision sinks and tail, decoded blocks in between (keys re-rotated for pre-RoPE codecs), or
    the payloads themselves (:meth:`fused_decode`); per row group (:class:`~kvcomp.cache.rows.ByRows`) when
    its rows are grouped or padded. Without kvcomp's attention, transformers' ``update`` serves codecs that need
    no step.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, parts: list[LayerPart], protocol: str, checks: FiniteChecks, compress_generated: bool = True,
                 press: Press | None = None):
        super().__init__()
        self.parts, self.protocol, self.checks, self.press = parts, protocol, checks, press
        self.codec, self.layer_idx = parts[0].schedule.codec, parts[0].schedule.layer_idx
        self.compress_generated = compress_generated
        self.keys = self.values = None
        self.is_initialized = False
        self.length = 0  # tokens of every forward, left padding included (which no stream holds)

    def reset(self) -> None:
        for part in self.parts:
            part.schedule.reset()
            part.positions.reset()
            part.evicted = 0
            part.last_query = None
            part.prefix = None
        self.checks.reset()
        self.is_initialized = False
        self.length = 0

    @property
    def schedule(self) -> Schedule:
        """The first row group's schedule (the only one unless the rows are grouped)."""
        return self.parts[0].schedule

    @property
    def positions(self) -> Positions:
        return self.parts[0].positions

    @property
    def key_stream(self) -> KVStream:
        return self.parts[0].schedule.key_stream

    @property
    def value_stream(self) -> KVStream:
        return self.parts[0].schedule.value_stream

    @property
    def streams(self) -> tuple[KVStream, ...]:
        """Every row group's key and value streams."""
        return tuple(s for part in self.parts for s in part.streams)

    @property
    def batch(self) -> int:
        return sum(part.batch for part in self.parts)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """At the layer's first forward: refuse keys and values of another shape than the codec was built for."""
        model = self.codec.model
        for kind, x in (("keys", key_states), ("values", value_states)):
            if x.dim() != 4 or (x.shape[1], x.shape[3]) != (model.num_kv_heads, model.head_dim):
                raise ConfigError(f"codec {self.codec.name} was built for {model.name}, whose layer {self.layer_idx} "
                                  f"has {model.num_kv_heads} KV heads of size {model.head_dim}, but this model's {kind} "
                                  f"are {tuple(x.shape)} [batch, heads, tokens, head_dim]: build the codec for this "
                                  "model (kvcomp.api.load_codec(model, ...))")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """transformers' entry when the model's attention is not kvcomp's: the keys and values for SDPA."""
        read = self.update_in_step(key_states, value_states, None)
        if isinstance(read, Reads):
            raise ConfigError("the streaming protocol needs the kvcomp attention function for multi-token forwards: "
                              "call kvcomp.cache.install(model) first (or use protocol='simulated')")
        return read

    def update_in_step(self, key_states: torch.Tensor, value_states: torch.Tensor, step: LayerStep | None,
                       query: torch.Tensor | None = None):
        """Store a forward's K/V (``step``: None outside kvcomp's attention); return ``(keys, values)`` for SDPA,
        or the :class:`~kvcomp.cache.reads.Reads` attention needs (per row group: a
        :class:`~kvcomp.cache.rows.ByRows`). ``query``: the forward's queries, which a press scores the prompt with."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        first = self.length
        self.length += key_states.shape[2]
        return self.checks.around(key_states, value_states, first,
                                  lambda: self._store_rows(key_states, value_states, step, first == 0, query),
                                  lambda: self.streams)

    def _store_rows(self, key_states: torch.Tensor, value_states: torch.Tensor, step: LayerStep | None,
                    first_forward: bool, query: torch.Tensor | None):
        whole = self.parts[0].group
        if len(self.parts) == 1 and whole.rows is None and not whole.pads and self.press is None:
            return self._store(self.parts[0], key_states, value_states, step, first_forward, query)
        if step is None:
            raise RuntimeError("a cache whose rows are grouped by their padding, or pressed, is read by kvcomp's "
                               "attention only")
        if self.press is not None and not first_forward and self.press.config.decoding_size:
            for part in self.parts:  # pressing while decoding, before this forward's tokens and mask columns
                self._press_held(part)
        dropped = [part.evicted for part in self.parts]  # before this forward: its own prefill reads every token
        queries = [None if query is None else part.group.tokens(query, first_forward, 2) for part in self.parts]
        read = ByRows([(part.group, self._store(part, part.group.tokens(key_states, first_forward, 2),
                                                part.group.tokens(value_states, first_forward, 2),
                                                part.group.layer_step(step, first_forward), first_forward, group_query),
                        evicted)
                       for part, evicted, group_query in zip(self.parts, dropped, queries)], first_forward)
        if self.press is not None and self.press.reads_queries and self.press.config.decoding_size:
            for part, group_query in zip(self.parts, queries):  # the next forward presses with it
                part.last_query = None if group_query is None else group_query[:, :, -1:].clone()  # not the prompt's
        return read

    def _evict(self, part: LayerPart, key_states: torch.Tensor, value_states: torch.Tensor, step: LayerStep,
               query: torch.Tensor | None):
        """A row group's prompt as its press keeps it: ``(keys, values, step)`` of the kept tokens (positions and
        RoPE of a selection shared by the heads), ``()`` when they are held apart (``part.prefix``, a budget per
        head), or None when the press keeps every token."""
        if query is None:
            raise RuntimeError(f"press {self.press.name} scores the prompt with its queries: call the cache through "
                               "kvcomp's attention (kvcomp.cache.install)")
        rotary = step.rotary if step.frequencies is not None and step.rope is not None else None
        prefill = Prefill(query, key_states, value_states, step.rope, rotary)
        if self.press.adaptive:
            selection = self.press.keep_per_layer(prefill)
            if selection is None:
                return None
            part.prefix = HeadwisePrefix.pressed(key_states, value_states, *selection)
            part.evicted = key_states.shape[2] - part.prefix.tokens_per_head
            return ()  # the streams hold the tokens after the prompt
        kept = self.press.keep(prefill)
        if kept is None:
            return None
        part.evicted = key_states.shape[2] - kept.shape[-1]
        key_states, value_states = _kept(key_states, kept), _kept(value_states, kept)
        if self.press.shared_across_heads and part.streams[0].rotates:  # the kept tokens' positions and angles
            rows = kept[:, 0]
            rope = None if step.rope is None else tuple(
                t.expand(rows.shape[0], -1, -1).gather(1, rows[..., None].expand(-1, -1, t.shape[-1])) for t in step.rope)
            positions = None if step.positions is None else step.positions.expand(rows.shape[0], -1).gather(1, rows)
            step = replace(step, rope=rope, positions=positions)
        return key_states, value_states, step

    def _press_held(self, part: LayerPart) -> None:
        """Pressing while decoding (kvpress's ``DecodingPress``): once the row group holds ``decoding_size +
        decoding_interval`` tokens, the press keeps ``decoding_size`` of them, before this forward's tokens are stored
        (:attr:`~kvcomp.presses.base.Press.decodes`; one that reads queries scores with the previous forward's last
        query, ``part.last_query``). The kept tokens stay in the buffers that hold them
        (:meth:`~kvcomp.cache.stream.KVStream.keep_tokens`: the uncompressed cache's tail, a per-token codec's payload
        rows; nothing quantized again; :func:`check_press` refuses other codecs)."""
        cfg, (key_stream, value_stream) = self.press.config, part.streams
        if key_stream.length < cfg.decoding_size + cfg.decoding_interval:
            return
        if self.press.reads_queries and part.last_query is None:
            raise RuntimeError(f"press {self.press.name} scores held tokens with the last forward's query: call the "
                               "cache through kvcomp's attention (kvcomp.cache.install)")
        copies = [stream.decoded.length > 0 for stream in part.streams]  # the torch path's: scoring decodes every block
        keys, values = key_stream.materialize(), value_stream.materialize()
        query = part.last_query if self.press.reads_queries else None
        kept = self.press.keep(Prefill(query, keys, values), count=cfg.decoding_size)
        part.evicted += key_stream.length - cfg.decoding_size
        for stream, copy in zip(part.streams, copies):
            stream.keep_tokens(kept, copy)

    def _store(self, part: LayerPart, key_states: torch.Tensor, value_states: torch.Tensor, step: LayerStep | None,
               first_forward: bool = False, query: torch.Tensor | None = None):
        """One row group's forward: store its K/V and return what its attention reads (a pressed prompt: every
        token, exactly, as it stores the kept ones)."""
        if self.press is not None and first_forward and key_states.shape[2] > 1:
            pressed = self._evict(part, key_states, value_states, step, query)
            if pressed is not None:
                prompt = (key_states, value_states)
                if pressed:
                    self._store(part, *pressed)
                return prompt
        batch, n = key_states.shape[0], key_states.shape[2]
        key_stream, value_stream = part.streams
        if key_stream.rotates:
            part.positions.record(step, batch, n, f"codec {self.codec.name} (layer {self.layer_idx})")
        fused = self.fused_decode(part, step) if n == 1 else None
        key_view = KVStream.segments if fused in ("attention", "scores") else KVStream.parts
        value_view = KVStream.segments if fused in ("attention", "values") else KVStream.parts
        for stream, view in ((key_stream, key_view), (value_stream, value_view)):
            if view is KVStream.segments:  # a chunked prefill's decoded copy, otherwise kept for the whole generation
                stream.forget_decoded()
        history = self.protocol == "exact_prefill" and part.schedule.encodes_in_update and any(
            s.ready_after(n) for s in part.streams)  # this forward sees its own tokens uncompressed
        if history:
            key_history, value_history = key_view(key_stream), value_view(value_stream)
        key_stream.append(key_states)
        value_stream.append(value_states)
        backend = "torch" if step is None else step.kernel_backend
        fresh_keys, fresh_values = part.schedule.encode_ready(backend)
        if history:
            keys, values = [*key_history, key_states], [*value_history, value_states]
        else:
            keys, values = key_view(key_stream), value_view(value_stream)
        part.schedule.after_views(backend)
        if not self.compress_generated:  # only the first forward (the prompt) is ever encoded
            for stream in part.streams:
                stream.freeze()
        if part.prefix is not None:
            return HeadwiseReads(part.prefix, _joined(keys), _joined(values))
        if fused == "attention":
            key_rope = part.positions.key_rope(key_stream.num_sinks) if key_stream.rotates else None
            return FusedDecode(keys, values, self.codec, self.layer_idx, step.kernel_backend, key_rope, key_stream.length)
        if fused:
            return FromSegments(keys, values, self.codec, self.layer_idx, step.kernel_backend, value_stream.state)
        if self.protocol == "streaming" and n > 1 and (fresh_keys or fresh_values):
            return Streaming(_joined(keys), _joined(values), fresh_keys, fresh_values)
        return _joined(keys), _joined(values)

    def fused_decode(self, part: LayerPart, step: LayerStep | None) -> str | None:
        """How a decode step reads a row group's streams: ``"attention"``: the fused decode-attention kernel reads both
        payloads (``kernel_backend="triton"``; :class:`~kvcomp.codecs.base.FusedPayload`; pre-RoPE keys
        need fixed RoPE frequencies and every token's position); ``"scores"`` (where the kernel cannot read the
        format): the codec's kernel scores the key payload (:class:`~kvcomp.codecs.base.PayloadScores`),
        values are decoded; ``"values"`` (any backend, :class:`~kvcomp.codecs.base.PayloadValues`): keys are
        decoded, the codec weights the value payload; ``None``: the torch path (also without kvcomp's attention,
        ``step`` None). Keys with a rotated offset are read by the fused kernel only (it adds the offset's score, with
        the same needs as pre-RoPE keys)."""
        if step is None or part.prefix is not None:
            return None
        if values_from_payload(self.codec):
            return "values"
        if step.kernel_backend != "triton":
            return None
        if (not part.streams[0].rotates or part.positions.recomputed) and reads_fused(self.codec, self.layer_idx):
            return "attention"
        if part.streams[0].offset is not None:
            return None
        return "scores" if scores_from_payload(self.codec) else None

    def raise_if_nonfinite(self) -> None:
        """Read this layer's verdicts of its last forward under ``check_finite="deferred"``."""
        self.checks.raise_pending()

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # transformers < 5.20 name of get_max_length
        return -1

    @property
    def full_precision_nbytes(self) -> int:
        """Bytes of full-precision sinks and tails, and of a prompt pressed with a budget per head."""
        return sum(s.full_precision_nbytes for s in self.streams) + sum(
            part.prefix.nbytes for part in self.parts if part.prefix is not None)

    @property
    def num_values(self) -> int:
        """K and V elements held, over every row group."""
        return sum(part.num_values for part in self.parts)

    @property
    def payload_nbytes(self) -> int:
        """Bytes of the encoded payloads this layer holds (a model-scope codec's are the cache's)."""
        return sum(s.store.nbytes for s in self.streams)

    @property
    def state_nbytes(self) -> int:
        """Bytes of per-sequence codec state (stream- and layer-scope)."""
        return sum(part.schedule.state_nbytes for part in self.parts)

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage held: sinks, tails, payloads and per-sequence state."""
        return self.full_precision_nbytes + self.payload_nbytes + self.state_nbytes

    @property
    def bookkeeping_nbytes(self) -> int:
        """Bytes held besides K/V storage: the positions of cached tokens (pre-RoPE codecs), the last query a
        press scores with while decoding and the counts of a prompt pressed with a budget per head."""
        return sum(part.positions.nbytes + (0 if part.last_query is None else part.last_query.nbytes)
                   + (0 if part.prefix is None else part.prefix.bookkeeping_nbytes) for part in self.parts)

    @property
    def working_nbytes(self) -> int:
        """Working memory: the torch path's decoded blocks and spare capacity of the growing buffers."""
        return sum(s.working_nbytes for s in self.streams) + sum(part.positions.reserved_nbytes for part in self.parts)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a compressed cache cannot drop encoded tokens (no assisted decoding)")


class CompressedCache(Cache, PaddedRows):
    """KV cache compressed by ``codec``.

    ``protocol``: how a multi-token forward (prefill) sees the tokens it brings in:
    ``streaming``: as a token-by-token feed would (blocks encoded within the forward are seen encoded
    by the queries after the token that completed them; see :mod:`kvcomp.cache.reads`);
    ``simulated``: encoded, by every query (the seeds' protocol); ``exact_prefill``: uncompressed (a
    deployed prefill: attention runs on the fresh K/V, the cache stores them encoded for later
    forwards). Earlier tokens are always seen as stored.
    ``decode_per_step=True``: the torch path keeps no decoded copy of the blocks and decodes them at
    every read (memory-true, slower); otherwise that copy is working memory (:attr:`working_nbytes`).
    ``compress_generated=False`` encodes the first forward's tokens only and keeps every later
    (generated) token in full precision. ``check_finite``: NaN/Inf in incoming K/V raise
    :class:`~kvcomp.errors.NonFiniteKVError` at once (``True``: a host sync per layer on a GPU), one
    forward later without any sync (``"deferred"``, which also defers the checks that uniform/KIVI's and HIGGS'
    scales fit their dtype, an error then instead of uniform's float32 fallback; :meth:`raise_if_nonfinite` reads the
    last ones), or never (``False``). ``capacity``: the tokens per sequence (prompt, padding and generated
    tokens) to preallocate storage for, e.g. ``prompt + max_new_tokens``: every buffer is reserved at its
    first append (payloads for ``capacity`` tokens, the full-precision tail as two small buffers it moves
    between, position ids), so decode steps within it allocate no storage (the tail alternates between
    its two buffers); the reservation beyond what is held counts as :attr:`working_nbytes`. Beyond ``capacity``
    the buffers grow as without it (``None``: grow as needed).

    Scheduling follows the codec's scope (:mod:`kvcomp.cache.scopes`): stream- and layer-scope blocks are
    encoded in the layer's update (a layer-scope encode receives the previous layer's reconstruction
    of the same block, handed over by that layer); model-scope blocks once the last layer has appended
    them, after its attention, so the forward that completes a block sees it in full precision under
    every protocol. Bytes are reported apart: :attr:`full_precision_nbytes`, :attr:`payload_nbytes`,
    :attr:`state_nbytes` (their sum is :attr:`nbytes`), :attr:`bookkeeping_nbytes`, :attr:`working_nbytes`.

    Rows left-padded unevenly (a batch of prompts of several lengths) are grouped by their padding before the
    first forward (:meth:`group_rows`, :mod:`kvcomp.cache.rows`): each group has its own streams and scope and holds
    no pad token, so a row is compressed (and its bytes counted) as when it runs alone.

    Models with sliding-window layers (``codec.model.layer_types``): the layers the codec encodes
    (:attr:`compressed_layers`; see :meth:`~kvcomp.codecs.base.ModelInfo.encoding`) are
    :class:`CompressedLayer` s, the others transformers' uncompressed ``DynamicSlidingWindowLayer``
    (:attr:`window_layers`, the last ``sliding_window - 1`` tokens); every byte count includes both.
    """

    def __init__(self, codec: Codec, protocol: str = "streaming", check_finite: bool | str = True,
                 compress_generated: bool = True, decode_per_step: bool = False, capacity: int | None = None,
                 press: Press | None = None):
        if protocol not in PROTOCOLS:
            raise ConfigError(f"unknown protocol {protocol!r}; valid choices: {', '.join(PROTOCOLS)}")
        check_press(press, codec, protocol, compress_generated)
        if check_finite not in CHECK_FINITE:
            raise ConfigError(f"unknown check_finite {check_finite!r}; valid choices: True, False, 'deferred'")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise ConfigError(f"capacity={capacity!r}: a positive number of tokens per sequence, or None (grow as needed)")
        self.codec, self.protocol, self.press = codec, protocol, press
        self.capacity, self.decode_per_step = capacity or 0, decode_per_step
        self.groups = [RowGroup(None, 0, make_scope(codec, self.capacity, decode_per_step))]
        info = codec.model
        encoded = dict(zip(info.model_layers, range(info.num_layers)))  # model layer -> codec layer
        layers = []
        for i in range(info.total_layers):
            if i not in encoded:  # a sliding-window layer the codec leaves alone: transformers' bounded window
                layers.append(DynamicSlidingWindowLayer(info.sliding_window))
                continue
            layers.append(CompressedLayer(self._parts(encoded[i]), protocol, FiniteChecks(check_finite, encoded[i]),
                                          compress_generated, press))
        super().__init__(layers=layers)
        self.compressed_layers = [layer for layer in layers if isinstance(layer, CompressedLayer)]
        self.window_layers = [layer for layer in layers if not isinstance(layer, CompressedLayer)]

    def _parts(self, layer_idx: int) -> list[LayerPart]:
        """Codec layer ``layer_idx``'s part of every row group (made in layer order: scopes chain their layers)."""
        parts = []
        for group in self.groups:
            positions = Positions(self.capacity)
            parts.append(LayerPart(group, group.scope.schedule(layer_idx, positions.rope), positions))
        return parts

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' entry without kvcomp's attention; refuses a model with more layers than the codec's."""
        if layer_idx >= len(self.layers):
            raise ConfigError(f"the cache has {len(self.layers)} layers (its codec {self.codec.name} was built for "
                              f"{self.codec.model.name}), but this model has a layer {layer_idx}: build the codec for "
                              "this model (kvcomp.api.load_codec(model, ...))")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def group_rows(self, pads: list[int]) -> None:
        """Give each set of rows with the same left padding its own streams and scope (:mod:`kvcomp.cache.rows`),
        before the first forward: a row is then compressed as when it runs alone."""
        spec = padding_groups(pads)
        if [(g.rows, g.pads) for g in self.groups] == spec:
            return
        if self.get_seq_length():
            raise RuntimeError("rows are grouped by their padding before the first forward only")
        self.groups = [RowGroup(rows, p, make_scope(self.codec, self.capacity, self.decode_per_step)) for rows, p in spec]
        for layer in self.compressed_layers:
            layer.parts = self._parts(layer.layer_idx)

    @property
    def scope(self) -> Scope:
        """The scheduling of a cache whose rows are not grouped by padding (see :attr:`groups`)."""
        if len(self.groups) > 1:
            raise NotImplementedError("this cache's rows are grouped by their left padding: each group has its own scope")
        return self.groups[0].scope

    def raise_if_nonfinite(self) -> None:
        """Read every layer's pending ``check_finite="deferred"`` verdict (e.g. after the last forward)."""
        for layer in self.compressed_layers:
            layer.raise_if_nonfinite()

    def layer_types(self) -> dict[str, list]:
        """The cache's layers by attention type (``full_attention``, ``sliding_attention``), model order."""
        kinds = self.codec.model.layer_types or (FULL,) * len(self.layers)
        return {kind: [layer for layer, k in zip(self.layers, kinds) if k == kind] for kind in dict.fromkeys(kinds)}

    @property
    def full_precision_nbytes(self) -> int:
        """Bytes of full-precision tokens: sinks and tails, and the windows of uncompressed sliding layers."""
        return sum(layer.full_precision_nbytes for layer in self.compressed_layers) + sum(
            _window_nbytes(layer) for layer in self.window_layers)

    @property
    def shared_payload_nbytes(self) -> int:
        """Bytes of payloads every layer shares (a model-scope codec's)."""
        return sum(g.scope.shared_store.nbytes for g in self.groups if g.scope.shared_store is not None)

    @property
    def payload_nbytes(self) -> int:
        """Bytes of every encoded payload (per layer, or shared by the layers)."""
        return sum(layer.payload_nbytes for layer in self.compressed_layers) + self.shared_payload_nbytes

    @property
    def state_nbytes(self) -> int:
        """Bytes of per-sequence codec state, e.g. dictionaries sampled from the prompt."""
        return sum(layer.state_nbytes for layer in self.compressed_layers) + self.shared_state_nbytes

    @property
    def shared_state_nbytes(self) -> int:
        """Bytes of per-sequence state every layer shares (a model-scope codec's)."""
        return sum(g.scope.shared_state_nbytes for g in self.groups)

    @property
    def nbytes(self) -> int:
        """Measured bytes of K/V storage: full-precision tokens, encoded payloads, per-sequence state."""
        return self.full_precision_nbytes + self.payload_nbytes + self.state_nbytes

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.select_rows(torch.arange(self.compressed_layers[0].batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_rows(_row_index(indices))

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (row ``r`` becomes old row ``index[r]``: beam reorder, batch select / repeat)
        of everything held; grouped rows stay with their group (one host read of ``index``)."""
        for layer in self.window_layers:
            layer.reorder_cache(index)
        if len(self.groups) == 1 and self.groups[0].rows is None:
            picks = [(0, index, None)]
        else:
            old = index.tolist()
            owner = {row: (k, pos) for k, g in enumerate(self.groups) for pos, row in enumerate(g.rows)}
            picks = []
            for k in range(len(self.groups)):
                rows = [r for r, o in enumerate(old) if owner[o][0] == k]
                if rows:
                    picks.append((k, torch.tensor([owner[old[r]][1] for r in rows]), rows))
        for k, local, rows in picks:
            self.groups[k].scope.select_rows(local)
            self.groups[k].move(rows)
            for layer in self.compressed_layers:
                layer.parts[k].select_rows(local)
        self.groups = [self.groups[k] for k, _, _ in picks]
        for layer in self.compressed_layers:
            layer.parts = [layer.parts[k] for k, _, _ in picks]

    @property
    def bookkeeping_nbytes(self) -> int:
        return sum(layer.bookkeeping_nbytes for layer in self.compressed_layers)

    def statistics(self) -> CacheStatistics:
        """What the cache holds for batch row 0 (its row group), for the codec's
        :meth:`~kvcomp.codecs.base.Codec.example_metrics`."""
        k = next(k for k, g in enumerate(self.groups) if g.rows is None or 0 in g.rows)
        parts = [layer.parts[k] for layer in self.compressed_layers]
        streams = [s for part in parts for s in part.streams]
        scope = self.groups[k].scope
        store = scope.shared_store
        prefixes = [part.prefix for part in parts if part.prefix is not None]  # a prompt pressed with budgets per head
        return CacheStatistics(
            batch=parts[0].batch, streams=len(streams),
            cached_tokens=sum(s.length for s in streams) + 2 * sum(p.tokens_per_head for p in prefixes),
            encoded_tokens=sum(s.num_encoded for s in streams),
            full_precision_nbytes=sum(s.full_precision_nbytes for s in streams) + sum(p.nbytes for p in prefixes),
            payload_nbytes=sum(s.store.nbytes for s in streams),
            state_nbytes=sum(part.schedule.state_nbytes for part in parts),
            shared_payloads=() if store is None else tuple(store.payloads), shared_state=scope.shared_state)

    @property
    def working_nbytes(self) -> int:
        """Bytes held besides storage and bookkeeping (decoded copies, spare capacity)."""
        return sum(layer.working_nbytes for layer in self.compressed_layers)

    def bits_per_value_seen(self) -> float:
        """Storage bits per K/V value of every real token the cache was given (a press's evicted tokens included,
        left padding not), over every layer: the byte axis eviction and quantization share."""
        info, layers = self.codec.model, self.compressed_layers
        tokens = sum(part.batch * (part.held_tokens + part.evicted) for part in layers[0].parts)
        return 8 * self.nbytes / max(2 * info.total_layers * info.num_kv_heads * info.head_dim * tokens, 1)

    def bits_breakdown(self) -> dict[str, float]:
        """Measured storage apart: ``encoded_share`` (the share of cached values held encoded, the others in
        full precision), ``code_bits_per_value`` (payload bits per encoded value),
        ``state_bits_per_value`` (per-sequence state per cached value) and ``bits_per_value_measured``
        (everything, full-precision tokens included, per cached value). Model-level overhead is the
        codec's (:meth:`~kvcomp.codecs.base.Codec.overhead_bits`). Models with sliding-window layers also
        get ``bits_per_value_<layer type>`` (bits per value held by the layers of that type) and
        ``kv_bytes_<layer type>`` (a model-scope codec's payloads and state count with the full-attention
        layers, if any)."""
        streams = [s for layer in self.compressed_layers for s in layer.streams]
        values = max(sum(layer.num_values for layer in self.compressed_layers)
                     + sum(_window_values(w) for w in self.window_layers), 1)
        encoded = sum(s.batch * self.codec.model.num_kv_heads * self.codec.model.head_dim * s.num_encoded for s in streams)
        bits = {
            "encoded_share": encoded / values,
            "code_bits_per_value": 8 * self.payload_nbytes / encoded if encoded else 0.0,
            "state_bits_per_value": 8 * self.state_nbytes / values,
            "bits_per_value_measured": 8 * self.nbytes / values,
        }
        if self.codec.model.layer_types:
            by_type = self.layer_types()
            shared = FULL if FULL in by_type else next(iter(by_type))
            for kind, layers in by_type.items():
                held = sum(_layer_nbytes(layer) for layer in layers)
                if kind == shared:
                    held += self.shared_payload_nbytes + self.shared_state_nbytes
                count = sum(_layer_values(layer) for layer in layers)
                bits[f"bits_per_value_{kind}"] = 8 * held / count if count else 0.0
                bits[f"kv_bytes_{kind}"] = held
        return bits


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
    """Whether every stream holds its tokens as :attr:`~kvcomp.cache.stream.KVStream.drops_in_place` needs: in full
    precision without sinks, or encoded one by one (a post-RoPE, stateless per-token codec)."""
    policies = [codec.policy(kind, layer) for kind in ("key", "value") for layer in range(codec.model.num_layers)]
    if codec.pre_rope or offsets or any(p.sinks for p in policies):  # tokens tied to their cache index, or sinks
        return False
    if _full_precision(codec):
        return True
    return (not keeps_state(codec) and codec.payload_layout == "tokens"
            and all(p.block_size is None or p.block_size == 1 and p.window == 0 for p in policies))


def _window_nbytes(layer) -> int:
    """Bytes of an uncompressed (window) layer's K/V."""
    return sum(t.numel() * t.element_size() for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
               if t is not None)


def _window_values(layer) -> int:
    return sum(t.numel() for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)


def _layer_nbytes(layer) -> int:
    return layer.nbytes if isinstance(layer, CompressedLayer) else _window_nbytes(layer)


def _layer_values(layer) -> int:
    return layer.num_values if isinstance(layer, CompressedLayer) else _window_values(layer)
