"""Static resources of a Triton kernel compiled for an NVIDIA GPU that need not be present.

A decode kernel's speed on a GPU is capped by what its compiled code holds per thread block: registers
per thread (and the local-memory spills past 255), shared memory, and the occupancy these allow. All
three are known at compile time, so they can be read on a machine without a GPU:

- :func:`compile_launch` compiles one :class:`~kvcomp.kernels.decode_attention_triton.Launch` with
  Triton's own argument specialisation (alignment, ``do_not_specialize``) for ``cuda`` compute
  capability ``capability``, through a stand-in driver (:func:`static_target`; nothing runs);
- :func:`kernel_resources` assembles its PTX with Triton's ``ptxas -v`` for registers and spills, and
  takes the dynamic shared memory from the compiled metadata;
- :func:`occupancy` is the resident warps per multiprocessor over the maximum, by the CUDA occupancy
  rules of sm_90 (H100/H200): 64 K registers allocated per warp in units of 256, 228 KB of shared memory
  with 1 KB reserved per block, 64 warps and 32 blocks at most.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
from pathlib import Path

REGISTERS_PER_SM, SHARED_PER_SM, WARPS_PER_SM, BLOCKS_PER_SM = 65536, 233472, 64, 32
RESERVED_SHARED_PER_BLOCK, REGISTER_UNIT = 1024, 256


@contextlib.contextmanager
def static_target(capability: int):
    """Triton's active driver replaced by one that reports a ``cuda`` target of ``capability`` on a device
    of its own name (so these compilations never meet a real device's kernel cache)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class StaticDriver:
        def get_current_device(self):
            return f"static-sm{capability}"

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", capability, 32)

    previous = driver._active
    driver.set_active(StaticDriver())
    try:
        yield
    finally:
        driver._active = previous


def compile_launch(launch, capability: int = 90):
    """The ``CompiledKernel`` of ``launch`` for a ``cuda`` GPU of compute capability ``capability``."""
    from triton.runtime.jit import JITFunction

    if not isinstance(launch.kernel, JITFunction):
        raise RuntimeError("static compilation needs compiled kernels: unset TRITON_INTERPRET (the interpreter is on)")
    with static_target(capability):
        return launch.kernel.warmup(grid=launch.grid, **launch.args)


def occupancy(registers: int, shared: int, num_warps: int) -> float:
    """Theoretical occupancy (resident warps / 64) on sm_90 of blocks of ``num_warps`` warps using
    ``registers`` per thread and ``shared`` bytes of shared memory."""
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    blocks = min(BLOCKS_PER_SM, WARPS_PER_SM // num_warps, REGISTERS_PER_SM // (per_warp * num_warps))
    if shared:
        blocks = min(blocks, SHARED_PER_SM // (shared + RESERVED_SHARED_PER_BLOCK))
    return blocks * num_warps / WARPS_PER_SM


def kernel_resources(compiled, capability: int = 90) -> dict:
    """``registers`` per thread, ``spill_stores``/``spill_loads`` (bytes per thread), ``stack`` (its local-memory
    frame, bytes per thread), ``shared`` (bytes
    per block), ``num_warps`` and ``occupancy`` of a compiled kernel."""
    from triton.backends.nvidia.compiler import get_ptxas

    arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        report = subprocess.run([get_ptxas(capability).path, "-v", "--gpu-name", arch, str(ptx), "-o", str(Path(tmp) / "k.cubin")],
                                capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    stack = re.search(r"(\d+) bytes stack frame", report)
    shared, warps = int(compiled.metadata.shared), int(compiled.metadata.num_warps)
    return dict(registers=registers, spill_stores=int(spills.group(1)), spill_loads=int(spills.group(2)), shared=shared,
                stack=int(stack.group(1)) if stack else 0, num_warps=warps, occupancy=occupancy(registers, shared, warps))
