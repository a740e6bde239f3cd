"""Hub models and corpora offline: a stand-in Hugging Face cache (tests/standin_hub.py) under real repository
ids and file names, ``HF_HUB_OFFLINE=1``, and the documented commands through the real runner.

The stand-in is built once per session (tiny random models, a few KB of text per corpus file);
``huggingface_hub`` reads ``HF_HOME`` / ``HF_HUB_OFFLINE`` at import, so its constants are patched too.
"""

import json
import math

import pytest

from kvcomp.config import register_configs
from kvcomp.data import HubUnavailableError, check_corpus_available, hub_download_command, load_corpus
from kvcomp.errors import ConfigError
from tests.helpers import compose_config
from tests.standin_hub import (CORPUS_FILES, MISTRAL_WINDOW, MODELS, REDPAJAMA_SOURCES, build_standin_hub, stage_corpus,
                               use_hub)

register_configs()
HUB_CORPORA = tuple(CORPUS_FILES)


@pytest.fixture(scope="session")
def standin(tmp_path_factory):
    """``HF_HOME`` of the stand-in hub: every corpus and model, with the embedded SmolLM2 tokenizer."""
    from kvcomp.data.assets import embedded_model_dir

    tokenizer_dir = embedded_model_dir()
    if not (tokenizer_dir / "tokenizer.json").is_file():
        pytest.skip("embedded tokenizer not fetched (run scripts/setup.sh)")
    return build_standin_hub(tmp_path_factory.mktemp("hf_home"), tokenizer_dir)


@pytest.fixture(scope="session")
def kvcomp_cache(tmp_path_factory):
    """A session's KVCOMP_CACHE, sharing the embedded corpora already fetched by setup."""
    from kvcomp.paths import cache_dir

    cache = tmp_path_factory.mktemp("kvcomp-cache")
    corpora = cache_dir() / "corpora"
    if corpora.is_dir():
        (cache / "corpora").symlink_to(corpora, target_is_directory=True)
    return cache


@pytest.fixture
def offline(standin, kvcomp_cache, monkeypatch):
    use_hub(monkeypatch, standin)
    monkeypatch.setenv("KVCOMP_CACHE", str(kvcomp_cache))
    return standin


@pytest.fixture
def bare_hub(tmp_path, monkeypatch):
    """An empty offline HF_HOME (stage files into it) and an empty KVCOMP_CACHE."""
    use_hub(monkeypatch, tmp_path / "hf")
    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path / "kvcomp"))
    return tmp_path / "hf"


# ------------------------------------------------------------------------------------------------
# Corpora
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", HUB_CORPORA)
def test_hub_corpus_loads_both_splits_offline(offline, name):
    check_corpus_available(name)
    cal, ev = load_corpus(name, "calibration"), load_corpus(name, "evaluation")
    assert cal and ev and not set(cal) & set(ev)
    if name == "wikitext2":  # articles of the train / test files, cut at the ' = Title = ' rows
        assert all(d.startswith("= wikitext2 train-") for d in cal) and len(cal) == 6
        assert all(d.startswith("= wikitext2 test-") for d in ev) and "= = Section = =" in ev[0]
    elif name == "c4":  # train / validation shards, in file order
        assert cal[0].startswith("c4 c4-train.00000-of-01024.json.gz document 0.")
        assert all("c4-validation.00000-of-00008" in d for d in ev) and len(ev) == 24
    else:  # one published split: a hashed quarter goes to calibration
        assert len(cal) + len(ev) == 24 * (len(REDPAJAMA_SOURCES) if name == "redpajama" else 1)
        assert len(cal) < len(ev)
    assert load_corpus(name, "calibration", max_documents=2) == cal[:2]


def test_redpajama_interleaves_its_files_by_seed(offline):
    docs = load_corpus("redpajama", "evaluation", seed=0)
    sources = [d.split()[1] for d in docs]
    assert set(sources) == {f"{s}_sample.jsonl" for s in REDPAJAMA_SOURCES}
    assert len(set(sources[:30])) >= 8  # mixed from the start, not file after file
    assert load_corpus("redpajama", "evaluation", seed=0) == docs
    assert load_corpus("redpajama", "evaluation", seed=1)[:20] != docs[:20]


def test_missing_corpus_file_names_it_and_the_download_command(bare_hub):
    validation = "en/c4-validation.00000-of-00008.json.gz"
    stage_corpus(bare_hub, "c4", skip=(validation,))
    command = ("hf download allenai/c4 en/c4-train.00000-of-01024.json.gz en/c4-validation.00000-of-00008.json.gz "
               "--repo-type dataset")
    assert hub_download_command("c4") == command
    for attempt in (lambda: check_corpus_available("c4"), lambda: load_corpus("c4", "evaluation")):
        with pytest.raises(HubUnavailableError) as err:
            attempt()
        message = str(err.value)
        assert "'c4'" in message and "offline" in message and validation in message and command in message
        assert "c4-train" not in message.split(command)[0]  # only the missing file is listed
    check_corpus_available("c4", split="calibration")  # the train shard is there
    assert load_corpus("c4", "calibration", max_documents=3)

    with pytest.raises(HubUnavailableError, match=r'--include "\*_sample.jsonl".*calibration=enwiki'):
        check_corpus_available("redpajama")
    check_corpus_available("enwiki")  # embedded corpora are never checked against the hub
    with pytest.raises(ValueError, match="corpus"):
        check_corpus_available("wikitext103")


def test_unreadable_corpus_file_is_named(bare_hub):
    snapshot = stage_corpus(bare_hub, "fineweb")
    (snapshot / "sample/10BT/000_00000.parquet").write_bytes(b"not parquet")
    with pytest.raises(HubUnavailableError, match="cannot read HuggingFaceFW/fineweb/sample/10BT/000_00000.parquet"):
        load_corpus("fineweb", "calibration")


def test_online_check_reports_an_unreachable_hub(tmp_path, monkeypatch):
    import huggingface_hub

    use_hub(monkeypatch, tmp_path / "hf", offline=False)

    def unreachable(*args, **kwargs):
        raise ConnectionError("Failed to resolve 'huggingface.co'")

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", unreachable)
    with pytest.raises(HubUnavailableError, match="did not serve.*ConnectionError.*sample/10BT/000_00000.parquet"):
        check_corpus_available("fineweb")


# ------------------------------------------------------------------------------------------------
# Models and the documented commands through the runner
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("repo_id", list(MODELS))
def test_standin_models_load_offline(offline, repo_id):
    import torch

    from kvcomp.models import load_model

    model, tokenizer = load_model("hub", hub_id=repo_id)
    ids = tokenizer(["The river city"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    config = model.config
    if repo_id.startswith("Qwen/"):
        assert model.model.layers[0].self_attn.k_proj.bias is not None
    if repo_id.startswith("google/"):
        assert config.layer_types == ["sliding_attention", "full_attention"]
    if repo_id.startswith("mistralai/"):
        assert config.sliding_window == MISTRAL_WINDOW


def _run(tmp_path, *overrides):
    from kvcomp.runner import run

    overrides = ["hardware.threads=1", "benchmark.seq_len=64", "benchmark.num_windows=2", *overrides]
    results = run(compose_config(*overrides), tmp_path / "out", overrides)
    assert results["rows"] and all(math.isfinite(row["ppl_streaming"]) for row in results["rows"])
    return results


def test_run_hub_model_offline(offline, tmp_path):
    results = _run(tmp_path, "model=llama32_1b")  # perplexity on the embedded default corpus
    assert results["model"]["name"] == "llama32_1b" and results["model"]["weights_from"] == "files"
    assert [row["codec"].split("(")[0] for row in results["rows"]] == ["fp16", "kivi"]
    assert results["rows"][0]["benchmark"] == "perplexity:enwiki/evaluation 2x64"


@pytest.mark.parametrize("corpus", HUB_CORPORA)
def test_run_calibrates_on_a_hub_corpus_offline(offline, tmp_path, corpus):
    results = _run(tmp_path, "model=llama32_1b", "codec=kvquant", "codec.kmeans_iters=2", f"calibration={corpus}",
                   "calibration.num_samples=2", "calibration.seq_len=64", "benchmark.dataset=wikitext2")
    assert results["calibration"]["artifact"] and not results["calibration"]["reused"]
    assert all(row["benchmark"].startswith("perplexity:wikitext2/evaluation 2x64") for row in results["rows"])


def test_run_sliding_window_model_offline(offline, tmp_path):
    """Mistral (a window on every layer): with compress_sliding the codec encodes the sliding layers."""
    results = _run(tmp_path, "model=mistral_7b", "codec.compress_sliding=true", "codec.residual_length=32")
    reference, kivi = results["rows"]
    assert results["model"]["name"] == "mistral_7b" and reference["codec"] == "fp16(compress_sliding=True)"
    assert kivi["encoded_share"] > 0 and kivi["bits_per_value_sliding_attention"] < 32


def test_run_lm_eval_task_offline_from_the_hub_cache(offline, tmp_path, monkeypatch):
    """``benchmark=lm_eval`` on a task whose dataset was fetched with ``hf download --repo-type dataset``;
    lm-eval's task index (seconds to build) is built once for the check and the run."""
    import lm_eval.tasks

    from kvcomp.runner import run
    from tests.standin_lmeval import stage_task_dataset

    full, built = lm_eval.tasks.TaskManager, []
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda **kw: built.append(1) or full(**kw))
    staged = stage_task_dataset(offline)
    overrides = ["hardware.threads=1", "model=llama32_1b", "benchmark=lm_eval", f"benchmark.tasks=[{staged.task}]",
                 "benchmark.limit=2", "benchmark.max_length=256"]
    results = run(compose_config(*overrides), tmp_path / "out", overrides)
    assert [row["benchmark"] for row in results["rows"]] == ["lm_eval:hub_cache (1 tasks)"] * 2
    assert all(0 <= row[f"score_{staged.task}"] <= 1 for row in results["rows"]) and len(built) == 1
    assert set(results["rows"][1]["lm_eval"][staged.task]) == {"acc,none", "acc_norm,none"}


def test_data_is_checked_before_the_model_loads(bare_hub, monkeypatch, tmp_path):
    """Missing hub data stops a run before its weights load; data a run does not read is not asked for."""
    from kvcomp import runner

    class Loaded(Exception):
        pass

    def load_model(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(runner, "load_model", load_model)
    for overrides, missing in [
        (["codec=kvquant", "calibration=wikitext2"], "train-00000-of-00001.parquet"),  # calibrates on it
        (["benchmark.dataset=c4"], "c4-validation"),
        (["benchmark=ruler", "benchmark.haystack=fineweb"], "000_00000.parquet"),
        (["benchmark=lm_eval", "benchmark.tasks=[arc_easy]", "benchmark.data=hub"], "allenai/ai2_arc"),
    ]:
        with pytest.raises(HubUnavailableError, match=missing):
            runner.run(compose_config(*overrides), tmp_path / "out", overrides)
    with pytest.raises(Loaded):  # KIVI calibrates on nothing: its calibration corpus is never needed
        runner.run(compose_config("codec=kivi", "calibration=wikitext2"), tmp_path / "out")
    artifact = tmp_path / "fitted.safetensors"  # a fitted artifact given: the corpus may not be needed
    artifact.write_bytes(b"checked when loaded")
    with pytest.raises(Loaded):
        runner.run(compose_config("codec=kvquant", "calibration=wikitext2", f"calibration.artifact={artifact}"), tmp_path / "out")


def _folder(snapshot, tmp_path, name):
    """A hub snapshot copied to a plain folder ``name`` (links resolved), as a user's local model folder."""
    import shutil

    return shutil.copytree(snapshot, tmp_path / name)


def test_a_local_folder_run_carries_the_folder_name_and_times_its_phases(offline, tmp_path):
    from tests.standin_hub import snapshot_dir

    folder = _folder(snapshot_dir(offline, "google/gemma-3-1b-pt"), tmp_path, "my-gemma-3")
    results = _run(tmp_path, f"model.source={folder}", "benchmark.protocols=[streaming]")
    assert results["model"]["name"] == "my-gemma-3" and {row["model"] for row in results["rows"]} == {"my-gemma-3"}
    assert {"load_seconds", "fingerprint_seconds", "codec_seconds", "benchmark_data_seconds", "reference_seconds",
            "evaluation_seconds", "total_seconds"} <= set(results["timings"])
    named = _run(tmp_path / "named", f"model.source={folder}", "model.name=gemma3_tiny", "benchmark.protocols=[streaming]")
    assert named["model"]["name"] == "gemma3_tiny"

    mistral = _folder(snapshot_dir(offline, "mistralai/Mistral-7B-v0.3"), tmp_path, "my-mistral")
    with pytest.raises(ConfigError, match="every layer of my-mistral uses sliding-window attention"):
        _run(tmp_path, f"model.source={mistral}")


def test_the_fingerprint_ignores_mistrals_consolidated_file(offline):
    """Mistral's repository carries consolidated.safetensors beside the shards transformers loads."""
    from kvcomp.models import load_model
    from kvcomp.models.fingerprint import model_fingerprint, weight_files
    from tests.standin_hub import snapshot_dir

    model, tokenizer = load_model("hub", hub_id="mistralai/Mistral-7B-v0.3")
    snapshot = snapshot_dir(offline, "mistralai/Mistral-7B-v0.3")
    files = weight_files(model)
    assert files and all(f.name.startswith("model-") for f in files)
    assert sorted(f.name for f in files) == sorted(set(json.loads(
        (snapshot / "model.safetensors.index.json").read_text())["weight_map"].values()))
    before = model_fingerprint(model, tokenizer)["weights"]
    consolidated = snapshot / "consolidated.safetensors"
    kept = consolidated.read_bytes()
    try:  # the session's stand-in hub is shared: put the file back
        consolidated.write_bytes(b"another file that transformers never reads")
        assert model_fingerprint(model, tokenizer)["weights"] == before
    finally:
        consolidated.write_bytes(kept)

