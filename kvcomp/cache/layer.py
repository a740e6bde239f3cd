"""One decoder layer of a :class:`~kvcomp.cache.compressed_cache.CompressedCache`: per row group, a key and a value
stream that hold codec payloads instead of full K/V tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcomp.cache.checks import FiniteChecks, check_kv_shape
from kvcomp.cache.eviction import Eviction
from kvcomp.cache.headwise import HeadwisePrefix, HeadwiseReads
from kvcomp.cache.positions import Positions
from kvcomp.cache.reads import FromSegments, FusedDecode, Reads, Streaming, payload_read
from kvcomp.cache.rows import ByRows, RowGroup
from kvcomp.cache.scopes import Schedule
from kvcomp.cache.context import LayerContext, ContextLayer
from kvcomp.cache.stream import KVStream
from kvcomp.errors import ConfigError
from kvcomp.presses import Press


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts along tokens; a single part as it is (no copy: e.g. the fp16 codec's tail)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


@dataclass(eq=False)
class LayerPart:
    """One :class:`~kvcomp.cache.rows.RowGroup`'s share of a layer: the schedule of its key and value streams, the
    positions of its tokens (pre-RoPE codecs), and its eviction state (:mod:`kvcomp.cache.eviction`): how many prompt
    tokens a press ``evicted`` (per row and KV head), the ``last_query [B, Hq, 1, D]`` of the latest forward, which a
    press that reads queries scores the held tokens with while decoding (TOVA), and the ``prefix`` a press with a
    budget per head kept (``head_budgets=adakv``), held apart from the streams, which then hold the later tokens."""

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

    def reset(self) -> None:
        self.schedule.reset()
        self.positions.reset()
        self.evicted, self.last_query, self.prefix = 0, None, None

    def select_rows(self, index: torch.Tensor) -> None:
        self.schedule.select_rows(index)
        self.positions.select_rows(index)
        if self.prefix is not None:
            self.prefix.select_rows(index)
        if self.last_query is not None:
            self.last_query = self.last_query.index_select(0, index.to(self.last_query.device))


class CompressedLayer(ContextLayer):
    """One decoder layer: per group of rows padded alike (``parts``: one unless a first forward came left-padded
    unevenly, :mod:`kvcomp.cache.rows`), a key and a value stream following the codec's policy, encoded and decoded
    as the codec's scope says; its finiteness ``checks``; a press's ``eviction`` (None without a press); and whether
    torch decode steps read payloads tile by tile (``tiles``, :func:`~kvcomp.cache.reads.payload_read`).

    Each forward's K/V come with the context (:meth:`update_in_context`), which returns what attention reads: full-precision
    sinks and tail, decoded blocks in between (keys re-rotated for pre-RoPE codecs), or the payloads themselves
    (:func:`~kvcomp.cache.reads.payload_read`); per row group (:class:`~kvcomp.cache.rows.ByRows`) when its rows are
    grouped or padded. Without kvcomp's attention, transformers' ``update`` serves codecs that need no context. Its bytes
    are counted by :mod:`kvcomp.cache.accounting`.
    """

    def __init__(self, parts: list[LayerPart], protocol: str, checks: FiniteChecks, compress_generated: bool = True,
                 press: Press | None = None, tiles: bool = True):
        super().__init__()
        self.parts, self.protocol, self.checks, self.tiles = parts, protocol, checks, tiles
        self.eviction = None if press is None else Eviction(press)
        self.codec, self.layer_idx = parts[0].schedule.codec, parts[0].schedule.layer_idx
        self.compress_generated = compress_generated
        self.keys = self.values = None
        self.is_initialized = False
        self.length = 0  # tokens of every forward, left padding included (which no stream holds)

    def reset(self) -> None:
        for part in self.parts:
            part.reset()
        self.checks.reset()
        self.is_initialized = False
        self.length = 0

    @property
    def positions(self) -> Positions:
        """The first row group's token positions (the only group unless the rows are grouped)."""
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
        check_kv_shape(self.codec, self.layer_idx, key_states, value_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """transformers' entry when the model's attention is not kvcomp's: the keys and values for SDPA."""
        read = self.update_in_context(key_states, value_states, None)
        if isinstance(read, Reads):
            raise ConfigError("the streaming protocol needs the kvcomp attention function for multi-token forwards: "
                              "call kvcomp.cache.install(model) first (or use protocol='simulated')")
        return read

    def update_in_context(self, key_states: torch.Tensor, value_states: torch.Tensor, context: LayerContext | None,
                       query: torch.Tensor | None = None):
        """Store a forward's K/V (``context``: None outside kvcomp's attention); return ``(keys, values)`` for SDPA,
        or the :class:`~kvcomp.cache.reads.Reads` attention needs (per row group: a
        :class:`~kvcomp.cache.rows.ByRows`). ``query``: the forward's queries, which a press scores the prompt with."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        first = self.length
        self.length += key_states.shape[2]
        return self.checks.around(key_states, value_states, first,
                                  lambda checks: self._store_rows(key_states, value_states, context, first == 0, query,
                                                                  checks),
                                  lambda: self.streams)

    def _store_rows(self, key_states: torch.Tensor, value_states: torch.Tensor, context: LayerContext | None,
                    first_forward: bool, query: torch.Tensor | None, range_checks: list | None):
        whole, eviction = self.parts[0].group, self.eviction
        if len(self.parts) == 1 and whole.rows is None and not whole.pads and eviction is None:
            return self._store(self.parts[0], key_states, value_states, context, range_checks, first_forward, query)
        if context is None:
            raise RuntimeError("a cache whose rows are grouped by their padding, or pressed, is read by kvcomp's "
                               "attention only")
        if eviction is not None and not first_forward and eviction.decodes:
            for part in self.parts:  # pressing while decoding, before this forward's tokens and mask columns
                eviction.press_held(part)
        dropped = [part.evicted for part in self.parts]  # before this forward: its own prefill reads every token
        queries = [None if query is None else part.group.tokens(query, first_forward, 2) for part in self.parts]
        read = ByRows([(part.group, self._store(part, part.group.tokens(key_states, first_forward, 2),
                                                part.group.tokens(value_states, first_forward, 2),
                                                part.group.layer_context(context, first_forward), range_checks, first_forward,
                                                group_query),
                        evicted)
                       for part, evicted, group_query in zip(self.parts, dropped, queries)], first_forward)
        if eviction is not None:
            eviction.remember_queries(self.parts, queries)  # the next forward presses with them
        return read

    def _store(self, part: LayerPart, key_states: torch.Tensor, value_states: torch.Tensor, context: LayerContext | None,
               range_checks: list | None, first_forward: bool = False, query: torch.Tensor | None = None):
        """One row group's forward: store its K/V and return what its attention reads (a pressed prompt: every
        token, exactly, as it stores the kept ones); ``range_checks``: what its encodes' requests carry
        (:mod:`kvcomp.stages.ranges`)."""
        if self.eviction is not None and first_forward and key_states.shape[2] > 1:
            pressed = self.eviction.prompt(part, key_states, value_states, context, query)
            if pressed is not None:
                if pressed:
                    self._store(part, *pressed, range_checks)
                return key_states, value_states
        n = key_states.shape[2]
        key_stream, value_stream = part.streams
        if key_stream.rotates:
            part.positions.record(context, key_states.shape[0], n, f"codec {self.codec.name} (layer {self.layer_idx})")
        fused = payload_read(self.codec, self.layer_idx, part, context, self.tiles) if n == 1 else None
        key_view = KVStream.segments if fused in ("attention", "scores") else KVStream.pieces
        value_view = KVStream.segments if fused in ("attention", "values") else KVStream.pieces
        for stream, view in ((key_stream, key_view), (value_stream, value_view)):
            if view is KVStream.segments:  # a chunked prefill's decoded copy, otherwise kept for the whole generation
                stream.forget_decoded()
        history = self.protocol == "exact_prefill" and part.schedule.encodes_in_update and any(
            s.ready_after(n) for s in part.streams)  # this forward sees its own tokens uncompressed
        if history:
            key_history, value_history = key_view(key_stream), value_view(value_stream)
        key_stream.append(key_states)
        value_stream.append(value_states)
        backend = "torch" if context is None else context.kernel_backend
        fresh = part.schedule.encode_ready(backend, range_checks)
        if history:
            keys, values = [*key_history, key_states], [*value_history, value_states]
        else:
            keys, values = key_view(key_stream), value_view(value_stream)
        part.schedule.after_views(backend, range_checks)
        if not self.compress_generated:  # only the first forward (the prompt) is ever encoded
            for stream in part.streams:
                stream.freeze()
        return self._read(part, keys, values, fresh, fused, context, n)

    def _read(self, part: LayerPart, keys: list, values: list, fresh: tuple, fused: str | None, context: LayerContext | None,
              n: int):
        """What a row group's attention reads of the pieces ``keys`` and ``values`` (tensors, or payloads where
        ``fused`` reads them), ``fresh``: the blocks this forward of ``n`` tokens encoded."""
        if part.prefix is not None:
            return HeadwiseReads(part.prefix, _joined(keys), _joined(values))
        key_stream, value_stream = part.streams
        if fused == "attention":
            key_rope = part.positions.key_rope(key_stream.num_sinks) if key_stream.rotates else None
            return FusedDecode(keys, values, self.codec, self.layer_idx, context.kernel_backend, key_rope, key_stream.length)
        if fused:
            return FromSegments(keys, values, self.codec, self.layer_idx, context.kernel_backend, value_stream.state)
        if self.protocol == "streaming" and n > 1 and any(fresh):
            return Streaming(_joined(keys), _joined(values), *fresh)
        return _joined(keys), _joined(values)

    def raise_if_nonfinite(self) -> None:
        """Read this layer's verdicts of its last forward under ``check_finite="deferred"``."""
        self.checks.raise_pending()
