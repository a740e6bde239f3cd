"""Checked files: what kvcomp computes once and reuses is verified before it is trusted.

Every cached file (calibration K/V shards, codec artifacts, reference rows, token ids) records its size
and sha256 when written; :func:`verify_file` checks both on load, and :func:`read_json` turns unreadable
metadata into an :class:`ArtifactError`. Each error names the file, the problem and the remedy, so a
damaged file never yields a silent result.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path

from kvcomp.errors import KVCompError, first_line

log = logging.getLogger(__name__)

REFIT = "delete it, or run with force=true to recompute it"


class ArtifactError(KVCompError, RuntimeError):
    """A cached file is missing, truncated, altered or unreadable."""


def safetensors_problem(path: str | Path) -> str | None:
    """Why a safetensors file's header cannot be read (missing, truncated, garbled), or None; reads only
    the header."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt"):
            return None
    except Exception as err:  # SafetensorError, or OSError for a missing file
        return first_line(err)


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_record(path: str | Path) -> dict:
    """``{"bytes": size, "sha256": digest}`` of ``path``, as stored beside it."""
    return {"bytes": Path(path).stat().st_size, "sha256": sha256_file(path)}


def verify_file(path: str | Path, record: dict, what: str, remedy: str = REFIT) -> None:
    """Raise :class:`ArtifactError` unless ``path`` has the size and sha256 in ``record``."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{what} {path} is missing; {remedy}")
    size = path.stat().st_size
    if size != record.get("bytes"):
        raise ArtifactError(
            f"{what} {path} has {size} bytes, its record says {record.get('bytes')} (truncated or altered); {remedy}"
        )
    if sha256_file(path) != record.get("sha256"):
        raise ArtifactError(f"{what} {path} fails its sha256 checksum (altered or damaged); {remedy}")


def read_json(path: str | Path, what: str, remedy: str = REFIT):
    """Parse a JSON file, or raise :class:`ArtifactError` naming it when it cannot be read."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ArtifactError(f"{what} {path} is unreadable ({type(err).__name__}: {err}); {remedy}") from err


def _out_of_space(error: BaseException) -> bool:
    """Whether ``error`` (an OSError, or a library's error wrapping one: safetensors, torch.save) is a full disk."""
    return (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "No space left on device" in str(error)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


@contextlib.contextmanager
def atomic_path(path: str | Path, nbytes: int):
    """A temporary path beside ``path`` (per process and call, keeping the suffix) for the block to write, renamed
    onto ``path`` when the block ends and removed when it fails, so that no partial file is ever left. A full disk
    is an :class:`ArtifactError` naming the folder, the ``nbytes`` the file needs and the bytes free there."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp{path.suffix}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        tmp.replace(path)
    except BaseException as error:
        tmp.unlink(missing_ok=True)
        if _out_of_space(error):
            free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
            raise ArtifactError(f"no space left in {path.parent} for {path.name}: it needs {_mib(nbytes)}, "
                                f"{_mib(free)} are free; free space there or write elsewhere (KVCOMP_CACHE for "
                                "kvcomp's cache, hydra.run.dir for a run)") from error
        raise


def tensors_nbytes(tensors: dict) -> int:
    """Bytes of a dict of tensors (what a safetensors or torch file of them needs, less its header)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` through :func:`atomic_path`."""
    data = text.encode()
    with atomic_path(path, len(data)) as tmp:
        tmp.write_bytes(data)


def write_json_atomic(path: str | Path, obj) -> None:
    """Write JSON atomically (:func:`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=str))


@contextlib.contextmanager
def file_lock(path: str | Path, what: str = "", wait: bool = True):
    """Hold an exclusive lock on ``<path>.lock`` (POSIX ``flock``; blocks while another process holds it), so that
    processes computing the same artifact at once (sweep members) compute it once: the first writes it, the others
    wait and then find it. The lock file is left in place (removing it would race with waiters). Without
    ``fcntl`` (Windows) nothing is locked. Yields whether the lock is held: ``wait=False`` does not wait for
    another process and yields False instead (a live writer holds it; without ``fcntl``: always False)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield wait
        return
    lock = Path(path).with_name(Path(path).name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            log.info("waiting for another process computing %s", what or Path(path).name)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
