"""The static performance model: SASS classes, the tile loop, the bound arithmetic, one compiled launch."""

import math
import os
import shutil
import subprocess
import sys
import time
from importlib import import_module
from pathlib import Path

import pytest
import torch

from kvcomp.kernels import decode_attention_triton
from tools import static_model as sm

SASS = """
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   MOV R1, RZ ;
.L_x_1:
	//## File "/nonexistent/k.py", line 10
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/              @!P0 BRA `(.L_x_2) ;
	//## File "/nonexistent/k.py", line 20
        /*0040*/                   LDS.64 R8, [R0] ;
        /*0050*/                   BRA `(.L_x_3) ;
.L_x_2:
	//## File "/nonexistent/k.py", line 10
        /*0060*/                   SHFL.BFLY PT, R9, R8, 0x1, 0x1f ;
.L_x_3:
        /*0070*/                   FFMA R1, R4, R5, R1 ;
        /*0080*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0090*/               @P1 BRA `(.L_x_1) ;
        /*00a0*/                   EXIT ;
.L_x_4:
        /*00b0*/                   BRA `(.L_x_4) ;
"""


def test_classify_widths_and_wavefronts():
    assert sm.classify("LDG.E.128.CONSTANT") == ("global load", 4.0, 16)
    assert sm.classify("LDG.E.U16") == ("global load", 1.0, 2)
    assert sm.classify("LDS.64") == ("shared load", 2.0, 0)
    assert sm.classify("LDSM.16.M88.2") == ("shared load", 2.0, 0)
    assert sm.classify("STL.128")[:2] == ("local", 4.0)
    assert sm.classify("SHFL.BFLY")[0] == "shuffle"
    assert sm.classify("I2FP.F32.U32")[0] == "conversion"
    assert sm.classify("MUFU.EX2")[0] == "special"
    assert sm.classify("FFMA")[0] == "fma" and sm.classify("IMAD.MOV.U32")[0] == "alu"
    assert sm.classify("LDGDEPBAR")[0] == "control"


def test_tile_loop_counts_every_path_but_the_padding_branch():
    instructions, looped = sm.tile_instructions(SASS)
    assert looped
    assert [i.address for i in instructions] == [0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90]
    counts = sm.count(instructions)
    assert counts.classes["global load"] == 1 and counts.classes["shuffle"] == 1 and counts.barriers == 1
    assert counts.wavefronts == 4 + 2 + 1 and counts.global_bytes == 32 * 16 and counts.widths == {16: 1}


def test_spills_are_counted_inside_the_tile_loop_only():
    spilled = SASS.replace("MOV R1, RZ ;", "STL [R1], R0 ;").replace("BAR.SYNC.DEFER_BLOCKING 0x0 ;", "LDL.64 R6, [R1] ;")
    assert sm.loop_local_accesses(spilled) == (0, 1)  # the store before the loop, the load on every tile
    branch = spilled.replace("LDS.64 R8, [R0] ;", "STL.64 [R1+0x8], R8 ;")
    assert sm.loop_local_accesses(branch) == (1, 1)  # a store on one of the loop's two paths
    assert sm.loop_local_accesses(SASS) == (0, 0)


def test_skipped_source_functions_leave_their_branch_out(tmp_path):
    source = tmp_path / "k.py"
    source.write_text("\n" * 8 + "def payload():\n    pass\n" + "\n" * 8 + "def dense():\n    pass\n")
    instructions, _ = sm.tile_instructions(SASS.replace("/nonexistent/k.py", str(source)), skip=("dense",))
    assert [i.address for i in instructions] == [0x20, 0x30, 0x60, 0x70, 0x80, 0x90]


def test_a_cubin_compiled_from_another_checkout_is_read_with_this_packages_sources():
    """Triton's cache holds kernels by source and first line, not path: a worktree's kernel, cached and then met
    here after the worktree was removed, names its files; their functions are this package's."""
    elsewhere = "/removed/worktree/kvcomp/kernels/decode_attention_triton.py"
    assert sm._source(elsewhere) == Path(decode_attention_triton.__file__).resolve()
    assert any(name == "decode_launches" for _, _, name in sm._functions(elsewhere))
    assert sm._functions("/nonexistent/k.py") == []


def test_a_skipped_functions_instruction_hoisted_into_the_loops_shared_blocks_keeps_them(tmp_path):
    """The scheduler moves a few instructions of a skipped function into blocks every tile runs (NVFP4's register-path
    launch: 5 of its loop header's 133): those blocks stay, or the tile would be empty."""
    source = tmp_path / "k.py"
    source.write_text("\n" * 8 + "def payload():\n    pass\n" + "\n" * 8 + "def dense():\n    pass\n")
    hoisted = SASS.replace("/nonexistent/k.py", str(source)).replace(
        "        /*0030*/              @!P0 BRA", f'\t//## File "{source}", line 20\n        /*0030*/              @!P0 BRA')
    instructions, _ = sm.tile_instructions(hoisted, skip=("dense",))
    assert [i.address for i in instructions] == [0x20, 0x30, 0x60, 0x70, 0x80, 0x90]


DENSE_SCORES = """
.L_x_1:
	//## File "{0}", line 10
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/              @!P0 BRA `(.L_x_2) ;
	//## File "{0}", line 20
        /*0040*/                   LDG.E.64 R8, desc[UR4][R6.64] ;
	//## File "{0}", line 10
        /*0050*/                   HMMA.16816.F32.BF16 R12, R8, R4, R12 ;
        /*0060*/                   HMMA.16816.F32.BF16 R12, R8, R4, R12 ;
        /*0070*/                   BRA `(.L_x_3) ;
.L_x_2:
        /*0080*/                   SHFL.BFLY PT, R9, R8, 0x1, 0x1f ;
.L_x_3:
        /*0090*/                   FFMA R1, R4, R5, R1 ;
        /*00a0*/               @P1 BRA `(.L_x_1) ;
        /*00b0*/                   EXIT ;
"""


def test_a_block_holding_a_skipped_functions_load_is_left_out(tmp_path):
    """The split kernel's full-precision branch loads its keys (``_dense``) and scores them with the payload's
    ``tl.dot`` (``_scores``) in one block, most of whose instructions are the dot's: its load marks it."""
    source = tmp_path / "k.py"
    source.write_text("\n" * 8 + "def payload():\n    pass\n" + "\n" * 8 + "def dense():\n    pass\n")
    instructions, _ = sm.tile_instructions(DENSE_SCORES.format(source), skip=("dense",))
    assert [i.address for i in instructions] == [0x20, 0x30, 0x80, 0x90, 0xa0]
    instructions, _ = sm.tile_instructions(DENSE_SCORES.format(source))
    assert [i.address for i in instructions] == [0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0]


def test_a_kernel_without_a_loop_is_one_tile():
    instructions, looped = sm.tile_instructions(SASS.replace("@P1 BRA `(.L_x_1)", "NOP"))
    assert not looped and len(instructions) == 12


def test_bounds_arithmetic():
    counts = sm.TileCounts()
    counts.classes.update({"fma": 800, "special": 10, "control": 200})
    counts.wavefronts, counts.latency = 400.0, 150.0
    geometry = sm.Geometry(programs=2 * sm.SMS + 1, num_warps=4, resident=2, tiles=10, bytes=2970e6)
    found = sm.bounds(counts, geometry)
    warp_tiles = 3 * 10 * 4  # the busiest SM runs 3 programs
    assert math.isclose(found["issue"], warp_tiles * 1010 / 4 / sm.CLOCK_HZ)
    assert math.isclose(found["l1"], warp_tiles * 400 / sm.CLOCK_HZ)
    assert math.isclose(found["mufu"], warp_tiles * 10 * 2 / sm.CLOCK_HZ)
    assert math.isclose(found["latency"], 2 * 10 * 150 / sm.CLOCK_HZ)  # 2 rounds of 2 resident programs
    assert math.isclose(found["dram"], 1e-3)
    assert math.isclose(found["time"], 1e-3 + sm.LAUNCH_S)  # DRAM-bound here
    found = sm.bounds(counts, sm.Geometry(2 * sm.SMS + 1, 4, 2, 10, 0.0))  # 2 warps per scheduler
    terms = [found["issue"], found["l1"], found["latency"]]
    assert max(terms) == found["l1"] and found["l1"] + (sum(terms) - found["l1"]) / math.sqrt(2) + sm.LAUNCH_S == \
        pytest.approx(found["time"])  # the smaller terms partly hidden behind the other warps
    alone = sm.bounds(counts, sm.Geometry(2 * sm.SMS + 1, 1, 2, 10, 0.0))  # half a warp per scheduler: nothing hidden
    assert alone["time"] == pytest.approx(alone["issue"] + alone["l1"] + alone["latency"] + sm.LAUNCH_S)


def test_a_dot_operand_read_from_shared_memory_pays_its_bank_conflicts():
    """A tf32 ``tl.dot`` A operand (16 x 32, 4 consecutive k per lane: LDS.128) read from a row-major buffer: rows g and
    g + 1 of one 8-lane phase fall in the same 16 banks, 2 wavefronts a phase; a swizzle that moves odd rows by 16
    words serves each phase in one. The lanes come from Triton's own linear layout of the operand."""
    pytest.importorskip("triton")
    aliases = {"#mma": "#ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [1, 4], instrShape = [16, 8]}>"}
    bases = sm._bases("#ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 4}>", (16, 32), aliases)
    assert bases["lane"] == [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]] and bases["register"][:2] == [[0, 1], [0, 2]]
    lanes = sm._coordinates(bases, 2, 4)
    for shared, per_instruction in (("vec = 1, perPhase = 1, maxPhase = 1", 8), ("vec = 16, perPhase = 1, maxPhase = 2", 4)):
        offset = sm._shared_offset(f"#ttg.swizzled_shared<{{{shared}, order = [1, 0]}}>", (16, 32), 4, aliases)
        wavefronts, instructions = sm.Access("shared load", ("k.py", 1), 4, lanes, offset).per_instruction(16, True)
        assert instructions == 4 and wavefronts == 4 * per_instruction


def _ins(opcode: str, operands: str, guard: str | None = None, line: int | None = None) -> sm.Instruction:
    return sm.Instruction(0, opcode, guard is not None, None, line and ("k.py", line), operands, guard)


def test_registers_read_and_written():
    assert sm.registers(_ins("IADD3", "R100, P0, R122, R37, RZ")) == (["R122", "R37"], ["R100", "P0"])
    assert sm.registers(_ins("ISETP.GE.AND", "P0, PT, R13.reuse, R89, PT")) == (["R13", "R89"], ["P0"])
    assert sm.registers(_ins("LDG.E.128", "R4, desc[UR6][R8.64]", "P3")) == (["P3", "UR6", "R8", "R9"],
                                                                           ["R4", "R5", "R6", "R7"])
    assert sm.registers(_ins("STS.128", "[R2], R12")) == (["R2", "R12", "R13", "R14", "R15"], [])
    assert sm.registers(_ins("SEL", "R3, R4, R5, P0")) == (["R4", "R5", "P0"], ["R3"])
    assert sm.registers(_ins("IMAD.WIDE", "R156, R159, 0x2, R152"))[1] == ["R156", "R157"]
    assert sm.registers(_ins("R2P", "PR, R228, 0x3"))[1] == [f"P{i}" for i in range(7)]
    assert sm.registers(_ins("SHFL.BFLY", "PT, R5, R0, 0x2, 0x1f")) == (["R0"], ["R5"])
    assert sm.registers(_ins("PLOP3.LUT", "P2, PT, !P1, !PT, !P0, 0x5f, 0x0")) == (["P1", "P0"], ["P2"])
    assert sm.registers(_ins("HMMA.16816.F32.BF16", "R8, R4, R12, R8")) == (
        ["R4", "R5", "R6", "R7", "R12", "R13", "R14", "R15", "R8", "R9", "R10", "R11"], ["R8", "R9", "R10", "R11"])


def test_tile_cycles_wait_for_operands_in_order():
    load = _ins("LDG.E", "R4, desc[UR4][R2.64]")
    use = _ins("FFMA", "R6, R4, R4, R6")
    independent = [_ins("FADD", f"R{10 + i}, R20, R21") for i in range(8)]
    assert sm.tile_cycles(independent) == 8  # one issue per cycle
    assert sm.tile_cycles([load, use]) == sm.DRAM_CYCLES + 1  # the use waits for the load
    work = independent * 60  # 480 cycles of independent work hide the load's 400
    assert sm.tile_cycles([load, use, *work]) == sm.DRAM_CYCLES + 1 + len(work)
    assert sm.tile_cycles([load, *work, use]) == len(work) + 2
    assert sm.tile_cycles([use, load, *work]) == len(work) + 2  # a load for the next tile, in flight across tiles
    chain = [_ins("FFMA", "R6, R6, R6, R6")] * 4  # each waits for the one before, across tiles too
    assert sm.tile_cycles(chain) == 4 * sm.ARITHMETIC_CYCLES
    assert sm.tile_cycles([_ins("BAR.SYNC.DEFER_BLOCKING", "0x0"), *independent]) == sm.BARRIER_CYCLES + 8
    assert sm.tile_cycles([load.__class__(**{**vars(load), "source": ("k.py", 7)}), use],
                          {("k.py", 7): sm.SHARED_CYCLES}) == sm.SHARED_CYCLES + 1  # an L1 hit


def test_a_line_read_earlier_in_the_tile_is_ready_with_that_load():
    def tile(*texts):  # instructions at addresses 0x0, 0x10, ...
        return [sm.Instruction(16 * i, text.split()[0], False, None, None, text.split(" ", 1)[1]) for i, text in enumerate(texts)]

    both = tile("LDG.E.U8 R4, desc[UR4][R2.64+0x4]", "LDG.E.U8 R5, desc[UR4][R2.64+0x5]", "IADD3 R6, R4, R5, RZ")
    one_line, two_lines = {0x0: frozenset({"a"}), 0x10: frozenset({"a"})}, {0x0: frozenset({"a"}), 0x10: frozenset({"b"})}
    assert sm.tile_cycles(both) == sm.tile_cycles(both, lines=two_lines) == sm.DRAM_CYCLES + 2  # in flight together
    assert sm.tile_cycles(both, lines=one_line) == sm.DRAM_CYCLES + 1  # the second rides on the first's miss
    chained = tile("LDG.E.U8 R4, desc[UR4][R2.64+0x4]", "IADD3 R8, R4, R8, RZ", "LDG.E.U8 R5, desc[UR4][R8.64+0x5]",
                   "IADD3 R6, R4, R5, RZ")  # the second load's address waits for the first load: an L1 hit
    lines = {0x0: frozenset({"a"}), 0x20: frozenset({"a"})}
    assert sm.tile_cycles(chained, lines=lines) == sm.DRAM_CYCLES + sm.ARITHMETIC_CYCLES + sm.SHARED_CYCLES + 1
    lines[0x20] = frozenset({"b"})
    assert sm.tile_cycles(chained, lines=lines) == sm.DRAM_CYCLES + sm.ARITHMETIC_CYCLES + sm.DRAM_CYCLES + 1


def test_instruction_lines_follow_the_accesses_registers():
    """Warp 0 holds 8 bytes of each of 4 token rows of 128 bytes (one code byte per register): its k-th byte load
    reads the k-th register's row, and rows are lines."""
    lanes = [[[(t, lane) for t in range(4)] for lane in range(32)]]
    access = sm.Access("global load", ("k.py", 61), 1, lanes, lambda c: c[0] * 128 + c[1])
    assert access.warp_lines(1) == [frozenset({t}) for t in range(4)]
    assert access.warp_lines(2) == [frozenset({0}), frozenset({2})]  # a 2-byte load: two registers of one lane
    assert access.warp_lines(3) is None
    sass = '\t//## File "/y/k.py", line 61\n' + "".join(
        f"        /*{16 * i:04x}*/                   LDG.E.U8 R{i}, desc[UR4][R2.64] ;\n" for i in range(6))
    instructions, _ = sm.parse_sass(sass)
    found = sm.instruction_lines(instructions, [access])
    assert [found[i.address] for i in instructions] == [frozenset({(("k.py", 61), t % 4)}) for t in range(6)]


def test_load_cycles_from_reuse_between_tiles():
    def recorded(reuse, footprint, load=True):
        return sm.Recorded(None, None, load, reuse, footprint)
    found = {(("k.py", 1), ("k.py", 9)): recorded(1.0, 4096), (("k.py", 2),): recorded(0.0, 1 << 20),
             (("k.py", 3),): recorded(0.5, 4096), (("k.py", 4),): recorded(1.0, 64, load=False)}
    cycles = sm.load_cycles(found, l1_bytes=16384)
    assert cycles == {("k.py", 1): sm.SHARED_CYCLES, ("k.py", 2): sm.DRAM_CYCLES,
                      ("k.py", 3): (sm.SHARED_CYCLES + sm.DRAM_CYCLES) / 2}
    assert sm.load_cycles(found, l1_bytes=4096)[("k.py", 1)] == sm.L2_CYCLES  # the reused lines do not fit the L1


COLD = """
.L_x_1:
        /*0000*/                   FFMA R1, R4, R5, R1 ;
        /*0010*/               @P0 BRA `(.L_x_3) ;
        /*0020*/                   MOV R2, RZ ;
.L_x_2:
        /*0030*/                   LDG.E.CONSTANT R8, desc[UR4][R2.64] ;
        /*0040*/                   IADD3 R2, R2, 0x4, RZ ;
        /*0050*/               @P2 BRA `(.L_x_2) ;
.L_x_3:
        /*0060*/                   FMUL R1, R1, R8 ;
        /*0070*/               @P1 BRA `(.L_x_1) ;
        /*0080*/                   EXIT ;
"""


def test_a_branch_over_an_inner_loop_is_taken():
    """libdevice's sin/cos reduce a huge argument in a loop over a table, behind a branch the tile takes."""
    instructions, looped = sm.tile_instructions(COLD)
    assert looped and [i.address for i in instructions] == [0x00, 0x10, 0x60, 0x70]


def test_a_spill_load_waits_for_the_l2_where_the_frames_overflow_the_l1():
    """A program's local-memory frames (ptxas' stack frame per thread) that fit in its share of the L1 are read back
    at an L1 hit's latency, else the L2's: the codebook kernels' 128-token tiles spill 2 KB per thread."""
    assert sm.local_cycles(16, 128, 100_000) == sm.SHARED_CYCLES
    assert sm.local_cycles(2112, 128, 100_000) == sm.L2_CYCLES
    spill = [_ins("LDL", "R2, [R1+0x10]"), _ins("FADD", "R3, R2, R2")]
    assert sm.tile_cycles(spill, {sm.LOCAL: sm.L2_CYCLES}, passes=1) > sm.tile_cycles(spill, {}, passes=1) + 100


def test_a_timed_step_is_its_host_time_then_its_launches(monkeypatch):
    """The benchmark's events are recorded on an idle device around one call: the device waits for the call's
    Python work before the first launch, then runs the launches in sequence; the host term keeps the fastest of its
    timed calls, and the step scales it to the GPU machine's CPU."""
    launches = [{"time": 2e-5}, {"time": 1e-5}]
    monkeypatch.setattr(sm, "HOST_FACTOR", 2.0)
    assert math.isclose(sm.step_seconds(launches, 1e-6), 3.2e-5)
    assert math.isclose(sm.step_seconds(launches, 1e-4), 2.3e-4)
    monkeypatch.setattr(sm, "HOST_REPEATS", 6)
    calls = iter([0.0] + [0.02] * sm.HOST_REPEATS)  # the first call compiles: untimed
    slept = []

    def call():
        slept.append(next(calls))
        time.sleep(slept[-1] if len(slept) != 5 else 0.0)

    assert sm.host_seconds(call) < 0.01 and len(slept) == 1 + sm.HOST_REPEATS


def _nvidia_tools() -> bool:
    try:
        from triton import knobs

        return shutil.which(knobs.nvidia.nvdisasm.path) is not None and shutil.which(knobs.nvidia.ptxas.path) is not None
    except Exception:  # no Triton, or no CUDA backend in it
        return False


COMPILE_ONE = """
import torch
from tools import static_model as sm
from kvcomp.kernels.decode_attention_triton import decode_launches
from tools.resources import compile_launch
h, d, t = 2, 128, 64
kv = [torch.randn(1, h, t, d, dtype=torch.bfloat16)]
_, launches = decode_launches(torch.randn(1, 2 * h, d, dtype=torch.bfloat16), kv, kv, d ** -0.5)
instructions, looped = sm.tile_instructions(sm.disassemble(compile_launch(launches[0]).asm["cubin"]))
counts = sm.count(instructions)
print(looped, counts.classes["global load"], counts.classes["fma"], sm.bounds(counts, sm.Geometry(sm.SMS, 16, 1, 100, 0.0))["time"])
"""


@pytest.mark.skipif(not _nvidia_tools(), reason="Triton's CUDA backend tools (ptxas, nvdisasm) are missing")
def test_model_runs_on_one_compiled_launch():
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the suite interprets kernels
    looped, loads, fma, seconds = subprocess.run([sys.executable, "-c", COMPILE_ONE], env=env, capture_output=True, text=True,
                                                 check=True, cwd=root).stdout.split()
    assert looped == "True" and int(loads) > 0 and int(fma) > 0 and float(seconds) > sm.LAUNCH_S


COMPILE_OPERANDS = """
import torch
from tools import static_model as sm
from kvcomp.kernels.decode_attention_triton import decode_launches
from tools.resources import compile_launch, kernel_resources
h, d, t = 2, 128, 64
kv = [torch.randn(1, h, t, d, dtype=torch.bfloat16)]
for operands in ("float32", "bfloat16"):
    _, launches = decode_launches(torch.randn(1, 2 * h, d, dtype=torch.bfloat16), kv, kv, d ** -0.5, operands=operands)
    compiled = compile_launch(launches[0])
    mma = sorted({i.opcode for i in sm.parse_sass(sm.disassemble(compiled.asm["cubin"]))[0] if i.opcode.startswith("HMMA")})
    print(operands, kernel_resources(compiled)["shared"], ",".join(mma))
"""


@pytest.mark.skipif(not _nvidia_tools(), reason="Triton's CUDA backend tools (ptxas, nvdisasm) are missing")
def test_bfloat16_operands_take_the_bfloat16_tensor_cores():
    """``operands="bfloat16"``: the split kernel's ``tl.dot`` runs bf16 MMAs with float32 accumulation and stages half the
    shared memory of the TF32 default (numbers checked only on a GPU: Triton's interpreter gets bf16 ``tl.dot`` wrong)."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    lines = subprocess.run([sys.executable, "-c", COMPILE_OPERANDS], env=env, capture_output=True, text=True, check=True,
                           cwd=root).stdout.split("\n")
    found = {line.split()[0]: (int(line.split()[1]), line.split()[2]) for line in lines if line.strip()}
    assert "F32.TF32" in found["float32"][1] and "BF16" not in found["float32"][1]
    assert "F32.BF16" in found["bfloat16"][1] and "TF32" not in found["bfloat16"][1]
    assert found["bfloat16"][0] < found["float32"][0]


def test_a_launch_refuses_unknown_operands():
    from kvcomp.kernels.decode_attention_triton import decode_launches

    kv = [torch.randn(1, 2, 16, 128)]
    with pytest.raises(ValueError, match="operands='fp16'; choose one of"):
        decode_launches(torch.randn(1, 4, 128), kv, kv, 0.1, operands="fp16")


def test_shared_wavefronts_count_bank_conflicts():
    column = [(lane, lane * 128) for lane in range(32)]  # 2-byte reads down a column of 128-byte rows: one bank
    assert sm.shared_wavefronts(column, 2) == 32
    assert sm.shared_wavefronts([(lane, lane * 4) for lane in range(32)], 4) == 1  # one word per bank
    assert sm.shared_wavefronts([(lane, 0) for lane in range(32)], 4) == 1  # one word, broadcast
    assert sm.shared_wavefronts([(lane, lane * 16) for lane in range(32)], 16) == 4  # 512 B in 4 phases
    assert sm.shared_wavefronts([(lane, lane * 8) for lane in range(32)], 4) == 2  # stride 2 words: 2-way


def test_global_wavefronts_count_lines():
    assert sm.global_wavefronts([(lane, lane * 4) for lane in range(32)], 4) == 1
    assert sm.global_wavefronts([(lane, lane * 32) for lane in range(32)], 1) == 8  # one byte per 32-byte row
    assert sm.global_wavefronts([(lane, lane * 16) for lane in range(32)], 16) == 4


TTGIR = """#blocked1 = #ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [32, 1], warpsPerCTA = [2, 2], order = [0, 1]}>
#shared1 = #ttg.swizzled_shared<{vec = 1, perPhase = 1, maxPhase = 1, order = [1, 0]}>
      %s = ttg.local_load %a token %t : !ttg.memdesc<64x64xf16, #shared1, #smem, mutable> -> tensor<64x64xf16, #blocked1> loc(#loc3)
#loc1 = loc("/x/k.py":53:20)
#loc2 = loc("/x/k.py":89:4)
#loc3 = loc(callsite(#loc1 at #loc2))
"""


def test_layout_lanes_and_a_conflicting_shared_load():
    ops = sm.ttgir_memory_ops(TTGIR)
    assert len(ops) == 1 and ops[0]["kind"] == "shared load" and ops[0]["chain"] == (("k.py", 53), ("k.py", 89))
    op = ops[0]
    lanes = sm._coordinates(sm._bases(op["layout"], op["shape"], op["aliases"]), 2, 4)
    assert [lanes[0][lane][0] for lane in (0, 1, 31)] == [(0, 0), (1, 0), (31, 0)]  # lanes run down the tokens
    assert lanes[1][0][0] == (32, 0) and lanes[2][0][0] == (0, 1) and lanes[0][0][1] == (0, 2) and len(lanes[0][0]) == 32
    access = sm.Access("shared load", ("k.py", 53), 2, lanes,
                       sm._shared_offset(op["shared"], op["shape"], 2, op["aliases"]))
    assert access.per_instruction(2, shared=True) == (1024.0, 32)  # per warp: 32 LDS.U16, each 32-way conflicting
    sass = '\t//## File "/y/k.py", line 53\n        /*0000*/                   LDS.U16 R1, [R2] ;\n'
    instructions, _ = sm.parse_sass(sass)
    assert sm.count(instructions).wavefronts == 1 and sm.count(instructions, [access]).wavefronts == 32


def _script():
    """tools/kernel_model.py as a module."""
    pytest.importorskip("triton")
    return import_module("tools.kernel_model")


def test_todays_measured_times_are_compared_only_with_the_machine_code_they_timed():
    """``sass_fingerprint``: the measured column is shown for a launch whose instructions are the measured ones; a
    changed operand (another register, another constant) is other code, a moved address or source line is not."""
    model = _script()
    sass = "        /*0010*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;\n        /*0020*/                   EXIT ;\n"
    moved = sass.replace("/*0010*/", "/*0030*/").replace("/*0020*/", "/*0040*/")
    assert model.sass_fingerprint(sass) == model.sass_fingerprint(moved)
    assert model.sass_fingerprint(sass) != model.sass_fingerprint(sass.replace("R1,", "R2,"))
    assert set(model.MEASURED_TODAY_SASS) == set(model.MEASURED_TODAY) | {"qjl scores"}


def test_measured_sweep_keeps_each_cards_rows_apart(tmp_path):
    model = _script()
    row = "| kivi-2 | 16 x 32768 | {} | {} | 0.2x | 100 | 3% | 1.00x | 0.0014 |"
    text = "\n".join([model.SWEEP_SECTION, "", "Command: `python -m benchmarks.sweep_decode_kernel` ... Device: NVIDIA H200", "",
                      row.format("tl.dot, 4 warps, 128 tokens", 3.0), "", "### H100", "",
                      "Command: `python -m benchmarks.sweep_decode_kernel` ... Device: NVIDIA H100 80GB HBM3", "",
                      row.format("tl.dot, 4 warps, 128 tokens", 2.8), row.format(model.FORMER_TILE_DEFAULT, 2.9),
                      "| kvarn | 16 x 32768 | default | failed: X | | | | | |", "",
                      "Then `python -m benchmarks.sweep_decode_kernel --configs 0 10` (H100):", "",
                      row.format("tl.dot, 4 warps, 128 tokens", 2.7), "", "## Next section", row.format("default", 9.9)])
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(text)
    measured = model.measured_sweep(path)
    assert measured == {("H200", 1, "kivi-2", 16, 32768): {"tl.dot, 4 warps, 128 tokens": 3.0},
                        ("H100", 2, "kivi-2", 16, 32768): {"tl.dot, 4 warps, 128 tokens": 2.8, model.FORMER_TILE_DEFAULT: 2.9},
                        ("H100", 3, "kivi-2", 16, 32768): {"tl.dot, 4 warps, 128 tokens": 2.7}}
    assert model.sweep_options(model.FORMER_TILE_DEFAULT, "qjl") == dict(num_warps=4, block_tokens=32)


MULTI_LINE_KERNEL = """
import triton
import triton.language as tl


@triton.jit
def kernel(x, y, N: tl.constexpr):
    offs = tl.arange(0, N)
    a = tl.load(
        x + offs,
        mask=offs < 5,
        other=0,
    ).to(tl.float32)
    b = tl.load(x +
                offs * 2, mask=offs < 3)
    tl.store(y + offs,
             a + b)
"""

LOCATE = """
import torch
from kvcomp.kernels import Launch
from tools import static_model as sm
from tools.resources import compile_launch
from multi import kernel

launch = Launch(kernel, (1,), dict(x=torch.zeros(64), y=torch.zeros(64), N=64))
print(sorted(sm.record_global_accesses(launch)))
print(sorted(op["chain"] for op in sm.ttgir_memory_ops(compile_launch(launch).asm["ttgir"])))
"""


@pytest.mark.skipif(not _nvidia_tools(), reason="Triton's CUDA backend tools (ptxas, nvdisasm) are missing")
def test_recorded_loads_carry_the_lines_triton_locates_them_at(tmp_path):
    """A load or store over several lines is found where Triton locates it in the TTGIR (hence the SASS): the model
    matches the two by line (reuse, lanes' addresses). Triton 3.6 takes a load's pointer line, 3.9 its first line."""
    (tmp_path / "multi.py").write_text(MULTI_LINE_KERNEL)
    (tmp_path / "locate.py").write_text(LOCATE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    recorded, located = subprocess.run([sys.executable, "locate.py"], env=env, capture_output=True, text=True,
                                       check=True, cwd=tmp_path).stdout.splitlines()
    recorded, located = eval(recorded), eval(located)
    assert len(located) == 3 and set(located) <= set(recorded)
    # candidates: the call's first and last line and its pointer's line; nothing between
    assert {chain[0][1] for chain in recorded} == {9, 10, 13, 14, 15, 16, 17}


def test_ranking_counts_the_pairs_measured_apart():
    model = _script()
    measured = {"a": 1.0, "b": 1.02, "c": 2.0}  # a and b within the benchmark's spread
    assert model.separated_pairs({"a": 1.1, "b": 1.0, "c": 3.0}, measured) == (2, 2)
    assert model.separated_pairs({"a": 1.1, "b": 1.0, "c": 0.5}, measured) == (0, 2)
    assert not model.spearman_agrees({"a": 1.1, "b": 1.0, "c": 3.0}, measured)


MODEL_ROTATED = """
from tools import kernel_model as model
result = model.today_step("int4-token-head", [(1, 4096)])
seconds, bound = result["shapes"][(1, 4096)]
print(seconds, bound, result["host"], len(result["launches"]))
"""


@pytest.mark.skipif(not _nvidia_tools(), reason="Triton's CUDA backend tools (ptxas, nvdisasm) are missing")
def test_todays_launch_of_a_rotated_format_is_modelled():
    """The model compiles a rotated payload's own launch (its inner payload), as ``--sweep`` does for the measured
    H100 rows of the 2026 formats (which crashed the script when it passed the rotated readers)."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    seconds, bound, host, launches = subprocess.run([sys.executable, "-c", MODEL_ROTATED], env=env, capture_output=True,
                                                    text=True, check=True, cwd=root).stdout.split()
    # one layer at 1 x 4K: a few microseconds on the device, the launcher's Python and Triton's binding on the host
    host = sm.HOST_FACTOR * float(host)  # on the GPU machine's CPU
    device = float(seconds) - host  # the launches after the host's work
    assert bound == "host" and host > 0 and int(launches) * sm.LAUNCH_S < device < host


def test_the_host_time_under_cuda_graphs_is_that_of_a_call_replayed_by_its_inputs(monkeypatch):
    """``kernel_model.graphed_host_seconds``: a call met, captured, then replayed by its inputs
    (:mod:`kvcomp.kernels.decode_graphs`) and timed on the host. Its launches are built only the first two times (met,
    captured): no timed call builds one. What is counted, not how long it took (host times swing on a loaded CPU)."""
    from kvcomp.kernels import decode_attention_triton as kernels

    model = import_module("tools.kernel_model")
    built = []
    setup_launches = kernels.setup_launches
    monkeypatch.setattr(kernels, "setup_launches", lambda *args, **kw: built.append(1) or setup_launches(*args, **kw))
    kv = [torch.randn(1, 2, 64, 32)]
    graphed = model.graphed_host_seconds(torch.randn(1, 4, 32), kv, kv, None)
    assert graphed > 0 and len(built) == 2
