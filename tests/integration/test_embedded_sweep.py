"""A KIVI sweep through ``run.py -m`` on the embedded SmolLM2-135M, checked several ways (its own module:
pytest-xdist hands each module to one worker, which runs the sweep once)."""

import json

import pytest

from tests.run_py import THREADS, run_py

pytestmark = pytest.mark.integration
SWEEP = ["benchmark.num_windows=2", "benchmark.seq_len=256", f"hardware.threads={THREADS}"]


@pytest.fixture(scope="module")
def kivi_sweep(embedded, tmp_path_factory):
    """`python run.py -m codec=kivi codec.bits=2,4` on 2 windows of 256 tokens (fp16 reference
    included)."""
    sweep = tmp_path_factory.mktemp("sweep")
    result = run_py("-m", "codec=kivi", "codec.bits=2,4", *SWEEP, f"hydra.sweep.dir={sweep}", cwd=sweep)
    assert result.returncode == 0, result.stderr[-3000:]
    return sweep, result


def _rows(sweep):
    rows = {}
    for path in sweep.rglob("results.json"):
        for row in json.loads(path.read_text())["rows"]:
            rows[row["codec"].split(",")[0]] = row
    return rows


def test_sweep_perplexities_are_sane(kivi_sweep):
    sweep, _ = kivi_sweep
    rows = _rows(sweep)
    fp16, kivi2, kivi4 = rows["fp16()"], rows["kivi(bits=2"], rows["kivi(bits=4"]
    assert 15 < fp16["ppl_streaming"] < 30 and fp16["ppl_simulated"] == fp16["ppl_streaming"]  # 2 windows of 256: 24.9
    for protocol in ("streaming", "simulated"):
        assert kivi4[f"ppl_{protocol}"] <= 1.02 * fp16[f"ppl_{protocol}"]
        assert kivi2[f"ppl_{protocol}"] > kivi4[f"ppl_{protocol}"]
    # streaming shows early queries full-precision tokens, so it can only be closer to fp16
    assert kivi2["ppl_streaming"] < kivi2["ppl_simulated"]


def test_sweep_bits_and_bytes(kivi_sweep):
    rows = _rows(kivi_sweep[0])
    assert rows["kivi(bits=2"]["bits_per_value"] == 3.0 and rows["kivi(bits=4"]["bits_per_value"] == 5.0
    for row in rows.values():
        assert row["cache_bytes_per_window"] == pytest.approx(row["cache_bytes_expected"], rel=0.01)


def test_sweep_writes_the_aggregated_table_and_resumes(kivi_sweep):
    sweep, result = kivi_sweep
    summary = (sweep / "summary.md").read_text()
    assert summary.count("\n| smollm2_135m |") == 3  # fp16 once, KIVI-2, KIVI-4
    assert (sweep / "summary.csv").is_file()
    again = run_py("-m", "codec=kivi", "codec.bits=2,4", *SWEEP, f"hydra.sweep.dir={sweep}", cwd=sweep)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("already holds this run") == 2
