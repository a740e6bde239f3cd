"""A model's fingerprint: what every cache key uses instead of its name.

``model_fingerprint`` hashes the HF config (minus paths, versions and the load dtype), the weights and
the tokenizer (vocabulary, merges, normalizer, chat template). Weights are hashed over the checkpoint
files transformers loads when the model came from a folder (a local one, the embedded one or the hub's
snapshot): ``model.safetensors``, or the files named by ``model.safetensors.index.json``'s ``weight_map``
(then the same for ``pytorch_model.bin``), never other files of the folder (Mistral's
``consolidated.safetensors``). A file in the hub cache is a link to a blob named by its sha256, which is
used as it is; other files' sha256 is computed once and cached by path, size and modification time. A
model with no such files behind it is hashed over its parameters. Two models that differ in any weight,
config field or token never share a reference result, calibration collection or codec artifact, whatever
their names.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

import torch

from kvcomp.artifacts import sha256_file, write_json_atomic
from kvcomp.paths import cache_dir

CHECKPOINTS = (("model.safetensors", "model.safetensors.index.json"), ("pytorch_model.bin", "pytorch_model.bin.index.json"))
_SHA256_NAME = re.compile(r"[0-9a-f]{64}")  # the hub cache's blob names for weight files
IGNORED_CONFIG_KEYS = ("transformers_version", "dtype", "torch_dtype", "name_or_path", "architectures_source")

log = logging.getLogger(__name__)


def model_fingerprint(model, tokenizer) -> dict:
    """``{"fingerprint", "config", "weights", "weights_from", "tokenizer"}``: hex digests (16 chars)."""
    files = weight_files(model)
    parts = {
        "config": config_digest(model.config),
        "weights": files_digest(files) if files else parameters_digest(model),
        "tokenizer": tokenizer_digest(tokenizer),
    }
    fingerprint = _digest(json.dumps(parts, sort_keys=True))
    return {"fingerprint": fingerprint, **parts, "weights_from": "files" if files else "parameters"}


def config_digest(config) -> str:
    """The HF config as JSON, without private keys (``_name_or_path``, ...), versions and dtype."""
    raw = config.to_dict()
    kept = {k: v for k, v in raw.items() if not k.startswith("_") and k not in IGNORED_CONFIG_KEYS}
    return _digest(json.dumps(kept, sort_keys=True, default=str))


def tokenizer_digest(tokenizer) -> str:
    """Changes whenever the tokenizer would produce other ids or another chat prompt."""
    from kvcomp.data.corpora import tokenizer_fingerprint

    return _digest(tokenizer_fingerprint(tokenizer) + "\x00" + str(getattr(tokenizer, "chat_template", None)))


def weight_files(model) -> list[Path]:
    """The checkpoint files the model was loaded from, in its folder (or hub snapshot)."""
    folder = model_folder(str(getattr(model.config, "_name_or_path", "") or ""))
    return checkpoint_files(folder) if folder is not None else []


def checkpoint_files(folder: Path) -> list[Path]:
    """The weight files transformers loads from ``folder``, in its order of preference: the single
    safetensors file, the safetensors index's ``weight_map``, then the same for PyTorch's ``.bin``
    (empty when the folder has none of them)."""
    for single, index in CHECKPOINTS:
        if (folder / single).is_file():
            return [folder / single]
        if (folder / index).is_file():
            weight_map = json.loads((folder / index).read_text()).get("weight_map", {})
            return [folder / name for name in sorted(set(weight_map.values()))]
    return []


def model_folder(name_or_path: str) -> Path | None:
    """The folder a model is read from: a local folder, or a hub id's snapshot in the local hub cache."""
    if not name_or_path:
        return None
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    try:  # a hub id: the snapshot folder of the local hub cache, when the model is there
        from transformers.utils import cached_file

        config = cached_file(name_or_path, "config.json", local_files_only=True)
    except Exception:  # not cached, not a hub id: fall back to hashing the parameters
        return None
    return Path(config).parent if config else None


def files_digest(files: list[Path]) -> str:
    """sha256 over the files' names and sha256s (a hub blob's name, or computed once and cached by path, size
    and mtime)."""
    memo_path = cache_dir() / "fingerprints.json"
    try:
        memo = json.loads(memo_path.read_text()) if memo_path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        memo = {}  # a damaged memo is only a cache of hashes: recompute them
    entries, changed = [], False
    for path in files:
        blob = path.resolve()
        if blob.parent.name == "blobs" and _SHA256_NAME.fullmatch(blob.name):  # the hub cache's content address
            entries.append((path.name, blob.name))
            continue
        stat = blob.stat()
        key = f"{blob}:{stat.st_size}:{stat.st_mtime_ns}"
        if key not in memo:
            log.info("fingerprint: hashing %s (%.2f GB, once: the hash is cached by path, size and mtime)",
                     path.name, stat.st_size / 1e9)
            memo[key] = sha256_file(path)
            changed = True
        entries.append((path.name, memo[key]))
    if changed:
        write_json_atomic(memo_path, memo)
    return _digest(json.dumps(entries))


@torch.no_grad()
def parameters_digest(model) -> str:
    """sha256 over every named parameter and buffer (name, dtype, shape, bytes)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().contiguous().cpu()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
