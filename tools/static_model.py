"""A static performance model of the decode kernels on an H100, from their SASS (no GPU needed).

A launch compiled for sm_90a (:mod:`tools.resources`) is disassembled with Triton's bundled
``nvdisasm`` (with source lines). The tile loop is the body of the kernel's outermost backward branch;
where a tile can take several paths (the split kernel picks a full-precision piece or the encoded
payload per tile), the blocks whose instructions come mostly from ``skip`` source functions or that hold their
global loads, and every block reachable only through them, are left out: a payload tile runs the rest (the loop's
first and last blocks always run; the scheduler hoists a few instructions of the skipped functions into shared
blocks, never a load across a branch). A kernel without a loop (the QJL score kernel: one group of keys per
program) is one tile. Its instructions are counted per warp by class (:func:`classify`).

The time of a launch comes from these per-multiprocessor terms, each over the programs the busiest
multiprocessor runs (``ceil(programs / 132)`` x tiles per program; programs resident at once: the occupancy of
the resources table). The issue, L1 and latency terms overlap only in part: the largest of them plus the other two
over the square root of the warps each scheduler holds (see "Combining the terms" below); the MUFU and DRAM terms
are bounds of their own, and the launch takes the largest of the three:

- **issue**: warp instructions / (4 schedulers x 1 instruction per cycle);
- **L1 / shared memory**: L1TEX data wavefronts / 1 per cycle. Where the lanes' addresses are known
  (:func:`accesses`: the layouts Triton chose, read from the TTGIR, and the global addresses program 0
  computes, run by Triton's interpreter on the CPU), each SASS load or store of that source line and width
  costs what its 32 lanes touch: global, one wavefront per distinct 128-byte line; shared memory, per
  128-byte phase the most distinct 4-byte words any bank holds (bank conflicts); MMA and dot-operand layouts
  are read through Triton's own conversion to linear layouts (:func:`_mma_bases`). Elsewhere (``convert_layout``
  scratch, spills) the minimum: ``ceil(32 w / 128)`` for ``w``
  bytes per lane, 1 per 8x8 matrix of LDSM, 1 per shuffle (SHFL, counted in the LSU pipe by ncu). ncu
  profiles of the earlier split and QJL kernels that ``python -m tools.kernel_model --commit`` reads found them
  L1/TEX-bound at 95-99.5 %;
- **special functions**: MUFU (exp2, sin, cos, reciprocal) at 16 lanes per cycle per SM, 2 cycles per warp
  instruction;
- **latency**: a program's warps run their tiles side by side, each tile no faster than one warp issuing its
  instructions in order and waiting for each operand (:func:`tile_cycles`): arithmetic ``ARITHMETIC_CYCLES``,
  shared memory and shuffles ``SHARED_CYCLES``, spills the same where a program's local-memory frames fit in its share
  of the L1, else ``L2_CYCLES`` (:func:`local_cycles`), MUFU and conversions ``VARIABLE_CYCLES``, ``HMMA``
  ``TENSOR_CYCLES``, a global load ``DRAM_CYCLES`` except for the lines that an earlier load of its access read in
  the same tile, ready with that load's data and no sooner than an L1 hit (``SHARED_CYCLES``;
  :func:`instruction_lines`: the code bytes of 4 tokens x 32 channels share a line, read by 32 instructions of one
  warp), and for the share of its lines an earlier tile read, which hits the L1 where the reused lines of all loads
  fit in the program's share of it, else the L2 (``L2_CYCLES``; :func:`load_cycles`, from the addresses program 0
  reads over its run); every ``BAR.SYNC``
  (Triton's cross-warp reductions and layout conversions meet there) holds the warp ``BARRIER_CYCLES``. Programs
  resident together overlap, so this term counts the busiest multiprocessor's rounds of resident programs (a
  partial last round costs a full one). ncu found the TemporalKV-2 kernel of that commit latency-bound at
  2 warps per scheduler (L1 50 % busy, 255 registers). A conditional branch over an inner loop (libdevice's
  sin/cos reducing huge arguments) is not taken (:func:`_cold_loops`);
- **DRAM**: the launch's unique payload bytes / the measured copy bandwidth (whole GPU).

Combining the terms. Where the issue, L1 and latency terms overlapped fully, a launch would take their largest;
where they did not overlap at all, their sum. With ``w`` warps per scheduler the smaller terms hide behind the other
warps' work only in part; the model adds them over ``sqrt(w)``, a choice made on two sets of measured kernels and
checked on a third (with bank conflicts counted on dot operands; ``docs/design/static-model.md``):

- the five kernels of the earlier commit (H100, 2 warps per scheduler): the largest term gave 0.30-0.97x of their
  measured times at batch 16, the sum 0.86-1.14x, this rule 0.78-1.09x;
- a later version on an H200: KIVI-2 and KIVI-4 run 4 warps per scheduler and are L1-bound (ncu: L1 91 % busy, the
  model's wavefronts within 3 % of ncu's); the sum put them at 1.31-1.44x, this rule at 1.07-1.16x; the codebook
  kernels (2 warps, latency-bound by ncu) 0.90-1.01x with it, 1.08-1.21x with the sum;
- held out, five kernels of a third version (H100): the sum 0.88-1.61x at batch 16, this rule 0.77-1.34x; every
  pair measured 5 % or more apart is ordered as measured under either.

The square root is fitted, not derived. It over-predicts a kernel that saturates the L1 (the earlier commit's QJL
scores, L1 99.5 % busy: 1.0-1.4x).

Cycles become seconds at ``CLOCK_HZ``; each launch adds ``LAUNCH_S``. A step's device time is the sum of its
launches'. A step as ``benchmarks/bench_decode_attention.py`` times it (its CUDA events recorded on an idle device,
around one call) takes its **host** time plus its device time: the device waits for the call's Python work (the
launcher building its arguments, Triton binding them and finding the compiled kernel) before its first launch runs,
and that work is nearly all before the first launch (the merge's binding overlaps the split kernel). The host term
is measured on this machine's CPU (:func:`host_seconds`) and scaled by ``HOST_FACTOR`` to the GPU machine's CPU,
which takes about twice as long for the same call (measured: the constant's entry below). (In a model's decode
loop the host runs ahead of the device, and a layer would take the larger of the two; the model predicts the
benchmark.)

Constants and their sources:

- ``SMS = 132``, ``SCHEDULERS = 4``: H100 SXM (ncu "# SMs", the sm_90 partitioning).
- ``CLOCK_HZ = 1.755e9``: the H100 SXM boosts to 1.98 GHz; ncu ran the earlier commit's kernels at 1.45-1.59 GHz
  (its locked clock); their bench times over the ncu durations (KIVI-2 10.0 / 12.2 ms, TemporalKV-2
  7.27 / 8.37 ms) put the benchmark's clock near 1.75 GHz.
- ``COPY_BYTES_PER_S = 2970e9``: the H100's measured copy bandwidth (as ``benchmarks/bench_decode_attention.py``
  measures it).
- ``L1_WAVEFRONTS_PER_CYCLE = 1``: 128 B per cycle per SM (shared memory: 32 banks x 4 B).
- ``BANKS = 32``, ``BANK_BYTES = 4``, ``LINE_BYTES = 128``: shared-memory banks and L1 cache lines of
  sm_90 (CUDA C++ Programming Guide, "Shared Memory" of compute capability 9.0; Nsight Compute's
  Profiling Guide, "Memory Tables": a wavefront is the work one cycle of the L1TEX data stage does,
  different cache lines or conflicting banks are serialised into further wavefronts).
- ``MUFU_CYCLES = 2``: 16 SFU lanes per SM (4 per partition).
- ``SHARED_CYCLES = BARRIER_CYCLES = 30``: the shared-memory and L1-hit load latency of Hopper (about 30 cycles,
  microbenchmarks, Luo et al. 2024, "Benchmarking and dissecting the Nvidia Hopper GPU architecture").
- ``ARITHMETIC_CYCLES = 4``, ``L2_CYCLES = 200``, ``DRAM_CYCLES = 400``: H100 latencies of arithmetic, L2 hits and
  global memory as tabulated for Volta, Ampere and Hopper in Ultrasonics Sonochemistry 99 (2023) 106546, table 3
  (PubMed Central PMC10448217).
- ``VARIABLE_CYCLES = 20``, ``TENSOR_CYCLES = 32``: assumed, of the order microbenchmarks report for MUFU and
  conversions (the variable-latency pipe) and for ``mma.sync`` on Ampere and Hopper; not measured here.
- ``L1_BYTES = 256 KiB``: the L1 / shared-memory array of an H100 SM (less the programs' shared memory).
- ``LAUNCH_S = 3e-6``: a kernel launch's fixed cost, on the device and in the driver.
- ``HOST_FACTOR = 1.9``: the GPU machine's host time of a call over this CPU's. On an H200 machine the median host
  ms of one call at 1 x 4K (``benchmarks/bench_decode_attention.py``'s host column,
  which includes the driver's launches, about 10 us each by ``torch.profiler``) was 0.239-0.278 for the five seed
  formats, 1.6-2.1x (mean 1.9) this CPU's fastest of ``HOST_REPEATS`` (0.125-0.151 ms). That CPU varies more than
  this one: the same KIVI-2 call took 0.26, 0.36 and 0.41 ms in three runs (``benchmarks/profile_decode_call.py``).
- ``HOST_REPEATS = 200``: calls timed for the host term, the fastest kept (other processes only add time).
"""

from __future__ import annotations

import ast
import itertools
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import kvcomp

SMS, SCHEDULERS, CLOCK_HZ, COPY_BYTES_PER_S = 132, 4, 1.755e9, 2970e9
L1_WAVEFRONTS_PER_CYCLE, MUFU_CYCLES, LAUNCH_S, HOST_FACTOR = 1.0, 2.0, 3e-6, 1.9
ARITHMETIC_CYCLES, SHARED_CYCLES, VARIABLE_CYCLES, TENSOR_CYCLES, L2_CYCLES, DRAM_CYCLES = 4.0, 30.0, 20.0, 32.0, 200.0, 400.0
BARRIER_CYCLES, L1_BYTES = SHARED_CYCLES, 256 * 1024
HOST_REPEATS = 200
WARP_LANES, WAVEFRONT_BYTES = 32, 128

CLASSES = ("global load", "global store", "shared load", "shared store", "local", "fma", "alu", "shuffle",
           "conversion", "special", "tensor", "control", "other")
_FMA = {"FFMA", "FADD", "FMUL", "FMNMX", "HFMA2", "HADD2", "HMUL2", "DFMA", "DADD", "DMUL", "FSWZADD"}
_ALU = {"IMAD", "IADD3", "IADD", "LOP3", "LOP", "SHF", "SHL", "SHR", "ISETP", "FSETP", "HSETP2", "DSETP", "SEL", "FSEL",
        "MOV", "PRMT", "LEA", "IABS", "SGXT", "IMNMX", "VIMNMX", "BMSK", "BFE", "BFI", "FLO", "POPC", "BREV", "P2R", "R2P",
        "PLOP3", "CSET", "CSETP", "IMUL", "IDP", "IDP4A", "FCHK", "VABSDIFF", "LOP32I", "IADD32I", "FADD32I",
        "FMUL32I", "FFMA32I", "IMAD32I", "ISCADD", "FMNMX3", "IMNMX3", "HMNMX2", "F2FP", "VIADD", "VIMNMX",
        "VIMNMX3", "LDC", "S2R", "CS2R", "S2UR"}
_CONVERSION = {"F2F", "F2I", "I2F", "I2FP", "F2IP", "FRND", "I2I"}
_CONTROL = {"BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "BSSY", "BSYNC", "BAR", "WARPSYNC", "BPT", "NOP",
            "DEPBAR", "LDGDEPBAR", "YIELD", "MEMBAR", "ERRBAR", "CCTL", "FENCE", "ELECT", "WARPGROUP", "ACQBULK", "SYNCS"}
_WIDTHS = {"U8": 1, "S8": 1, "8": 1, "U16": 2, "S16": 2, "16": 2, "32": 4, "64": 8, "128": 16}


def classify(opcode: str) -> tuple[str, float, int]:
    """``(class, L1TEX wavefronts, bytes per lane read from global memory)`` of one warp instruction
    (``opcode`` with its modifiers, e.g. ``LDG.E.128.CONSTANT``)."""
    base, *mods = opcode.split(".")
    width = next((_WIDTHS[m] for m in mods if m in _WIDTHS), 4)
    lanes = max(1, math.ceil(WARP_LANES * width / WAVEFRONT_BYTES))
    if base in ("LDG", "LDGSTS", "LD", "ATOMG") or base.startswith("UTMALDG"):
        return "global load", float(lanes), width
    if base in ("STG", "ST", "RED"):
        return "global store", float(lanes), 0
    if base == "LDSM":  # .1/.2/.4: that many 8x8 matrices of 16-bit values, one wavefront each
        return "shared load", float(int(mods[-1]) if mods and mods[-1] in ("1", "2", "4") else 4), 0
    if base == "LDS":
        return "shared load", float(lanes), 0
    if base in ("STS", "STSM", "ATOMS"):
        return "shared store", float(lanes), 0
    if base in ("LDL", "STL"):
        return "local", float(lanes), 0
    if base == "SHFL":
        return "shuffle", 1.0, 0
    if base in _CONVERSION:
        return "conversion", 0.0, 0
    if base == "MUFU":
        return "special", 0.0, 0
    if base in ("HMMA", "HGMMA", "IMMA", "QGMMA", "DMMA", "BMMA"):
        return "tensor", 0.0, 0
    if base in _FMA:
        return "fma", 0.0, 0
    if base in _ALU or base.startswith("U"):  # uniform datapath (ULDC, UIADD3, ...) issues like ALU
        return "alu", 0.0, 0
    if base in _CONTROL:
        return "control", 0.0, 0
    return "other", 0.0, 0


@dataclass
class Instruction:
    address: int
    opcode: str
    predicated: bool
    target: str | None  # a branch's label
    source: tuple[str, int] | None  # (file, line) of its source line
    operands: str = ""  # the text after the opcode, e.g. ``R4, R2, 0x10, RZ``
    guard: str | None = None  # a predicated instruction's predicate, e.g. ``P0``


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')


def parse_sass(text: str) -> tuple[list[Instruction], dict[str, int]]:
    """Instructions of ``nvdisasm -c -g`` output and the address of each label."""
    instructions, labels, source, pending = [], {}, None, []
    for line in text.splitlines():
        if m := _LINE.search(line):
            source = (m.group(1), int(m.group(2)))
        elif m := _LABEL.match(line.strip()):
            pending.append(m.group(1))
        elif m := _INSTRUCTION.search(line):
            address = int(m.group(1), 16)
            for label in pending:
                labels[label] = address
            pending = []
            target = re.search(r"`\((\.L_x_\d+)\)", m.group(4))
            guard = m.group(2) and m.group(2).strip().lstrip("@!")
            instructions.append(Instruction(address, m.group(3), bool(m.group(2)), target and target.group(1), source,
                                            m.group(4).strip(), guard))
    return instructions, labels


def _blocks(instructions: list[Instruction], labels: dict[str, int]) -> tuple[list[list[Instruction]], dict[int, set[int]]]:
    """Basic blocks (in address order) and the successor block indices of each."""
    leaders = {instructions[0].address} | set(labels.values())
    for a, b in zip(instructions, instructions[1:]):
        if a.opcode.split(".")[0] in ("BRA", "EXIT", "BRX", "JMP", "RET"):
            leaders.add(b.address)
    blocks = []
    for ins in instructions:
        if ins.address in leaders:
            blocks.append([])
        blocks[-1].append(ins)
    start = {block[0].address: i for i, block in enumerate(blocks)}
    successors = {}
    for i, block in enumerate(blocks):
        last, out = block[-1], set()
        base = last.opcode.split(".")[0]
        if last.target is not None and base == "BRA":
            out.add(start[labels[last.target]])
        if (base not in ("BRA", "EXIT", "RET", "BRX", "JMP") or last.predicated) and i + 1 < len(blocks):
            out.add(i + 1)
        successors[i] = out
    return blocks, successors


def _functions(path: str) -> list[tuple[int, int, str]]:
    """``(first line, last line, name)`` of every function in a source file, innermost last when sorted; none
    where the file cannot be found."""
    source = _source(path)
    if not source.exists():
        return []
    tree = ast.parse(source.read_text())
    return sorted((n.lineno, n.end_lineno, n.name) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))


def _source(path: str) -> Path:
    """The file a SASS line names, with a file of kvcomp read from the imported kvcomp package: Triton's cache is
    keyed by the kernels' sources and first lines, not by their paths, so a cubin compiled from another checkout (a
    worktree, since removed or changed) names that checkout's files for this package's lines."""
    parts = Path(path).parts
    if "kvcomp" not in parts:
        return Path(path)
    package = len(parts) - 1 - parts[::-1].index("kvcomp")
    return Path(kvcomp.__file__).resolve().parent.joinpath(*parts[package + 1:])


def _reachable(start: set[int], edges: dict[int, set[int]], allowed: set[int]) -> set[int]:
    seen, todo = set(), [s for s in start if s in allowed]
    while todo:
        i = todo.pop()
        if i not in seen:
            seen.add(i)
            todo += [j for j in edges.get(i, ()) if j in allowed and j not in seen]
    return seen


def _cold_loops(blocks: list, successors: dict, back: list, outer: tuple[int, int], body: set[int]) -> set[int]:
    """Blocks of the tile loop's ``body`` that a conditional forward branch jumps over to skip an inner loop (a slow
    path: libdevice's sin/cos reduce huge arguments in a loop over a table); the region from the branch to its
    target runs only where the branch is not taken."""
    cold = set()
    for latch, header in back:
        if (latch, header) == outer or header not in body:
            continue
        for i in sorted((i for i in body if i < header), reverse=True):  # the nearest branch over the whole loop
            last = blocks[i][-1]
            target = max(successors[i] - {i + 1}, default=-1)
            if last.predicated and last.opcode.startswith("BRA") and target > latch:
                cold |= set(range(i + 1, target)) & body
                break
    return cold


def tile_instructions(text: str, skip: tuple[str, ...] = ()) -> tuple[list[Instruction], bool]:
    """The instructions one tile runs (see the module docstring) and whether the kernel has a tile loop.
    ``skip``: source functions whose blocks a payload tile does not run."""
    instructions, labels = parse_sass(text)
    blocks, successors = _blocks(instructions, labels)
    # backward branches, but not the branch-to-itself that pads the end of every kernel
    back = [(i, j) for i, out in successors.items() for j in out if j <= i and len(blocks[i]) > 1]
    if not back:
        return instructions, False
    latch, header = max(back, key=lambda e: e[0] - e[1])  # the outermost loop
    predecessors = {}
    for i, out in successors.items():
        for j in out:
            predecessors.setdefault(j, set()).add(i)
    body = _reachable({latch}, {i: p - {header} for i, p in predecessors.items()}, set(range(len(blocks)))) | {header}
    functions = {}
    banned = set()
    for i in body - {header, latch}:  # the loop's own blocks run every tile
        skipped, loads = 0, False
        for ins in blocks[i]:
            if ins.source is None:
                continue
            path, line = ins.source
            if path not in functions:
                functions[path] = _functions(path)
            names = [name for lo, hi, name in functions[path] if lo <= line <= hi]
            if names and names[-1] in skip:
                skipped += 1
                loads |= classify(ins.opcode)[0] == "global load"
        # mostly a skipped function's (the scheduler moves a few instructions, never a load across a branch), or
        # holding its loads (a full-precision tile's scores: its loads beside the tl.dot that follows them)
        if 2 * skipped > len(blocks[i]) or loads:
            banned.add(i)
    banned |= _cold_loops(blocks, successors, back, (latch, header), body)
    allowed = body - banned
    inner = {i: successors[i] - {header} for i in allowed}
    forward = _reachable({header}, inner, allowed)
    backward = _reachable({latch}, {i: p & allowed for i, p in predecessors.items()}, allowed)
    return [ins for i in sorted(forward & backward) for ins in blocks[i]], True


def loop_local_accesses(text: str) -> tuple[int, int]:
    """Local-memory stores and loads (``STL`` / ``LDL``: a Triton kernel's register spills) among the instructions of
    its tile loop (:func:`tile_instructions`, every path): a spill outside the loop is paid once per program, one
    inside it every tile."""
    instructions, _ = tile_instructions(text)
    stores = sum(ins.opcode.startswith("STL") for ins in instructions)
    return stores, sum(ins.opcode.startswith("LDL") for ins in instructions)


@dataclass
class TileCounts:
    """Warp instructions of one tile by class, with L1TEX wavefronts and global bytes per warp."""
    classes: Counter = field(default_factory=Counter)
    wavefronts: float = 0.0
    global_bytes: int = 0  # bytes requested by the tile's global loads, per warp (lanes x width)
    widths: Counter = field(default_factory=Counter)  # global loads by bytes per lane

    barriers: int = 0
    latency: float = 0.0  # cycles of one warp's tile alone on its scheduler (:func:`tile_cycles`)

    @property
    def issued(self) -> int:
        return sum(self.classes.values())


def count(instructions: list[Instruction], found: list | None = None, loads: dict | None = None) -> TileCounts:
    """Counts of a tile's instructions; with ``found`` (:func:`accesses`), the L1 wavefronts of each memory
    instruction come from its lanes' addresses where an access of its source line matches it, and so do the lines
    of its global loads (:func:`instruction_lines`); ``loads``: the latency of global loads by source line from
    their reuse between tiles (:func:`load_cycles`)."""
    counts = TileCounts()
    cache = {}
    for ins in instructions:
        klass, wavefronts, width = classify(ins.opcode)
        if found:
            from_lanes = access_wavefronts(ins, found, cache)
            wavefronts = wavefronts if from_lanes is None else from_lanes
        counts.classes[klass] += 1
        counts.wavefronts += wavefronts
        counts.barriers += ins.opcode.startswith("BAR.SYNC")
        if width:
            counts.global_bytes += WARP_LANES * width
            counts.widths[width] += 1
    counts.latency = tile_cycles(instructions, loads, instruction_lines(instructions, found or []))
    return counts


# --- Latency: one warp's tile, issued in order, each instruction waiting for its operands -------------------------

_NO_RESULT = ("ST", "STG", "STS", "STL", "STSM", "RED", "BAR", "BRA", "BSSY", "BSYNC", "EXIT", "WARPSYNC", "NOP",
              "LDGSTS", "LDGDEPBAR", "DEPBAR", "YIELD", "MEMBAR", "FENCE", "CCTL", "ERRBAR")
_REGISTER = re.compile(r"(?<![\w.])(U?R\d+|U?P\d|PR)(\.64)?(?![\w])")
_PREDICATE = re.compile(r"U?P[0-9T]")
_WIDE_SOURCES = ("ST", "STG", "STS", "STL", "STSM", "RED", "HMMA", "DMUL", "DADD", "DFMA")


def _register_range(name: str, count: int) -> list[str]:
    if name == "PR":  # every predicate (R2P writes them, P2R reads them)
        return [f"P{i}" for i in range(7)]
    head = name.rstrip("0123456789")
    first = int(name[len(head):])
    return [f"{head}{first + i}" for i in range(count)]


def _wide(opcode: str) -> int:
    """32-bit registers of a memory instruction's data, or of a double, wide or matrix operation's result."""
    base, *mods = opcode.split(".")
    if base == "LDSM":
        return int(mods[-1]) if mods and mods[-1] in ("1", "2", "4") else 4
    if base == "HMMA":
        return 4 if "F32" in mods else 2
    if base in ("DMUL", "DADD", "DFMA", "CS2R") or "WIDE" in mods:
        return 2
    return max(1, next((_WIDTHS[m] for m in mods if m in _WIDTHS), 4) // 4)


def registers(ins: Instruction) -> tuple[list[str], list[str]]:
    """``(read, written)`` registers and predicates of one instruction, from its operand text: the destination comes
    first, then any predicates written beside it (a carry-out, a second comparison; ``SHFL`` writes a predicate and
    then a register); ``RZ``/``PT`` are constants."""
    base = ins.opcode.split(".")[0]
    operands = [o.strip() for o in ins.operands.split(",")] if ins.operands else []
    destinations = 0 if base in _NO_RESULT or not operands else 2 if base == "SHFL" else 1
    while 0 < destinations < len(operands) and _PREDICATE.fullmatch(operands[destinations]):
        destinations += 1
    wide = _wide(ins.opcode)
    read = [ins.guard] if ins.guard not in (None, "PT", "UPT") else []
    written = []
    for position, operand in enumerate(operands):
        for m in _REGISTER.finditer(operand):
            name, pair = m.groups()
            if position < destinations:
                written += _register_range(name, 1 if base == "R2P" or "P" in name else wide)
            else:  # a stored value, or a matrix or double operand, spans the instruction's width
                data = "[" not in operand and base in _WIDE_SOURCES
                read += _register_range(name, 2 if pair else wide if data else 1)
    return read, written


def result_cycles(ins: Instruction, loads: dict | None = None) -> float:
    """Cycles from an instruction's issue until its result can be read (module docstring, "latency"); ``loads``:
    ``{source line: cycles}`` of the global loads whose lines' reuse is known (:func:`load_cycles`), others miss, and
    under :data:`LOCAL` the spill loads' (:func:`local_cycles`; an L1 hit where absent)."""
    klass = classify(ins.opcode)[0]
    base = ins.opcode.split(".")[0]
    if klass == "global load":
        line = ins.source and (Path(ins.source[0]).name, ins.source[1])
        return (loads or {}).get(line, DRAM_CYCLES)
    if klass == "local":
        return (loads or {}).get(LOCAL, SHARED_CYCLES)
    if klass in ("shared load", "shuffle"):
        return SHARED_CYCLES
    if klass == "special" or base in ("F2F", "F2I", "I2F", "FRND", "I2I"):
        return VARIABLE_CYCLES
    if klass == "tensor":
        return TENSOR_CYCLES
    return ARITHMETIC_CYCLES


LOCAL = "local memory"  # the key of spill loads' latency among load_cycles' lines


def local_cycles(stack: int, threads: int, l1_bytes: float) -> float:
    """Cycles of a spill load (``LDL``): an L1 hit where a program's local-memory frames (``stack`` bytes per thread
    over its ``threads``) fit in its share of the L1 (``l1_bytes``), else an L2 hit."""
    return SHARED_CYCLES if stack * threads <= l1_bytes else L2_CYCLES


def load_cycles(recorded: dict, l1_bytes: float) -> dict:
    """``{innermost source line: cycles}`` of the global loads :func:`record_global_accesses` found: the share of
    their lines an earlier tile touched (``reuse``) hits the L1 where the reused lines of all of them fit in
    ``l1_bytes`` (else the L2), the rest misses to DRAM; a line takes the slowest of its loads."""
    loads = [(chain[0], r) for chain, r in recorded.items() if r.load]
    reused = {id(r): r.footprint for _, r in loads if r.reuse}  # a load found under several lines counted once
    hit = SHARED_CYCLES if sum(reused.values()) <= l1_bytes else L2_CYCLES
    out = {}
    for line, r in loads:
        out[line] = max(out.get(line, 0.0), r.reuse * hit + (1 - r.reuse) * DRAM_CYCLES)
    return out


def tile_cycles(instructions: list[Instruction], loads: dict | None = None, lines: dict | None = None,
                passes: int = 3) -> float:
    """Cycles one warp takes per tile when nothing else competes for its scheduler: the tile's instructions issued
    in order, one per cycle at most, each waiting until the registers and predicates it reads are ready
    (:func:`result_cycles`); ``BAR.SYNC`` holds the next issue for ``BARRIER_CYCLES``, ``DEPBAR`` until the async
    copies it waits for land. The tile is run ``passes`` times carrying what is in flight, and the last pass counted
    (a loop's steady state: a load issued for the next tile overlaps it). ``loads``: the latency of its global loads
    by source line (:func:`load_cycles`; DRAM's elsewhere); ``lines``: the lines each global load reads, by address
    (:func:`instruction_lines`): a line an earlier load of the tile read is ready when that load's data is, and
    no sooner than an L1 hit."""
    parsed = [(ins, *registers(ins), result_cycles(ins, loads), (lines or {}).get(ins.address, ()))
              for ins in instructions]
    ready, groups, pending, clock = {}, [], [], 0.0
    duration = 0.0
    for _ in range(passes):
        start, filled = clock, {}  # line -> when the load that first read it in this tile has its data
        for ins, read, written, cycles, here in parsed:
            base = ins.opcode.split(".")[0]
            issue = max([clock] + [ready.get(r, 0.0) for r in read])
            if base == "DEPBAR":  # DEPBAR.LE SB0, n: all but the newest n groups of async copies have landed
                keep = int(ins.operands.rsplit(",", 1)[-1], 0) if "," in ins.operands else 0
                issue = max([issue] + (groups[:-keep] if keep else groups))
            done = issue + cycles
            if here:
                done = max(max(issue + SHARED_CYCLES, filled.setdefault(line, done)) for line in here)
            if base == "LDGSTS":
                pending.append(done)
            elif base == "LDGDEPBAR":
                groups.append(max(pending, default=issue))
                pending = []
            for r in written:
                ready[r] = done
            clock = issue + (BARRIER_CYCLES if ins.opcode.startswith("BAR.SYNC") else 1.0)
        duration = clock - start
    return duration


def disassemble(cubin: bytes) -> str:
    """SASS with source lines of a cubin, by Triton's bundled ``nvdisasm``."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([knobs.nvidia.nvdisasm.path, "-c", "-g", str(path)], capture_output=True, text=True,
                              check=True).stdout


@dataclass
class Geometry:
    """What one launch does: ``programs`` of ``num_warps`` warps, ``resident`` of them per multiprocessor
    at once (occupancy), ``tiles`` per program, ``bytes`` of unique global memory read by the launch."""
    programs: int
    num_warps: int
    resident: int
    tiles: int
    bytes: float


def bounds(counts: TileCounts, geometry: Geometry) -> dict[str, float]:
    """Seconds of each term of one launch (module docstring) and ``time``: the largest of the issue, L1 and latency
    terms plus the other two over the square root of the warps per scheduler, or the MUFU or DRAM bound where larger,
    plus ``LAUNCH_S``."""
    per_sm = math.ceil(geometry.programs / SMS)
    warp_tiles = per_sm * geometry.tiles * geometry.num_warps
    rounds = math.ceil(per_sm / max(1, geometry.resident))
    cycles = {
        "issue": warp_tiles * counts.issued / SCHEDULERS,
        "l1": warp_tiles * counts.wavefronts / L1_WAVEFRONTS_PER_CYCLE,
        "mufu": warp_tiles * counts.classes["special"] * MUFU_CYCLES,
        "latency": rounds * geometry.tiles * counts.latency,
    }
    out = {name: c / CLOCK_HZ for name, c in cycles.items()}
    out["dram"] = geometry.bytes / COPY_BYTES_PER_S
    terms = [out["issue"], out["l1"], out["latency"]]
    hidden = math.sqrt(max(1.0, geometry.resident * geometry.num_warps / SCHEDULERS))  # sqrt(warps per scheduler)
    out["time"] = max(max(terms) + (sum(terms) - max(terms)) / hidden, out["mufu"], out["dram"]) + LAUNCH_S
    return out


def host_seconds(call) -> float:
    """The host term of a step (module docstring): the fastest of :data:`HOST_REPEATS` runs of ``call`` on this CPU,
    after one untimed run (which compiles)."""
    call()
    fastest = math.inf
    for _ in range(HOST_REPEATS):
        begin = time.perf_counter()
        call()
        fastest = min(fastest, time.perf_counter() - begin)
    return fastest


def step_seconds(launches: list[dict], host: float) -> float:
    """A timed step (module docstring): its ``host`` seconds (this CPU's, scaled by ``HOST_FACTOR``), then its
    launches' device times (:func:`bounds`) in sequence."""
    return HOST_FACTOR * host + sum(found["time"] for found in launches)


# --- Per-lane addresses: L1 wavefronts of each access from the layouts Triton chose ---------------------------

BANKS, BANK_BYTES, LINE_BYTES = 32, 4, 128


def global_wavefronts(addresses, width: int) -> int:
    """L1TEX wavefronts of one warp's global access: one per distinct 128-byte line the active lanes' bytes
    ``[address, address + width)`` touch (``addresses``: ``(lane, byte address)`` of the active lanes)."""
    lines = {a // LINE_BYTES for _, a in addresses} | {(a + width - 1) // LINE_BYTES for _, a in addresses}
    return max(1, len(lines))


def shared_wavefronts(addresses, width: int) -> int:
    """Shared-memory wavefronts of one warp's access of ``width`` bytes per lane: lanes are served in phases
    of 128 bytes (32 lanes up to 4 B, 16 lanes at 8 B, 8 at 16 B); a phase takes as many wavefronts as the
    most distinct 4-byte words any one of the 32 banks holds (lanes reading the same word share it)."""
    per_phase = WARP_LANES * BANK_BYTES // max(width, BANK_BYTES)
    total = 0
    for start in range(0, WARP_LANES, per_phase):
        banks: dict[int, set[int]] = {}
        for lane, a in addresses:
            if start <= lane < start + per_phase:
                for word in range(a // BANK_BYTES, (a + max(width, 1) - 1) // BANK_BYTES + 1):
                    banks.setdefault(word % BANKS, set()).add(word)
        total += max((len(words) for words in banks.values()), default=0)
    return max(1, total)


_LAYOUT = re.compile(r"^(#[\w.]+) = (#ttg\.\w+<\{.*\}>)\s*$", re.M)
_LOC = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$", re.M)


def _fields(text: str) -> dict:
    """``{name: value}`` of a layout attribute's ``{a = 1, b = [1, 2], c = #parent}`` (lists as lists)."""
    out = {}
    for name, value in re.findall(r"(\w+) = (\[\[.*?\]\]|\[\]|\[[^\[\]]*\]|#[\w.]+|\d+)", text):
        out[name] = ast.literal_eval(value) if value[0] in "[0123456789" else value
    return out


def _bases(layout: str, shape: tuple, aliases: dict) -> dict | None:
    """``{register, lane, warp}`` bases (element offsets per bit of the index, Triton's linear layouts) of a
    distributed ``layout`` over a tensor of ``shape``; ``None`` for layouts not modelled."""
    layout = aliases.get(layout, layout)
    f = _fields(layout)
    rank = len(shape)
    if layout.startswith("#ttg.slice"):
        dim = f["dim"]
        parent = _bases(f["parent"], shape[:dim] + (1,) + shape[dim:], aliases)
        return parent and {k: [b[:dim] + b[dim + 1:] for b in v] for k, v in parent.items()}
    if layout.startswith("#ttg.linear"):
        return {k: f[k] for k in ("register", "lane", "warp")}
    if layout.startswith(("#ttg.nvidia_mma", "#ttg.dot_op")):
        return _mma_bases(layout, shape, aliases)
    if not layout.startswith("#ttg.blocked"):
        return None
    out = {"register": [], "lane": [], "warp": []}

    def unit(d, n):
        return [n % shape[d] if i == d else 0 for i in range(rank)]  # past the shape: broadcast (offset 0)

    for kind, sizes, below in (("register", f["sizePerThread"], [1] * rank),
                               ("lane", f["threadsPerWarp"], f["sizePerThread"]),
                               ("warp", f["warpsPerCTA"], [s * t for s, t in zip(f["sizePerThread"], f["threadsPerWarp"])])):
        for d in f["order"]:
            out[kind] += [unit(d, below[d] << k) for k in range(int(math.log2(sizes[d])))]
    for d in f["order"]:  # repetitions of the CTA tile are further registers
        tile = f["sizePerThread"][d] * f["threadsPerWarp"][d] * f["warpsPerCTA"][d]
        out["register"] += [unit(d, tile << k) for k in range(max(0, int(math.log2(shape[d] / tile))))]
    return out


_LINEAR_LAYOUTS = """
import json, sys
from triton._C.libtriton import gluon_ir, ir
context = ir.context()
ir.load_dialects(context)
builder = gluon_ir.GluonOpBuilder(context)
def attribute(spec):
    if spec["kind"] == "mma":
        return builder.get_mma_layout(spec["version"], spec["warps"], [], spec["instr"])
    return builder.get_dot_operand_layout(spec["op"], attribute(spec["parent"]), spec["k_width"])
out = []
for spec, shape in json.load(sys.stdin):
    linear = builder.to_linear_layout(attribute(spec), shape)
    out.append({"register": linear.reg_bases, "lane": linear.lane_bases, "warp": linear.warp_bases})
print(json.dumps(out))
"""
_CONVERTED: dict = {}  # (spec, shape) -> bases, from Triton's conversion


def _mma_spec(layout: str, aliases: dict) -> dict | None:
    """An ``nvidia_mma`` layout, or a ``dot_op`` layout of one, as the arguments of Triton's builders; ``None`` for
    another parent."""
    layout = aliases.get(layout, layout)
    f = _fields(layout)
    if layout.startswith("#ttg.nvidia_mma"):
        return {"kind": "mma", "version": [f["versionMajor"], f["versionMinor"]], "warps": f["warpsPerCTA"],
                "instr": f["instrShape"]}
    parent = _mma_spec(f["parent"], aliases) if layout.startswith("#ttg.dot_op") else None
    return parent and {"kind": "dot", "op": f["opIdx"], "k_width": f["kWidth"], "parent": parent}


def _mma_key(layout: str, shape, aliases: dict) -> tuple | None:
    """The key of an MMA or dot-operand layout over ``shape`` among the converted ones; ``None`` for another layout."""
    spec = _mma_spec(layout, aliases)
    return None if spec is None else (json.dumps(spec, sort_keys=True), tuple(shape))


def convert_mma_layouts(requests) -> None:
    """Convert ``(layout, shape, aliases)`` requests of MMA and dot-operand layouts to linear layouts with Triton's own
    ``to_linear_layout`` (its Gluon builder; Triton 3.6 and 3.9), in one subprocess: 3.9's conversion leaves binding
    objects that nanobind reports at the interpreter's exit. Results are kept for :func:`_mma_bases`."""
    pending = []
    for request in requests:
        key = _mma_key(*request)
        if key is not None and key not in _CONVERTED and key not in pending:
            pending.append(key)
    if not pending:
        return
    done = subprocess.run([sys.executable, "-c", _LINEAR_LAYOUTS], capture_output=True, text=True, check=True,
                          input=json.dumps([[json.loads(spec), list(shape)] for spec, shape in pending]))
    _CONVERTED.update(zip(pending, json.loads(done.stdout.strip().splitlines()[-1])))


def _mma_bases(layout: str, shape: tuple, aliases: dict) -> dict | None:
    """Bases of an ``nvidia_mma`` layout or a ``dot_op`` layout of one (:func:`convert_mma_layouts`); ``None`` for
    another parent."""
    key = _mma_key(layout, shape, aliases)
    if key is None:
        return None
    if key not in _CONVERTED:
        convert_mma_layouts([(layout, shape, aliases)])
    return _CONVERTED[key]


def _mma_requests(layout: str, shape: tuple, aliases: dict):
    """The ``(layout, shape, aliases)`` of the MMA or dot-operand layouts :func:`_bases` meets for ``layout``."""
    resolved = aliases.get(layout, layout)
    if resolved.startswith("#ttg.slice"):
        dim = _fields(resolved)["dim"]
        yield from _mma_requests(_fields(resolved)["parent"], shape[:dim] + (1,) + shape[dim:], aliases)
    elif resolved.startswith(("#ttg.nvidia_mma", "#ttg.dot_op")):
        yield layout, shape, aliases


def _coordinates(bases: dict, rank: int, warps: int) -> list:
    """``[warp][lane][register]`` element coordinates of a layout given by its bases."""
    def combine(names_bits):
        out = [0] * rank
        for name, index in names_bits:
            for bit, basis in enumerate(bases[name]):
                if index >> bit & 1:
                    out = [o ^ b for o, b in zip(out, basis)]
        return tuple(out)

    registers = 1 << len(bases["register"])
    return [[[combine((("warp", w), ("lane", lane), ("register", r))) for r in range(registers)]
             for lane in range(WARP_LANES)] for w in range(warps)]


def _shared_offset(layout: str, shape: tuple, element: int, aliases: dict):
    """Byte offset of tensor coordinates in a ``swizzled_shared`` buffer (``None`` for other shared layouts):
    the row (slowest dim) picks a phase ``(row // perPhase) % maxPhase`` that XORs the ``vec``-element groups."""
    layout = aliases.get(layout, layout)
    if not layout.startswith("#ttg.swizzled_shared"):
        return None
    f = _fields(layout)
    order = f["order"]

    def offset(coords):
        inner = coords[order[0]]
        outer = 0
        for d in reversed(order[1:]):
            outer = outer * shape[d] + coords[d]
        phase = (outer // f["perPhase"]) % f["maxPhase"]
        inner = ((inner // f["vec"]) ^ phase) * f["vec"] + inner % f["vec"]
        return (outer * shape[order[0]] + inner) * element
    return offset


@dataclass
class Access:
    """One memory operation of the TTGIR: its ``kind`` (``global load``, ``async copy``, ``global store``,
    ``shared load``, ``shared store``), innermost source ``line`` (file name, line), element bytes, the
    element coordinates each lane holds (``[warp][lane][register]``) and the byte address of coordinates
    (``address``), with ``active`` the coordinates of unmasked elements (``None``: all)."""
    kind: str
    line: tuple[str, int]
    element: int
    lanes: list
    address: object
    active: object = None

    def _instructions(self, width: int) -> range | None:
        """The first register of each instruction when each moves ``width`` bytes per lane (``None`` where that width
        does not split this layout's registers)."""
        vec = width // self.element
        registers = len(self.lanes[0][0])
        return None if vec < 1 or registers % vec else range(0, registers, vec)

    def per_instruction(self, width: int, shared: bool) -> tuple[float, int] | None:
        """``(wavefronts, instructions)`` per warp when each instruction moves ``width`` bytes per lane
        (``None`` where that width does not split this layout's registers)."""
        starts = self._instructions(width)
        if starts is None:
            return None
        wavefronts, instructions = 0, 0
        for warp in self.lanes:
            for r in starts:
                lanes = [(lane, self.address(held[r])) for lane, held in enumerate(warp)
                         if self.active is None or self.active(held[r])]
                if not lanes:
                    continue
                instructions += 1
                wavefronts += (shared_wavefronts if shared else global_wavefronts)(lanes, width)
        return wavefronts / len(self.lanes), instructions // len(self.lanes)

    def warp_lines(self, width: int) -> list[frozenset] | None:
        """The 128-byte lines each instruction of the first warp reads when each moves ``width`` bytes per lane, in
        register order (``None`` as :meth:`per_instruction`)."""
        starts = self._instructions(width)
        if starts is None:
            return None
        return [frozenset(self.address(held[r]) // LINE_BYTES for held in self.lanes[0]
                          if self.active is None or self.active(held[r])) for r in starts]


_TYPE = re.compile(r"tensor<([\dx]+)x(!tt\.ptr<)?(\w+)>?, (#[^>]*?>|#[\w.]+)>")
_MEMDESC = re.compile(r"memdesc<([\dx]+)x(\w+), (#[\w.]+)")
_BITS = {"i1": 8, "i8": 8, "i16": 16, "i32": 32, "i64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
         "f8E4M3FN": 8, "f8E5M2": 8}


def ttgir_locations(ttgir: str) -> dict:
    """``{#locN: ((file name, line), ...)}``: each location's call chain of source lines, innermost first."""
    raw = dict(_LOC.findall(ttgir))
    out = {}

    def chain(text: str) -> tuple:
        text = text.strip()
        if m := re.fullmatch(r'"([^"]+)":(\d+):\d+', text):
            return ((Path(m.group(1)).name, int(m.group(2))),)
        if m := re.fullmatch(r"callsite\((#loc\d*) at (#loc\d*)\)", text):
            return resolve(m.group(1)) + resolve(m.group(2))
        if m := re.fullmatch(r'"[^"]*"\((#loc\d*)\)', text):
            return resolve(m.group(1))
        return ()

    def resolve(name: str) -> tuple:
        if name not in out:
            out[name] = ()
            out[name] = chain(raw.get(name, ""))
        return out[name]

    for name in raw:
        resolve(name)
    return out


def ttgir_memory_ops(ttgir: str) -> list[dict]:
    """Memory operations of a TTGIR module: ``kind``, ``chain`` (source lines, innermost first), ``shape``,
    ``element`` bytes, register ``layout`` and, for shared memory, the ``shared`` layout."""
    aliases = dict(_LAYOUT.findall(ttgir))
    locations = ttgir_locations(ttgir)
    out = []
    for line in ttgir.splitlines():
        op = re.search(r"= (tt\.load|ttg\.async_copy_global_to_local|ttg\.local_load|ttg\.local_alloc) |^\s*(tt\.store|ttg\.local_store) ",
                       line)
        loc = re.search(r"loc\((#loc\d*)\)\s*$", line)
        tensor = _TYPE.search(line)
        if not op or not loc or not tensor:
            continue
        name = op.group(1) or op.group(2)
        shape = tuple(int(n) for n in tensor.group(1).split("x"))
        element = _BITS.get(tensor.group(3), 32) // 8
        found = {"chain": locations.get(loc.group(1), ()), "shape": shape, "element": element,
                 "layout": tensor.group(4), "aliases": aliases}
        memdesc = _MEMDESC.search(line)
        if name in ("tt.load", "tt.store", "ttg.async_copy_global_to_local"):
            found["kind"] = {"tt.load": "global load", "tt.store": "global store"}.get(name, "async copy")
        elif memdesc:
            found.update(kind="shared load" if name == "ttg.local_load" else "shared store", shared=memdesc.group(3))
        else:
            continue  # an allocation without a value
        out.append(found)
    return out


class Recorded(NamedTuple):
    """A global load or store of one source call chain, as program 0 ran it (:func:`record_global_accesses`)."""
    offsets: object  # byte offsets of its first run, from the start of each argument tensor's storage
    mask: object
    load: bool
    reuse: float  # the share of the 128-byte lines its later runs (tiles) touched that an earlier run had touched
    footprint: int  # bytes of the distinct lines it touched over the program's run


def record_global_accesses(launch) -> dict:
    """``{chain: Recorded}`` of each source call chain's global loads and stores in program 0 of ``launch``, run on
    the CPU by Triton's interpreter (a GPU allocation aligns each storage to 256 bytes; chain: innermost source
    line first; a call over several lines is found under each line Triton may locate it at)."""
    import numpy as np
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    import triton.language as tl

    storages = sorted({t.untyped_storage().data_ptr() for t in launch.tensors()})
    interpreting = tl.constexpr(True)
    starts = np.array(storages, dtype=np.uint64)
    swapped = []

    class Device(interpreter.InterpretedFunction):  # a device function call that undoes its patches of tl
        def __call__(self, *args, **kwargs):
            scope = interpreter._patch_lang(self.fn)
            try:
                return self.rewrite()(*args, **kwargs)
            finally:
                scope.restore()

    def interpret(scope: dict):  # every @triton.jit function a kernel reaches, interpreted for this run
        if "INTERPRETED" in scope and scope["INTERPRETED"] is not interpreting:  # (tiles_triton's: the branches of
            swapped.append((scope, "INTERPRETED", scope["INTERPRETED"]))  # PTX the interpreter cannot run; they load
            scope["INTERPRETED"] = interpreting  # what the compiled code loads)
        for name, value in list(scope.items()):
            if isinstance(value, JITFunction):
                swapped.append((scope, name, value))
                scope[name] = Device(value.fn)
                interpret(value.fn.__globals__)

    found, lines = {}, {}
    builder = interpreter.interpreter_builder

    positions, pointers = {}, {}  # code object -> its instructions' source positions; file -> its calls' pointer lines

    def pointer_line(file: str, position: tuple) -> int | None:  # a call's first argument's first line
        if file not in pointers:
            pointers[file] = {(n.lineno, n.end_lineno, n.col_offset, n.end_col_offset): (n.args or [n])[0].lineno
                              for n in ast.walk(ast.parse(Path(file).read_text())) if isinstance(n, ast.Call)}
        return pointers[file].get(position)

    def chain():  # each frame's file and the lines of its running call, where Triton may locate what it compiles to
        frames, frame = [], sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            if code.co_filename in files:
                if code not in positions:
                    positions[code] = list(code.co_positions())
                position = positions[code][frame.f_lasti // 2]
                # a call over several lines: Triton 3.9 locates it at its first line, 3.6 a load or store at its
                # pointer argument's first line and a device function's call where its last argument ends
                lines = {position[0], position[1], pointer_line(code.co_filename, position) if not frames else None}
                frames.append((Path(code.co_filename).name, tuple(sorted(n for n in lines if n)) or (frame.f_lineno,)))
            frame = frame.f_back
        return tuple(frames)

    def offsets(ptrs):
        data = ptrs.data.astype(np.uint64)
        return (data - starts[np.searchsorted(starts, data, side="right") - 1]).astype(np.int64)

    load, store = builder.create_masked_load, builder.create_masked_store
    patch_tensor = interpreter._patch_lang_tensor

    def patched_tensor(tensor, scope):  # NumPy 2.3+ refuses int() of a one-element array (Triton 3.6's __index__)
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def record(ptrs, mask, load: bool):
        here, active = chain(), mask.data.astype(bool)
        if here not in found:
            found[here] = (offsets(ptrs), active, load)
        data = ptrs.data[active].astype(np.uint64)  # lines as a GPU allocation aligns them: (storage, offset // 128)
        storage = np.searchsorted(starts, data, side="right") - 1
        touched = set(zip(storage.tolist(), ((data - starts[storage]) // LINE_BYTES).tolist()))
        seen, hits, later = lines.setdefault(here, [set(), 0, 0])
        if seen:  # a later run of this access (the next tile): its lines already read count as hits
            lines[here][1:] = [hits + len(touched & seen), later + len(touched)]
        seen |= touched

    def recorded_load(ptrs, mask, *rest):
        record(ptrs, mask, True)
        return load(ptrs, mask, *rest)

    def recorded_store(ptrs, value, mask, *rest):
        record(ptrs, mask, False)
        return store(ptrs, value, mask, *rest)

    import importlib

    importlib.import_module("triton.experimental.gluon")  # imported lazily by the interpreter; needs tl.standard jitted

    def interpreted(value):  # launch arguments, their device functions (a format's) interpreted for this run
        if isinstance(value, JITFunction):
            interpret(value.fn.__globals__)
            return Device(value.fn)
        if isinstance(value, tuple):
            items = [interpreted(v) for v in value]
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        return value

    for scope in (vars(tl), vars(tl.standard), vars(tl.math), launch.kernel.fn.__globals__):
        interpret(scope)
    args = {name: interpreted(value) for name, value in launch.args.items()}
    files = {fn.fn.__code__.co_filename for _, _, fn in swapped
             if isinstance(fn, JITFunction) and "triton" not in Path(fn.fn.__code__.co_filename).parts}
    files.add(launch.kernel.fn.__code__.co_filename)
    builder.create_masked_load, builder.create_masked_store = recorded_load, recorded_store
    interpreter._patch_lang_tensor = patched_tensor
    try:
        interpreter.InterpretedFunction(launch.kernel.fn)[(1, 1, 1)](**args)
    finally:
        builder.create_masked_load, builder.create_masked_store = load, store
        interpreter._patch_lang_tensor = patch_tensor
        for scope, name, value in swapped:
            scope[name] = value
    out = {}
    for here, (offsets, mask, load) in found.items():
        recorded = Recorded(offsets, mask, load, lines[here][1] / lines[here][2] if lines[here][2] else 0.0,
                            len(lines[here][0]) * LINE_BYTES)
        for located in itertools.product(*[[(name, line) for line in candidates] for name, candidates in here]):
            out[located] = recorded
    return out


def accesses(launch, compiled, recorded: dict | None = None) -> list[Access]:
    """The memory accesses of a compiled launch whose lanes' addresses are known: global loads and stores
    of a blocked (or sliced, or linear) layout, addressed as program 0 of ``launch`` addresses them
    (:func:`record_global_accesses`), and shared-memory loads and stores between such a layout and a
    swizzled buffer, including MMA and dot-operand layouts; ``convert_layout`` scratch is not modelled."""
    warps = compiled.metadata.num_warps
    recorded = record_global_accesses(launch) if recorded is None else recorded
    out = []
    ops = ttgir_memory_ops(compiled.asm["ttgir"])
    convert_mma_layouts([r for op in ops for r in _mma_requests(op["layout"], op["shape"], op["aliases"])])
    for op in ops:
        bases = _bases(op["layout"], op["shape"], op["aliases"])
        if bases is None or not op["chain"]:
            continue
        lanes = _coordinates(bases, len(op["shape"]), warps)
        if op["kind"].startswith("shared"):
            offset = _shared_offset(op["shared"], op["shape"], op["element"], op["aliases"])
            if offset is not None:
                out.append(Access(op["kind"], op["chain"][0], op["element"], lanes, offset))
        elif op["chain"] in recorded:
            offsets, mask = recorded[op["chain"]][:2]
            if offsets.shape == op["shape"]:
                out.append(Access(op["kind"], op["chain"][0], op["element"], lanes,
                                  lambda c, o=offsets: int(o[c]), lambda c, m=mask: bool(m[c])))
    return out


_ACCESS_KIND = {"LDG": "global load", "LDGSTS": "async copy", "STG": "global store", "LDS": "shared load",
                "STS": "shared store"}


def _matching(instruction: Instruction, found: list[Access]) -> tuple | None:
    """``(kind, source line, bytes per lane)`` of a SASS memory instruction and the accesses of that kind and line."""
    base, *mods = instruction.opcode.split(".")
    kind = _ACCESS_KIND.get(base)
    if kind is None or instruction.source is None:
        return None
    width = next((_WIDTHS[m] for m in mods if m in _WIDTHS), 4)
    line = (Path(instruction.source[0]).name, instruction.source[1])
    return (kind, line, width), [a for a in found if a.kind == kind and a.line == line]


def access_wavefronts(instruction: Instruction, found: list[Access], cache: dict) -> float | None:
    """Wavefronts of one SASS memory instruction from the accesses of its source line and kind moving its
    width per lane (their mean per instruction); ``None`` where no access matches."""
    matched = _matching(instruction, found)
    if matched is None:
        return None
    key, accesses_here = matched
    if key not in cache:
        found_here = [a.per_instruction(key[2], key[0].startswith("shared")) for a in accesses_here]
        found_here = [f for f in found_here if f is not None and f[1]]
        cache[key] = sum(f[0] for f in found_here) / sum(f[1] for f in found_here) if found_here else None
    return cache[key]


def instruction_lines(instructions: list[Instruction], found: list[Access]) -> dict:
    """``{address: lines}`` of a tile's global loads whose accesses are known: the k-th SASS load of a source line
    and width reads what the k-th instruction of its accesses does (:meth:`Access.warp_lines`, their first warp;
    lines named with the source line, so that loads of different tensors never share one)."""
    sequences, seen, out = {}, {}, {}
    for ins in instructions:
        matched = _matching(ins, found) if classify(ins.opcode)[0] == "global load" else None
        if matched is None:
            continue
        key, accesses_here = matched
        if key not in sequences:
            sequences[key] = [frozenset((key[1], line) for line in group) for a in accesses_here
                              for group in (a.warp_lines(key[2]) or [])]
        k = seen[key] = seen.get(key, -1) + 1
        if sequences[key]:
            out[ins.address] = sequences[key][k % len(sequences[key])]
    return out
