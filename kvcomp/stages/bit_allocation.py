"""kvtc's quantization types and its dynamic-programming bit allocation (kvtc spec §3.5, K5, K6, K8, K9).

PCA coefficients of one token (a row of ``P [N, r]``, leading components first) are coded in contiguous
groups. Every group has a type and a per-row 16-bit shift and scale (32 bits per group and row, K5):

- ``none``: the coefficients are dropped (0 bits, no shift/scale);
- ``int2`` / ``int4``: min-max uniform, ``shift = min``, ``scale = (max - min) / (2^b - 1)`` (KIVI's scheme);
- ``fp8``: E4M3 of ``(x - shift) / scale`` with ``shift = (max + min) / 2``, ``scale = (max - min) / (2 * 448)``;
- ``fp16``: the coefficients themselves in fp16, no shift/scale (16 bits each): kvtc-DPQ's pure PCA
  truncation (Table 15), never offered to the DP.

Shift and scale are rounded to fp16 before coding, as they will be stored (spec §5.2).

:func:`allocate` chooses the groups (sizes ``1, 16, 64, 256, 1024``) and types that minimise the squared
error ``|P - P_hat|_F^2`` under a budget of ``B`` bits per row. Since the PCA basis is orthonormal, this is
the error in feature space too (Eq. 5). ``E[i, b]`` is the least error when only the first ``i``
coefficients may be kept, using at most ``b`` bits:

    E[0, b] = |P|^2
    E[i, b] = min over (s, t) with s <= i and cost(s, t) <= b of  E[i - s, b - cost(s, t)] + delta(i, s, t),
              and E[i, b - 1]
    cost(s, none) = 0,  cost(s, t) = s * bits(t) + 32,  delta(i, s, t) = |Q_t(P_blk) - P_blk|^2 - |P_blk|^2

with ``P_blk = P[:, i - s : i]``. Every cost is even, so the budget runs in 2-bit units (exact, K8).

The deltas do not depend on the budget: :func:`group_errors` simulates them once (the expensive part,
``O(r * N * sum(S))``) and :func:`allocate_from` runs the DP for any budget from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TYPE_BITS = {"none": 0, "int2": 2, "int4": 4, "fp8": 8, "fp16": 16}
DP_TYPES = ("none", "int2", "int4", "fp8")
GROUP_SIZES = (1, 16, 64, 256, 1024)
GROUP_OVERHEAD_BITS = 32  # fp16 shift + fp16 scale per group and row
FP8_MAX = 448.0  # largest E4M3 value


def group_codes(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, shift, scale)`` of ``x [N, s]`` coded as one group per row (``kind`` not ``none``): integer
    codes as uint8 (fp8: ``float8_e4m3fn``), fp16 shift and scale ``[N, 1]``."""
    x = x.float()
    if kind == "fp16":
        empty = x.new_zeros(x.shape[0], 0, dtype=torch.float16)
        return x.half(), empty, empty
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    tiny = torch.finfo(torch.float16).tiny
    if kind == "fp8":
        shift, scale = ((hi + lo) / 2).half(), ((hi - lo) / (2 * FP8_MAX)).half().clamp_min(tiny)
        return ((x - shift.float()) / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), shift, scale
    levels = 2 ** TYPE_BITS[kind] - 1
    shift, scale = lo.half(), ((hi - lo) / levels).half().clamp_min(tiny)
    codes = torch.round((x - shift.float()) / scale.float()).clamp(0, levels).to(torch.uint8)
    return codes, shift, scale


def group_values(codes: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`group_codes` (float32)."""
    if codes.dtype == torch.float16:
        return codes.float()
    return codes.float() * scale.float() + shift.float()


def quantize_group(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The reconstruction of ``x [N, s]`` coded as one group per row with type ``kind`` (float32)."""
    if kind == "none":
        return torch.zeros_like(x, dtype=torch.float32)
    return group_values(*group_codes(x, kind))


def group_cost(size: int, kind: str, overhead: int = GROUP_OVERHEAD_BITS) -> int:
    """Bits per row of one group."""
    if kind in ("none", "fp16"):
        return size * TYPE_BITS[kind]
    return size * TYPE_BITS[kind] + overhead


@dataclass(frozen=True)
class Plan:
    """Groups ``(start, end, type)`` covering ``[0, r)`` in order; ``error``: the DP's squared error on its data."""

    groups: tuple[tuple[int, int, str], ...]
    error: float

    @property
    def width_used(self) -> int:
        """Coefficients up to the last kept group (the rest are dropped: projection and reconstruction skip them)."""
        return max((end for _, end, kind in self.groups if kind != "none"), default=0)

    @property
    def bits(self) -> int:
        """Bits per row (codes plus per-group shift and scale)."""
        return sum(group_cost(end - start, kind) for start, end, kind in self.groups)

    def apply(self, p: torch.Tensor) -> torch.Tensor:
        """The reconstruction of ``p [N, r]`` under this plan."""
        return torch.cat([quantize_group(p[:, start:end], kind) for start, end, kind in self.groups], dim=1)


def _squared_error(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``(quantize_group(x, kind) - x)^2`` with the same float32 operations, in place on one buffer (the DP's
    simulation; :func:`quantize_group` is the reference, checked equal in the tests)."""
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    tiny = torch.finfo(torch.float16).tiny
    if kind == "fp8":
        shift, scale = ((hi + lo) / 2).half().float(), ((hi - lo) / (2 * FP8_MAX)).half().clamp_min(tiny).float()
        y = (x - shift).div_(scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    else:
        levels = 2 ** TYPE_BITS[kind] - 1
        shift, scale = lo.half().float(), ((hi - lo) / levels).half().clamp_min(tiny).float()
        y = (x - shift).div_(scale).round_().clamp_(0, levels)
    return y.mul_(scale).add_(shift).sub_(x).square_()


def block_deltas(p: torch.Tensor, size: int, kind: str, chunk_values: int = 1 << 19) -> torch.Tensor:
    """``delta`` of every group of ``size`` consecutive coefficients of ``p [N, r]`` with type ``kind``: float64
    ``[r - size + 1]``, entry ``j`` for the group starting at ``j`` (quantized error minus its energy; 0 for
    ``none``). Computed for all starts at once, in chunks of about ``chunk_values`` values; the quantization
    runs in float32 as in coding, the sums in float64."""
    starts = p.shape[1] - size + 1
    out = torch.zeros(starts, dtype=torch.float64)
    if kind == "none" or starts <= 0:
        return out
    p = p.float()
    energy = torch.cat([p.new_zeros(1, dtype=torch.float64), p.double().square().sum(0).cumsum(0)])
    step = max(1, chunk_values // (p.shape[0] * size))
    for first in range(0, starts, step):
        blocks = p[:, first:min(starts, first + step) + size - 1].unfold(1, size, 1)  # [N, n, size]
        flat = blocks.reshape(-1, size)
        out[first:first + blocks.shape[1]] = _squared_error(flat, kind).view(blocks.shape).sum(dim=(0, 2), dtype=torch.float64)
    return out - (energy[size:] - energy[:-size])


@dataclass(frozen=True)
class GroupErrors:
    """What the DP needs from its data: ``energy = |P|^2`` and, per ``(size, type)`` choice, the ``delta`` of
    the group at every start (``deltas[c, j]``; 0 where the group does not fit, never read)."""

    choices: tuple[tuple[int, str], ...]
    energy: float
    deltas: torch.Tensor  # float64 [len(choices), r]

    @property
    def width(self) -> int:
        return self.deltas.shape[1]


def group_errors(p: torch.Tensor, sizes=GROUP_SIZES, kinds=DP_TYPES) -> GroupErrors:
    """Simulate every group of ``p [N, r]`` (each allowed size, each kept type) once."""
    if not set(kinds) <= set(DP_TYPES):
        raise ValueError(f"the DP chooses among {DP_TYPES}, got {kinds}")
    choices = tuple((s, k) for s in sizes for k in kinds if k != "none") + ((1, "none"),)
    r = p.shape[1]
    deltas = torch.zeros(len(choices), r, dtype=torch.float64)
    for index, (size, kind) in enumerate(choices):
        if size <= r:
            deltas[index, : r - size + 1] = block_deltas(p, size, kind)
    return GroupErrors(choices, p.double().square().sum().item(), deltas)


def allocate(p: torch.Tensor, budget_bits: int, sizes=GROUP_SIZES, kinds=DP_TYPES,
             overhead: int = GROUP_OVERHEAD_BITS) -> Plan:
    """The error-minimising plan for the rows of ``p [N, r]`` within ``budget_bits`` bits per row."""
    return allocate_from(group_errors(p, sizes, kinds), budget_bits, overhead)


def allocate_from(errors: GroupErrors, budget_bits: int, overhead: int = GROUP_OVERHEAD_BITS) -> Plan:
    """The DP of the module docstring over precomputed :class:`GroupErrors`, for ``budget_bits`` bits per row."""
    r, units, choices = errors.width, budget_bits // 2, errors.choices
    costs = [group_cost(s, k, overhead) // 2 for s, k in choices]
    if any(group_cost(s, k, overhead) % 2 for s, k in choices):
        raise ValueError("every group cost must be even (the budget runs in 2-bit units)")
    deltas = errors.deltas.tolist()
    table = torch.empty(r + 1, units + 1, dtype=torch.float64)
    table[0] = errors.energy
    pointer = torch.full((r + 1, units + 1), -1, dtype=torch.int16)
    best = torch.empty(units + 1, dtype=torch.float64)
    choice = torch.empty(units + 1, dtype=torch.int16)
    for i in range(1, r + 1):
        best.fill_(float("inf"))
        choice.fill_(-1)
        for index, ((size, _), cost) in enumerate(zip(choices, costs)):
            if size > i or cost > units:
                continue
            candidate = table[i - size, : units + 1 - cost] + deltas[index][i - size]
            better = candidate < best[cost:]
            best[cost:] = torch.where(better, candidate, best[cost:])
            choice[cost:][better] = index
        carried_best, carried = torch.cummin(best, dim=0)  # "at most b bits": the best of any smaller budget
        table[i], pointer[i] = carried_best, choice[carried]
    groups, i, b = [], r, units
    while i > 0:
        index = int(pointer[i, b])
        size, kind = choices[index]
        groups.append((i - size, i, kind))
        i, b = i - size, b - costs[index]
    return Plan(tuple(reversed(groups)), float(table[r, units]))


def truncation_plan(width: int, budget_bits: int) -> Plan:
    """kvtc-DPQ (Table 15): the leading ``budget_bits // 16`` coefficients in fp16, the rest dropped (no DP)."""
    kept = min(width, budget_bits // TYPE_BITS["fp16"])
    groups = tuple(g for g in ((0, kept, "fp16"), (kept, width, "none")) if g[1] > g[0])
    return Plan(groups, float("nan"))
