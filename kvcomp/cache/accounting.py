"""What a compressed cache holds, in bytes and bits: storage (full-precision tokens, encoded payloads, per-sequence
state), bookkeeping and working memory, per layer (:func:`layer_bytes`) and for the whole cache
(:class:`ByteAccounting`, which :class:`~kvcomp.cache.compressed_cache.CompressedCache` reports through).
``tests/cache/test_memory.py`` walks every tensor a cache holds against these counts."""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvcomp.codecs.base import FULL, CacheStatistics


@dataclass(frozen=True)
class HeldBytes:
    """Bytes one :class:`~kvcomp.cache.layer.CompressedLayer` holds, by kind."""

    full_precision: int  # sinks and tails, and a prompt pressed with a budget per head
    payload: int  # encoded payloads (a model-scope codec's are the cache's, not the layer's)
    state: int  # per-sequence codec state (stream- and layer-scope)
    bookkeeping: int  # token positions (pre-RoPE codecs), a press's last query and per-head counts
    working: int  # the torch path's decoded blocks and spare capacity of growing buffers

    @property
    def storage(self) -> int:
        return self.full_precision + self.payload + self.state


def stream_full_precision_nbytes(stream) -> int:
    """Bytes of a :class:`~kvcomp.cache.stream.KVStream`'s full-precision sinks and tail."""
    return sum(t.numel() * t.element_size() for t in (stream.sinks, stream.tail) if t is not None)


def stream_working_nbytes(stream) -> int:
    """Bytes a stream holds besides storage: the torch path's decoded copy and spare capacity."""
    copy = stream.decoded.tensor
    return copy.nbytes + copy.reserved_nbytes + stream.tail_buffer.reserved_nbytes + stream.store.reserved_nbytes


def stream_values(stream) -> int:
    """K or V elements a stream represents (batch x heads x tokens x head_dim)."""
    return stream.batch * stream.codec.model.num_kv_heads * stream.codec.model.head_dim * stream.length


def part_bytes(part) -> HeldBytes:
    """What one row group's share of a layer (:class:`~kvcomp.cache.layer.LayerPart`) holds."""
    streams, prefix = part.streams, part.prefix
    return HeldBytes(
        full_precision=sum(stream_full_precision_nbytes(s) for s in streams) + (0 if prefix is None else prefix.nbytes),
        payload=sum(s.store.nbytes for s in streams),
        state=part.schedule.state_nbytes,
        bookkeeping=part.positions.nbytes + (0 if part.last_query is None else part.last_query.nbytes)
        + (0 if prefix is None else prefix.bookkeeping_nbytes),
        working=sum(stream_working_nbytes(s) for s in streams) + part.positions.reserved_nbytes)


def total(held: list[HeldBytes]) -> HeldBytes:
    """Kind by kind, the sum of ``held``."""
    return HeldBytes(*(sum(getattr(h, f.name) for h in held) for f in fields(HeldBytes)))


def layer_bytes(layer) -> HeldBytes:
    """What a compressed layer holds, over every row group."""
    return total([part_bytes(part) for part in layer.parts])


def layer_values(layer) -> int:
    """K and V elements a compressed layer holds (batch x heads x tokens x head_dim, both streams, every row group)."""
    return sum(sum(stream_values(s) for s in part.streams) + (0 if part.prefix is None else 2 * part.prefix.num_values)
               for part in layer.parts)


def _window_tensors(layer) -> list:
    """An uncompressed (window) layer's K/V."""
    return [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None]


class ByteAccounting:
    """The byte and bit counts of a cache with ``compressed_layers``, ``window_layers`` (transformers' uncompressed
    sliding windows), row ``groups`` (each with its scope) and a ``codec``."""

    def _storage(self, layer) -> int:
        if layer in self.window_layers:
            return sum(t.numel() * t.element_size() for t in _window_tensors(layer))
        return layer_bytes(layer).storage

    def _values(self, layer) -> int:
        return sum(t.numel() for t in _window_tensors(layer)) if layer in self.window_layers else layer_values(layer)

    def _layers(self, kind: str) -> int:
        return sum(getattr(layer_bytes(layer), kind) for layer in self.compressed_layers)

    @property
    def full_precision_nbytes(self) -> int:
        """Bytes of full-precision tokens: sinks and tails, and the windows of uncompressed sliding layers."""
        return self._layers("full_precision") + sum(self._storage(layer) for layer in self.window_layers)

    @property
    def shared_payload_nbytes(self) -> int:
        """Bytes of payloads every layer shares (a model-scope codec's)."""
        return sum(g.scope.shared_store.nbytes for g in self.groups if g.scope.shared_store is not None)

    @property
    def payload_nbytes(self) -> int:
        """Bytes of every encoded payload (per layer, or shared by the layers)."""
        return self._layers("payload") + self.shared_payload_nbytes

    @property
    def shared_state_nbytes(self) -> int:
        """Bytes of per-sequence state every layer shares (a model-scope codec's)."""
        return sum(g.scope.shared_state_nbytes for g in self.groups)

    @property
    def state_nbytes(self) -> int:
        """Bytes of per-sequence codec state, e.g. dictionaries sampled from the prompt."""
        return self._layers("state") + self.shared_state_nbytes

    @property
    def nbytes(self) -> int:
        """Measured bytes of K/V storage: full-precision tokens, encoded payloads, per-sequence state."""
        return self.full_precision_nbytes + self.payload_nbytes + self.state_nbytes

    @property
    def bookkeeping_nbytes(self) -> int:
        """Bytes held besides K/V storage: positions of cached tokens, a press's last query and per-head counts."""
        return self._layers("bookkeeping")

    @property
    def working_nbytes(self) -> int:
        """Bytes held besides storage and bookkeeping (decoded copies, spare capacity)."""
        return self._layers("working")

    def statistics(self) -> CacheStatistics:
        """What the cache holds for batch row 0 (its row group), for the codec's
        :meth:`~kvcomp.codecs.base.Codec.example_metrics`."""
        k = next(k for k, g in enumerate(self.groups) if g.rows is None or 0 in g.rows)
        parts = [layer.parts[k] for layer in self.compressed_layers]
        streams = [s for part in parts for s in part.streams]
        scope = self.groups[k].scope
        store = scope.shared_store
        prefixes = [part.prefix for part in parts if part.prefix is not None]  # a prompt pressed with budgets per head
        held = total([part_bytes(part) for part in parts])
        return CacheStatistics(
            batch=parts[0].batch, streams=len(streams),
            cached_tokens=sum(s.length for s in streams) + 2 * sum(p.tokens_per_head for p in prefixes),
            encoded_tokens=sum(s.num_encoded for s in streams), full_precision_nbytes=held.full_precision,
            payload_nbytes=held.payload, state_nbytes=held.state,
            shared_payloads=() if store is None else tuple(store.payloads), shared_state=scope.shared_state)

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
        info = self.codec.model
        streams = [s for layer in self.compressed_layers for s in layer.streams]
        values = max(sum(self._values(layer) for layer in self.layers), 1)
        encoded = sum(s.batch * info.num_kv_heads * info.head_dim * s.num_encoded for s in streams)
        bits = {
            "encoded_share": encoded / values,
            "code_bits_per_value": 8 * self.payload_nbytes / encoded if encoded else 0.0,
            "state_bits_per_value": 8 * self.state_nbytes / values,
            "bits_per_value_measured": 8 * self.nbytes / values,
        }
        if info.layer_types:
            by_type = self.layer_types()
            shared = FULL if FULL in by_type else next(iter(by_type))
            for kind, layers in by_type.items():
                held = sum(self._storage(layer) for layer in layers)
                if kind == shared:
                    held += self.shared_payload_nbytes + self.shared_state_nbytes
                count = sum(self._values(layer) for layer in layers)
                bits[f"bits_per_value_{kind}"] = 8 * held / count if count else 0.0
                bits[f"kv_bytes_{kind}"] = held
        return bits
