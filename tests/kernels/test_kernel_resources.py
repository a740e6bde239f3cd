"""Static resources of the decode kernels compiled for sm_90 without a GPU (:mod:`tools.resources`,
``python -m tools.kernel_resources``), and the whole-wave split plan."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from kvcomp.kernels.decode_plan import _splits  # noqa: E402
from tools.resources import occupancy  # noqa: E402


def _ptxas_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return shutil.which(get_ptxas(90).path) is not None
    except Exception:  # no NVIDIA backend in this triton build
        return False


def test_occupancy_follows_the_sm90_limits():
    assert occupancy(128, 2048, 16) == 0.25  # 128 registers x 512 threads = the whole register file
    assert occupancy(64, 2048, 16) == 0.5
    assert occupancy(255, 0, 4) == 0.125  # 8 K registers per warp: two blocks of 4 warps
    assert occupancy(32, 0, 4) == 1.0
    assert occupancy(32, 110 * 1024, 4) == 2 * 4 / 64  # 110 KB of shared memory: two blocks per SM


def test_splits_fill_whole_waves_where_the_interval_is_long_enough():
    for programs, wave in [(128, 132), (64, 132), (8, 132), (16, 114), (256, 78)]:
        splits = _splits(4096, programs, wave, None)
        assert programs * splits % wave == 0 and programs * splits >= 2 * wave
    assert _splits(3, 128, 132, None) == 3  # a short interval: one tile per slice
    assert _splits(4096, 128, 132, 5) == 5 and _splits(2, 128, 132, 5) == 2  # forced, capped by the tiles


@pytest.mark.skipif(not _ptxas_available(), reason="triton's ptxas is not available")
def test_every_decode_launch_compiles_for_sm90_within_its_register_cap():
    """The default launches at batch 16 (tl.dot, 32-token tiles) compile for sm_90a at 128 registers per thread:
    per-group codebooks at 4 warps (the fastest measured on an H200, ``benchmarks/sweep_decode_kernel.py``), four programs
    per multiprocessor, spilling a few hundred bytes per thread at most (1.13-1.33x faster all the same on the H200:
    136-260 bytes for TemporalKV-2 under Triton 3.6 and 3.9); packed ints at 2 warps, eight programs, spilling 48-72
    bytes (predicted faster by the static model, ``tools/kernel_model.py``; not measured), stored before the tile
    loop and reloaded in it by a few loads."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the suite interprets kernels
    table = subprocess.run([sys.executable, "-m", "tools.kernel_resources", "--codecs", "kivi-2", "temporalkv-2",
                            "--context", "512", "--no-qjl", "--ratios", "4"], env=env, capture_output=True, text=True, check=True, cwd=root).stdout
    rows = [line.split(" | ")[1:] for line in table.splitlines() if line.startswith(("| 4 | kivi-2", "| 4 | temporalkv-2"))]
    formats = {row[1] for row in rows}
    assert {"keys packed ints (stored layout), values packed ints", "keys codebook + RoPE, values codebook"} <= formats
    assert len(rows) == 2  # one split launch per step and codec: sinks, payload and tail in one launch
    for row in rows:
        tile, warps, spill_stores, spill_loads = int(row[2]), int(row[3]), int(row[5]), int(row[6])
        loop_stores, loop_loads = map(int, row[7].split(" / "))
        assert (tile, warps) == ((32, 2) if row[0] == "kivi-2" else (32, 4)), row
        assert int(row[4]) <= 128, row  # the formats' register cap: four programs of 4 warps, eight of 2
        if row[0] == "kivi-2":
            assert spill_stores <= 160 and spill_loads <= 160, row
            assert loop_stores == 0 and loop_loads <= 16, row  # every spill stored once per program
        else:
            assert 0 < spill_stores <= 320 and spill_loads <= 320, row  # capped below the compiler's 168-255
        assert row[9].rstrip(" |") != "0%", row


def test_sdpa_without_cudnn_leaves_flash_memory_efficient_and_math():
    """Decode steps on a GPU avoid cuDNN's SDPA, which builds a plan per sequence length
    (``benchmarks/profile_decode_step.py``)."""
    import torch

    from kvcomp.kernels import sdpa_without_cudnn

    with sdpa_without_cudnn():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored
