"""Results you can trust: content-keyed caches, checked artifacts, clear errors for bad input."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from kvcomp.artifacts import ArtifactError
from kvcomp.calibration import artifact_path, calibrate, fitted_for
from kvcomp.calibration.collect import activations_key, collect_kv
from kvcomp.codecs import CodecState, ModelInfo
from kvcomp.config import CalibrationConfig
from kvcomp.errors import ConfigError, NonFiniteStateError
from kvcomp.models import load_model
from kvcomp.models.fingerprint import model_fingerprint
from tests.helpers import TINY, word_tokenizer
from tests.toy_codecs import MODEL, OffsetCodec, OffsetConfig


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def save_tiny(folder, seed):
    """A tiny Llama folder (config, safetensors, tokenizer); ``seed`` picks the weights."""
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return str(folder)


def test_same_name_other_weights_never_share_a_cache_entry(tmp_path, cache_home):
    """Two tiny models with one config name but other weights: other fingerprints, so other reference,
    calibration-collection and artifact keys; a byte-identical copy shares them."""
    folders = [save_tiny(tmp_path / "a", 0), save_tiny(tmp_path / "b", 1)]
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in (tmp_path / "a").iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    prints = [model_fingerprint(*load_model(folder)) for folder in (*folders, str(copy))]
    assert prints[0]["weights_from"] == "files"
    assert prints[0]["config"] == prints[1]["config"] and prints[0]["tokenizer"] == prints[1]["tokenizer"]
    assert prints[0]["weights"] != prints[1]["weights"] and prints[0]["fingerprint"] != prints[1]["fingerprint"]
    assert prints[0]["fingerprint"] == prints[2]["fingerprint"]

    infos = [ModelInfo("same-name", 2, 2, 16, fingerprint=p["fingerprint"]) for p in prints[:2]]
    windows = torch.zeros(1, 16, dtype=torch.long)
    assert activations_key(infos[0], windows, 8) != activations_key(infos[1], windows, 8)
    calibration = CalibrationConfig()
    paths = [artifact_path(OffsetCodec(OffsetConfig(), info), calibration) for info in infos]
    assert paths[0] != paths[1]
    model, tokenizer = load_model(folders[0])
    with torch.no_grad():  # a parameter changed in memory changes the parameter hash too
        before = model_fingerprint(model, tokenizer)
        model.config._name_or_path = ""  # no files behind it: hashed over its parameters
        in_memory = model_fingerprint(model, tokenizer)
        model.model.layers[0].mlp.down_proj.weight.zero_()
        assert model_fingerprint(model, tokenizer)["weights"] != in_memory["weights"]
    assert in_memory["weights_from"] == "parameters" and before["weights_from"] == "files"


def test_reference_rows_are_keyed_on_the_fingerprint(tmp_path, cache_home):
    from kvcomp.benchmarks.perplexity import PerplexityBenchmark
    from kvcomp.codecs import build_codec
    from kvcomp.config import HardwareConfig, ModelConfig, PerplexityConfig
    from kvcomp.runner import _reference_rows

    model, tokenizer = load_model(save_tiny(tmp_path / "a", 0))
    benchmark = PerplexityBenchmark(PerplexityConfig(seq_len=16, protocols=["streaming"]))
    benchmark.windows = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    rows = {}
    for seed in (0, 1):  # same name, other weights
        torch.manual_seed(seed)
        model.model.layers[0].mlp.down_proj.weight.data.normal_()
        info = ModelInfo.from_hf_config(model.config, name="same", fingerprint=f"fp{seed}")
        rows[seed], _ = _reference_rows(model, build_codec({"name": "fp16"}, info), benchmark, ModelConfig(),
                                        HardwareConfig(), False)
    assert rows[0][0]["reference_key"] != rows[1][0]["reference_key"]
    assert rows[0][0]["ppl_streaming"] != rows[1][0]["ppl_streaming"]
    path = cache_home / "reference" / f"{rows[1][0]['reference_key']}.json"
    assert len(list(path.parent.glob("*.json"))) == 2 and path.is_file()
    path.write_text(path.read_text()[:20])  # truncated
    reference = build_codec({"name": "fp16"}, info)
    with pytest.raises(ArtifactError, match=rf"{path.name} is unreadable.*force=true"):
        _reference_rows(model, reference, benchmark, ModelConfig(), HardwareConfig(), False)
    untimed = lambda rows: [{k: v for k, v in row.items() if not k.startswith("eval_seconds")} for row in rows]  # noqa: E731
    recomputed, kept = _reference_rows(model, reference, benchmark, ModelConfig(), HardwareConfig(), True)
    assert untimed(recomputed) == untimed(rows[1]) and kept["states_streaming"].shape == (2, 16, 64)
    states = path.with_suffix(".safetensors")  # the states the distribution metrics compare with, beside the rows
    states.write_bytes(states.read_bytes()[:40])
    with pytest.raises(ArtifactError, match=rf"reference tensors .*{states.name} cannot be read.*force=true"):
        _reference_rows(model, reference, benchmark, ModelConfig(), HardwareConfig(), False)


def _fitted_artifact(cache_home, model=MODEL):
    codec = OffsetCodec(OffsetConfig(), model)
    calibration = CalibrationConfig(num_samples=2, seq_len=4)
    calibrate(codec, calibration, lambda: torch.ones(2, 4))
    return codec, calibration, artifact_path(codec, calibration)


@pytest.mark.parametrize("damage", ["truncate", "garble_header", "flip_data"])
def test_damaged_artifact_is_a_clear_error_and_force_refits(cache_home, damage):
    codec, calibration, path = _fitted_artifact(cache_home)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 10]
    elif damage == "garble_header":
        data[10:30] = b"x" * 20
    else:
        data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=rf"{path.name}.*(delete it, or run with force=true)"):
        calibrate(OffsetCodec(OffsetConfig(), MODEL), calibration, lambda: pytest.fail("must not fit"))
    report = calibrate(OffsetCodec(OffsetConfig(), MODEL), calibration, lambda: torch.ones(2, 4), force=True)
    assert report["reused"] is False
    assert calibrate(OffsetCodec(OffsetConfig(), MODEL), calibration, lambda: None)["reused"] is True


def test_relabelled_artifact_fails_its_checksum(cache_home):
    """An artifact fitted for one model, whose header is edited to claim another model, is refused."""
    _, calibration, path = _fitted_artifact(cache_home)
    other = ModelInfo("tiny", 2, 2, 16, fingerprint="bbbb")
    forged = {**json.loads(_metadata(path)["fitted_for"]), **fitted_for(OffsetCodec(OffsetConfig(), other), calibration)}
    save_file(load_file(str(path)), str(path), metadata={**_metadata(path), "fitted_for": json.dumps(forged, sort_keys=True)})
    with pytest.raises(ArtifactError, match="checksum"):
        calibrate(OffsetCodec(OffsetConfig(), other), calibration, lambda: None, path=path)


def _metadata(path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


def test_non_finite_states_are_refused_with_layer_and_field(cache_home, tmp_path):
    class NaNCodec(OffsetCodec):
        def fit(self, calibration):
            return CodecState({"layer1.key.codebooks": torch.tensor([1.0, float("nan")])})

    codec = NaNCodec(OffsetConfig(), MODEL)
    with pytest.raises(NonFiniteStateError, match="layer 1, field 'key.codebooks' holds NaN or Inf"):
        calibrate(codec, CalibrationConfig(), lambda: None)
    assert not artifact_path(codec, CalibrationConfig()).exists()
    state = CodecState({"layer0.value.scale": torch.tensor([float("inf")])}, fitted_for={"x": 1})
    state.save(tmp_path / "s.safetensors")  # a consistent file whose content is not finite
    with pytest.raises(NonFiniteStateError, match="layer 0, field 'value.scale'"):
        CodecState.load(tmp_path / "s.safetensors", {"x": 1})


def test_damaged_calibration_shards_are_never_reused(tiny_llama, cache_home):
    from tests.helpers import info_of

    info = info_of(tiny_llama)
    windows = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    store = collect_kv(tiny_llama, info, windows, drop_first=8)
    record = json.loads(store.record_path.read_text())
    assert len(record["files"]) == 4 * info.num_layers and all(r["bytes"] > 0 for r in record["files"].values())
    shard = store.path(1, "value")
    expected = store.tensor(1, "value").clone()
    shard.write_bytes(shard.read_bytes()[:-64])  # truncated: from_file would pad it with zeros
    with pytest.raises(ArtifactError, match=rf"{shard.name} has .* bytes.*force=true"):
        collect_kv(tiny_llama, info, windows, drop_first=8)
    assert shard.stat().st_size < expected.numel() * 2  # the check did not grow the file
    data = bytearray(store.path(0, "key").read_bytes())
    data[5] ^= 0x40
    store.path(0, "key").write_bytes(bytes(data))
    again = collect_kv(tiny_llama, info, windows, drop_first=8, force=True)
    assert torch.equal(again.tensor(1, "value"), expected)
    collect_kv(tiny_llama, info, windows, drop_first=8)  # verified and reused
    store.record_path.write_text("{not json")
    with pytest.raises(ArtifactError, match="complete.json is unreadable"):
        collect_kv(tiny_llama, info, windows, drop_first=8)


def test_token_cache_is_loaded_weights_only_and_checked(tmp_path, cache_home):
    from kvcomp.data.corpora import tokenize_documents

    tokenizer = word_tokenizer()
    ids = tokenize_documents(["w1 w2 w3", "w4"], tokenizer)
    cached = next((cache_home / "tokens").glob("*.pt"))
    assert torch.equal(tokenize_documents(["w1 w2 w3", "w4"], tokenizer), ids)
    cached.write_bytes(cached.read_bytes()[:30])
    with pytest.raises(ArtifactError, match=rf"{cached.name} is unreadable.*delete it"):
        tokenize_documents(["w1 w2 w3", "w4"], tokenizer)


def test_calibration_needs_a_positive_sample_count_and_windows_longer_than_the_sinks(tiny_llama, cache_home):
    from kvcomp.config import typed
    from tests.helpers import info_of

    with pytest.raises(ConfigError, match="calibration.num_samples=0 is out of range; valid: an integer >= 1"):
        typed("calibration", {"num_samples": 0})
    with pytest.raises(ConfigError, match=r"calibration.seq_len=8 .* valid: calibration.seq_len > 8"):
        collect_kv(tiny_llama, info_of(tiny_llama), torch.zeros(1, 8, dtype=torch.long), drop_first=8)


@pytest.mark.parametrize("override, message", [
    ("benchmark.seq_len=1", "benchmark.seq_len=1 is out of range; valid: an integer >= 2"),
    ("benchmark.batch_size=0", "benchmark.batch_size=0 is out of range"),
    ("benchmark.chunk_tokens=0", "benchmark.chunk_tokens=0 is out of range; valid: an integer >= 1"),
    ("hardware.threads=-1", "hardware.threads=-1 is out of range; valid: an integer >= 0"),
    ("calibration.num_samples=0", "calibration.num_samples=0 is out of range"),
    ("model.source=/no/such/folder", "neither 'embedded', 'hub' .* nor an existing folder"),
    ("hardware.dtype=float8", r"hardware.dtype='float8' is unknown; valid choices: float32, bfloat16, float16, auto"),
    ("benchmark=ruler benchmark.num_samples=0", "benchmark.num_samples=0 is out of range"),
])
def test_bad_input_is_a_config_error_naming_the_field(override, message):
    from kvcomp.runner import check_config
    from tests.helpers import compose_config

    with pytest.raises(ConfigError, match=message):
        check_config(compose_config(*override.split()))


def test_a_cuda_profile_on_a_machine_without_cuda_says_so(tmp_path):
    from kvcomp.runner import check_config
    from tests.helpers import compose_config

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match=r"needs CUDA, but torch.cuda.is_available\(\) is False.*hardware=cpu"):
        check_config(compose_config("hardware=h100"))
    with pytest.raises(ConfigError, match="without config.json"):
        check_config(compose_config(f"model.source={tmp_path}"))


def test_sweep_members_are_checked_before_they_run():
    from omegaconf import OmegaConf

    from kvcomp.sweep import sweep_members

    config = OmegaConf.create({"hydra": {
        "sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper", "params": {"seed": "0,1"}},
        "overrides": {"task": ["codec=kivi", "codec.bits=9,2"]},
    }})
    members = sweep_members(config)
    assert len(members) == 4 and ["seed=0", "codec=kivi", "codec.bits=9"] in members


STORAGE_FULL = 'Error while serializing: I/O error: No space left on device (os error 28)'


def test_a_full_disk_names_the_folder_and_the_bytes_and_leaves_no_partial_file(tmp_path, monkeypatch):
    """safetensors' own error on a full disk (after part of the file is written), and an OSError from a text
    write: one :class:`ArtifactError` naming the folder, the file and the bytes it needs; nothing left behind."""
    import errno

    from safetensors import SafetensorError

    from kvcomp.artifacts import write_text_atomic

    def full(tensors, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise SafetensorError(STORAGE_FULL)

    monkeypatch.setattr("kvcomp.codecs.base.save_file", full)
    state = CodecState({"codebook": torch.zeros(2**18)}, {"codec": "x"})  # 1 MiB
    folder = tmp_path / "calibration"
    with pytest.raises(ArtifactError, match=rf"no space left in {folder} for x.safetensors: it needs 1.0 MiB, "
                                            r"[\d.]+ MiB are free; free space there or write elsewhere") as error:
        state.save(folder / "x.safetensors")
    assert "\n" not in str(error.value) and list(folder.iterdir()) == []

    def no_space(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", no_space)
    with pytest.raises(ArtifactError, match=rf"no space left in {tmp_path} for results.json: it needs 0.0 MiB"):
        write_text_atomic(tmp_path / "results.json", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calibration"]
