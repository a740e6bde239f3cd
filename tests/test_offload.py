"""Store -> restore of a compressed cache between turns (kvcomp.cache.offload): the stored bytes come back
exactly, in memory and through a safetensors file, and the next turn sees the same cache."""

import json

import pytest
import torch

from kvcomp.cache import CompressedCache, install
from kvcomp.cache.offload import StoredCache, restore, store
from kvcomp.errors import ConfigError
from kvcomp.codecs import build_codec
from kvcomp.calibration import CalibrationData, calibrate
from tests.codec_matrix import CALIBRATION, MATRIX, calibration_windows, make_codec
from tests.conftest import info_of, load_script


pytestmark = pytest.mark.usefixtures("session_cache")


def _all_bytes(cache: CompressedCache) -> list[bytes]:
    """Every stored tensor's bytes in a fixed order (payloads, ragged rows, sinks, tails)."""
    stored = store(cache)
    return [stored.tensors[k].contiguous().view(torch.uint8).numpy().tobytes() for k in sorted(stored.tensors)]


@pytest.mark.parametrize("name", ["kvtc", "kivi", "uniform"])
def test_store_restore_is_exact_and_the_next_turn_matches(tiny_llama, name, tmp_path):
    install(tiny_llama)
    codec = make_codec(tiny_llama, name)
    ids = torch.randint(0, 96, (2, 50), generator=torch.Generator().manual_seed(3))
    cache = CompressedCache(codec, "exact_prefill")
    tiny_llama(ids[:, :40], past_key_values=cache, use_cache=True)  # turn 1
    stored = store(cache)
    assert stored.nbytes == cache.nbytes + sum(t.numel() * t.element_size() for k, t in stored.tensors.items()
                                               if k.endswith("position_ids"))
    path = stored.save(tmp_path / "turn1.safetensors")
    loaded = StoredCache.load(path)
    assert loaded.meta == stored.meta and sorted(loaded.tensors) == sorted(stored.tensors)
    restored = restore(loaded, codec)
    assert _all_bytes(restored) == _all_bytes(cache)
    assert restored.nbytes == cache.nbytes and restored.get_seq_length() == 40
    expected = tiny_llama(ids[:, 40:], past_key_values=cache, use_cache=True).logits  # turn 2
    got = tiny_llama(ids[:, 40:], past_key_values=restored, use_cache=True).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert _all_bytes(restored) == _all_bytes(cache)  # and both went on to encode the same blocks


def test_restore_refuses_another_codec_and_unsupported_codecs(tiny_llama):
    install(tiny_llama)
    codec = make_codec(tiny_llama, "kivi")
    cache = CompressedCache(codec, "exact_prefill")
    tiny_llama(torch.randint(0, 96, (1, 30)), past_key_values=cache, use_cache=True)
    other = make_codec(tiny_llama, "kivi", group_size=4)
    with pytest.raises(ConfigError, match="restore it with the same one"):
        restore(store(cache), other)
    aquakv = build_codec(MATRIX["aquakv"].config, info_of(tiny_llama))  # layer scope (no need to fit it)
    with pytest.raises(NotImplementedError, match="not supported"):
        store(CompressedCache(aquakv, "exact_prefill"))


def test_restore_refuses_a_kvtc_cache_stored_under_another_calibration(tiny_llama, tmp_path):
    install(tiny_llama)
    codec = make_codec(tiny_llama, "kvtc")
    cache = CompressedCache(codec, "exact_prefill")
    tiny_llama(torch.randint(0, 96, (1, 30)), past_key_values=cache, use_cache=True)
    stored = StoredCache.load(store(cache).save(tmp_path / "turn1.safetensors"))
    assert stored.meta["calibration"] == codec.calibrated_with and len(codec.calibrated_with) == 64
    other = build_codec(MATRIX["kvtc"].config, info_of(tiny_llama))  # the same configuration, fitted on other windows
    windows = calibration_windows(seed=1)
    calibrate(other, CALIBRATION, lambda: CalibrationData(tiny_llama, None, windows, None).activations(other),
              tmp_path / "other-calibration.safetensors")
    assert other.describe() == codec.describe() and other.calibrated_with != codec.calibrated_with
    with pytest.raises(ConfigError, match=f"turn1.safetensors was made with calibration '{codec.calibrated_with}'"):
        restore(stored, other)
    assert restore(stored, codec).get_seq_length() == 30


def test_multiturn_benchmark_rows(tiny_llama):
    from kvcomp.benchmarks.multiturn import MultiTurnConfig, evaluate_multiturn

    install(tiny_llama)
    codec = make_codec(tiny_llama, "kvtc")
    conversations = torch.randint(0, 96, (2, 24 + 2 * 8), generator=torch.Generator().manual_seed(5))
    rows = evaluate_multiturn(tiny_llama, codec, conversations, MultiTurnConfig(24, 8, 2, 1, on_disk=True))
    assert [r["turn"] for r in rows] == [1, 2] and all(r["conversations"] == 2 for r in rows)
    first, second = rows
    assert first["context_tokens"] == 24 and second["context_tokens"] == 32
    assert 0 < first["stored_bytes"] < second["stored_bytes"] and first["file_bytes"] > first["stored_bytes"]
    assert first["uncompressed_bytes"] == 2 * codec.model.num_layers * codec.width * 24 * 4  # fp32 K and V
    assert first["recompute_check"] == 1.0  # recomputing the history gives the kept cache's predictions
    for r in rows:
        assert r["ttft_restore"] > 0 and r["ttft_recompute"] > 0 and r["ttft_uncompressed"] > 0
        assert 0 <= r["agreement"] <= 1 and r["ppl_restored"] > 1 and r["ppl_uncompressed"] > 1


def test_flush_stores_the_whole_cache_compressed(tiny_llama):
    install(tiny_llama)
    codec = make_codec(tiny_llama, "kvtc")
    ids = torch.randint(0, 96, (1, 50), generator=torch.Generator().manual_seed(4))
    cache = CompressedCache(codec, "exact_prefill")
    tiny_llama(ids[:, :42], past_key_values=cache, use_cache=True)
    assert cache.full_precision_nbytes > 0
    stored = store(cache, flush=True)
    assert cache.full_precision_nbytes == 0 and cache.layers[0].key_stream.num_encoded == 42
    restored = restore(stored, codec)
    expected = tiny_llama(ids[:, 42:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(tiny_llama(ids[:, 42:], past_key_values=restored, use_cache=True).logits, expected, rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="fixed size"):
        store(CompressedCache(make_codec(tiny_llama, "kivi"), "exact_prefill"), flush=True)


def _stored(model, tmp_path, pads: int = 0):
    install(model)
    codec = make_codec(model, "uniform", pre_rope=True)  # pre-RoPE: position ids are stored too
    ids = torch.randint(1, 96, (2, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :pads] = 0
    cache = CompressedCache(codec, "exact_prefill")
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    return codec, store(cache), tmp_path / "turn.safetensors"


def test_a_left_padded_cache_is_not_stored(tiny_llama, tmp_path):
    """Its rows are grouped by padding (kvcomp.cache.rows), which a stored cache does not describe."""
    with pytest.raises(NotImplementedError, match="left-padded cache"):
        _stored(tiny_llama, tmp_path, pads=3)


def test_a_flipped_byte_or_zeroed_codes_fail_the_checksum(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    from kvcomp.artifacts import ArtifactError

    codec, stored, path = _stored(tiny_llama, tmp_path)
    stored.save(path)
    assert restore(StoredCache.load(path), codec).get_seq_length() == 40
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x10  # a data byte near the end of the file
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="sha256"):
        StoredCache.load(path)
    stored.save(path)  # zero every code, keeping the header as written
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        header = f.metadata()
    tensors = load_file(str(path))
    tensors = {k: torch.zeros_like(t) if k.endswith("codes") else t for k, t in tensors.items()}
    save_file(tensors, str(path), metadata=header)
    with pytest.raises(ArtifactError, match="sha256"):
        StoredCache.load(path)
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(ArtifactError, match="not a readable stored cache"):
        StoredCache.load(path)


def _crafted(stored, change):
    """A stored cache whose metadata (or tensors) an adversary edited and re-signed."""
    meta = json.loads(json.dumps(stored.meta))
    tensors = dict(stored.tensors)
    change(meta, tensors)
    return StoredCache(tensors, meta, "crafted.safetensors")


@pytest.mark.parametrize("change, message", [
    (lambda m, t: m.update(layers=[]), "holds 0 layers"),
    (lambda m, t: m["layers"][0].update(dtype="__class__"), "dtype '__class__'; valid"),
    (lambda m, t: m["layers"][1]["streams"]["value"].update(length=10**12), "but length"),
    (lambda m, t: m["layers"][0]["streams"]["key"].update(num_encoded=-1), "must be counts"),
    (lambda m, t: m["layers"][0]["streams"]["key"]["blocks"].clear(), "blocks hold 0 tokens"),
    (lambda m, t: m["layers"][1]["streams"]["key"]["store"].update(num_tokens=10**12), "its store holds 1000000000000"),
    (lambda m, t: m["layers"][0]["streams"].pop("value"), "a key and a value stream"),
    (lambda m, t: t.update({"layer0.position_ids": t["layer0.position_ids"].flip(-1)}), "do not increase"),
])
def test_restore_checks_the_metadata_before_allocating(tiny_llama, tmp_path, change, message):
    codec, stored, path = _stored(tiny_llama, tmp_path)
    crafted = _crafted(stored, change)
    crafted.save(path)  # a consistent checksum: only the structure can tell
    loaded = StoredCache.load(path)
    with pytest.raises(ConfigError, match=message) as error:
        restore(loaded, codec)
    assert str(path) in str(error.value)


def test_a_decompression_bomb_in_a_kvtc_row_is_refused_when_read(tiny_llama, tmp_path):
    import zlib

    from kvcomp.errors import DamagedPayloadError

    install(tiny_llama)
    codec = make_codec(tiny_llama, "kvtc")
    ids = torch.randint(0, 96, (1, 50), generator=torch.Generator().manual_seed(3))
    cache = CompressedCache(codec, "exact_prefill")
    with torch.no_grad():
        tiny_llama(ids[:, :40], past_key_values=cache, use_cache=True)
    stored = store(cache)
    rows = [k for k in stored.tensors if ".ragged." in k]
    assert rows
    bomb = torch.frombuffer(bytearray(zlib.compress(bytes(64 * 2**20), 9)), dtype=torch.uint8)  # 64 MiB of zeros
    crafted = _crafted(stored, lambda m, t: t.update({rows[0]: bomb}))
    crafted.save(tmp_path / "bomb.safetensors")
    restored = restore(StoredCache.load(tmp_path / "bomb.safetensors"), codec)
    with torch.no_grad(), pytest.raises(DamagedPayloadError, match="more than"):
        tiny_llama(ids[:, 40:], past_key_values=restored, use_cache=True)


@pytest.mark.parametrize("args", [["--prompt", "0"], ["--turn", "1"], ["--cr", "0"], ["--repeats", "0"]])
def test_the_multiturn_script_refuses_bad_arguments_before_loading(args, capsys):
    script = load_script("bench_multiturn")
    with pytest.raises(SystemExit) as exit_:
        script.main(args)
    assert exit_.value.code == 2 and f"{args[0]} must be at least" in capsys.readouterr().err


def test_multiturn_config_refuses_counts_that_measure_nothing():
    from kvcomp.benchmarks.multiturn import MultiTurnConfig

    with pytest.raises(ConfigError, match="turn_tokens"):
        MultiTurnConfig(24, 1, 2, 1)
