"""Bounded requests: calibration windows against the corpus, K/V collections against the cache
disk, cache reservations against memory, each refused with the numbers before anything big is allocated;
incomplete collections of killed runs are removed by the next run, never those a live run is writing."""

import collections

import pytest
import torch

from kvcomp.artifacts import file_lock
from kvcomp.cache import CompressedCache, with_cache
from kvcomp.cache.growing import CHECKED_FROM, GrowingTensor
from kvcomp.cache.memory import available_bytes
from kvcomp.calibration import CalibrationConfig, artifact_path, check_collection, check_windows, collect, fitted_for
from kvcomp.calibration.collect import KVActivations, collect_kv, collection_shape, kv_root
from kvcomp.codecs import ModelInfo, build_codec
from kvcomp.errors import ConfigError
from tests.codec_matrix import make_codec
from tests.helpers import info_of

Usage = collections.namedtuple("Usage", "total used free")
SMOLLM2 = ModelInfo(name="smollm2", num_layers=30, num_kv_heads=3, head_dim=64, fingerprint="aaaa")


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture
def free_disk(monkeypatch):
    """Sets the free bytes ``shutil.disk_usage`` reports (``free_disk(n)``)."""
    def set_free(free: int) -> None:
        monkeypatch.setattr(collect.shutil, "disk_usage", lambda path: Usage(10 * free, 9 * free, free))
    return set_free


@pytest.fixture
def allocated(monkeypatch):
    """The bytes of every buffer growing tensors allocate, in order."""
    sizes, empty = [], GrowingTensor._empty

    def recorded(self, *args):
        buffer = empty(self, *args)
        sizes.append(buffer.numel() * buffer.element_size())
        return buffer

    monkeypatch.setattr(GrowingTensor, "_empty", recorded)
    return sizes


def _prefill(model, cache, tokens: int = 12):
    ids = torch.randint(1, 96, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, **with_cache(model, cache), use_cache=True)


def test_a_capacity_beyond_memory_is_refused_before_allocating(tiny_llama, allocated):
    cache = CompressedCache(make_codec(tiny_llama, "fp16"), capacity=10**12)
    with pytest.raises(ConfigError, match=r"reserving 1000000000000 entries .* needs 128 TB \(128000000000000 bytes\) "
                                          r"of cpu memory, but .* \(\d+ bytes\) are available; lower CompressedCache\(capacity"):
        _prefill(tiny_llama, cache)
    assert max(allocated, default=0) < 2**20  # the refused buffer was never allocated


def test_a_reservation_is_checked_against_the_memory_available(tiny_llama, monkeypatch, allocated):
    assert available_bytes(torch.device("cpu")) > 0
    monkeypatch.setattr("kvcomp.cache.memory.available_bytes", lambda device: 10**6)
    cache = CompressedCache(make_codec(tiny_llama, "fp16"), capacity=2**18)  # 2 heads x 16 x fp32: 32 MiB buffers
    with pytest.raises(ConfigError, match=r"needs 33.6 MB \(33554432 bytes\) of cpu memory, but 1 MB \(1000000 bytes\)"):
        _prefill(tiny_llama, cache)
    assert max(allocated, default=0) < CHECKED_FROM
    _prefill(tiny_llama, CompressedCache(make_codec(tiny_llama, "fp16"), capacity=64))  # small: not checked


def test_more_windows_than_the_corpus_holds_are_refused_unless_oversample():
    lee = CalibrationConfig(name="lee", num_samples=100000, seq_len=512)
    with pytest.raises(ConfigError, match=r"num_samples=100000 windows of calibration.seq_len=512 tokens need 51200000 "
                                          r"tokens, but the 'lee' calibration corpus has 17306: 33 windows without "
                                          r"overlap; .* calibration.oversample=true"):
        check_windows(17306, lee)
    check_windows(17306, CalibrationConfig(name="lee", num_samples=33, seq_len=512))
    check_windows(17306, CalibrationConfig(name="lee", num_samples=100000, seq_len=512, oversample=True))


def test_calibration_data_checks_the_corpus_before_cutting_windows(cache_home, monkeypatch):
    import kvcomp.data
    from kvcomp.runner import calibration_data
    from tests.helpers import word_tokenizer

    monkeypatch.setattr(kvcomp.data, "load_corpus", lambda *args, **kwargs: [" ".join(f"w{i}" for i in range(20))])
    with pytest.raises(ConfigError, match="has 20: 2 windows without overlap"):
        calibration_data(None, word_tokenizer(), CalibrationConfig(num_samples=3, seq_len=8))
    data = calibration_data(None, word_tokenizer(), CalibrationConfig(num_samples=3, seq_len=8, oversample=True))
    assert data.windows.shape == (3, 8)


def test_oversample_is_not_part_of_an_artifacts_identity():
    codec = build_codec({"name": "kvquant"}, SMOLLM2)
    assert fitted_for(codec, CalibrationConfig(oversample=True)) == fitted_for(codec, CalibrationConfig())
    assert artifact_path(codec, CalibrationConfig(oversample=True)) == artifact_path(codec, CalibrationConfig())


def test_a_collection_the_disk_cannot_hold_is_refused_before_the_model_loads(cache_home, free_disk):
    codec = build_codec({"name": "kvquant"}, SMOLLM2)
    shape = collection_shape(SMOLLM2, 100000, 512, codec.calibration_drop_first)
    planned = KVActivations(kv_root(), shape, SMOLLM2.num_layers, codec.needs_fisher)
    free_disk(63 * 10**9)
    with pytest.raises(ConfigError, match=rf"collection of 100000 windows .* needs [\d.]+ TB \({planned.nbytes} bytes\) "
                                          rf".* 63 GB \(63000000000 bytes\) free: {63 * 10**9 // planned.window_nbytes} "
                                          r"windows fit; lower calibration.num_samples"):
        check_collection(codec, CalibrationConfig(num_samples=100000, seq_len=512))
    check_collection(codec, CalibrationConfig(num_samples=16, seq_len=512))


def test_the_runner_checks_windows_and_disk_before_loading_the_model(cache_home, free_disk, monkeypatch):
    import kvcomp.data
    import kvcomp.runner
    from kvcomp.benchmarks import build_benchmark
    from kvcomp.runner import check_config, check_data
    from tests.helpers import compose_config, word_tokenizer

    plan = check_config(compose_config("codec=kvquant", "calibration.num_samples=100000"))
    benchmark, codec = build_benchmark(plan.benchmark), build_codec(plan.codec, SMOLLM2)
    free_disk(63 * 10**9)
    with pytest.raises(ConfigError, match="needs .* TB .* windows fit"):  # the model's tokenizer is not at hand
        check_data(plan, benchmark, codec)
    monkeypatch.setattr(kvcomp.runner, "_local_tokenizer", lambda model: word_tokenizer())
    monkeypatch.setattr(kvcomp.data, "load_corpus", lambda *args, **kwargs: [" ".join(f"w{i}" for i in range(90))])
    with pytest.raises(ConfigError, match="corpus has 90: 0 windows without overlap"):
        check_data(plan, benchmark, codec)


def test_a_collection_is_sized_against_the_disk_before_it_is_written(tiny_llama, cache_home, free_disk):
    info = info_of(tiny_llama)
    windows = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    free_disk(10_000)  # 2 layers x 4 fields x 2 heads x 16 tokens x 16 x bf16 = 8192 bytes a window
    with pytest.raises(ConfigError, match=r"needs 16.4 kB \(16384 bytes\) .* 10 kB \(10000 bytes\) free: 1 windows fit"):
        collect_kv(tiny_llama, info, windows, drop_first=8)
    assert not any(p.is_dir() for p in kv_root().iterdir())  # nothing written
    free_disk(16384)
    collected = collect_kv(tiny_llama, info, windows, drop_first=8)
    assert collected.complete and collected.nbytes == 16384
    assert sum(p.stat().st_size for p in collected.paths()) == 16384
    free_disk(0)
    collect_kv(tiny_llama, info, windows, drop_first=8)  # reused: needs no disk
    kvquant = build_codec({"name": "kvquant"}, info)  # K/V + Fisher, 8 sinks dropped: the shape collected above
    check_collection(kvquant, CalibrationConfig(num_samples=2, seq_len=24))  # a cached collection may serve
    with pytest.raises(ConfigError, match="0 windows fit"):
        check_collection(kvquant, CalibrationConfig(num_samples=3, seq_len=24))


def test_incomplete_collections_of_killed_runs_are_removed_by_the_next_but_not_a_live_ones(
        tiny_llama, cache_home, monkeypatch):
    assert kv_root().is_relative_to(cache_home)
    info = info_of(tiny_llama)
    killed = torch.randint(0, 96, (3, 24), generator=torch.Generator().manual_seed(1))
    windows = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))

    def killed_after_one(items, *args, **kwargs):
        yield items[0]
        raise KeyboardInterrupt  # the run is killed while collecting

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(collect, "progress", killed_after_one)
        collect_kv(tiny_llama, info, killed, drop_first=8)
    left = [p for p in kv_root().iterdir() if p.is_dir()]
    assert len(left) == 1 and any(left[0].iterdir()) and not (left[0] / "complete.json").exists()
    live = kv_root() / "0123456789abcdef"  # a collection another run is writing now (it holds the lock)
    live.mkdir()
    (live / "layer000.key.bin").write_bytes(b"\0" * 64)
    with file_lock(live):
        store = collect_kv(tiny_llama, info, windows, drop_first=8)
    assert store.complete
    assert sorted(p.name for p in kv_root().iterdir() if p.is_dir()) == sorted([store.folder.name, live.name])
    assert (live / "layer000.key.bin").is_file()
    check_collection(build_codec({"name": "kvquant"}, info), CalibrationConfig(num_samples=2, seq_len=24))
    assert sorted(p.name for p in kv_root().iterdir() if p.is_dir()) == [store.folder.name]  # lock free: removed
