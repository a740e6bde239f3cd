"""lm-eval tasks offline: ``data=hub`` / ``auto`` read the local Hugging Face cache (the snapshot that
``hf download --repo-type dataset`` leaves, or the Arrow cache of ``datasets``); missing data is one
error from ``check``, before the model loads."""

import json
import urllib.request
from pathlib import Path

import pytest

from kvcomp.benchmarks.lm_eval_bridge import LMEvalBenchmark
from kvcomp.config import LMEvalConfig, ModelConfig
from kvcomp.data import HubUnavailableError, hub_offline
from tests.standin_hub import use_hub
from tests.standin_lmeval import COMMIT, REPO, ROWS, stage_arrow_cache, stage_task_dataset


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """An empty ``HF_HOME`` in offline mode: the environment, and the constants huggingface_hub and datasets
    read from it at import; asking the hub fails the test."""
    home = tmp_path / "hf"
    use_hub(monkeypatch, home)
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: pytest.fail("asked the hub while offline"))
    assert hub_offline()
    return home


@pytest.fixture
def small_index(monkeypatch):
    """lm-eval's ``TaskManager`` over the arc and sciq task folders only (the full index takes seconds), in
    place of the full one; returns the list of the ones built."""
    import lm_eval.tasks

    full, built = lm_eval.tasks.TaskManager, []
    folders = [Path(lm_eval.tasks.__file__).parent / name for name in ("arc", "sciq")]

    def small(metadata=None, **kwargs):
        built.append(full(include_path=folders, include_defaults=False, metadata=metadata))
        return built[-1]

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", small)
    return built


def _checked(**config) -> LMEvalBenchmark:
    bench = LMEvalBenchmark(LMEvalConfig(**config))
    bench.check(ModelConfig())
    return bench


def _test_ids(bench, task):
    return [doc["id"] for doc in bench.task_manager.load([task])["tasks"][task].test_docs()]


@pytest.mark.parametrize("data", ["hub", "auto"])
def test_offline_hub_data_reads_the_hub_cache_snapshot(hf_home, small_index, data):
    """The tag ai2_arc (arc_easy, arc_challenge): each task reads its own config's files from the snapshot."""
    staged = stage_task_dataset(hf_home)
    bench = _checked(tasks=["ai2_arc"], data=data)
    assert bench.source == "hub_cache" and len(small_index) == 1
    assert bench.fingerprint()["local"] == {"arc_easy": f"{REPO}@{COMMIT}", "arc_challenge": f"{REPO}@{COMMIT}"}
    easy = bench.task_manager.load(["arc_easy"])["tasks"]["arc_easy"]
    assert easy.config.dataset_path == str(staged.snapshot) and easy.config.dataset_name == "ARC-Easy"
    docs = list(easy.test_docs())
    assert [d["id"] for d in docs] == [r["id"] for r in staged.rows["test"]]
    assert easy.doc_to_text(docs[0]) == f"Question: {staged.rows['test'][0]['question']}\nAnswer:"
    assert easy.doc_to_target(docs[2]) == 0  # answerKey "1" among labels 1-4
    assert [d["id"] for d in easy.validation_docs()] == [r["id"] for r in staged.rows["validation"]]
    assert _test_ids(bench, "arc_challenge") == [r["id"] for r in ROWS["ARC-Challenge"]["test"]]
    bench.prepare(None, None, ModelConfig())
    assert bench.tasks == ["ai2_arc"] and len(small_index) == 1  # check and prepare share one task index


def test_a_prepared_arrow_cache_runs_the_task_unchanged(hf_home, small_index, tmp_path):
    """With no snapshot, the Arrow cache an online run prepared serves the hub id offline, as lm-eval asks it."""
    stage_arrow_cache(hf_home, tmp_path / "scratch")
    bench = _checked(tasks=["arc_easy"], data="hub")
    assert bench.source == "hub_cache" and bench.local_data["arc_easy"].snapshot is None
    assert bench.fingerprint()["local"] == {"arc_easy": REPO}
    assert _test_ids(bench, "arc_easy") == [r["id"] for r in ROWS["ARC-Easy"]["test"]]
    assert bench.task_manager.load(["arc_easy"])["tasks"]["arc_easy"].config.dataset_path == REPO


@pytest.mark.parametrize("data", ["hub", "auto"])
def test_missing_data_offline_is_one_clear_error_from_check(hf_home, small_index, data):
    stage_task_dataset(hf_home)
    with pytest.raises(HubUnavailableError) as err:
        _checked(tasks=["arc_easy", "sciq"], data=data)
    text = str(err.value)
    assert "1 task(s)" in text and "allenai/sciq (task sciq)" in text
    assert "`hf download allenai/sciq --repo-type dataset`" in text and "ai2_arc" not in text


def test_a_partial_download_names_the_missing_split(hf_home, small_index):
    staged = stage_task_dataset(hf_home)
    (staged.snapshot / "ARC-Easy" / "validation-00000-of-00001.parquet").unlink()
    with pytest.raises(HubUnavailableError, match=r"arc_easy\).*no files for split\(s\) \['validation'\]"):
        _checked(tasks=["arc_easy"], data="hub")


def test_auto_offline_falls_back_to_fixtures_when_data_is_missing(hf_home, small_index, tmp_path):
    fixture = tmp_path / "sciq.jsonl"
    fixture.write_text(json.dumps({"question": "Q?", "distractor1": "a", "distractor2": "b", "distractor3": "c",
                                   "correct_answer": "d", "support": "S."}) + "\n")
    bench = _checked(tasks=["sciq"], data="auto", fixtures={"sciq": str(fixture)})
    assert bench.source == "fixtures" and bench.fixture_files == {"sciq": fixture.resolve()}
