import json

import pytest

from kvcomp.config import LoggerConfig
from kvcomp.results import load_rows, log_to_wandb, markdown_table, write_json_atomic, write_summary

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


def test_summary_deduplicates_the_shared_reference(tmp_path):
    write_json_atomic(tmp_path / "bits=2" / "results.json", {"rows": ROWS})
    write_json_atomic(tmp_path / "bits=4" / "results.json", {"rows": [ROWS[0], {**ROWS[1], "codec": "kivi(bits=4)"}]})
    assert len(load_rows(tmp_path)) == 3
    table = write_summary(tmp_path)
    assert table.count("\n| m |") == 3
    assert (tmp_path / "summary.csv").read_text().count("\n") == 4


def test_wandb_offline_gets_the_table(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    log_to_wandb(LoggerConfig(name="wandb", mode="offline"), "test-run", {"codec": "kivi"}, ROWS)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    table_files = list(runs[0].rglob("results_*.table.json"))
    assert table_files and "kivi(bits=2)" in table_files[0].read_text()
