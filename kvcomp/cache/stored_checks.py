"""Checks of a stored cache (:mod:`kvcomp.cache.offload`) against the tensors it actually holds.

A stored file's checksum proves nothing against a crafted file (anyone can recompute it), so every count its
metadata gives is derived from, or checked against, the stored tensors before anything is allocated:

- :func:`check_layout` (no codec needed, run by :meth:`~kvcomp.cache.offload.StoredCache.load`): the metadata
  describes exactly the stored tensors; sinks, tails and position ids are ``[batch, ...]`` tensors of the layer's
  dtype; the blocks follow each other from the last sink; in ``payload_layout="tokens"`` stores their rows tile
  each payload tensor's token dimension; every count adds up (tokens, blocks, the shared blocks of a model-scope
  codec);
- :func:`check_structure` (with the codec, run by :func:`~kvcomp.cache.offload.restore`): the layout above plus
  the model's layer count, heads and head size, the policy's sinks, and each block against what the codec
  writes: a ``"tokens"`` block holds as many rows of each tensor, of the same dtype and shape, as a reference
  block encoded here (one ``block_size`` block per stream) in proportion to its tokens; a ``"blocks"`` block is
  checked by :meth:`~kvcomp.codecs.base.Codec.check_payload` (kvtc: the sizes its DEFLATE streams inflate to).

Every refusal is one :class:`~kvcomp.errors.ConfigError` naming the file and the field.
"""

from __future__ import annotations

import torch

from kvcomp.cache.compressed_cache import PROTOCOLS
from kvcomp.codecs.base import KINDS, Codec, Payload, StreamRequest
from kvcomp.errors import ConfigError

DTYPES = ("float32", "float16", "bfloat16")  # model dtypes a stored cache may hold


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class _Reader:
    """The stored tensors and metadata of one file, read as checks go: every tensor a check takes is marked as
    described, and :meth:`fail` raises the one error."""

    def __init__(self, stored):
        self.tensors, self.meta, self.source = stored.tensors, stored.meta, stored.source
        self.described: set[str] = set()

    def fail(self, problem: str):
        raise ConfigError(f"{self.source}: {problem}; store the cache again")

    def tensor(self, name: str, optional: bool = False) -> torch.Tensor | None:
        t = self.tensors.get(name)
        if t is None and not optional:
            self.fail(f"tensor {name!r}, which the metadata describes, is not stored")
        if t is not None:
            self.described.add(name)
        return t

    def batched(self, name: str, batch: int, dims: int | None = None, optional: bool = False) -> torch.Tensor | None:
        t = self.tensor(name, optional)
        if t is not None and (t.dim() < 1 or t.shape[0] != batch or (dims is not None and t.dim() != dims)):
            shape = "[batch, heads, tokens, head_dim]" if dims == 4 else "[batch, ...]"
            self.fail(f"{name} has shape {tuple(t.shape)}, not {shape} with batch {batch}")
        return t


def _dict_of_counts(value) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and _count(v) for k, v in value.items())


def _check_blocks(r: _Reader, where: str, blocks, first: int) -> int:
    """The blocks' entries are ``[index, rows, sizes, first, count]`` following each other from token ``first``;
    returns the token after the last."""
    if not isinstance(blocks, list):
        r.fail(f"{where}.blocks is not a list")
    for j, block in enumerate(blocks):
        if not (isinstance(block, list) and len(block) == 5 and block[0] == j and _dict_of_counts(block[1])
                and _dict_of_counts(block[2]) and block[3] == first and _count(block[4]) and block[4] >= 1):
            r.fail(f"{where}.blocks[{j}] is not [index {j}, rows, sizes, first token {first}, count >= 1]")
        first += block[4]
    return first


def _check_token_store(r: _Reader, where: str, store: dict, prefix: str, blocks: list, batch: int) -> None:
    """Each payload tensor ``[batch, ..., rows, ...]`` (rows on dim 2) is tiled by the blocks' rows and sizes."""
    names = store.get("names")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        r.fail(f"{where}.names is not a list of tensor names")
    if names and not blocks:
        r.fail(f"{where} holds tensors {names} but no block")
    for name in names:
        t = r.batched(f"{prefix}.{name}", batch)
        if t.dim() < 3:
            r.fail(f"{prefix}.{name} has shape {tuple(t.shape)}: a payload tensor holds rows on dim 2")
        row = 0
        for j, block in enumerate(blocks):
            rows, sizes = block[1], block[2]
            if sorted(rows) != sorted(names) or sorted(sizes) != sorted(names):
                r.fail(f"{where}: block {j} gives rows for {sorted(rows)}, the store holds {sorted(names)}")
            if rows[name] != row or sizes[name] < 1:
                r.fail(f"{where}: block {j} places {name} at rows {rows[name]}..+{sizes[name]}, where row {row} "
                       "comes next")
            row += sizes[name]
        if row != t.shape[2]:
            r.fail(f"{where}: the blocks hold {row} rows of {name}, the stored tensor {t.shape[2]}")


def _check_block_store(r: _Reader, where: str, store: dict, prefix: str, batch: int) -> list[Payload]:
    """A ``payload_layout="blocks"`` store: its payloads, read as :class:`Payload` views of the stored tensors."""
    entries = store.get("payloads")
    if not isinstance(entries, list):
        r.fail(f"{where}.payloads is not a list")
    payloads = []
    for j, p in enumerate(entries):
        names, ragged = (p.get(k) if isinstance(p, dict) else None for k in ("names", "ragged"))
        if not (isinstance(p, dict) and _count(p.get("num_tokens")) and p["num_tokens"] >= 1
                and isinstance(names, list) and all(isinstance(n, str) for n in names) and _dict_of_counts(ragged)):
            r.fail(f"{where}.payloads[{j}] is not {{num_tokens >= 1, names, ragged}}")
        for name, rows in ragged.items():
            if rows != batch:
                r.fail(f"{where}.payloads[{j}] has {rows} rows of {name}, the batch is {batch}")
        tensors = {name: r.batched(f"{prefix}.{j}.{name}", batch) for name in names}
        rows = {name: [r.tensor(f"{prefix}.{j}.ragged.{name}.{i}") for i in range(count)] for name, count in ragged.items()}
        for name, held in rows.items():
            if any(t.dim() != 1 for t in held):
                r.fail(f"{where}.payloads[{j}]: the rows of {name} must be 1-D")
        payloads.append(Payload(tensors, p["num_tokens"], rows))
    return payloads


def _check_store(r: _Reader, where: str, store, prefix: str, blocks: list, batch: int) -> list[Payload]:
    """A store holding ``blocks`` (its tensors tiled by them, or one payload per block) and nothing else; returns a
    ``"blocks"`` store's payloads."""
    if not isinstance(store, dict) or not _count(store.get("num_tokens")) or not _count(store.get("num_blocks")):
        r.fail(f"{where} has no num_tokens and num_blocks counts")
    payloads = []
    if "names" in store:
        _check_token_store(r, where, store, prefix, blocks, batch)
    else:
        payloads = _check_block_store(r, where, store, prefix, batch)
        if [p.num_tokens for p in payloads] != [b[4] for b in blocks]:
            r.fail(f"{where}: its payloads hold {[p.num_tokens for p in payloads]} tokens, the blocks "
                   f"{[b[4] for b in blocks]}")
    tokens = sum(b[4] for b in blocks)
    if store["num_tokens"] != tokens or store["num_blocks"] != len(blocks):
        r.fail(f"{where} claims {store['num_tokens']} tokens in {store['num_blocks']} blocks, its blocks hold "
               f"{tokens} in {len(blocks)}")
    return payloads


def _check_stream(r: _Reader, i: int, kind: str, s, dtype: torch.dtype, shared: bool) -> dict:
    """One stream: sinks + encoded + tail tokens equal its length, each count taken from the stored tensors."""
    where, prefix = f"layers[{i}].streams.{kind}", f"layer{i}.{kind}"
    if not isinstance(s, dict):
        r.fail(f"{where} is not a stream")
    numbers = [s.get(k) for k in ("length", "num_encoded", "batch")]
    if not all(_count(n) for n in numbers) or numbers[2] < 1 or not isinstance(s.get("frozen"), bool):
        r.fail(f"{where}: length, num_encoded and batch must be counts (batch >= 1) and frozen a bool, got "
               f"{numbers} and {s.get('frozen')!r}")
    length, num_encoded, batch = numbers
    parts = {part: r.batched(f"{prefix}.{part}", batch, dims=4, optional=True) for part in ("sinks", "tail")}
    for name, t in parts.items():
        if t is not None and t.dtype != dtype:
            r.fail(f"{prefix}.{name} is {t.dtype}, the layer {dtype}")
    sinks, tail = (0 if t is None else t.shape[2] for t in parts.values())
    blocks = s.get("blocks")
    end = _check_blocks(r, where, blocks, sinks)
    if end - sinks != num_encoded:
        r.fail(f"{where}: its blocks hold {end - sinks} tokens, num_encoded is {num_encoded}")
    if sinks + num_encoded + tail != length:
        r.fail(f"{where}: {sinks} sink + {num_encoded} encoded + {tail} tail tokens (as stored), but length {length}")
    payloads = _check_store(r, f"{where}.store", s.get("store"), f"{prefix}.store", [] if shared else blocks, batch)
    return {"length": length, "batch": batch, "sinks": parts["sinks"], "tail": parts["tail"], "blocks": blocks,
            "payloads": payloads}


def _check_positions(r: _Reader, i: int, batch: int, length: int) -> None:
    positions = r.tensor(f"layer{i}.position_ids", optional=True)
    if positions is None:
        return
    if tuple(positions.shape) != (batch, length) or positions.dtype not in (torch.int32, torch.int64):
        r.fail(f"layer {i} position ids are {positions.dtype} {tuple(positions.shape)}, not int32 or int64 "
               f"{(batch, length)}")
    if positions.shape[1] > 1 and not bool((positions[:, 1:] > positions[:, :-1]).all()):
        r.fail(f"layer {i} position ids do not increase")


def _layout(r: _Reader) -> tuple[list[dict], list[Payload] | None]:
    """Every layer's streams (as :func:`_check_stream` reads them) and a model-scope codec's shared payloads."""
    meta = r.meta
    layers, unit = meta.get("layers"), meta.get("model_unit")
    if meta.get("protocol") not in PROTOCOLS:
        r.fail(f"protocol {meta.get('protocol')!r}; valid: {', '.join(PROTOCOLS)}")
    if not isinstance(layers, list) or not layers:
        r.fail(f"it holds {len(layers) if isinstance(layers, list) else 'no'} layers")
    shared = unit is not None
    read = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict) or layer.get("dtype") not in DTYPES:
            r.fail(f"layers[{i}].dtype {layer.get('dtype') if isinstance(layer, dict) else None!r}; valid: "
                   f"{', '.join(DTYPES)}")
        streams = layer.get("streams")
        if not isinstance(streams, dict) or sorted(streams) != sorted(KINDS):
            r.fail(f"layer {i} must hold a key and a value stream")
        dtype = getattr(torch, layer["dtype"])
        read.append({kind: _check_stream(r, i, kind, streams[kind], dtype, shared) for kind in KINDS})
        if read[-1]["key"]["length"] != read[-1]["value"]["length"]:
            r.fail(f"layer {i} keys and values hold different token counts")
        _check_positions(r, i, read[-1]["key"]["batch"], read[-1]["key"]["length"])
    streams = [s for layer in read for s in layer.values()]
    if len({s["batch"] for s in streams}) != 1:
        r.fail(f"its streams hold different batch sizes {sorted({s['batch'] for s in streams})}")
    payloads = None
    if shared:
        first = streams[0]["blocks"]
        payloads = _check_store(r, "model_unit", unit, "model_unit", first, streams[0]["batch"])
        for s in streams:
            if [b[4] for b in s["blocks"]] != [b[4] for b in first]:
                r.fail("the layers' encoded blocks differ, but a model-scope codec encodes every layer's in one")
    if not any(name in r.described for name in r.tensors):
        r.fail("it holds no tokens")
    unknown = sorted(set(r.tensors) - r.described)
    if unknown:
        r.fail(f"it holds tensors the metadata does not describe: {', '.join(unknown[:5])}")
    return read, payloads


def check_layout(stored) -> None:
    """Refuse a stored cache whose metadata does not describe exactly the tensors it holds (module docstring):
    one :class:`ConfigError` naming the file and the field."""
    _layout(_Reader(stored))


def _reference_block(codec: Codec, layer: int, kind: str, batch: int, dtype: torch.dtype) -> tuple[int, Payload]:
    """``(tokens, payload)`` of one ``block_size`` block encoded here (what every stored block must be a whole
    multiple of)."""
    count = codec.policy(kind, layer).block_size
    tokens = torch.randn(batch, codec.model.num_kv_heads, count, codec.model.head_dim,
                         generator=torch.Generator().manual_seed(0)).to(dtype)
    return count, codec.encode(StreamRequest(layer, kind, tokens=tokens))


def _check_against_reference(r: _Reader, i: int, kind: str, s: dict, codec: Codec, dtype: torch.dtype) -> None:
    where, prefix = f"layers[{i}].streams.{kind}", f"layer{i}.{kind}.store"
    if not s["blocks"]:
        return
    if codec.policy(kind, i).block_size is None:
        r.fail(f"{where} holds encoded blocks, but {codec.name} never encodes the {kind}s of layer {i}")
    count, reference = _reference_block(codec, i, kind, 1, dtype)
    names = r.meta["layers"][i]["streams"][kind]["store"]["names"]
    if sorted(names) != sorted(reference.tensors):
        r.fail(f"{where}.store holds tensors {sorted(names)}, {codec.name} writes {sorted(reference.tensors)}")
    for name, ref in reference.tensors.items():
        t = r.tensors[f"{prefix}.{name}"]
        if t.dtype != ref.dtype or t.shape[1:2] + t.shape[3:] != ref.shape[1:2] + ref.shape[3:]:
            r.fail(f"{prefix}.{name} is {t.dtype} {tuple(t.shape)}; {codec.name} writes {ref.dtype} "
                   f"[batch, {ref.shape[1]}, rows, {', '.join(map(str, ref.shape[3:]))}]")
    for j, (_, _, sizes, _, tokens) in enumerate(s["blocks"]):
        if tokens % count or any(sizes[n] != tokens // count * ref.shape[2] for n, ref in reference.tensors.items()):
            r.fail(f"{where}.blocks[{j}] claims {tokens} tokens in rows {sizes}; {codec.name} writes "
                   f"{ {n: ref.shape[2] for n, ref in reference.tensors.items()} } rows per {count} tokens")


def check_structure(stored, codec: Codec) -> None:
    """Refuse a stored cache that does not hold what ``codec``'s cache for its model would (module docstring),
    before anything is allocated: one :class:`ConfigError` naming the file and the field."""
    r = _Reader(stored)
    read, payloads = _layout(r)
    model = codec.model
    if len(read) != model.num_layers:
        r.fail(f"it holds {len(read)} layers, the model's cache has {model.num_layers}")
    if (payloads is not None) != (codec.scope == "model"):
        r.fail(f"its blocks are {'shared by' if payloads is not None else 'held by'} the layers, but {codec.name} "
               f"has {codec.scope} scope")
    for i, layer in enumerate(read):
        dtype = getattr(torch, r.meta["layers"][i]["dtype"])
        for kind, s in layer.items():
            for part in ("sinks", "tail"):
                t = s[part]
                if t is not None and (t.shape[1], t.shape[3]) != (model.num_kv_heads, model.head_dim):
                    r.fail(f"layer{i}.{kind}.{part} has {t.shape[1]} heads of size {t.shape[3]}, the model "
                           f"{model.num_kv_heads} of size {model.head_dim}")
            sinks = 0 if s["sinks"] is None else s["sinks"].shape[2]
            if sinks != min(codec.policy(kind, i).sinks, s["length"]):
                r.fail(f"layer{i}.{kind}.sinks holds {sinks} tokens; {codec.name} keeps "
                       f"{min(codec.policy(kind, i).sinks, s['length'])} of {s['length']}")
            if codec.payload_layout == "tokens":
                _check_against_reference(r, i, kind, s, codec, dtype)
    batch = read[0]["key"]["batch"]
    units = [read[0]["key"] | {"payloads": payloads}] if payloads is not None else [s for l in read for s in l.values()]
    for unit in units:  # a "blocks" store's payloads, each checked by the codec
        before = 0
        for j, (block, payload) in enumerate(zip(unit["blocks"], unit["payloads"])):
            try:
                codec.check_payload(payload, batch, before)
            except ValueError as error:
                r.fail(f"encoded block {j} (tokens {block[3]}..+{block[4]}): {error}")
            before += block[4]
