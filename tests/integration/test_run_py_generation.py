"""``python run.py`` on the embedded SmolLM2-135M: the generation benchmarks (RULER, and lm-eval's presets on their
fixtures) end to end."""

import json

import pytest

from tests.run_py import THREADS, run_py

pytestmark = pytest.mark.integration


def test_run_py_ruler_rows_per_length(embedded, tmp_path):
    result = run_py("benchmark=ruler", "benchmark.tasks=[niah_single_1,vt]", "benchmark.lengths=[512,768]",
                  "benchmark.num_samples=1", "benchmark.max_new_tokens=16", f"hardware.threads={THREADS}",
                  f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["codec"].split("(")[0], r["length"]) for r in rows] == [("fp16", 512), ("fp16", 768), ("kivi", 512), ("kivi", 768)]
    assert all({"acc_niah_single_1", "acc_vt", "acc_avg"} <= set(r) and len(r["predictions"]["vt"]) == 1 for r in rows)
    assert "acc_niah_single_1" in result.stdout


@pytest.mark.parametrize("preset, tasks", [("longbench", "[longbench_hotpotqa,longbench_passage_count]"), ("aime", "[aime24]")])
def test_run_py_lm_eval_presets_on_fixtures(embedded, tmp_path, preset, tasks):
    """The presets run offline on the fixtures through lm-eval, with the compressed cache."""
    result = run_py(f"benchmark={preset}", f"benchmark.tasks={tasks}", "benchmark.limit=1", "benchmark.max_gen_toks=8",
                  "benchmark.data=fixtures", f"hardware.threads={THREADS}", f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) == 2 and all(r["benchmark"].startswith(f"{preset}:fixtures") for r in rows)
    task_names = tasks.strip("[]").split(",")
    assert all({f"score_{t}" for t in task_names} | {"score_avg"} <= set(r) for r in rows)
