"""A static performance model of the decode kernels on an H100, from their SASS (no GPU needed).

A launch compiled for sm_90a (:mod:`kvcomp.kernels.resources`) is disassembled with Triton's bundled
``nvdisasm`` (with source lines). The tile loop is the body of the kernel's outermost backward branch;
where a tile can take several paths (today's split kernel picks a full-precision piece or the encoded
payload per tile), the blocks whose instructions come from ``skip`` source functions, and every block
reachable only through them, are left out: a payload tile runs the rest. A kernel without a loop (the
QJL score kernel: one group of keys per program) is one tile. Its instructions are counted per warp by
class (:func:`classify`).

The time of a launch is the largest of these per-multiprocessor bounds, each over the programs the
busiest multiprocessor runs (``ceil(programs / 132)`` x tiles per program; programs resident at once:
the occupancy of the resources table):

- **issue**: warp instructions / (4 schedulers x 1 instruction per cycle);
- **L1 / shared memory**: L1TEX data wavefronts / 1 per cycle. A warp's access of ``w`` bytes per lane is
  ``ceil(32 w / 128)`` wavefronts (128 B per cycle, 32 banks x 4 B; no bank conflicts assumed, so a
  lower bound), for shared memory (LDS, STS, LDSM: 1 per 8x8 matrix), global (LDG, LDGSTS, STG, atomics:
  coalesced), local memory (LDL / STL: register spills), and 1 per shuffle (SHFL, which ncu counts in the
  LSU pipe). The ncu profiles of 9c57ff6 found the split and QJL kernels L1/TEX-bound at 95-99.5 %;
- **special functions**: MUFU (exp2, sin, cos, reciprocal) at 16 lanes per cycle per SM, 2 cycles per warp
  instruction;
- **barriers**: a program's warps meet at every ``BAR.SYNC`` of the tile (Triton's cross-warp reductions
  and layout conversions go through shared memory), each wait at least a shared-memory round trip
  (``BARRIER_CYCLES``); programs resident together overlap their waits, so this bound counts the busiest
  multiprocessor's rounds of resident programs (a partial last round costs a full one);
- **DRAM**: the launch's unique payload bytes / the measured copy bandwidth (whole GPU).

Cycles become seconds at ``CLOCK_HZ``; each launch adds ``LAUNCH_S``. Constants and their sources:

- ``SMS = 132``, ``SCHEDULERS = 4``: H100 SXM (ncu "# SMs", the sm_90 partitioning).
- ``CLOCK_HZ = 1.755e9``: the H100 SXM boosts to 1.98 GHz; ncu ran the 9c57ff6 kernels at 1.45-1.59 GHz
  (its locked clock); their bench times over the ncu durations (KIVI-2 10.0 / 12.2 ms, TemporalKV-2
  7.27 / 8.37 ms) put the benchmark's clock near 1.75 GHz.
- ``COPY_BYTES_PER_S = 2970e9``: measured copy bandwidth (``gpu-evidence/README.md``).
- ``L1_WAVEFRONTS_PER_CYCLE = 1``: 128 B per cycle per SM (shared memory: 32 banks x 4 B).
- ``MUFU_CYCLES = 2``: 16 SFU lanes per SM (4 per partition).
- ``BARRIER_CYCLES = 30``: the shared-memory load latency of Hopper (about 30 cycles, microbenchmarks,
  Luo et al. 2024, "Benchmarking and dissecting the Nvidia Hopper GPU architecture").
- ``LAUNCH_S = 3e-6``: a kernel launch's fixed cost on the device (host-side Python work is not modelled).
"""

from __future__ import annotations

import ast
import math
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

SMS, SCHEDULERS, CLOCK_HZ, COPY_BYTES_PER_S = 132, 4, 1.755e9, 2970e9
L1_WAVEFRONTS_PER_CYCLE, MUFU_CYCLES, BARRIER_CYCLES, LAUNCH_S = 1.0, 2.0, 30.0, 3e-6
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
            instructions.append(Instruction(address, m.group(3), bool(m.group(2)), target and target.group(1), source))
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
    """``(first line, last line, name)`` of every function in a source file, innermost last when sorted."""
    tree = ast.parse(Path(path).read_text())
    return sorted((n.lineno, n.end_lineno, n.name) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))


def _reachable(start: set[int], edges: dict[int, set[int]], allowed: set[int]) -> set[int]:
    seen, todo = set(), [s for s in start if s in allowed]
    while todo:
        i = todo.pop()
        if i not in seen:
            seen.add(i)
            todo += [j for j in edges.get(i, ()) if j in allowed and j not in seen]
    return seen


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
    for i in body:
        for ins in blocks[i]:
            if ins.source is None:
                continue
            path, line = ins.source
            if path not in functions:
                functions[path] = _functions(path) if Path(path).exists() else []
            names = [name for lo, hi, name in functions[path] if lo <= line <= hi]
            if names and names[-1] in skip:
                banned.add(i)
    allowed = body - banned
    inner = {i: successors[i] - {header} for i in allowed}
    forward = _reachable({header}, inner, allowed)
    backward = _reachable({latch}, {i: p & allowed for i, p in predecessors.items()}, allowed)
    return [ins for i in sorted(forward & backward) for ins in blocks[i]], True


@dataclass
class TileCounts:
    """Warp instructions of one tile by class, with L1TEX wavefronts and global bytes per warp."""
    classes: Counter = field(default_factory=Counter)
    wavefronts: float = 0.0
    global_bytes: int = 0  # bytes requested by the tile's global loads, per warp (lanes x width)
    widths: Counter = field(default_factory=Counter)  # global loads by bytes per lane

    barriers: int = 0

    @property
    def issued(self) -> int:
        return sum(self.classes.values())


def count(instructions: list[Instruction]) -> TileCounts:
    counts = TileCounts()
    for ins in instructions:
        klass, wavefronts, width = classify(ins.opcode)
        counts.classes[klass] += 1
        counts.wavefronts += wavefronts
        counts.barriers += ins.opcode.startswith("BAR.SYNC")
        if width:
            counts.global_bytes += WARP_LANES * width
            counts.widths[width] += 1
    return counts


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
    """Seconds of each bound of one launch (module docstring) and ``time``: their maximum plus ``LAUNCH_S``."""
    per_sm = math.ceil(geometry.programs / SMS)
    warp_tiles = per_sm * geometry.tiles * geometry.num_warps
    rounds = math.ceil(per_sm / max(1, geometry.resident))
    cycles = {
        "issue": warp_tiles * counts.issued / SCHEDULERS,
        "l1": warp_tiles * counts.wavefronts / L1_WAVEFRONTS_PER_CYCLE,
        "mufu": warp_tiles * counts.classes["special"] * MUFU_CYCLES,
        "barrier": rounds * geometry.tiles * counts.barriers * BARRIER_CYCLES,
    }
    out = {name: c / CLOCK_HZ for name, c in cycles.items()}
    out["dram"] = geometry.bytes / COPY_BYTES_PER_S
    out["time"] = max(out.values()) + LAUNCH_S
    return out
