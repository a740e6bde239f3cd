"""A codec's scope (:mod:`kvcomp.codecs.base`) in the cache: when blocks are encoded and how they decode.

- ``stream``: each stream encodes its own blocks (:meth:`~kvcomp.codecs.base.Codec.encode`);
- ``layer``: a layer's key and value blocks together, with the previous layer's reconstruction of the same
  tokens, handed over by that layer's :class:`LayerSchedule` (AQUA-KV);
- ``model``: every layer's block at once, once the last layer has appended it, after its attention read it,
  so the forward that completes a block sees it in full precision (:class:`ModelUnit`; kvtc).

The cache makes one :class:`Scope` per row group (:func:`make_scope`) and asks it for each layer's
:class:`Schedule`, which owns that layer's key and value streams. When blocks are encoded and decoded, and where
per-sequence state lives, is decided here. A few callers outside ``codecs/`` also ask about the scope or the state:

- :mod:`kvcomp.cache.eviction`: :func:`~kvcomp.cache.eviction.check_press` refuses a press beside a codec that is
  not stream-scope, and pressing while decoding needs a codec without per-sequence state (``keeps_state``);
- :mod:`kvcomp.cache.accounting`: the byte counts read :attr:`Scope.shared_store` (a model-scope codec's payloads);
- :mod:`kvcomp.cache.offload` stores and restores :attr:`Scope.shared_store` (after
  :meth:`Scope.check_storable`);
- the benchmarks ask :meth:`~kvcomp.codecs.base.Codec.encodes_after_forward` (model scope): perplexity's protocols
  (:func:`~kvcomp.benchmarks.perplexity.protocols_for`, called by :mod:`kvcomp.runner`) and how lm-eval requests are
  fed (:mod:`kvcomp.benchmarks.lm_eval_bridge`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvcomp.cache.payload_store import Block, PayloadStore
from kvcomp.cache.stream import FreshlyEncoded, KVStream
from kvcomp.codecs.base import (KINDS, Codec, LayerRequest, ModelRequest, SequenceState, StreamRequest, Unit,
                                keeps_state)

Fresh = tuple[FreshlyEncoded | None, FreshlyEncoded | None]


class Schedule(ABC):
    """One layer's key and value streams and when their blocks are encoded (:meth:`encode_ready`, in the
    layer's update; or :meth:`after_views`, once attention's view of the forward is taken) and decoded
    (:meth:`decode`, un-rotated; the streams re-rotate pre-RoPE keys)."""

    encodes_in_update = True  # False: blocks are encoded after attention's view (model scope)

    def __init__(self, codec: Codec, layer_idx: int, rope, decode_per_step: bool, capacity: int):
        self.codec, self.layer_idx = codec, layer_idx
        self.is_last = layer_idx == codec.model.num_layers - 1
        self.stream_args = (rope, decode_per_step, capacity)
        self.reset()

    def reset(self) -> None:
        rope, decode_per_step, capacity = self.stream_args
        self.key_stream, self.value_stream = (
            KVStream(self.codec, kind, self.layer_idx, rope, decode_per_step,
                     lambda block, kind=kind: self.decode(kind, block), capacity) for kind in KINDS)

    @property
    def streams(self) -> tuple[KVStream, KVStream]:
        return self.key_stream, self.value_stream

    @abstractmethod
    def encode_ready(self, kernel_backend: str, range_checks: list | None) -> Fresh:
        """Encode what the streams' policies allow now (``kernel_backend``: the step's; ``range_checks``: the
        forward's deferred range checks, :mod:`kvcomp.stages.ranges`); what moved from the tails, per stream."""

    @abstractmethod
    def decode(self, kind: str, block: Block) -> torch.Tensor:
        """One stream's block decoded (pre-RoPE keys un-rotated)."""

    def after_views(self, kernel_backend: str, range_checks: list | None) -> None:
        """Called once attention's view of a forward is taken."""

    @property
    def state(self) -> SequenceState | None:
        """The layer's per-sequence codec state (layer scope)."""
        return None

    @property
    def state_nbytes(self) -> int:
        """Bytes of per-sequence state held for this layer (its streams' and its own)."""
        own = 0 if self.state is None else self.state.nbytes
        return own + sum(s.state.nbytes for s in self.streams if s.state is not None)

    def select_rows(self, index: torch.Tensor) -> None:
        for stream in self.streams:
            stream.select_rows(index)
        if self.state is not None:
            self.state.select_rows(index)


class StreamSchedule(Schedule):
    """Stream scope: each stream encodes and decodes its blocks alone, with its own state."""

    def encode_ready(self, kernel_backend: str, range_checks: list | None) -> Fresh:
        return (self._encode(self.key_stream, kernel_backend, range_checks),
                self._encode(self.value_stream, kernel_backend, range_checks))

    def _encode(self, stream: KVStream, kernel_backend: str, range_checks: list | None) -> FreshlyEncoded | None:
        count = stream.ready()
        if not count:
            return None
        if keeps_state(self.codec) and stream.state is None:
            held = {(self.layer_idx, stream.kind): stream.held()}
            stream.state = self.codec.init_state(Unit(self.layer_idx, stream.kind), held)
        first, chunk, x = stream.take(count)
        payload = self.codec.encode(StreamRequest(self.layer_idx, stream.kind, tokens=x, state=stream.state,
                                                  kernel_backend=kernel_backend, range_checks=range_checks))
        return stream.add_block(stream.store.append(payload, first), chunk)

    def decode(self, kind: str, block: Block) -> torch.Tensor:
        stream = self.key_stream if kind == "key" else self.value_stream
        return self.codec.decode(stream.store.block(block), StreamRequest(self.layer_idx, kind, state=stream.state,
                                                                          dtype=stream.dtype))


class JointSchedule(Schedule):
    """Layer and model scope: a block's keys and values decode in one call; the half not asked for yet is
    kept until its stream asks."""

    def reset(self) -> None:
        super().reset()
        self.decoded_other: dict[tuple[str, int], torch.Tensor] = {}

    def decode(self, kind: str, block: Block) -> torch.Tensor:
        other = self.decoded_other.pop((kind, block.first), None)
        if other is not None:
            return other
        k, v = self.decode_both(block)
        self.decoded_other[("value" if kind == "key" else "key", block.first)] = v if kind == "key" else k
        return k if kind == "key" else v

    @abstractmethod
    def decode_both(self, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of the block whose key block is ``block``."""


class LayerSchedule(JointSchedule):
    """Layer scope: a block of keys and values is encoded and decoded with the previous layer's reconstruction
    of the same tokens, which that layer hands over (``previous``: its schedule; None for the first layer)."""

    def __init__(self, codec: Codec, layer_idx: int, rope, decode_per_step: bool, capacity: int,
                 previous: "LayerSchedule | None"):
        self.previous = previous
        super().__init__(codec, layer_idx, rope, decode_per_step, capacity)

    def reset(self) -> None:
        super().reset()
        self.own_state: SequenceState | None = None
        self.blocks: dict[int, tuple[Block, Block]] = {}  # (key, value) block by first token
        self.encode_handoff: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # for the next layer's encode
        self.decode_handoff: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # for the next layer's decode

    @property
    def state(self) -> SequenceState | None:
        return self.own_state

    def encode_ready(self, kernel_backend: str, range_checks: list | None) -> Fresh:
        keys, values = self.streams
        count = keys.ready()
        if count != values.ready():
            raise RuntimeError(f"layer-scope codec {self.codec.name}: keys and values are ready to encode different token counts")
        if not count:
            return None, None
        if keeps_state(self.codec) and self.own_state is None:
            held = {(self.layer_idx, s.kind): s.held() for s in self.streams}
            self.own_state = self.codec.init_state(Unit(self.layer_idx), held)
        first, key_chunk, k = keys.take(count)
        _, value_chunk, v = values.take(count)
        encoding = self.codec.encode(LayerRequest(self.layer_idx, keys=k, values=v,
                                                  previous=self._handed("encode", first), state=self.own_state,
                                                  kernel_backend=kernel_backend, range_checks=range_checks))
        if not self.is_last:
            self.encode_handoff[first] = (encoding.keys, encoding.values)
        key_block, value_block = keys.store.append(encoding.key, first), values.store.append(encoding.value, first)
        self.blocks[first] = (key_block, value_block)
        return keys.add_block(key_block, key_chunk), values.add_block(value_block, value_chunk)

    def decode_both(self, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
        key_block, value_block = self.blocks[block.first]
        payloads = self.key_stream.store.block(key_block), self.value_stream.store.block(value_block)
        k, v = self.codec.decode(payloads, LayerRequest(self.layer_idx, previous=self._handed("decode", block.first),
                                                        state=self.own_state, dtype=self.key_stream.dtype))
        if not self.is_last:
            self.decode_handoff[block.first] = (k, v)
        return k, v

    def _handed(self, what: str, first: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The previous layer's reconstruction of the block at ``first``, on this layer's device."""
        if self.previous is None:
            return None
        handoff = self.previous.encode_handoff if what == "encode" else self.previous.decode_handoff
        if first not in handoff:
            raise RuntimeError(
                f"layer-scope codec {self.codec.name}: layer {self.layer_idx - 1} has not {what}d the block at "
                f"cache index {first} before layer {self.layer_idx} (layers must run in order over one cache)")
        return tuple(t.to(self.key_stream.device) for t in handoff.pop(first))


class ModelUnit:
    """The encoding unit of a model-scope codec: a token block of every layer's keys and values is encoded as
    one payload once the last layer has appended it. Holds those payloads and the per-sequence state."""

    def __init__(self, codec: Codec, capacity: int = 0):
        self.codec = codec
        self.store = PayloadStore(codec.payload_layout, capacity)
        self.state: SequenceState | None = None
        self.schedules: list[ModelSchedule] = []

    def encode_ready(self, kernel_backend: str, range_checks: list | None, flush: bool = False) -> None:
        """Encode the block every stream has ready (``flush``: every tail token, e.g. before storing the cache;
        ``range_checks``: :mod:`kvcomp.stages.ranges`)."""
        streams = [s for schedule in self.schedules for s in schedule.streams]
        counts = {s.num_tail if flush else s.ready() for s in streams}
        if len(counts) > 1:
            raise RuntimeError(f"model-scope codec {self.codec.name}: layers are ready to encode different token counts {counts}")
        count = counts.pop()
        if not count:
            return
        if keeps_state(self.codec) and self.state is None:
            self.state = self.codec.init_state(Unit(), {(s.layer_idx, s.kind): s.held() for s in streams})
        taken = [s.take(count) for s in streams]
        device = taken[0][2].device  # the first layer's: layers may live on several devices (device_map)
        payload = self.codec.encode(ModelRequest(keys=[t[2].to(device) for t in taken[0::2]],
                                                 values=[t[2].to(device) for t in taken[1::2]], state=self.state,
                                                 encoded_before=self.store.num_tokens, kernel_backend=kernel_backend,
                                                 range_checks=range_checks))
        block = self.store.append(payload, taken[0][0])
        for stream, (_, chunk, _) in zip(streams, taken):
            stream.add_block(block, chunk)

    @property
    def state_nbytes(self) -> int:
        return 0 if self.state is None else self.state.nbytes

    def select_rows(self, index: torch.Tensor) -> None:
        self.store.select_rows(index)
        if self.state is not None:
            self.state.select_rows(index)


class ModelSchedule(JointSchedule):
    """Model scope: the layer's streams take part in the shared :class:`ModelUnit`, which encodes after the
    last layer's attention view."""

    encodes_in_update = False

    def __init__(self, codec: Codec, layer_idx: int, rope, decode_per_step: bool, capacity: int, unit: ModelUnit):
        self.unit = unit
        super().__init__(codec, layer_idx, rope, decode_per_step, capacity)

    def encode_ready(self, kernel_backend: str, range_checks: list | None) -> Fresh:
        return None, None

    def after_views(self, kernel_backend: str, range_checks: list | None) -> None:
        if self.is_last:  # every layer has appended the block
            self.unit.encode_ready(kernel_backend, range_checks)

    def decode_both(self, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.codec.decode(self.unit.store.block(block), ModelRequest(self.layer_idx, state=self.unit.state,
                                                                            dtype=self.key_stream.dtype))
        return k.to(self.key_stream.device), v.to(self.key_stream.device)


class Scope:
    """A cache's scheduling: makes each layer's :class:`Schedule` (in layer order) and holds what layers share
    (a model-scope codec's :class:`ModelUnit`)."""

    def __init__(self, codec: Codec, capacity: int = 0, decode_per_step: bool = False):
        self.codec, self.capacity, self.decode_per_step = codec, capacity, decode_per_step
        self.schedules: list[Schedule] = []

    def schedule(self, layer_idx: int, rope) -> Schedule:
        schedule = self._make(layer_idx, rope)
        self.schedules.append(schedule)
        return schedule

    def _make(self, layer_idx: int, rope) -> Schedule:
        return StreamSchedule(self.codec, layer_idx, rope, self.decode_per_step, self.capacity)

    @property
    def shared_store(self) -> PayloadStore | None:
        """Payloads every layer shares (model scope)."""
        return None

    @property
    def shared_state(self) -> SequenceState | None:
        """Per-sequence state every layer shares (model scope)."""
        return None

    @property
    def shared_state_nbytes(self) -> int:
        return 0

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` of what layers share."""

    def flush(self) -> None:
        """Encode every full-precision tail token (before storing a cache)."""
        raise NotImplementedError(f"flushing the window of a {self.codec.name} cache is not supported: its blocks have "
                                  "a fixed size (model-scope codecs such as kvtc can flush)")

    hands_over = False  # layers hand reconstructions to the next layer (not stored)

    def check_storable(self) -> None:
        """Refuse to store a cache whose codec keeps per-sequence state or hands blocks between layers."""
        if self.hands_over or keeps_state(self.codec):
            raise NotImplementedError(
                f"storing a {self.codec.name} cache between turns is not supported: only stream- and model-scope codecs "
                "without per-sequence state (e.g. kvtc with deflate_scope=block and pca_source=calibration, kivi, uniform, "
                "qjl, fp16) can be stored")


class LayerScope(Scope):
    def _make(self, layer_idx: int, rope) -> Schedule:
        previous = self.schedules[-1] if self.schedules else None
        return LayerSchedule(self.codec, layer_idx, rope, self.decode_per_step, self.capacity, previous)

    hands_over = True


class ModelScope(Scope):
    def __init__(self, codec: Codec, capacity: int = 0, decode_per_step: bool = False):
        super().__init__(codec, capacity, decode_per_step)
        self.unit = ModelUnit(codec, capacity)

    def _make(self, layer_idx: int, rope) -> Schedule:
        schedule = ModelSchedule(self.codec, layer_idx, rope, self.decode_per_step, self.capacity, self.unit)
        self.unit.schedules.append(schedule)
        return schedule

    @property
    def shared_store(self) -> PayloadStore:
        return self.unit.store

    @property
    def shared_state(self) -> SequenceState | None:
        return self.unit.state

    @property
    def shared_state_nbytes(self) -> int:
        return self.unit.state_nbytes

    def select_rows(self, index: torch.Tensor) -> None:
        self.unit.select_rows(index)

    def flush(self) -> None:
        self.unit.encode_ready("torch", None, flush=True)  # stored next: checked on the host


SCOPE_CLASSES = {"stream": Scope, "layer": LayerScope, "model": ModelScope}


def make_scope(codec: Codec, capacity: int = 0, decode_per_step: bool = False) -> Scope:
    """The :class:`Scope` of ``codec``'s scope."""
    return SCOPE_CLASSES[codec.scope](codec, capacity, decode_per_step)
