import json

import pytest

from kvcomp.config import LoggerConfig
from kvcomp.errors import ConfigError
from kvcomp.results import (
    clear_failure,
    failed_members,
    load_rows,
    log_to_wandb,
    markdown_table,
    write_failure,
    write_json_atomic,
    write_summary,
)

ROWS = [
    {"model": "m", "codec": "fp16()", "benchmark": "b", "bits_per_value": 16.0, "ppl_streaming": 20.0, "ppl_simulated": 20.0},
    {"model": "m", "codec": "kivi(bits=2)", "benchmark": "b", "bits_per_value": 3.0, "ppl_streaming": 22.5, "ppl_simulated": 25.0},
]


def test_atomic_json_leaves_no_temporary(tmp_path):
    write_json_atomic(tmp_path / "r" / "results.json", {"rows": ROWS})
    assert json.loads((tmp_path / "r" / "results.json").read_text())["rows"] == ROWS
    assert [p.name for p in (tmp_path / "r").iterdir()] == ["results.json"]


def test_markdown_table_has_both_protocols():
    table = markdown_table(ROWS)
    assert "PPL streaming" in table and "PPL simulated" in table
    assert "| m | kivi(bits=2) | 3.000 |" in table


def test_the_readme_main_table_has_the_columns_the_main_job_prints():
    """The main job's rows carry ``paper_bits_per_value`` equal to ``bits_per_value`` (fp16, KIVI): the table
    leaves that column out, as the README's table does; a codebook row where they differ brings it back."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    header = next(line for line in readme.splitlines() if line.startswith("| model | codec |"))
    metrics = {"benchmark": "b", "bits_per_value_measured": 6.6, "cache_bytes_per_window": 1, "ppl_streaming": 23.1,
               "ppl_simulated": 34.5, "encoded_share": 0.75, "code_bits_per_value": 3.0, "eval_seconds_streaming": 1.0,
               "kld_mean_streaming": 0.13, "kld_mean_simulated": 0.56}
    rows = [{"model": "m", "codec": name, "bits_per_value": bits, "paper_bits_per_value": bits, "overhead_bits": 0,
             **metrics} for name, bits in (("fp16()", 16.0), ("kivi(bits=2)", 3.0))]
    assert markdown_table(rows).splitlines()[0] == header
    codebook = {**rows[1], "codec": "temporalkv(bits=2)", "bits_per_value": 2.06, "paper_bits_per_value": 2.0}
    assert "paper bits/value" in markdown_table(rows + [codebook]).splitlines()[0]


def _member(directory, overrides, rows):
    write_json_atomic(directory / ",".join(overrides) / "results.json", {"overrides": overrides, "rows": rows})


def test_summary_lists_every_member_and_a_shared_reference_once(tmp_path):
    reference = {**ROWS[0], "reference_key": "r1"}
    _member(tmp_path, ["codec.bits=2"], [reference, ROWS[1]])
    _member(tmp_path, ["codec.bits=4"], [reference, {**ROWS[1], "codec": "kivi(bits=4)"}])
    rows, columns = load_rows(tmp_path)
    assert columns == ["codec.bits"] and len(rows) == 3
    assert [(r["codec"], r.get("codec.bits")) for r in rows] == [("fp16()", None), ("kivi(bits=2)", "2"), ("kivi(bits=4)", "4")]
    table = write_summary(tmp_path)
    assert table.count("\n| m |") == 3 and "| codec.bits |" in table
    assert (tmp_path / "summary.csv").read_text().count("\n") == 4


def test_members_that_differ_only_in_an_override_keep_their_rows(tmp_path):
    """Members of calibration=enwiki,lee and of hardware.dtype=float32,bfloat16 keep a row each, not one row per
    sweep."""
    for calibration in ("enwiki", "lee"):
        _member(tmp_path / "cal", [f"calibration={calibration}"], [{**ROWS[0], "reference_key": "r"}, ROWS[1]])
    rows, columns = load_rows(tmp_path / "cal")
    assert columns == ["calibration"]
    assert [(r["codec"], r.get("calibration")) for r in rows] == [("fp16()", None), ("kivi(bits=2)", "enwiki"), ("kivi(bits=2)", "lee")]
    for dtype in ("float32", "bfloat16"):  # each dtype has its own reference
        _member(tmp_path / "dtype", [f"hardware.dtype={dtype}"], [{**ROWS[0], "reference_key": dtype}, ROWS[1]])
    rows, _ = load_rows(tmp_path / "dtype")
    assert sorted((r["codec"], r["hardware.dtype"]) for r in rows) == [
        ("fp16()", "bfloat16"), ("fp16()", "float32"), ("kivi(bits=2)", "bfloat16"), ("kivi(bits=2)", "float32")]


def test_failed_member_is_a_row_with_its_error(tmp_path):
    _member(tmp_path, ["codec.bits=2"], ROWS)
    config = {"model": {"name": "m"}, "codec": {"name": "kivi", "bits": 9}, "benchmark": {"name": "perplexity"}}
    write_failure(tmp_path / "codec.bits=9", config, ["codec.bits=9"], ConfigError("bits=9 is not supported"))
    rows, _ = load_rows(tmp_path)
    failed = [r for r in rows if r["status"] == "failed"]
    assert len(failed) == 1 and failed[0]["codec.bits"] == "9" and "bits=9 is not supported" in failed[0]["error"]
    assert failed_members(tmp_path) == [tmp_path / "codec.bits=9"]
    assert "| failed | ConfigError: bits=9 is not supported |" in write_summary(tmp_path)
    clear_failure(tmp_path / "codec.bits=9")
    assert failed_members(tmp_path) == []


def test_bug_failures_keep_their_traceback(tmp_path):
    try:
        raise ZeroDivisionError("boom")
    except ZeroDivisionError as error:
        write_failure(tmp_path, {}, [], error)
    record = json.loads((tmp_path / "error.json").read_text())
    assert "ZeroDivisionError" in record["traceback"]


def test_wandb_offline_gets_the_table(tmp_path, monkeypatch):
    """W&B files go under the run's output folder (not ./wandb of the checkout)."""
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    log_to_wandb(LoggerConfig(name="wandb", mode="offline"), "test-run", {"codec": "kivi"}, ROWS, directory=tmp_path)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    table_files = list(runs[0].rglob("results_*.table.json"))
    assert table_files and "kivi(bits=2)" in table_files[0].read_text()
