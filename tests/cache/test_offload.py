"""Store -> restore of a compressed cache between turns (kvcomp.cache.offload): the stored bytes come back
exactly, in memory and through a safetensors file, and the next turn sees the same cache."""

import json
from importlib import import_module

import pytest
import torch

from kvcomp.cache import CompressedCache, install
from kvcomp.cache.offload import StoredCache, restore, store
from kvcomp.calibration import CalibrationData, calibrate
from kvcomp.codecs import build_codec
from kvcomp.errors import ConfigError
from tests.codec_matrix import CALIBRATION, MATRIX, calibration_windows, make_codec
from tests.helpers import info_of

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


def _saved(crafted, path):
    crafted.save(path)  # a consistent checksum: only the structure can tell
    return path


@pytest.mark.parametrize("change, message", [
    (lambda m, t: m.update(layers=[]), "holds 0 layers"),
    (lambda m, t: m.update(protocol="nosuch"), "protocol 'nosuch'; valid: streaming, simulated, exact_prefill"),
    (lambda m, t: m["layers"][0].update(dtype="__class__"), r"layers\[0\].dtype '__class__'; valid"),
    (lambda m, t: m["layers"][1]["streams"]["value"].update(length=10**12), "but length 1000000000000"),
    (lambda m, t: m["layers"][0]["streams"]["key"].update(num_encoded=-1), "must be counts"),
    (lambda m, t: m["layers"][0]["streams"]["key"].update(batch=10**6), "not .batch, heads, tokens, head_dim. with batch"),
    (lambda m, t: m["layers"][0]["streams"]["key"]["blocks"].clear(), "its blocks hold 0 tokens, num_encoded is"),
    (lambda m, t: m["layers"][1]["streams"]["key"]["store"].update(num_tokens=10**12), "claims 1000000000000 tokens"),
    (lambda m, t: m["layers"][0]["streams"].pop("value"), "a key and a value stream"),
    (lambda m, t: t.update({"layer0.position_ids": t["layer0.position_ids"].flip(-1)}), "do not increase"),
    # block row offsets, sizes and counts that the stored tensors do not hold
    (lambda m, t: m["layers"][0]["streams"]["key"]["blocks"][-1][1].update(codes=10**6), "places codes at rows 1000000"),
    (lambda m, t: m["layers"][0]["streams"]["key"]["blocks"][0][2].update(codes=1000), "the blocks hold 1000 rows of codes, the stored tensor"),
    (lambda m, t: m["layers"][0]["streams"]["value"]["blocks"][0].__setitem__(4, 10**6), "its blocks hold 10000"),
    (lambda m, t: t.update(extra=torch.zeros(3)), "tensors the metadata does not describe: extra"),
    (lambda m, t: t.pop("layer1.value.tail"), "0 tail tokens .as stored., but length 40"),
    (lambda m, t: t.update({"layer0.key.tail": t["layer0.key.tail"].half()}), "layer0.key.tail is torch.float16"),
])
def test_a_crafted_stored_cache_is_refused_at_load(tiny_llama, tmp_path, change, message):
    """Metadata that does not describe the stored tensors, with the digest recomputed: refused by load, which needs
    no codec, naming the file and the field."""
    _, stored, path = _stored(tiny_llama, tmp_path)
    with pytest.raises(ConfigError, match=message) as error:
        StoredCache.load(_saved(_crafted(stored, change), path))
    assert str(path) in str(error.value)


def _inflate_counts(meta, tensors, by: int) -> None:
    """Every count a stored cache gives raised by ``by`` tokens, consistently: each stream's length, encoded tokens,
    last block and store, a model-scope codec's shared blocks, and no position ids (whose shape would tell)."""
    shared = meta.get("model_unit")
    for i, layer in enumerate(meta["layers"]):
        tensors.pop(f"layer{i}.position_ids", None)
        for s in layer["streams"].values():
            s["length"] += by
            s["num_encoded"] += by
            s["blocks"][-1][4] += by
            if shared is None:
                s["store"]["num_tokens"] += by
    if shared is not None:
        shared["num_tokens"] += by
        shared["payloads"][-1]["num_tokens"] += by


@pytest.mark.parametrize("name, message", [
    ("kivi", r"layers\[0\].streams.key.blocks\[\d+\] claims 1000000\d+ tokens in rows"),
    ("fp8", r"layers\[0\].streams.key.blocks\[\d+\] claims 1000000\d+ tokens in rows"),
    ("turboquant", r"layers\[0\].streams.key.blocks\[\d+\] claims 1000000\d+ tokens in rows"),
    ("kvtc", r"encoded block \d+ .tokens \d+..\+1000000\d+.: the key.0 stream of row 0: a DEFLATE stream holds \d+ bytes"),
])
def test_inflated_token_counts_are_refused_before_anything_is_allocated(tiny_llama, tmp_path, monkeypatch, name,
                                                                         message):
    """A short cache whose every count claims a billion more tokens, re-signed: the codec's own blocks tell, before
    a cache is built (a block it encodes here, or the sizes kvtc's DEFLATE streams inflate to, chunk by chunk)."""
    install(tiny_llama)
    codec = make_codec(tiny_llama, name)
    cache = CompressedCache(codec, "exact_prefill")
    with torch.no_grad():
        tiny_llama(torch.randint(0, 96, (1, 48), generator=torch.Generator().manual_seed(3)), past_key_values=cache,
                   use_cache=True)
    path = tmp_path / f"{name}.safetensors"
    loaded = StoredCache.load(_saved(_crafted(store(cache), lambda m, t: _inflate_counts(m, t, 10**9)), path))
    assert loaded.meta["layers"][0]["streams"]["key"]["length"] == 48 + 10**9  # consistent: load alone cannot tell

    def no_cache(*args, **kwargs):
        raise AssertionError("a cache was built before the stored cache was checked")

    monkeypatch.setattr("kvcomp.cache.offload.CompressedCache", no_cache)
    with pytest.raises(ConfigError, match=message) as error:
        restore(loaded, codec)
    assert str(path) in str(error.value)


def test_payload_tensors_of_another_shape_are_refused(tiny_llama, tmp_path):
    codec, stored, path = _stored(tiny_llama, tmp_path)
    codes = "layer0.key.store.codes"
    crafted = _crafted(stored, lambda m, t: t.update({codes: t[codes].reshape(*t[codes].shape[:3], 2, -1)}))
    with pytest.raises(ConfigError, match=f"{codes} is torch.uint8 .* writes torch.uint8"):
        restore(StoredCache.load(_saved(crafted, path)), codec)


def test_a_decompression_bomb_in_a_kvtc_row_is_refused_at_restore(tiny_llama, tmp_path, monkeypatch):
    """Inflated in chunks, keeping nothing: refused as soon as it holds more than its plan implies."""
    import zlib

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
    loaded = StoredCache.load(_saved(_crafted(stored, lambda m, t: t.update({rows[0]: bomb})), tmp_path / "bomb.st"))
    with pytest.raises(ConfigError, match="holds more than"):
        restore(loaded, codec)


@pytest.mark.parametrize("args", [["--prompt", "0"], ["--turn", "1"], ["--cr", "0"], ["--repeats", "0"]])
def test_the_multiturn_script_refuses_bad_arguments_before_loading(args, capsys):
    script = import_module("benchmarks.bench_multiturn")
    with pytest.raises(SystemExit) as exit_:
        script.main(args)
    assert exit_.value.code == 2 and f"{args[0]} must be at least" in capsys.readouterr().err


def test_multiturn_config_refuses_counts_that_measure_nothing():
    from kvcomp.benchmarks.multiturn import MultiTurnConfig

    with pytest.raises(ConfigError, match="turn_tokens"):
        MultiTurnConfig(24, 1, 2, 1)
