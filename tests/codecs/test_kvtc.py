"""kvtc as a codec (model scope): the DP budget, DEFLATE payloads, per-layer decoding, the K12 schedule,
the compression-ratio accounting (K13, B.15), kvtc-DPQ and layer groups (also in the codec matrix)."""

import pytest
import torch

from kvcomp.cache import CompressedCache
from kvcomp.codecs.base import ModelRequest, keeps_state, needs_calibration
from kvcomp.codecs.kvtc import packed_stream_nbytes
from kvcomp.stages.transform_coding import decode_rows, encode_rows, inflate
from tests.codec_matrix import make_codec

pytestmark = pytest.mark.usefixtures("session_cache")


def _kv(layers=2, batch=2, tokens=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(batch, 2, tokens, 16, generator=g) for _ in range(layers)],
            [torch.randn(batch, 2, tokens, 16, generator=g) for _ in range(layers)])


def test_plans_meet_the_budget_and_payloads_are_the_deflated_plan_streams(tiny_llama):
    codec = make_codec(tiny_llama, "kvtc")
    p = codec.model.num_layers * codec.width
    assert codec.budget_bits("key") == 16 * p // 4 and len(codec.layer_groups) == 1
    for plan in codec.plans.values():
        assert 0 < plan.bits <= codec.budget_bits("key")
    keys, values = _kv()
    payload = codec.encode(ModelRequest(keys=keys, values=values, encoded_before=codec.config.sinks))  # a block after the sinks
    assert payload.nbytes == sum(row.numel() for rows in payload.ragged.values() for row in rows)
    plan = codec.plans["key", 0]
    stream = inflate(payload.ragged["key.0"][1].numpy().tobytes(), packed_stream_nbytes(plan, 8))  # row 1: 8 tokens
    assert stream.numel() == packed_stream_nbytes(plan, 8)
    rounding = 8 * len(plan.groups)  # each group's packed codes are rounded up to whole bytes
    assert abs(stream.numel() * 8 - 8 * plan.bits) <= rounding
    whole = codec.pca["key", 0].reconstruct(decode_rows(stream, plan, 8))  # [8, p]: every layer
    k1, _ = codec.decode(payload, ModelRequest(1, dtype=torch.float32))  # layer 1 alone, from its columns
    torch.testing.assert_close(k1[1], whole[:, codec.width:2 * codec.width].view(8, 2, 16).transpose(0, 1))
    more = make_codec(tiny_llama, "kvtc", cr=2)  # more bits, less error; the same calibration
    assert more.plans["key", 0].error < plan.error
    torch.testing.assert_close(more.pca["key", 0].basis, codec.pca["key", 0].basis)


def test_per_cache_ratios_and_truncation(tiny_llama):
    codec = make_codec(tiny_llama, "kvtc", cr_key=2, cr_value=8)
    assert codec.budget_bits("key") == 4 * codec.budget_bits("value")
    assert codec.plans["key", 0].bits > codec.plans["value", 0].bits
    dpq = make_codec(tiny_llama, "kvtc", quantization="truncate")  # kvtc-DPQ: p / CR coefficients in fp16
    plan = dpq.plans["key", 0]
    assert plan.groups[0] == (0, dpq.budget_bits("key") // 16, "fp16") and plan.bits == dpq.budget_bits("key")
    keys, values = _kv()
    k0, _ = dpq.decode(dpq.encode(ModelRequest(keys=keys, values=values, encoded_before=8)), ModelRequest(0, dtype=torch.float32))
    coefficients = dpq.pca["key", 0].project(torch.stack(keys, 1).permute(0, 3, 1, 2, 4).reshape(16, -1))
    kept = plan.groups[0][1]
    expected = dpq.pca["key", 0].reconstruct(torch.cat([coefficients[:, :kept].half().float(),
                                                        torch.zeros(16, coefficients.shape[1] - kept)], 1))
    torch.testing.assert_close(k0, expected[:, :dpq.width].view(2, 8, 2, 16).transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_layer_groups_have_their_own_basis_and_budget(tiny_llama):
    codec = make_codec(tiny_llama, "kvtc", layers_per_group=1)
    assert [list(g) for g in codec.layer_groups] == [[0], [1]]
    assert codec.budget_bits("key", 1) == 16 * codec.width // 4
    assert codec.pca["key", 1].basis.shape[0] == codec.width
    keys, values = _kv()
    payload = codec.encode(ModelRequest(keys=keys, values=values, encoded_before=8))
    assert sorted(payload.ragged) == ["key.0", "key.1", "value.0", "value.1"]
    k1, v1 = codec.decode(payload, ModelRequest(1, dtype=torch.float32))
    assert k1.shape == keys[1].shape and (k1 - keys[1]).norm() < keys[1].norm()


def test_stream_bytes_follow_the_plan_for_fp16_groups():
    from kvcomp.stages.bit_allocation import Plan

    plan = Plan(((0, 3, "fp16"), (3, 5, "int4"), (5, 9, "none")), 0.0)
    x = torch.randn(6, 9)
    stream = encode_rows(x, plan)
    assert stream.numel() == packed_stream_nbytes(plan, 6) == 6 * 3 * 2 + 6 * 2 // 2 + 4 * 6
    back = decode_rows(stream, plan, 6)
    torch.testing.assert_close(back[:, :3], x[:, :3].half().float())
    assert back[:, 5:].abs().sum() == 0


@pytest.mark.parametrize("sink_dtype", ["model", "fp8"])
def test_window_and_sinks_follow_k12_and_ratios_follow_b15(tiny_llama, sink_dtype):
    """Sinks stay uncompressed (apart in the model dtype, or FP8 in the first block), the uncompressed tail
    stays between window - every and window tokens, every compression event takes ``every`` tokens; the
    reported ratios are the stored bytes'."""
    from kvcomp.cache import install

    install(tiny_llama)
    codec = make_codec(tiny_llama, "kvtc", sinks=2, window=8, every=4, sink_dtype=sink_dtype)
    cache = CompressedCache(codec, "exact_prefill")
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    tiny_llama(ids[:, :21], past_key_values=cache, use_cache=True)
    apart = 2 if sink_dtype == "model" else 0
    for n in range(21, 40):
        stream = cache.layers[0].key_stream
        assert stream.num_sinks == apart and 4 <= stream.num_tail < 8 and stream.num_encoded % 4 == 0
        assert stream.num_sinks + stream.num_encoded + stream.num_tail == n
        tiny_llama(ids[:, n:n + 1], past_key_values=cache, use_cache=True)
    payloads = cache.scope.unit.store.payloads
    fp8 = [p.tensors["sink.key"].shape[3] if p.tensors else 0 for p in payloads]
    assert fp8 == ([2] + [0] * (len(payloads) - 1) if sink_dtype == "fp8" else [0] * len(payloads))
    metrics = codec.example_metrics(cache.statistics())
    tokens = sum(p.num_tokens for p in payloads) - sum(fp8)
    raw = 2 * 2 * codec.model.num_layers * codec.width * tokens
    deflated = sum(rows[0].numel() for p in payloads for rows in p.ragged.values())
    assert metrics["cr"] == pytest.approx(raw / deflated)
    assert metrics["cr_before_deflate"] == pytest.approx(
        raw / sum(codec.packed_nbytes(p.num_tokens - s) for p, s in zip(payloads, fp8)))
    # with the window: B.15's ctx / ((ctx - w - s) / cr + w + s / 2) with 16-bit window tokens; here the window
    # (and model-dtype sinks) are fp32, 2 token-equivalents each, and FP8 sinks cost d + 2 bytes per 2d
    sink_share = 0 if sink_dtype == "model" else 2 * (16 + 2) / (2 * 16)
    ctx, kept = 40, 40 - tokens - sum(fp8)
    assert metrics["cr_with_window"] == pytest.approx(ctx / (tokens / metrics["cr"] + 2 * kept + sink_share))


def test_fp8_sinks_round_trip_and_blocks_of_sinks_only(tiny_llama):
    from kvcomp.codecs.kvtc import fp8_absmax

    x = torch.randn(2, 3, 4, 5, 16) * 7
    codes, scale = fp8_absmax(x)
    back = codes.float() * scale.float()[..., None]
    assert ((back - x).abs() <= x.abs().amax(-1, keepdim=True) / 8).all()  # E4M3: 3 mantissa bits
    codec = make_codec(tiny_llama, "kvtc", sinks=4, every=1, window=1)
    keys, values = _kv(tokens=3)  # a block of sinks only (compressing every token)
    payload = codec.encode(ModelRequest(keys=keys, values=values, encoded_before=1))
    assert payload.tensors["sink.key"].shape == (2, 2, 2, 3, 16)
    k, v = codec.decode(payload, ModelRequest(1, dtype=torch.float32))
    torch.testing.assert_close(k, keys[1], atol=0.1 * keys[1].abs().max().item(), rtol=0)
    later = codec.encode(ModelRequest(keys=keys, values=values, encoded_before=4))
    assert not later.tensors and codec.decode(later, ModelRequest(0, dtype=torch.float32))[0].shape == keys[0].shape


def test_per_prompt_pca_is_per_sequence_state(tiny_llama):
    """Table 18: each sequence's own PCA of its prompt, stored with it (state bytes, counted in the ratio)."""
    from kvcomp.cache import install
    from kvcomp.codecs import build_codec
    from kvcomp.errors import ConfigError
    from tests.codec_matrix import MATRIX
    from tests.helpers import info_of

    install(tiny_llama)
    config = {**MATRIX["kvtc"].config, "pca_source": "prompt", "quantization": "truncate", "sink_dtype": "model"}
    with pytest.raises(ConfigError, match="quantization=truncate"):
        build_codec({**config, "quantization": "dp"}, info_of(tiny_llama))
    codec = build_codec({**config, "cr": 1}, info_of(tiny_llama))  # every coefficient kept (fp16): near lossless
    assert keeps_state(codec) and not needs_calibration(codec)
    cache = CompressedCache(codec, "exact_prefill")
    ids = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(2))
    tiny_llama(ids, past_key_values=cache, use_cache=True)
    state = cache.scope.unit.state
    assert state.tensors["key.basis"].shape == (2, 64, 30)  # rank min(p, the 30 prompt tokens held at the first encode)
    assert cache.state_nbytes == state.nbytes > 0
    stream = cache.layers[1].key_stream
    decoded, exact = stream.materialize(), None
    reference = CompressedCache(build_codec({"name": "fp16"}, info_of(tiny_llama)), "exact_prefill")
    tiny_llama(ids, past_key_values=reference, use_cache=True)
    exact = reference.layers[1].key_stream.materialize()
    torch.testing.assert_close(decoded, exact, atol=2e-3 * exact.abs().max().item(), rtol=0)
    metrics = codec.example_metrics(cache.statistics())
    assert metrics["cr"] < 1  # the stored basis costs more than the tokens it codes (the paper's 1.0-1.1x)


def test_cached_plans_are_checked_against_the_group_errors(tmp_path, monkeypatch):
    """A plan file that does not add up to its group errors (edited, or written for other data) is recomputed."""
    import json

    from kvcomp.codecs import kvtc
    from kvcomp.stages.bit_allocation import group_errors

    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path))
    errors = group_errors(torch.randn(40, 24) * torch.linspace(5, 0.1, 24), (1, 4))
    plan = kvtc.plan_for(errors, 120)
    (path,) = (tmp_path / "kvtc_plans").glob("*.json")
    saved = json.loads(path.read_text())
    assert saved["key"] == path.stem and kvtc._plan_fits(errors, plan, 120)
    kvtc._PLANS.clear()
    assert kvtc.plan_for(errors, 120) == plan  # read back from the file
    saved["groups"][0][2] = "fp8" if saved["groups"][0][2] != "fp8" else "int2"  # edited: no longer the DP's
    path.write_text(json.dumps(saved))
    kvtc._PLANS.clear()
    assert kvtc.plan_for(errors, 120) == plan and json.loads(path.read_text())["groups"] == [list(g) for g in plan.groups]


def _fill(model, codec, ids):
    """A cache of ``codec`` after a 20-token prompt and 4 tokens per forward to the end of ``ids``."""
    cache = CompressedCache(codec, "exact_prefill")
    model(ids[:, :20], past_key_values=cache, use_cache=True)
    for n in range(20, ids.shape[1], 4):
        model(ids[:, n:n + 4], past_key_values=cache, use_cache=True)
    return cache


def test_deflate_scope_sequence_spans_the_blocks(tiny_llama):
    """``deflate_scope=sequence``: one DEFLATE stream per sequence, a segment per block. On a prompt that repeats
    (DEFLATE's matches lie in earlier blocks) it gains more than per-block streams from the same packed bytes;
    its reads equal block mode's bit for bit (DEFLATE is lossless); the cache reports the bytes it holds:
    payloads with their positions, and both sides' windows, the packed bytes so far (under 32 KiB here)."""
    from kvcomp.cache import install

    install(tiny_llama)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(3)).repeat(1, 8)[:, :60]
    codecs = {scope: make_codec(tiny_llama, "kvtc", deflate_scope=scope) for scope in ("block", "sequence")}
    caches = {scope: _fill(tiny_llama, codec, ids) for scope, codec in codecs.items()}
    block, sequence = (codecs[s].example_metrics(caches[s].statistics()) for s in ("block", "sequence"))
    assert block["cr_before_deflate"] == sequence["cr_before_deflate"]
    assert sequence["deflate_gain"] > 1.2 * block["deflate_gain"] and sequence["cr"] > 1.2 * block["cr"]
    for layer in range(2):
        for stream in ("key_stream", "value_stream"):
            assert torch.equal(getattr(caches["sequence"].layers[layer], stream).materialize(),
                               getattr(caches["block"].layers[layer], stream).materialize())
    cache, unit = caches["sequence"], caches["sequence"].scope.unit
    assert caches["block"].state_nbytes == 0 and not any("position" in p.tensors for p in caches["block"].scope.unit.store.payloads)
    positions = [int(p.tensors["position"][0]) for p in unit.store.payloads]
    assert positions == [sum(p.num_tokens for p in unit.store.payloads[:i]) for i in range(len(positions))]
    ragged = sum(row.numel() for p in unit.store.payloads for rows in p.ragged.values() for row in rows)
    sinks = sum(p.tensors["sink.key"].numel() * 2 + p.tensors["sink.key.scale"].numel() * 4 for p in unit.store.payloads
                if "sink.key" in p.tensors)  # FP8 codes and fp16 scales, K and V
    assert cache.payload_nbytes == ragged + sinks + 8 * 2 * len(positions)
    fp8 = [p.tensors["sink.key"].shape[3] if "sink.key" in p.tensors else 0 for p in unit.store.payloads]
    state, windows = unit.state, 0
    for kind in ("key", "value"):
        packed = sum(packed_stream_nbytes(codecs["sequence"].plans[kind, 0], p.num_tokens - s)
                     for p, s in zip(unit.store.payloads, fp8))
        deflated, inflated = state.ragged[f"{kind}.0.deflated"], state.ragged[f"{kind}.0.inflated"]
        assert [w.numel() for w in deflated] == [packed] * 2 and all(map(torch.equal, deflated, inflated))
        windows += 2 * 2 * packed  # both sides, both rows
    assert cache.state_nbytes == windows + 8 * 2 * len(state.tensors)


def test_deflate_scope_sequence_decodes_in_order_and_bounds_inflate(tiny_llama):
    """A sequence's blocks are inflated once each, in order (a reread or a skip is refused, naming the
    setting); a segment that holds more or fewer bytes than its plan implies is refused after inflating at
    most one byte more; a cache with sequence streams cannot be stored between turns; an unknown scope is
    refused with the choices."""
    from kvcomp.cache import install
    from kvcomp.cache.offload import store
    from kvcomp.codecs.base import Unit
    from kvcomp.errors import ConfigError, DamagedPayloadError
    from kvcomp.stages.transform_coding import deflate

    with pytest.raises(ConfigError, match="deflate_scope.*block, sequence"):
        make_codec(tiny_llama, "kvtc", deflate_scope="model")
    codec = make_codec(tiny_llama, "kvtc", deflate_scope="sequence")
    keys, values = _kv()
    state = codec.init_state(Unit(), {(0, "key"): keys[0]})
    first = codec.encode(ModelRequest(keys=keys, values=values, state=state, encoded_before=2))
    second = codec.encode(ModelRequest(keys=keys, values=values, state=state, encoded_before=10))
    state.tensors = {name: t + 2 for name, t in state.tensors.items()}  # the 2 sinks kept apart came first
    with pytest.raises(ConfigError, match="position \\[10, 10\\].*next is at \\[2, 2\\].*deflate_scope=block"):
        codec.decode(second, ModelRequest(0, dtype=torch.float32, state=state))
    for layer in range(2):
        codec.decode(first, ModelRequest(layer, dtype=torch.float32, state=state))
    with pytest.raises(ConfigError, match="decode_per_step"):
        codec.decode(first, ModelRequest(0, dtype=torch.float32, state=state))
    k, _ = codec.decode(second, ModelRequest(0, dtype=torch.float32, state=state))
    assert k.shape == keys[0].shape and (k - keys[0]).norm() < keys[0].norm()
    size = packed_stream_nbytes(codec.plans["key", 0], 8)
    segment, history = first.ragged["key.0"][0].numpy().tobytes(), b""
    assert inflate(segment, size, history).numel() == size
    for wrong in (size - 1, size + 1):
        with pytest.raises(DamagedPayloadError, match="plan implies"):
            inflate(segment, wrong, history)
    bomb = deflate(torch.zeros(10**6, dtype=torch.uint8), 6, b"")
    with pytest.raises(DamagedPayloadError, match="more than 100 bytes"):
        inflate(bomb, 100, b"")
    install(tiny_llama)
    cache = _fill(tiny_llama, codec, torch.randint(0, 96, (1, 28), generator=torch.Generator().manual_seed(4)))
    with pytest.raises(NotImplementedError, match="per-sequence state.*kvtc with deflate_scope=block"):
        store(cache)
