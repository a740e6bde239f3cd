"""What a cache object really holds: the bytes of every distinct tensor storage reachable from it.

Used to check that a cache's reported bytes (storage + bookkeeping + working memory) are what it holds
(``tests/test_memory.py``) and to measure caches (``scripts/bench_cache_memory.py``).
"""

from __future__ import annotations

import types

import torch


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
