"""Memory: what a cache object really holds, and whether a reservation can fit before it is made.

:func:`held_nbytes` (the bytes of every distinct tensor storage reachable from an object) checks that a
cache's reported bytes (storage + bookkeeping + working memory) are what it holds (``tests/cache/test_memory.py``)
and measures caches (``benchmarks/bench_cache_memory.py``). :func:`check_fits` refuses a reservation larger
than the memory its device has available (:func:`available_bytes`) with the numbers, before allocating.
"""

from __future__ import annotations

import os
import types

import torch

from kvcomp.errors import ConfigError


def held_nbytes(root, exclude: set[int] = frozenset(), skip: tuple[type, ...] = ()) -> int:
    """Bytes of every distinct tensor storage reachable from ``root`` (attributes, slots, containers, bound
    methods, closures), views counted once; storages whose data pointer is in ``exclude`` (e.g. the
    model's weights) and objects of the ``skip`` types (e.g. codecs, whose fitted state is model-level)
    are left out, as are modules."""
    storages, seen, stack = {}, set(), [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (torch.nn.Module, type, types.ModuleType, str, bytes, *skip)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in exclude:
                storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, types.MethodType):
            stack.append(obj.__self__)
        elif isinstance(obj, types.FunctionType):
            stack.extend(cell.cell_contents for cell in obj.__closure__ or ())
        else:
            stack.extend(getattr(obj, "__dict__", {}).values())
            stack.extend(getattr(obj, slot) for slot in getattr(type(obj), "__slots__", ()) if hasattr(obj, slot))
    return sum(storages.values())


def model_storages(model: torch.nn.Module) -> set[int]:
    """Data pointers of the model's parameters and buffers (to leave out of :func:`held_nbytes`)."""
    return {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}


def readable(nbytes: int) -> str:
    """``1180000000000`` -> ``"1.18 TB"`` (decimal units, for messages)."""
    if nbytes < 1000:
        return f"{nbytes} bytes"
    for unit in ("kB", "MB", "GB", "TB"):
        nbytes /= 1000
        if nbytes < 999.5:  # 999_999 bytes: 1 MB, not 1e+03 kB
            return f"{nbytes:.3g} {unit}"
    return f"{nbytes:.0f} TB"


def available_bytes(device: torch.device) -> int | None:
    """Memory a new allocation on ``device`` can take: on CUDA the device's free memory plus what torch's
    allocator holds unused; on CPU the kernel's ``MemAvailable`` (``/proc/meminfo``; free pages where that is
    missing). None where it cannot be read (other devices, no ``/proc`` nor ``sysconf``)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_fits(nbytes: int, device: torch.device, what: str, remedy: str) -> None:
    """Raise :class:`ConfigError` when ``nbytes`` exceed what ``device`` has available (naming both, what
    needs them and the remedy); pass when that cannot be read."""
    available = available_bytes(device)
    if available is not None and nbytes > available:
        raise ConfigError(
            f"{what} needs {readable(nbytes)} ({nbytes} bytes) of {torch.device(device).type} memory, but "
            f"{readable(available)} ({available} bytes) are available; {remedy}"
        )
