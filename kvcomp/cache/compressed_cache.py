"""A transformers 5.x ``Cache`` whose layers hold codec payloads instead of full K/V tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from kvcomp.cache.growing import GrowingTensor
from kvcomp.cache.stream import Block, FreshlyEncoded, KVStream, PayloadStore
from kvcomp.codecs.base import FULL, Codec, SequenceState, Unit
from kvcomp.errors import ConfigError, NonFiniteKVError
from kvcomp.kernels.payloads import RotaryPositions
from kvcomp.stages.uniform_quantizer import deferred_range_checks

PROTOCOLS = ("streaming", "simulated", "exact_prefill")


@dataclass
class LastUpdate:
    """What the latest ``update`` did, for the attention function (streaming protocol)."""

    keys: FreshlyEncoded | None
    values: FreshlyEncoded | None


def _finite(key_states: torch.Tensor, value_states: torch.Tensor) -> torch.Tensor:
    """Device bool: no NaN/Inf in the K/V (sums of finite K/V cannot overflow float32)."""
    return torch.isfinite(key_states.sum(dtype=torch.float32) + value_states.sum(dtype=torch.float32))


def _span(first: int, count: int) -> str:
    return f"{first}..{first + count - 1}"


class DeviceFlag:
    """Device bools read later without stalling the stream: on a GPU they are copied into pinned host memory
    behind an event, and reading waits for that event only (not for work queued after it)."""

    def __init__(self, flag: torch.Tensor):
        self.event = None
        if flag.device.type == "cuda":
            self.host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
            self.host.copy_(flag, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = flag

    def read(self) -> list[bool]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.reshape(-1).tolist()


@dataclass
class FusedStep:
    """What a fused decode step's attention reads, handed over by ``update`` (see
    :attr:`CompressedLayer.fused_decode`): the mode and the key and value segments (full-precision
    tensors and payloads, in token order)."""

    mode: str
    keys: list
    values: list


def _row_index(indices: torch.Tensor) -> torch.Tensor:
    """Batch rows to keep, from transformers' indices or boolean mask."""
    return indices.nonzero().squeeze(-1) if indices.dtype == torch.bool else indices


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts along tokens; a single part as it is (no copy: e.g. the fp16 codec's tail)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


class ModelUnit:
    """The encoding unit of a model-scope codec: a token block of every layer's keys and values is encoded
    as one payload once the last layer has appended it (after that layer's attention, so every layer of
    the forward that completed the block saw it in full precision). Holds those payloads and the
    per-sequence state."""

    def __init__(self, codec: Codec, capacity: int = 0):
        self.codec = codec
        self.store = PayloadStore(codec.payload_layout, capacity)
        self.state: SequenceState | None = None
        self.layers: list[CompressedLayer] = []

    def encode_ready(self, flush: bool = False) -> None:
        """Encode the block every stream has ready (``flush``: every tail token, e.g. before storing the cache)."""
        streams = [s for layer in self.layers for s in (layer.key_stream, layer.value_stream)]
        counts = {s.num_tail if flush else s.ready() for s in streams}
        if len(counts) > 1:
            raise RuntimeError(f"model-scope codec {self.codec.name}: layers are ready to encode different token counts {counts}")
        count = counts.pop()
        if not count:
            return
        if self.codec.stateful and self.state is None:
            self.state = self.codec.init_state(Unit(), {(s.layer_idx, s.kind): s.held() for s in streams})
        taken = [s.take(count) for s in streams]
        device = taken[0][2].device  # the first layer's: layers may live on several devices (device_map)
        payload = self.codec.encode_model([t[2].to(device) for t in taken[0::2]], [t[2].to(device) for t in taken[1::2]], self.state,
                                          encoded_before=self.store.num_tokens)
        block = self.store.append(payload, taken[0][0])
        for stream, (_, chunk, _) in zip(streams, taken):
            stream.add_block(block, chunk)

    def decode(self, layer_idx: int, block: Block, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codec.decode_model(self.store.block(block), layer_idx, dtype, self.state)

    @property
    def state_nbytes(self) -> int:
        return 0 if self.state is None else self.state.nbytes

    def select_rows(self, index: torch.Tensor) -> None:
        self.store.select_rows(index)
        if self.state is not None:
            self.state.select_rows(index)


class CompressedLayer(CacheLayerMixin):
    """One decoder layer: a key stream and a value stream, each following the codec's policy.

    ``update`` returns the keys and values attention should use: full-precision sinks and tail,
    decoded blocks in between (keys re-rotated for pre-RoPE codecs).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, codec: Codec, layer_idx: int, protocol: str = "streaming", check_finite: bool | str = True,
                 compress_generated: bool = True, decode_per_step: bool = False, previous: "CompressedLayer | None" = None,
                 model_unit: ModelUnit | None = None, capacity: int = 0):
        super().__init__()
        self.codec, self.layer_idx, self.protocol, self.check_finite = codec, layer_idx, protocol, check_finite
        self.compress_generated, self.decode_per_step, self.capacity = compress_generated, decode_per_step, capacity
        self.previous, self.model_unit = previous, model_unit  # layer-scope predecessor; model-scope unit
        self.is_last = layer_idx == codec.model.num_layers - 1
        self.attention_hooked = False  # set by the kvcomp attention pre-hook
        self.kernel_backend = "torch"  # set by the pre-hook from install(model, kernel_backend)
        self.rotary: tuple | None = None  # the model's RoPE (inv_freq, attention scaling, dtype), from the pre-hook
        self.reset()

    def reset(self) -> None:
        joint = self.codec.scope != "stream"  # K and V blocks decode together, through the layer
        self.key_stream, self.value_stream = (
            KVStream(self.codec, kind, self.layer_idx, self.rope, self.decode_per_step,
                     (lambda block, kind=kind: self._decode_jointly(kind, block)) if joint else None, self.capacity)
            for kind in ("key", "value")
        )
        self.state: SequenceState | None = None  # stateful layer-scope codecs
        self.layer_blocks: dict[int, tuple[Block, Block]] = {}  # layer scope: (key, value) block by first token
        self.decoded_other: dict[tuple[str, int], torch.Tensor] = {}  # the half of a joint decode not asked for yet
        self.encode_handoff: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer scope: for the next layer's encode
        self.decode_handoff: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer scope: for the next layer's decode
        self.position_ids = GrowingTensor(1, self.capacity)  # of every cached token [B, L] (pre-RoPE codecs)
        self.pending_check: tuple[DeviceFlag, int, int] | None = None  # check_finite="deferred": verdicts, first, count
        self.positions_known = True  # False once a forward came without position ids
        # cos/sin [B, L, D] of every cached token, kept only when they cannot be recomputed from position ids
        self.cos, self.sin = GrowingTensor(1, self.capacity), GrowingTensor(1, self.capacity)
        self.incoming_rope: tuple[torch.Tensor, torch.Tensor] | None = None  # set by the attention pre-hook
        self.incoming_positions: torch.Tensor | None = None  # set by the attention pre-hook
        self.incoming_pads = 0  # left padding of the first forward's batch, set by the attention pre-hook
        self.last_update: LastUpdate | None = None  # streaming multi-token forwards only; consumed by attention
        self.fused_step: FusedStep | None = None  # fused decode steps; consumed by attention
        self.keys = self.values = None
        self.is_initialized = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.check_finite != "deferred":
            if self.check_finite:
                self._check_incoming(key_states, value_states)
            return self._update(key_states, value_states)
        self.raise_if_nonfinite()  # the previous forward's verdicts, long computed
        first, ranges = self.get_seq_length(), []
        with deferred_range_checks(ranges):
            out = self._update(key_states, value_states)
        self.pending_check = (DeviceFlag(torch.stack([_finite(key_states, value_states), *ranges])), first, key_states.shape[2])
        return out

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor):
        self._record_rope(key_states)
        if self.get_seq_length() == 0:  # the first forward: its left padding stays out of the encoded blocks
            self.key_stream.leading_pads = max(self.key_stream.leading_pads, self.incoming_pads)
            self.value_stream.leading_pads = max(self.value_stream.leading_pads, self.incoming_pads)
        self.last_update = None
        fused = self.fused_decode if key_states.shape[2] == 1 else None
        key_view = KVStream.segments if fused in ("attention", "scores") else KVStream.parts
        value_view = KVStream.segments if fused in ("attention", "values") else KVStream.parts
        n = key_states.shape[2]
        history = self.protocol == "exact_prefill" and self.codec.scope != "model" and any(
            s.ready_after(n) for s in self.streams)  # this forward sees its own tokens uncompressed
        if history:
            key_history, value_history = key_view(self.key_stream), value_view(self.value_stream)
        self.key_stream.append(key_states)
        self.value_stream.append(value_states)
        fresh_keys = fresh_values = None
        if self.codec.scope == "stream":
            fresh_keys, fresh_values = self.key_stream.encode_ready(), self.value_stream.encode_ready()
        elif self.codec.scope == "layer":
            fresh_keys, fresh_values = self._encode_layer_ready()
        if history:
            keys, values = [*key_history, key_states], [*value_history, value_states]
        else:
            keys, values = key_view(self.key_stream), value_view(self.value_stream)
        if self.codec.scope == "model" and self.is_last:  # every layer has appended: encode after attention's view
            self.model_unit.encode_ready()
        if not self.compress_generated:  # only the first forward (the prompt) is ever encoded
            self.key_stream.freeze()
            self.value_stream.freeze()
        if fused:
            self.fused_step = FusedStep(fused, keys, values)
            return key_states, value_states
        if self.protocol == "streaming" and key_states.shape[2] > 1 and (fresh_keys or fresh_values):
            if not self.attention_hooked:
                raise ConfigError(
                    "the streaming protocol needs the kvcomp attention function for multi-token forwards: "
                    "call kvcomp.cache.install(model) first (or use protocol='simulated')"
                )
            self.last_update = LastUpdate(fresh_keys, fresh_values)
        return _joined(keys), _joined(values)

    def _check_incoming(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Raise :class:`NonFiniteKVError` on NaN/Inf in incoming K/V; a host sync per layer on a GPU (``check_finite="deferred"`` avoids it, see :meth:`update`)."""
        if not _finite(key_states, value_states):
            kind = "keys" if not torch.isfinite(key_states).all() else "values"
            raise NonFiniteKVError(f"layer {self.layer_idx}: NaN or Inf in incoming {kind} "
                                   f"(cache positions {_span(self.get_seq_length(), key_states.shape[2])})")

    def raise_if_nonfinite(self) -> None:
        """Read this layer's verdicts of its last forward under ``check_finite="deferred"``: NaN/Inf in the
        incoming K/V, and quantization parameters that overflowed their storage dtype (uniform/KIVI, HIGGS). They
        were copied to the host without waiting, so reading them one forward later costs no sync."""
        pending, self.pending_check = self.pending_check, None
        if pending is None:
            return
        verdicts, positions = pending[0].read(), _span(pending[1], pending[2])
        if not verdicts[0]:
            raise NonFiniteKVError(f"layer {self.layer_idx}: NaN or Inf in the keys or values of an earlier forward "
                                   f"(cache positions {positions}; check_finite='deferred' reports it one forward late)")
        if not all(verdicts[1:]):
            raise NonFiniteKVError(
                f"layer {self.layer_idx}: a quantization group's scale or zero overflowed its storage dtype "
                f"(cache positions {positions}; reported one forward late by check_finite='deferred'): "
                "set codec.param_dtype=float32 (HIGGS, AQUA-KV: codec.scale_dtype=float32), or use check_finite=True "
                "(uniform/KIVI then fall back to float32 per block)")

    def _encode_layer_ready(self) -> tuple[FreshlyEncoded | None, FreshlyEncoded | None]:
        """Layer scope: encode the block both streams have ready, with the previous layer's reconstruction."""
        keys, values = self.key_stream, self.value_stream
        count = keys.ready()
        if count != values.ready():
            raise RuntimeError(f"layer-scope codec {self.codec.name}: keys and values are ready to encode different token counts")
        if not count:
            return None, None
        if self.codec.stateful and self.state is None:
            self.state = self.codec.init_state(Unit(self.layer_idx), {(self.layer_idx, s.kind): s.held() for s in (keys, values)})
        first, key_chunk, k = keys.take(count)
        _, value_chunk, v = values.take(count)
        previous = None if self.previous is None else self._handed(self.previous.encode_handoff, first, "encoded")
        encoding = self.codec.encode_layer(k, v, self.layer_idx, previous, self.state)
        if not self.is_last:
            self.encode_handoff[first] = (encoding.keys, encoding.values)
        key_block, value_block = keys.store.append(encoding.key, first), values.store.append(encoding.value, first)
        self.layer_blocks[first] = (key_block, value_block)
        return keys.add_block(key_block, key_chunk), values.add_block(value_block, value_chunk)

    def _handed(self, handoff: dict, first: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        if first not in handoff:
            raise RuntimeError(
                f"layer-scope codec {self.codec.name}: layer {self.layer_idx - 1} has not {what} the block at "
                f"cache index {first} before layer {self.layer_idx} (layers must run in order over one cache)"
            )
        return tuple(t.to(self.device) for t in handoff.pop(first))  # from the previous layer's device

    def _decode_jointly(self, kind: str, block: Block) -> torch.Tensor:
        """One stream's half of a layer- or model-scope block decode (both halves come from one call; the
        other is kept until its stream asks). Layer scope hands the reconstruction to the next layer."""
        other = self.decoded_other.pop((kind, block.first), None)
        if other is not None:
            return other
        dtype = self.key_stream.dtype
        if self.codec.scope == "model":
            k, v = (t.to(self.device) for t in self.model_unit.decode(self.layer_idx, block, dtype))
        else:
            key_block, value_block = self.layer_blocks[block.first]
            previous = None if self.previous is None else self._handed(self.previous.decode_handoff, block.first, "decoded")
            k, v = self.codec.decode_layer(self.key_stream.store.block(key_block), self.value_stream.store.block(value_block),
                                           self.layer_idx, previous, dtype, self.state)
            if not self.is_last:
                self.decode_handoff[block.first] = (k, v)
        self.decoded_other[("value" if kind == "key" else "key", block.first)] = v if kind == "key" else k
        return k if kind == "key" else v

    @property
    def fused_decode(self) -> str | None:
        """How decode steps read the cache when ``install(model, kernel_backend="triton")`` selected kernels:
        ``"attention"``: the fused decode-attention kernel reads both payloads
        (:meth:`~kvcomp.codecs.base.Codec.payload_reader`; pre-RoPE keys need the model's RoPE frequencies
        and every token's position; QJL's sign-sketched keys included); ``"scores"`` (where the kernel cannot read
        the format): the key payload is scored by the codec's kernel
        (:meth:`~kvcomp.codecs.base.Codec.payload_scores`) and values are decoded; ``None``: the torch path.
        ``"values"`` (any backend, codecs that set ``values_from_payload``): keys are decoded, the attention
        output of the value payload comes from :meth:`~kvcomp.codecs.base.Codec.payload_values`.
        When fused, ``update`` returns the fresh K/V only and leaves :attr:`fused_step` to attention."""
        if self.codec.values_from_payload:
            return "values"
        if self.kernel_backend != "triton":
            return None
        rope_ready = not self.codec.pre_rope or (self.rotary is not None and self.positions is not None)
        if rope_ready and self.codec.fused_attention_supported(self.layer_idx):
            return "attention"
        if self.codec.scores_from_payload:
            return "scores"
        return None

    def key_rope(self) -> RotaryPositions | None:
        """Positions and frequencies that rotate the key payload's decoded keys (pre-RoPE codecs)."""
        if not self.codec.pre_rope:
            return None
        return RotaryPositions(self.positions, self.key_stream.num_sinks, *self.rotary)

    def _record_rope(self, key_states: torch.Tensor) -> None:
        """Keep the position ids of the new tokens (pre-RoPE codecs only; they come from the pre-hook).

        cos/sin are recomputed from them by :meth:`rope` when the model's RoPE has fixed frequencies
        (:attr:`rotary`); otherwise (RoPE types whose frequencies change with the length, or forwards
        without position ids) the cos/sin the model used are kept instead."""
        if not self.codec.pre_rope:
            self.incoming_rope = self.incoming_positions = None  # do not keep the forward's cos/sin alive
            return
        if self.incoming_rope is None:
            raise ConfigError(
                f"codec {self.codec.name} needs pre-RoPE keys, but layer {self.layer_idx} received no "
                "position embeddings: call kvcomp.cache.install(model) before using the cache"
            )
        batch, n = key_states.shape[0], key_states.shape[2]
        cos, sin = (t.expand(batch, n, -1) for t in self.incoming_rope)
        positions = self.incoming_positions
        self.incoming_rope = self.incoming_positions = None
        if positions is not None and self.positions_known:
            self.position_ids.append(positions.to(torch.int32).expand(batch, n))
        elif self.positions_known:  # from now on, fused kernels cannot rotate keys: keep the angles
            if self.angles_recomputed and self.position_ids.length:
                for grown, earlier in zip((self.cos, self.sin), self.rope(0, self.position_ids.length)):
                    grown.append(earlier.to(cos.dtype))
            self.positions_known = False
        if not self.angles_recomputed:
            self.cos.append(cos)
            self.sin.append(sin)

    @property
    def angles_recomputed(self) -> bool:
        """Whether :meth:`rope` recomputes cos/sin from position ids (nothing but the ids is kept)."""
        return self.rotary is not None and self.positions_known

    def rope(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[B, count, D]`` of cached tokens ``first .. first + count - 1`` (pre-RoPE codecs)."""
        if self.angles_recomputed:
            return RotaryPositions(self.positions, first, *self.rotary).cos_sin(count)
        return self.cos.view.narrow(1, first, count), self.sin.view.narrow(1, first, count)

    @property
    def positions(self) -> torch.Tensor | None:
        """Position id of every cached token ``[B, L]`` (pre-RoPE codecs), when every forward gave them."""
        return self.position_ids.view if self.positions_known else None

    def get_seq_length(self) -> int:
        return self.key_stream.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # transformers < 5.20 name of get_max_length
        return -1

    @property
    def streams(self) -> tuple[KVStream, KVStream]:
        return self.key_stream, self.value_stream

    @property
    def full_precision_nbytes(self) -> int:
        """Bytes of full-precision sinks and tails."""
        return sum(s.full_precision_nbytes for s in self.streams)

    @property
    def payload_nbytes(self) -> int:
        """Bytes of the encoded payloads this layer holds (a model-scope codec's are the cache's)."""
        return sum(s.store.nbytes for s in self.streams)

    @property
    def state_nbytes(self) -> int:
        """Bytes of per-sequence codec state (stream- and layer-scope)."""
        return sum(s.state_nbytes for s in self.streams) + (0 if self.state is None else self.state.nbytes)

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage held: sinks, tails, payloads and per-sequence state."""
        return self.full_precision_nbytes + self.payload_nbytes + self.state_nbytes

    @property
    def bookkeeping_nbytes(self) -> int:
        """Bytes held besides K/V storage: position ids (and, when not recomputable, cos/sin) of cached
        tokens (pre-RoPE codecs)."""
        return sum(g.nbytes for g in (self.cos, self.sin, self.position_ids))

    @property
    def working_nbytes(self) -> int:
        """Working memory: the torch path's decoded blocks and spare capacity of the growing buffers."""
        reserved = sum(g.reserved_nbytes for g in (self.cos, self.sin, self.position_ids))
        return self.key_stream.working_nbytes + self.value_stream.working_nbytes + reserved

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` of everything held (beam reorder, batch select / repeat)."""
        for stream in self.streams:
            stream.select_rows(index)
        if self.state is not None:
            self.state.select_rows(index)
        for growing in (self.cos, self.sin, self.position_ids):
            growing.map(lambda t: t.index_select(0, index.to(t.device)))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.select_rows(torch.arange(self.key_stream.batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_rows(_row_index(indices))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a compressed cache cannot drop encoded tokens (no assisted decoding)")


class CompressedCache(Cache):
    """KV cache compressed by ``codec``.

    ``protocol``: how a multi-token forward (prefill) sees the tokens it brings in:
    ``streaming``: as a token-by-token feed would (blocks encoded within the forward are seen encoded
    by the queries after the token that completed them; see :mod:`kvcomp.cache.attention`);
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

    Scheduling follows the codec's scope (:mod:`kvcomp.codecs.base`): stream- and layer-scope blocks are
    encoded in the layer's ``update`` (a layer-scope encode receives the previous layer's reconstruction
    of the same block, handed over by that layer); model-scope blocks once the last layer has appended
    them, after its attention, so the forward that completes a block sees it in full precision under
    every protocol. Bytes are reported apart: :attr:`full_precision_nbytes`, :attr:`payload_nbytes`,
    :attr:`state_nbytes` (their sum is :attr:`nbytes`), :attr:`bookkeeping_nbytes`, :attr:`working_nbytes`.

    Models with sliding-window layers (``codec.model.layer_types``): the layers the codec encodes
    (:attr:`compressed_layers`; see :meth:`~kvcomp.codecs.base.ModelInfo.encoding`) are
    :class:`CompressedLayer` s, the others transformers' uncompressed ``DynamicSlidingWindowLayer``
    (:attr:`window_layers`, the last ``sliding_window - 1`` tokens); every byte count includes both.
    """

    receives_position_embeddings = True

    def __init__(self, codec: Codec, protocol: str = "streaming", check_finite: bool | str = True,
                 compress_generated: bool = True, decode_per_step: bool = False, capacity: int | None = None):
        if protocol not in PROTOCOLS:
            raise ConfigError(f"unknown protocol {protocol!r}; valid choices: {', '.join(PROTOCOLS)}")
        if check_finite not in (True, False, "deferred"):
            raise ConfigError(f"unknown check_finite {check_finite!r}; valid choices: True, False, 'deferred'")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise ConfigError(f"capacity={capacity!r}: a positive number of tokens per sequence, or None (grow as needed)")
        self.capacity = capacity or 0
        self.model_unit = ModelUnit(codec, self.capacity) if codec.scope == "model" else None
        info = codec.model
        encoded = dict(zip(info.model_layers, range(info.num_layers)))  # model layer -> codec layer
        layers, compressed = [], []
        for i in range(info.total_layers):
            if i not in encoded:  # a sliding-window layer the codec leaves alone: transformers' bounded window
                layers.append(DynamicSlidingWindowLayer(info.sliding_window))
                continue
            previous = compressed[-1] if compressed and codec.scope == "layer" else None
            compressed.append(CompressedLayer(codec, encoded[i], protocol, check_finite, compress_generated,
                                              decode_per_step, previous, self.model_unit, self.capacity))
            layers.append(compressed[-1])
        if self.model_unit is not None:
            self.model_unit.layers = compressed
        super().__init__(layers=layers)
        self.codec, self.protocol, self.compressed_layers = codec, protocol, compressed
        self.window_layers = [layer for layer in layers if layer not in compressed]

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
    def payload_nbytes(self) -> int:
        """Bytes of every encoded payload (per layer, or the model-scope unit's)."""
        model = 0 if self.model_unit is None else self.model_unit.store.nbytes
        return sum(layer.payload_nbytes for layer in self.compressed_layers) + model

    @property
    def state_nbytes(self) -> int:
        """Bytes of per-sequence codec state, e.g. dictionaries sampled from the prompt."""
        model = 0 if self.model_unit is None else self.model_unit.state_nbytes
        return sum(layer.state_nbytes for layer in self.compressed_layers) + model

    @property
    def nbytes(self) -> int:
        """Measured bytes of K/V storage: full-precision tokens, encoded payloads, per-sequence state."""
        return self.full_precision_nbytes + self.payload_nbytes + self.state_nbytes

    def _select_model_rows(self, index: torch.Tensor) -> None:
        if self.model_unit is not None:
            self.model_unit.select_rows(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._select_model_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        batch = self.compressed_layers[0].key_stream.batch
        super().batch_repeat_interleave(repeats)
        self._select_model_rows(torch.arange(batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._select_model_rows(_row_index(indices))

    @property
    def bookkeeping_nbytes(self) -> int:
        return sum(layer.bookkeeping_nbytes for layer in self.compressed_layers)

    @property
    def working_nbytes(self) -> int:
        """Bytes held besides storage and bookkeeping (decoded copies, spare capacity)."""
        return sum(layer.working_nbytes for layer in self.compressed_layers)

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
        values = max(sum(s.num_values for s in streams) + sum(_window_values(w) for w in self.window_layers), 1)
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
                if self.model_unit is not None and kind == shared:
                    held += self.model_unit.store.nbytes + self.model_unit.state_nbytes
                count = sum(_layer_values(layer) for layer in layers)
                bits[f"bits_per_value_{kind}"] = 8 * held / count if count else 0.0
                bits[f"kv_bytes_{kind}"] = held
        return bits


def _window_nbytes(layer) -> int:
    """Bytes of an uncompressed (window) layer's K/V."""
    return sum(t.numel() * t.element_size() for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
               if t is not None)


def _window_values(layer) -> int:
    return sum(t.numel() for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)


def _layer_nbytes(layer) -> int:
    return layer.nbytes if isinstance(layer, CompressedLayer) else _window_nbytes(layer)


def _layer_values(layer) -> int:
    return sum(s.num_values for s in layer.streams) if isinstance(layer, CompressedLayer) else _window_values(layer)
