"""CUDA-graph capture of the fused decode launches of one layer's call (``DecodeWorkspace(graphs=True)``, e.g.
``install(model, "triton", cuda_graphs=True)``): the host work of a call (building the launches' arguments, Triton's
binding of each launch, the driver's launches) becomes one graph replay where the call reads what it read before.

A call is captured the second time its launches read the same tensors (every argument's address and strides, and
every other argument, but the query's and the output's) and replayed after: the plan's grid does not change as the
cache grows (``fixed_grid``), the token bounds are read from the workspace's slots (copied there once per step), the
step's mask from the workspace's, and the payloads in place from buffers with spare capacity. The query is copied
into the graph's own before a replay; the output is the graph's own (one per captured call, so layers do not share
it). Calls whose tensors change every step (a query projected per step, a cache without spare capacity) are never
captured and run as they are. Verified only where a GPU is available; the CPU tests replay by running the captured
launches again (the same arguments)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

KEPT = 1024  # calls remembered (seen or captured), the least recently used forgotten first: a model's layers, twice


def _summary(value):
    """What a launch argument's value is to a graph: a tensor's address, strides and dtype; anything else itself."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.data_ptr(), value.stride(), value.dtype)
    if isinstance(value, tuple):
        return tuple(_summary(v) for v in value)
    return value


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
    out: torch.Tensor  # the merge's output


class DecodeGraphs:
    """The captured calls of one workspace, by what their launches read. ``capture(run)``: returns a replay of ``run``
    (:func:`cuda_capture`; a stand-in in the CPU tests)."""

    def __init__(self, capture=cuda_capture):
        self.capture, self.seen, self.captured = capture, OrderedDict(), OrderedDict()

    @staticmethod
    def _keep(calls: OrderedDict, key, value) -> None:
        calls[key] = value
        calls.move_to_end(key)
        if len(calls) > KEPT:  # calls that never come back (a query projected per step) must not pile up
            calls.popitem(last=False)

    def run(self, launches: list, query: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Run a call's ``launches`` (split launches reading ``query`` as ``q_ptr``, then the merge writing ``out``):
        replayed where captured, captured where met before, else run; returns the output it wrote."""
        key = tuple((launch.kernel, launch.grid, tuple((name, _summary(value)) for name, value in launch.args.items()
                                                       if name not in ("q_ptr", "out_ptr"))) for launch in launches)
        found = self.captured.get(key)
        if found is not None:
            self.captured.move_to_end(key)
            found.query.copy_(query)
            found.replay()
            return found.out
        if key not in self.seen:  # the first time: as it is (it compiles the kernels), remembered
            self._keep(self.seen, key, None)
            for launch in launches:
                launch()
            return out
        static = query.clone()
        for launch in launches:
            launch.args.update({"q_ptr": static} if "q_ptr" in launch.args else {})

        def call():
            for launch in launches:
                launch()

        entry = Captured(self.capture(call), static, out)
        self._keep(self.captured, key, entry)
        entry.replay()  # capturing records the launches without running them
        return out
