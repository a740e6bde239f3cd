"""The plan / run split of the fused decode kernels (flashinfer's decode wrapper: ``plan`` once per step, ``run`` per
layer, a caller-owned workspace).

- :func:`plan_decode`: which split launches a step needs and how many slices each gets, from the segments'
  token bounds alone (every layer of a step has the same ones);
- :class:`DecodePlans`: one model forward's plans, made by the first layer that asks and reused by the others
  (:class:`~kvcomp.cache.context.Step` holds one), and the workspace they run in;
- :class:`DecodeWorkspace`: the split kernels' partial outputs and log-sum-exps, owned across layers and steps
  (:class:`~kvcomp.cache.attention.Installation` holds one per model), so that a decode step allocates no scratch.

Imports neither Triton nor the launcher: the plan is arithmetic on token counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvcomp.kernels.decode_graphs import DecodeGraphs

MAX_DENSE = 3  # full-precision pieces per stream in one launch: sinks, tail and the fresh token (exact_prefill)
ALIGN = 64  # float32 elements (256 bytes, CUDA's allocation alignment) at which a workspace's log-sum-exps start
# A split launch's row of int32 bounds, read by the kernel from device memory (nothing that grows with the cache is a
# kernel argument: a growing cache never recompiles a kernel): its tokens [lo, hi), tiles, first slot and the step's
# slots, the strides of the attention mask and the position ids, each stream's payload (first cached token, tokens),
# the first cached token of each full-precision piece in order, and the cuts between the stream's segments.
LO, HI, TILES, SLOT0, SLOTS, VALID_S_B, POS_S_B, K_FIRST, K_LENGTH, V_FIRST, V_LENGTH = range(11)
K_LOWS, K_CUTS, V_LOWS, V_CUTS = (11 + i * MAX_DENSE for i in range(4))
ROW = -(-(V_CUTS + MAX_DENSE) // 4) * 4  # whole 16-byte rows: each launch's row as aligned as the first


@dataclass(frozen=True)
class PlannedLaunch:
    """One split launch: cached tokens ``[lo, hi)``, the key and value segments it reads (indices in token order),
    its ``tiles`` and its ``splits`` (slices, one program each per batch x KV head)."""

    lo: int
    hi: int
    keys: tuple[int, ...]
    values: tuple[int, ...]
    tiles: int
    splits: int


@dataclass(frozen=True)
class DecodePlan:
    """The split launches of one decode step, in token order; their slices are numbered consecutively, and the merge
    combines all :attr:`slots` of them. ``key_bounds`` / ``value_bounds``: each stream's segment boundaries, and
    ``*_encoded`` which segments are payloads (:func:`plan_decode`)."""

    launches: tuple[PlannedLaunch, ...]
    key_bounds: tuple = ()
    key_encoded: tuple = ()
    value_bounds: tuple = ()
    value_encoded: tuple = ()

    @property
    def slots(self) -> int:
        return sum(launch.splits for launch in self.launches)

    def rows(self, valid_s_b: int, pos_s_b: int, shifts: tuple = ((), ())) -> list[list[int]]:
        """Each launch's row of bounds (:data:`ROW` ints, laid out as :data:`LO` ... :data:`V_CUTS` say). ``shifts``: per
        stream, the tokens before each full-precision piece in the buffer the kernel is given for it (its first
        cached token less these is where the buffer's first row lies; none: 0)."""
        rows, slot = [], 0
        for launch in self.launches:
            row = [0] * ROW
            row[LO: POS_S_B + 1] = [launch.lo, launch.hi, launch.tiles, slot, self.slots, valid_s_b, pos_s_b]
            streams = ((launch.keys, self.key_bounds, self.key_encoded, K_FIRST, K_LOWS, K_CUTS, shifts[0]),
                       (launch.values, self.value_bounds, self.value_encoded, V_FIRST, V_LOWS, V_CUTS, shifts[1]))
            for indices, bounds, encoded, first, lows, cuts, shift in streams:
                dense = [bounds[i] - (shift[i] if shift else 0) for i in indices if not encoded[i]]
                row[lows: lows + len(dense)] = dense
                row[cuts: cuts + len(indices) - 1] = [bounds[i + 1] for i in indices[:-1]]
                for i in indices:
                    if encoded[i]:
                        row[first: first + 2] = [bounds[i], bounds[i + 1] - bounds[i]]
            rows.append(row)
            slot += launch.splits
        return rows


def _splits(tiles: int, programs: int, wave: int, num_splits: int | None, fixed: bool = False) -> int:
    """Slices of a launch of ``tiles`` tiles run by ``programs`` (batch x KV head) programs each: the
    fewest that fill at least two waves of ``wave`` resident programs in whole waves (a multiple of
    ``wave / gcd(wave, programs)``), or fewer where the launch has too few tiles (then at most two waves);
    ``num_splits`` forces a count. ``fixed``: the whole waves whatever the tiles (a grid that does not change as the
    cache grows, for CUDA graphs; a slice without tiles writes an empty partial output)."""
    if num_splits:
        return max(1, min(tiles, num_splits))
    step = wave // math.gcd(wave, programs)
    whole = step * -(-2 * wave // (programs * step))
    return whole if whole <= tiles or fixed else max(1, min(tiles, -(-2 * wave // programs)))


def _fits(indices: set, encoded: tuple) -> bool:
    """Whether one launch can read these segments of a stream: at most one encoded payload (its format is
    compiled in) and :data:`MAX_DENSE` full-precision pieces."""
    payloads = sum(encoded[i] for i in indices)
    return payloads <= 1 and len(indices) - payloads <= MAX_DENSE


def plan_decode(key_bounds: tuple, key_encoded: tuple, value_bounds: tuple, value_encoded: tuple, programs: int,
                wave: int, block_tokens: int, num_splits: int | None, fixed_grid: bool = False) -> DecodePlan:
    """One launch over the whole cache when each stream is at most one payload and :data:`MAX_DENSE` full-precision
    pieces (sinks, tail, fresh token), else one per run of consecutive segments that is. ``*_bounds``: each stream's
    segment boundaries in cached tokens (``[0, ..., length]``); ``*_encoded``: which segments are payloads;
    ``programs``: batch x KV heads; ``wave``: resident programs per wave (the GPU's multiprocessors); ``fixed_grid``:
    slices that do not depend on the tokens (:func:`_splits`)."""
    cuts = sorted(set(key_bounds) | set(value_bounds))
    runs = []  # [lo, hi, key segment indices, value segment indices]
    for lo, hi in zip(cuts, cuts[1:]):
        ki = max(i for i, bound in enumerate(key_bounds[:-1]) if bound <= lo)
        vi = max(i for i, bound in enumerate(value_bounds[:-1]) if bound <= lo)
        if runs and _fits(runs[-1][2] | {ki}, key_encoded) and _fits(runs[-1][3] | {vi}, value_encoded):
            runs[-1][1:] = [hi, runs[-1][2] | {ki}, runs[-1][3] | {vi}]
        else:
            runs.append([lo, hi, {ki}, {vi}])
    launches = []
    for lo, hi, keys, values in runs:
        tiles = -(-(hi - lo) // block_tokens)
        launches.append(PlannedLaunch(lo, hi, tuple(sorted(keys)), tuple(sorted(values)), tiles,
                                      _splits(tiles, programs, wave, num_splits, fixed_grid)))
    return DecodePlan(tuple(launches), key_bounds, key_encoded, value_bounds, value_encoded)


class DecodeWorkspace:
    """Float32 scratch for the split kernels' partial outputs ``[B*H, slots, R, D]`` and log-sum-exps
    ``[B*H, slots, R]``, one region per launch group of a layer (a rotated or offset payload's groups are merged
    together, so each keeps its own). A region grows to the largest step it has served and never shrinks; every layer
    and step after reuses it in stream order (the merge reads it before the next layer's split launches write it).
    The attention output is not kept here: it leaves the layer. Also the steps' rows of bounds (:meth:`bounds`) and
    masks (:meth:`mask`) at addresses kept from step to step, and ``graphs`` (:class:`DecodeGraphs`, optional): the
    calls captured in CUDA graphs, whose plans then have grids that do not change with the cache."""

    def __init__(self, graphs: DecodeGraphs | None = None):
        self.graphs = graphs
        self._storage: dict[tuple, torch.Tensor] = {}

    def scratch(self, device: torch.device, region: int, programs: int, slots: int, rows: int,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(partial, lse)`` views of region ``region`` on ``device``, grown if it is too small (contents undefined)."""
        partial_size, lse_size = programs * slots * rows * head_dim, programs * slots * rows
        lse_at = -(-partial_size // ALIGN) * ALIGN  # as aligned as a fresh allocation (the kernels' pointer specialisation)
        storage = self._buffer(("scratch", torch.device(device), region), lse_at + lse_size, torch.float32)
        return (storage[:partial_size].view(programs, slots, rows, head_dim),
                storage[lse_at: lse_at + lse_size].view(programs, slots, rows))

    def bounds(self, device: torch.device, region: int, slot, rows: list[list[int]]) -> torch.Tensor:
        """``rows`` copied (queued) into bounds buffer ``slot`` of ``region``: ``[len(rows), ROW]`` int32 at the
        same address every step while it fits (a captured step reads this step's bounds)."""
        values = torch.tensor(rows, dtype=torch.int32)
        buffer = self._buffer(("bounds", torch.device(device), region, slot), values.numel(), torch.int32)
        view = buffer[: values.numel()].view(values.shape)
        view.copy_(values, non_blocking=True)
        return view

    def mask(self, device: torch.device, slot: int, mask: torch.Tensor,
             spans: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An attention mask ``[B, L]`` (uint8) of the step copied into buffer ``slot``, whose row stride grows in powers
        of two only, and its spans (``[B, SPAN]`` int32, :class:`~kvcomp.kernels.valid_tokens.ValidTokens`) into one
        of their own: the same addresses and stride step after step (a captured step reads this step's mask)."""
        b, length = mask.shape
        width = 1 << max(length - 1, 0).bit_length()
        buffer = self._buffer(("mask", torch.device(device), slot, b), b * width, torch.uint8).view(-1)
        if buffer.numel() != b * width:  # a grown buffer is allocated with this width, a kept one has its own
            width = buffer.numel() // b
        view = buffer.view(b, width)[:, :length]
        view.copy_(mask)
        kept = self._buffer(("spans", torch.device(device), slot, b), spans.numel(), torch.int32)[: spans.numel()]
        kept = kept.view(spans.shape)
        kept.copy_(spans)
        return view, kept

    def _buffer(self, key: tuple, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The buffer ``key`` with at least ``numel`` elements (grown, never shrunk; contents kept only while it fits)."""
        buffer = self._storage.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._storage[key] = torch.empty(numel, device=key[1], dtype=dtype)
        return buffer

    @property
    def nbytes(self) -> int:
        """Bytes held, over every device and region."""
        return sum(t.numel() * t.element_size() for t in self._storage.values())


@dataclass
class DecodePlans:
    """One model forward's decode plans, by their inputs (:func:`plan_decode`'s arguments): the step's first layer
    plans, the others find the plan here, with its rows of bounds on the device (copied once per step); and the
    :class:`DecodeWorkspace` they run in (a fresh one by default: scratch allocated for this step only)."""

    workspace: DecodeWorkspace = field(default_factory=DecodeWorkspace)
    plans: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)  # what the step copied to the device, by kind and inputs
    slots: dict = field(default_factory=dict)  # bounds slots given to the step's plans so far, per (device, region)

    def plan(self, *inputs) -> DecodePlan:
        """:func:`plan_decode` of ``inputs`` (its arguments but ``fixed_grid``, the workspace's ``graphs``)."""
        if inputs not in self.plans:
            self.plans[inputs] = plan_decode(*inputs, fixed_grid=self.workspace.graphs is not None)
        return self.plans[inputs]

    def bounds(self, plan: DecodePlan, device: torch.device, region: int, valid_s_b: int, pos_s_b: int,
               shifts: tuple = ((), ())) -> torch.Tensor:
        """The plan's rows of bounds (:meth:`DecodePlan.rows`), int32 ``[launches, ROW]`` on ``device``, copied once
        per step into the workspace (each plan of a region, and each ``shifts`` of its pieces, in a slot of its own,
        in the order the step meets them)."""
        key = ("bounds", plan, torch.device(device), region, valid_s_b, pos_s_b, shifts)
        if key not in self.tensors:
            slot = self.slots.get(key[2:4], 0)
            self.slots[key[2:4]] = slot + 1
            self.tensors[key] = self.workspace.bounds(device, region, slot, plan.rows(valid_s_b, pos_s_b, shifts))
        return self.tensors[key]

    def count(self, device: torch.device, region: int, value: int) -> torch.Tensor:
        """``[value]`` int32 on ``device``: a merge's slot count over several plans (a bounds slot of ``region`` of its
        own per value: calls of one step may merge different counts, e.g. groups of padded rows)."""
        key = ("count", torch.device(device), region, value)
        if key not in self.tensors:
            self.tensors[key] = self.workspace.bounds(device, region, ("count", value), [[value]])[0]
        return self.tensors[key]

    def mask(self, device: torch.device, mask: torch.Tensor, spans: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A mask of the step and its spans in the workspace (:meth:`DecodeWorkspace.mask`), copied once per step, each
        mask in a slot of its own in the order the step meets them (row groups of one batch size attend with masks
        of their own: their lengths differ by their pads)."""
        key = ("mask", id(mask))
        if key not in self.tensors:
            slot = self.slots.get(("mask", torch.device(device)), 0)
            self.slots[("mask", torch.device(device))] = slot + 1
            self.tensors[key] = (mask, self.workspace.mask(device, slot, mask, spans))  # (mask kept: its id stays its own)
        return self.tensors[key][1]
