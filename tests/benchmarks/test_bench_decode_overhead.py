"""python -m benchmarks.bench_decode_overhead --smoke: the decode-step overhead benchmark runs and fills its table."""

from importlib import import_module


def _script():
    return import_module("benchmarks.bench_decode_overhead")


def test_smoke_table_has_baseline_and_fp16_rows_with_positive_times():
    table = _script().main(["--smoke"])
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[2]] = (float(cells[4]), float(cells[6].rstrip("x")))
    assert "DynamicCache" in rows
    assert "CompressedCache fp16, exact_prefill" in rows and "CompressedCache fp16, streaming" in rows
    assert rows["DynamicCache"][1] == 1.0
    assert all(ms > 0 and ratio > 0 for ms, ratio in rows.values())
