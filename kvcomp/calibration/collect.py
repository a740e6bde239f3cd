"""Collect what codecs are fitted on: pre-RoPE keys, values and (on request) their Fisher weights.

For each calibration window, one forward pass gives, per layer and KV head, the keys and values exactly
as the compressed cache will see them (keys un-rotated, i.e. pre-RoPE). With ``fisher=True`` a backward
pass of the mean next-token cross-entropy (HF ``labels=input_ids``) also gives the squared gradients of
the loss with respect to them, the diagonal Fisher weights of the TemporalKV thesis (Eq. 3). Keys are
recorded post-RoPE from the cache and un-rotated; since RoPE is a rotation ``R``, the pre-RoPE gradient
is ``R^T`` times the post-RoPE one, i.e. the same un-rotation. A collection with Fisher weights also
serves requests without them.

The first ``drop_first`` tokens (attention sinks, kept in full precision) of every window are dropped.
Everything is written, as it is produced, to file-backed tensors (``torch.from_file``) under the cache
folder, so memory stays bounded by one window's activations (64 x 2048 tokens of an 8B model are
~34 GB of bf16 on disk), and later codecs fitted on the same model (fingerprint) and data reuse the
files. ``complete.json`` records every shard's size and sha256; a reused folder is verified first, so a
truncated or altered shard is an error naming it, never zeros read back.

A collection is sized before anything is written: one the cache disk cannot hold is a
:class:`~kvcomp.errors.ConfigError` naming the bytes it needs, the bytes free and how many windows fit
(:func:`check_disk`). A folder without ``complete.json`` is never reused; one whose lock no live process holds
(a killed collection) is removed by the next collection (:func:`remove_incomplete`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import torch

import kvcomp
from kvcomp.artifacts import ArtifactError, file_lock, file_record, read_json, verify_file, write_json_atomic
from kvcomp.cache import install, with_cache
from kvcomp.cache.memory import readable
from kvcomp.cache.recording import RecordingCache
from kvcomp.codecs import Activations, ModelInfo
from kvcomp.errors import ConfigError
from kvcomp.paths import cache_dir, cache_relative
from kvcomp.progress import progress
from kvcomp.stages.rope import rope_transpose, undo_rope

FIELDS = ("key", "value")
FISHER_FIELDS = ("key_grad2", "value_grad2")
RECORD = "complete.json"  # written last: its presence marks a collection complete

log = logging.getLogger(__name__)


class KVActivations(Activations):
    """File-backed per-layer tensors ``[samples, kv_heads, tokens, head_dim]`` for each of :data:`FIELDS`
    (and :data:`FISHER_FIELDS` when collected with ``fisher``)."""

    def __init__(self, folder: Path, shape: tuple[int, int, int, int], num_layers: int, fisher: bool,
                 device: torch.device = torch.device("cpu"), dtype=torch.bfloat16):
        self.folder, self.shape, self.num_layers, self.dtype = Path(folder), tuple(shape), num_layers, dtype
        self.fisher, self.device = fisher, torch.device(device)
        self.fields = FIELDS + FISHER_FIELDS if fisher else FIELDS

    def path(self, layer: int, field: str) -> Path:
        return self.folder / f"layer{layer:03d}.{field}.bin"

    def tensor(self, layer: int, field: str) -> torch.Tensor:
        numel = 1
        for n in self.shape:
            numel *= n
        return torch.from_file(str(self.path(layer, field)), shared=True, size=numel, dtype=self.dtype).view(self.shape)

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        return {field: self.tensor(layer, field) for field in self.fields}

    @property
    def nbytes(self) -> int:
        """Bytes of every shard together (what the collection writes to disk)."""
        return self.shape[0] * self.window_nbytes

    @property
    def window_nbytes(self) -> int:
        """Bytes one window adds to the shards."""
        _, heads, tokens, head_dim = self.shape
        return self.num_layers * len(self.fields) * heads * tokens * head_dim * self.dtype.itemsize

    @property
    def record_path(self) -> Path:
        return self.folder / RECORD

    @property
    def complete(self) -> bool:
        return self.record_path.is_file()

    def paths(self) -> list[Path]:
        return [self.path(layer, field) for layer in range(self.num_layers) for field in self.fields]

    def seal(self, seconds: float) -> None:
        """Record every shard's size and sha256 (written last: its presence marks the folder complete)."""
        files = {p.name: file_record(p) for p in self.paths()}
        write_json_atomic(self.record_path, {"shape": self.shape, "seconds": seconds, "files": files})

    def verify(self) -> None:
        """Raise :class:`~kvcomp.artifacts.ArtifactError` unless every shard matches its record."""
        remedy = f"delete {self.folder}, or run with force=true to collect it again"
        files = read_json(self.record_path, "calibration K/V record", remedy).get("files")
        if not isinstance(files, dict) or set(files) != {p.name for p in self.paths()}:
            raise ArtifactError(f"calibration K/V record {self.record_path} lists no or other shards; {remedy}")
        for path in self.paths():
            verify_file(path, files[path.name], "calibration K/V shard", remedy)


def activations_key(info: ModelInfo, windows: torch.Tensor, drop_first: int, fisher: bool = True) -> str:
    spec = {
        "fisher": fisher,
        "model": info.identity,
        "shape": [info.num_layers, info.num_kv_heads, info.head_dim],
        "windows": hashlib.sha256(windows.cpu().numpy().tobytes()).hexdigest(),
        "drop_first": drop_first,
        "kvcomp": kvcomp.__version__,
    }
    if info.layer_types:  # a hybrid model: which of its layers are collected
        spec["layers"] = list(info.model_layers)
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def kv_root() -> Path:
    """The cache folder that holds a folder per K/V collection."""
    return cache_dir() / "calibration" / "kv"


def collection_shape(info: ModelInfo, samples: int, seq_len: int, drop_first: int) -> tuple[int, int, int, int]:
    """Each shard's shape ``[samples, kv_heads, seq_len - drop_first, head_dim]``; a ConfigError when the
    windows keep no token after the sinks."""
    if seq_len <= drop_first:
        raise ConfigError(
            f"calibration.seq_len={seq_len} leaves nothing after dropping {drop_first} sink tokens; "
            f"valid: calibration.seq_len > {drop_first}"
        )
    return samples, info.num_kv_heads, seq_len - drop_first, info.head_dim


def check_disk(store: KVActivations) -> None:
    """Raise :class:`ConfigError` when the disk of ``store``'s folder has less free space than the collection
    needs, naming both, and how many windows fit."""
    where = next(p for p in (store.folder, *store.folder.parents) if p.exists())
    free = shutil.disk_usage(where).free
    if store.nbytes > free:
        samples, _, tokens, _ = store.shape
        raise ConfigError(
            f"the calibration K/V collection of {samples} windows ({tokens} tokens kept of each, {store.num_layers} "
            f"layers, {' + '.join(store.fields)}) needs {readable(store.nbytes)} ({store.nbytes} bytes) on the disk "
            f"of {cache_relative(where)}, which has {readable(free)} ({free} bytes) free: "
            f"{free // store.window_nbytes} windows fit; lower calibration.num_samples or calibration.seq_len, or set "
            "KVCOMP_CACHE to a folder on a larger disk"
        )


def remove_incomplete(root: Path) -> None:
    """Remove the collections under ``root`` that a killed run left incomplete (no :data:`RECORD`) and that no
    live process is writing (their :func:`~kvcomp.artifacts.file_lock` is free)."""
    if not root.is_dir():
        return
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not (p / RECORD).is_file()):
        with file_lock(folder, wait=False) as held:
            if held and folder.is_dir() and not (folder / RECORD).is_file():
                nbytes = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
                shutil.rmtree(folder, ignore_errors=True)
                log.info("removed %s, an incomplete calibration K/V collection (%s) of a killed run",
                         cache_relative(folder), readable(nbytes))


def collect_kv(model, info: ModelInfo, windows: torch.Tensor, drop_first: int = 8, folder: Path | None = None,
               force: bool = False, fisher: bool = True) -> KVActivations:
    """Record pre-RoPE K/V (and, with ``fisher``, squared loss gradients) of every window, reusing a complete,
    verified earlier collection unless ``force`` (one with Fisher weights serves one without). Incomplete
    collections of killed runs are removed first (:func:`remove_incomplete`); a collection the disk cannot
    hold is refused before anything is written (:func:`check_disk`)."""
    shape = collection_shape(info, *windows.shape, drop_first)
    device = next(model.parameters()).device
    remove_incomplete(kv_root())
    if folder is None and not fisher and not force:
        richer = KVActivations(kv_root() / activations_key(info, windows, drop_first, True), shape, info.num_layers,
                               True, device)
        if richer.complete:
            richer.verify()
            return richer
    folder = Path(folder) if folder is not None else kv_root() / activations_key(info, windows, drop_first, fisher)
    with file_lock(folder, "the calibration K/V collection"):  # concurrent sweep members collect once
        return _collect_into(KVActivations(folder, shape, info.num_layers, fisher, device), model, info, windows,
                             drop_first, force)


def _collect_into(store: KVActivations, model, info: ModelInfo, windows: torch.Tensor, drop_first: int,
                  force: bool) -> KVActivations:
    """:func:`collect_kv`'s work once ``store`` is chosen (and locked): reuse it when complete, else fill it."""
    folder, fisher, device = store.folder, store.fisher, store.device
    seq_len = windows.shape[1]
    if store.complete and not force:
        store.verify()
        return store
    shutil.rmtree(folder, ignore_errors=True)
    check_disk(store)
    folder.mkdir(parents=True)
    tensors = [store.layer(i) for i in range(info.num_layers)]
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.requires_grad_(False)
    start = time.perf_counter()
    what = "K/V + Fisher" if fisher else "K/V"
    with install(model):  # scoped: whatever the model had before is back afterwards
        try:
            for s, window in enumerate(progress(windows, f"calibration {what}", unit="window")):
                ids = window[None].to(device)
                cache = RecordingCache(info.total_layers, retain_grad=fisher)
                with torch.set_grad_enabled(fisher):
                    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(fisher)
                    loss = model(inputs_embeds=embeds, labels=ids, **with_cache(model, cache), use_cache=True).loss
                if fisher:
                    loss.backward()
                for layer, out in zip([cache.layers[i] for i in info.model_layers], tensors):  # the layers the codec encodes
                    keys, values, rope, *_ = layer.recorded
                    grads = (keys.grad, values.grad) if fisher else ()
                    keys, values = keys.detach(), values.detach()
                    if rope is not None:
                        cos, sin = (t.expand(1, seq_len, -1) for t in rope)
                        keys = undo_rope(keys, cos, sin)
                        grads = (rope_transpose(grads[0], cos, sin), grads[1]) if fisher else ()  # chain rule
                    for field, x in zip(store.fields, (keys, values, *(g.square() for g in grads))):
                        out[field][s] = x[0, :, drop_first:].detach().to(store.dtype).cpu()
        finally:
            for p in trainable:
                p.requires_grad_(True)
    del tensors  # release the file mappings before hashing the shards
    store.seal(time.perf_counter() - start)
    return store
