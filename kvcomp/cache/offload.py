"""Store and restore a compressed cache between conversation turns (kvtc's store mode, spec §5.1 item 6).

:func:`store` copies everything a :class:`~kvcomp.cache.CompressedCache` holds as storage (sinks, encoded
payloads with their ragged rows, full-precision tails, position ids) to CPU memory as a
:class:`StoredCache`; :meth:`StoredCache.save` writes it as one safetensors file whose header carries the
JSON metadata (no pickle). :func:`restore` rebuilds a cache holding exactly those bytes on a device: its
blocks are decoded when the next turn's attention first reads them (kvtc: per layer, by column slice),
so restoring costs the transfer plus the decode, not a prefill. Decoded copies and spare capacity are
working memory and are not stored. ``store(cache, flush=True)`` first compresses the full-precision window
too (model-scope codecs), so that the whole conversation is stored compressed.

Stream- and model-scope codecs without per-sequence state are supported (kvtc, the fixed-rate codecs);
layer-scope codecs hand reconstructions between layers and stateful codecs keep per-sequence state,
neither of which is stored yet.

A stored file is a checked artifact: its header carries a sha256 over the metadata and every tensor, verified
by :meth:`StoredCache.load`. As anyone can recompute that digest, every count the metadata gives is also checked
against the stored tensors (:mod:`kvcomp.cache.stored_checks`): by :meth:`StoredCache.load` without a codec, and by
:func:`restore` against the codec, its calibration and the model, before it allocates anything.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcomp.cache.compressed_cache import CompressedCache
from kvcomp.cache.scopes import make_scope
from kvcomp.cache.stored_checks import check_layout, check_structure
from kvcomp.cache.payload_store import Block, PayloadStore
from kvcomp.codecs.base import Codec, Payload, calibration_identity
from kvcomp.artifacts import ArtifactError, atomic_path
from kvcomp.errors import ConfigError

FORMAT = "kvcomp-stored-cache/1"


def digest(tensors: dict[str, torch.Tensor], meta: dict) -> str:
    """sha256 over the metadata (canonical JSON) and every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass
class StoredCache:
    """A cache's storage on the CPU: ``tensors`` by name and JSON-able ``meta`` (layout, counts, codec)."""

    tensors: dict[str, torch.Tensor]
    meta: dict
    source: str = "stored cache"  # the file it was loaded from, for error messages

    @property
    def nbytes(self) -> int:
        """Bytes of the stored tensors (what a restore moves back)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def save(self, path: str | Path) -> Path:
        """Write one safetensors file (metadata in its header), atomically."""
        from safetensors.torch import save_file

        header = {"kvcomp": json.dumps(self.meta), "sha256": digest(self.tensors, self.meta)}
        with atomic_path(path, self.nbytes) as partial:
            save_file({k: t.contiguous() for k, t in self.tensors.items()}, str(partial), metadata=header)
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> "StoredCache":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                header = f.metadata() or {}
                if "kvcomp" not in header:
                    raise ConfigError(f"{path}: not a stored kvcomp cache (no 'kvcomp' metadata)")
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            meta = json.loads(header["kvcomp"])
        except (OSError, ValueError, RuntimeError, SafetensorError) as exc:  # truncated or garbled files
            raise ArtifactError(f"{path}: not a readable stored cache ({exc}); store the cache again") from exc
        if header.get("sha256") != digest(tensors, meta):
            raise ArtifactError(f"{path}: the stored cache fails its sha256 check (altered or damaged): store the cache "
                                "again")
        stored = cls(tensors, meta, str(path))
        check_layout(stored)
        return stored


def _identity(codec: Codec) -> dict:
    """What a stored cache must be restored with: the codec configuration, the model and, for a calibrated
    codec, its calibration state's checksum (a cache stored under one calibration decodes wrongly under another)."""
    return {"codec": codec.describe(), "model": codec.model.identity, "calibration": calibration_identity(codec)}


def _check_supported(codec: Codec) -> None:
    make_scope(codec).check_storable()
    if codec.model.total_layers != codec.model.num_layers:
        raise NotImplementedError(f"storing a cache with uncompressed sliding-window layers ({codec.model.name}) is not "
                                  "supported; set codec.compress_sliding=true to store every layer encoded")


def _host(t: torch.Tensor) -> torch.Tensor:
    """A copy in CPU memory, also of a CPU tensor (``.cpu()`` would return the cache's own buffer, which
    the cache reuses as it goes on, e.g. a preallocated tail)."""
    return t.to("cpu", copy=True)


def _put_store(store: PayloadStore, prefix: str, tensors: dict) -> dict:
    meta = {"num_tokens": store.num_tokens, "num_blocks": store.num_blocks}
    if store.layout == "tokens":
        for name, grown in store.tensors.items():
            tensors[f"{prefix}.{name}"] = _host(grown.view)
        meta["names"] = list(store.tensors)
        return meta
    payloads = []
    for j, payload in enumerate(store.payloads):
        for name, t in payload.tensors.items():
            tensors[f"{prefix}.{j}.{name}"] = _host(t)
        for name, rows in payload.ragged.items():
            for r, t in enumerate(rows):
                tensors[f"{prefix}.{j}.ragged.{name}.{r}"] = _host(t)
        payloads.append({"num_tokens": payload.num_tokens, "names": list(payload.tensors),
                         "ragged": {name: len(rows) for name, rows in payload.ragged.items()}})
    meta["payloads"] = payloads
    return meta


def _take_store(store: PayloadStore, meta: dict, prefix: str, tensors: dict, device) -> None:
    store.num_tokens, store.num_blocks = meta["num_tokens"], meta["num_blocks"]
    if store.layout == "tokens":
        for name in meta["names"]:
            stored = tensors[f"{prefix}.{name}"]
            store.tensor(name, stored.shape[2], store.num_tokens).append(stored.to(device))
        return
    store.payloads = [
        Payload({name: tensors[f"{prefix}.{j}.{name}"].to(device) for name in p["names"]}, p["num_tokens"],
                {name: [tensors[f"{prefix}.{j}.ragged.{name}.{r}"] for r in range(count)] for name, count in p["ragged"].items()})
        for j, p in enumerate(meta["payloads"])
    ]


def store(cache: CompressedCache, flush: bool = False) -> StoredCache:
    """Copy the storage of ``cache`` to CPU memory (see the module docstring). ``flush``: first encode the
    full-precision window too (model-scope codecs, whose blocks take any length), so that the whole cache is
    stored compressed; the cache then continues from that state (its window is lossy from now on)."""
    codec = cache.codec
    _check_supported(codec)
    if len(cache.groups) > 1 or cache.groups[0].pads:
        raise NotImplementedError("storing a left-padded cache is not supported: store each conversation's cache "
                                  "(rows without padding)")
    if cache.press is not None:
        raise NotImplementedError(f"storing a cache with a press ({cache.press.name}) is not supported: what it evicted "
                                  "and the query a decode press scores with are not stored")
    if flush:
        cache.scope.flush()
    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for i, layer in enumerate(cache.layers):
        if not layer.positions.known:
            raise NotImplementedError("storing a cache whose forwards came without position ids is not supported")
        if layer.positions.ids.length:
            tensors[f"layer{i}.position_ids"] = _host(layer.positions.ids.view)
        streams = {}
        for stream in layer.streams:
            prefix = f"layer{i}.{stream.kind}"
            for part in ("sinks", "tail"):
                if getattr(stream, part) is not None:
                    tensors[f"{prefix}.{part}"] = _host(getattr(stream, part))
            streams[stream.kind] = {
                "length": stream.length, "num_encoded": stream.num_encoded, "batch": stream.batch, "frozen": stream.frozen,
                "blocks": [[b.index, b.rows, b.sizes, b.first, b.count] for b in stream.blocks],
                "store": _put_store(stream.store, f"{prefix}.store", tensors),
            }
        layers.append({"dtype": str(layer.dtype).removeprefix("torch."), "streams": streams})
    meta = {"format": FORMAT, **_identity(codec), "protocol": cache.protocol, "layers": layers}
    if cache.scope.shared_store is not None:
        meta["model_unit"] = _put_store(cache.scope.shared_store, "model_unit", tensors)
    return StoredCache(tensors, meta)


def restore(stored: StoredCache, codec: Codec, device: str | torch.device = "cpu", protocol: str | None = None,
            **cache_options) -> CompressedCache:
    """A :class:`CompressedCache` for ``codec`` on ``device`` holding ``stored``'s bytes (``protocol``: the
    stored one by default). Refuses a store made with another codec configuration, model or calibration."""
    meta = stored.meta
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{stored.source}: format {meta.get('format')!r}; this kvcomp reads {FORMAT!r}")
    for what, mine in _identity(codec).items():
        if meta.get(what) != mine:
            raise ConfigError(f"{stored.source} was made with {what} {meta.get(what)!r}, not {mine!r}: restore it with "
                              "the same one")
    _check_supported(codec)
    check_structure(stored, codec)
    tensors = stored.tensors
    cache = CompressedCache(codec, protocol or meta["protocol"], **cache_options)
    for i, (layer, saved) in enumerate(zip(cache.layers, meta["layers"])):
        layer.dtype, layer.device, layer.is_initialized = getattr(torch, saved["dtype"]), torch.device(device), True
        if f"layer{i}.position_ids" in tensors:
            layer.positions.ids.append(tensors[f"layer{i}.position_ids"].to(device))
        for stream in layer.streams:
            s, prefix = saved["streams"][stream.kind], f"layer{i}.{stream.kind}"
            stream.length, stream.num_encoded, stream.batch = s["length"], s["num_encoded"], s["batch"]
            stream.frozen, stream.dtype = s["frozen"], layer.dtype
            layer.length = stream.length
            if f"{prefix}.sinks" in tensors:
                stream.sinks = tensors[f"{prefix}.sinks"].to(device)
            if f"{prefix}.tail" in tensors:
                stream.tail_buffer.append(tensors[f"{prefix}.tail"].to(device))
            stream.blocks = [Block(*b) for b in s["blocks"]]
            stream.decoded.pending = list(stream.blocks)  # decoded when attention first reads them
            _take_store(stream.store, s["store"], f"{prefix}.store", tensors, device)
    if cache.scope.shared_store is not None:
        _take_store(cache.scope.shared_store, meta["model_unit"], "model_unit", tensors, device)
    return cache
