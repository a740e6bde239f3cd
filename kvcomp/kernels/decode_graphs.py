"""CUDA-graph capture of the fused decode launches of one layer's call (``DecodeWorkspace(graphs=True)``, e.g.
``install(model, "triton", cuda_graphs=True)``): the host work of a call (building the launches' arguments, Triton's
binding of each launch, the driver's launches) becomes one graph replay where the call reads what it read before.

A call is captured the second time its launches read the same tensors (every argument's address and strides, and
every other argument, but the query's and the output's) and replayed after: the plan's grid does not change as the
cache grows (``fixed_grid``), the token bounds are read from the workspace's slots (copied there once per step), the
step's mask from the workspace's, and the payloads in place from buffers with spare capacity. The query is copied
into the graph's own before a replay; the output is the graph's own (one per captured call, so layers do not share
it). Calls whose tensors change every step (a cache without spare capacity) are never captured and run as they are.

What the call derives from its query (QJL's ``y = S q``: :class:`~kvcomp.kernels.formats.CallQuery`) is remade in
place from the graph's query by the graph itself, before its launches: those tensors are the graph's own, and a call
is matched whatever their addresses.

A captured call whose launches read only tensors of its inputs (the segments and the call's options, the workspace's
buffers: :meth:`DecodeGraphs.inputs_key`), its query and what that derives is also found by those inputs, before its
launches are built: the next calls with the same inputs replay it without building any argument
(:meth:`DecodeGraphs.replay`). One whose launches read another tensor made during the call (a payload's arguments
converted) is found by its launches only. Verified only where a GPU is available; the CPU tests replay by running the
captured work again (the same arguments)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvcomp.kernels.formats import CallQuery

KEPT = 1024  # calls remembered (seen or captured), the least recently used forgotten first: a model's layers, twice


def _summary(value, derived: frozenset = frozenset()):
    """What a value (a launch argument, a call's input) is to a graph: a tensor's address, strides and dtype (a tensor
    of a storage in ``derived``, which a graph remakes itself: its shape, strides and dtype); the summaries of a
    tuple's, list's or dict's items and of a dataclass's fields (a payload reader's, but its token count, which the
    step's bounds carry); anything else itself."""
    if type(value) in _PLAIN:
        return value
    if isinstance(value, torch.Tensor):
        if value.untyped_storage().data_ptr() in derived:
            return ("derived", value.shape, value.stride(), value.dtype)
        return ("tensor", value.data_ptr(), value.stride(), value.dtype)
    if isinstance(value, (tuple, list)):
        return tuple(_summary(v, derived) for v in value)
    if isinstance(value, dict):
        return tuple((k, _summary(v, derived)) for k, v in value.items())
    if dataclasses.is_dataclass(value):
        return (type(value),) + tuple(_summary(getattr(value, f.name), derived) for f in dataclasses.fields(value)
                                      if f.name != "num_tokens")
    return value


_PLAIN = (int, float, bool, str, type(None), torch.dtype)  # values that are their own summary


def _storages(value) -> set[int]:
    """The storages (their addresses) of every tensor in ``value``, walked as :func:`_summary` walks it."""
    if isinstance(value, torch.Tensor):
        return {value.untyped_storage().data_ptr()}
    if isinstance(value, dict):
        value = tuple(value.values())
    elif dataclasses.is_dataclass(value):
        value = tuple(getattr(value, f.name) for f in dataclasses.fields(value))
    if isinstance(value, (tuple, list)):
        return set().union(*(_storages(v) for v in value))
    return set()


def cuda_capture(run) -> object:
    """``run`` captured in a CUDA graph; returns its replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


@dataclass
class Captured:
    replay: object
    query: torch.Tensor  # the graph's own copy of the query the split launches read
    out: torch.Tensor | None  # the merge's output (None: split launches alone)


class DecodeGraphs:
    """The captured calls of one workspace, by what their launches read. ``capture(run)``: returns a replay of ``run``
    (:func:`cuda_capture`; a stand-in in the CPU tests)."""

    def __init__(self, capture=cuda_capture):
        self.capture, self.seen, self.captured, self.by_inputs = capture, OrderedDict(), OrderedDict(), OrderedDict()

    @staticmethod
    def _keep(calls: OrderedDict, key, value) -> None:
        calls[key] = value
        calls.move_to_end(key)
        if len(calls) > KEPT:  # calls that never come back (a cache without spare capacity) must not pile up
            calls.popitem(last=False)

    @staticmethod
    def inputs_key(query: torch.Tensor, inputs: tuple) -> tuple:
        """What a call's launches are built from (:func:`_summary`), ``inputs`` less the query, which only its shape
        and type enter (it is copied into a graph's own)."""
        return query.shape, query.dtype, query.device, _summary(inputs)

    def replay(self, key: tuple, query: torch.Tensor) -> Captured | None:
        """The call captured with inputs ``key`` (:meth:`inputs_key`), replayed with ``query`` (its output: ``.out``);
        ``None`` where none is (its launches must be built and :meth:`run`)."""
        found = self.by_inputs.get(key)
        if found is None:
            return None
        self.by_inputs.move_to_end(key)
        found.query.copy_(query)
        found.replay()
        return found

    def run(self, launches: list, query: CallQuery, out: torch.Tensor | None, inputs_key: tuple | None = None,
            inputs: tuple = ()) -> torch.Tensor | None:
        """Run a call's ``launches`` (split launches reading ``query.q`` as ``q_ptr`` and what it derives, then the
        merge writing ``out``; or split launches alone, ``out`` None, their partial outputs in the scratch they were
        given: a launch group's): replayed where captured, captured where met before, else run; returns the output it
        wrote. A call captured here is also found by ``inputs_key`` (:meth:`replay`) where its launches read no tensor
        but ``inputs``', the query's, what it derives and the output."""
        derived = frozenset(_storages(query.tensors))
        key = tuple((launch.kernel, launch.grid, tuple((name, _summary(value, derived))
                                                       for name, value in launch.args.items()
                                                       if name not in ("q_ptr", "out_ptr"))) for launch in launches)
        found = self.captured.get(key)
        if found is not None:
            self.captured.move_to_end(key)
            found.query.copy_(query.q)
            found.replay()
            return found.out
        if key not in self.seen:  # the first time: as it is (it compiles the kernels), remembered
            self._keep(self.seen, key, None)
            for launch in launches:
                launch()
            return out
        static = query.q.clone()
        for launch in launches:
            launch.args.update({"q_ptr": static} if "q_ptr" in launch.args else {})

        def call():
            query.refresh(static)  # what the launches read of the query, from the graph's copy of it
            for launch in launches:
                launch()

        entry = Captured(self.capture(call), static, out)
        self._keep(self.captured, key, entry)
        read = set().union(*(_storages(launch.args) for launch in launches))
        if inputs_key is not None and read <= _storages(inputs) | _storages((static, out)) | derived:
            self._keep(self.by_inputs, inputs_key, entry)
        entry.replay()  # capturing records the launches without running them
        return out
