"""scripts/kernel_model.py: reading the measured launch sweeps of BENCHMARKS.md, one card at a time."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("triton")


def _script():
    path = Path(__file__).resolve().parent.parent / "scripts" / "kernel_model.py"
    spec = importlib.util.spec_from_file_location("kernel_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_measured_sweep_keeps_each_cards_rows_apart(tmp_path):
    model = _script()
    row = "| kivi-2 | 16 x 32768 | {} | {} | 0.2x | 100 | 3% | 1.00x | 0.0014 |"
    text = "\n".join([model.SWEEP_SECTION, "", "Device: NVIDIA H200; ...", "", row.format("tl.dot, 4 warps, 128 tokens", 3.0),
                      "", "### H100", "", "Device: NVIDIA H100 80GB HBM3", "", row.format("tl.dot, 4 warps, 128 tokens", 2.8),
                      row.format(model.FORMER_DOT_DEFAULT, 2.9), "| kvarn | 16 x 32768 | default | failed: X | | | | | |",
                      "", "## Next section", row.format("default", 9.9)])
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(text)
    measured = model.measured_sweep(path)
    assert measured == {("H200", "kivi-2", 16, 32768): {"tl.dot, 4 warps, 128 tokens": 3.0},
                        ("H100", "kivi-2", 16, 32768): {"tl.dot, 4 warps, 128 tokens": 2.8, model.FORMER_DOT_DEFAULT: 2.9}}
    assert model.sweep_options(model.FORMER_DOT_DEFAULT, "kvarn") == dict(dot=True, num_warps=4, block_tokens=32)
