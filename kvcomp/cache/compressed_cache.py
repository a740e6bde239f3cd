"""A transformers 5.x ``Cache`` whose layers hold codec payloads instead of full K/V tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcomp.cache.growing import GrowingTensor
from kvcomp.cache.stream import FreshlyEncoded, KVStream
from kvcomp.codecs.base import Codec
from kvcomp.errors import ConfigError, NonFiniteKVError
from kvcomp.kernels.decode_attention import RotaryPositions

PROTOCOLS = ("streaming", "simulated", "exact_prefill")


@dataclass
class LastUpdate:
    """What the latest ``update`` did, for the attention function (streaming protocol)."""

    keys: FreshlyEncoded | None
    values: FreshlyEncoded | None


class CompressedLayer(CacheLayerMixin):
    """One decoder layer: a key stream and a value stream, each following the codec's policy.

    ``update`` returns the keys and values attention should use: full-precision sinks and tail,
    decoded blocks in between (keys re-rotated for pre-RoPE codecs).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, codec: Codec, layer_idx: int, protocol: str = "streaming", check_finite: bool = True,
                 compress_generated: bool = True, decode_per_step: bool = False):
        super().__init__()
        self.codec, self.layer_idx, self.protocol, self.check_finite = codec, layer_idx, protocol, check_finite
        self.compress_generated, self.decode_per_step = compress_generated, decode_per_step
        self.attention_hooked = False  # set by the kvcomp attention pre-hook
        self.kernel_backend = "torch"  # set by the pre-hook from install(model, kernel_backend)
        self.rotary: tuple | None = None  # the model's RoPE (inv_freq, attention scaling, dtype), from the pre-hook
        self.reset()

    def reset(self) -> None:
        self.key_stream = KVStream(self.codec, "key", self.layer_idx, self.rope, self.decode_per_step)
        self.value_stream = KVStream(self.codec, "value", self.layer_idx, self.rope, self.decode_per_step)
        self.position_ids = GrowingTensor(1)  # of every cached token [B, L] (pre-RoPE codecs)
        self.positions_known = True  # False once a forward came without position ids
        # cos/sin [B, L, D] of every cached token, kept only when they cannot be recomputed from position ids
        self.cos, self.sin = GrowingTensor(1), GrowingTensor(1)
        self.incoming_rope: tuple[torch.Tensor, torch.Tensor] | None = None  # set by the attention pre-hook
        self.incoming_positions: torch.Tensor | None = None  # set by the attention pre-hook
        self.incoming_pads = 0  # left padding of the first forward's batch, set by the attention pre-hook
        self.last_update: LastUpdate | None = None  # streaming multi-token forwards only; consumed by attention
        self.decode_segments: tuple[str, list, list] | None = None  # fused decode steps; consumed by attention
        self.keys = self.values = None
        self.is_initialized = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.check_finite:
            for kind, x in (("keys", key_states), ("values", value_states)):
                if not torch.isfinite(x).all():
                    raise NonFiniteKVError(
                        f"layer {self.layer_idx}: NaN or Inf in incoming {kind} "
                        f"(cache positions {self.get_seq_length()}..{self.get_seq_length() + x.shape[2] - 1})"
                    )
        self._record_rope(key_states)
        if self.get_seq_length() == 0:  # the first forward: its left padding stays out of the encoded blocks
            self.key_stream.leading_pads = max(self.key_stream.leading_pads, self.incoming_pads)
            self.value_stream.leading_pads = max(self.value_stream.leading_pads, self.incoming_pads)
        self.last_update = None
        fused = self.fused_decode if key_states.shape[2] == 1 else None
        key_view = KVStream.segments if fused else KVStream.parts
        value_view = KVStream.segments if fused == "attention" else KVStream.parts
        if self.protocol == "exact_prefill":  # this forward sees its own tokens uncompressed
            key_history, value_history = key_view(self.key_stream), value_view(self.value_stream)
        fresh_keys = self.key_stream.append(key_states)
        fresh_values = self.value_stream.append(value_states)
        if not self.compress_generated:  # only the first forward (the prompt) is ever encoded
            self.key_stream.freeze()
            self.value_stream.freeze()
        if self.protocol == "exact_prefill":
            keys, values = [*key_history, key_states], [*value_history, value_states]
        else:
            keys, values = key_view(self.key_stream), value_view(self.value_stream)
        if fused:
            self.decode_segments = (fused, keys, values)
            return key_states, value_states
        if self.protocol == "streaming" and key_states.shape[2] > 1 and (fresh_keys or fresh_values):
            if not self.attention_hooked:
                raise ConfigError(
                    "the streaming protocol needs the kvcomp attention function for multi-token forwards: "
                    "call kvcomp.cache.install(model) first (or use protocol='simulated')"
                )
            self.last_update = LastUpdate(fresh_keys, fresh_values)
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)

    @property
    def fused_decode(self) -> str | None:
        """How decode steps read the cache when ``install(model, kernel_backend="triton")`` selected kernels:
        ``"attention"``: the fused decode-attention kernel reads both payloads
        (:meth:`~kvcomp.codecs.base.Codec.payload_reader`; pre-RoPE keys need the model's RoPE frequencies
        and every token's position); ``"scores"``: the key payload is scored by the codec's kernel
        (:meth:`~kvcomp.codecs.base.Codec.payload_scores`) and values are decoded; ``None``: the torch path.
        When fused, ``update`` returns the fresh K/V only and leaves :attr:`decode_segments` to attention."""
        if self.kernel_backend != "triton":
            return None
        if self.codec.scores_from_payload:
            return "scores"
        rope_ready = not self.codec.pre_rope or (self.rotary is not None and self.positions is not None)
        if rope_ready and self.codec.fused_attention_supported(self.layer_idx):
            return "attention"
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
    def nbytes(self) -> int:
        """Bytes of K/V storage held (sinks, payloads, tails)."""
        return self.key_stream.nbytes + self.value_stream.nbytes

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

    def _map_batch(self, fn) -> None:
        self.key_stream.map_batch(fn)
        self.value_stream.map_batch(fn)
        for growing in (self.cos, self.sin, self.position_ids):
            growing.map(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

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
    (generated) token in full precision.
    """

    receives_position_embeddings = True

    def __init__(self, codec: Codec, protocol: str = "streaming", check_finite: bool = True,
                 compress_generated: bool = True, decode_per_step: bool = False):
        if protocol not in PROTOCOLS:
            raise ConfigError(f"unknown protocol {protocol!r}; valid choices: {', '.join(PROTOCOLS)}")
        layers = [
            CompressedLayer(codec, i, protocol, check_finite, compress_generated, decode_per_step)
            for i in range(codec.model.num_layers)
        ]
        super().__init__(layers=layers)
        self.codec, self.protocol = codec, protocol

    @property
    def nbytes(self) -> int:
        """Measured bytes of K/V storage over all layers."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def bookkeeping_nbytes(self) -> int:
        return sum(layer.bookkeeping_nbytes for layer in self.layers)

    @property
    def working_nbytes(self) -> int:
        """Bytes held besides storage and bookkeeping (decoded copies, spare capacity)."""
        return sum(layer.working_nbytes for layer in self.layers)

    def measured_bits_per_value(self) -> float:
        """Stored bits per cached K/V element, from the bytes actually held."""
        values = sum(layer.key_stream.num_values + layer.value_stream.num_values for layer in self.layers)
        return 8 * self.nbytes / max(values, 1)
