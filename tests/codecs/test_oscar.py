"""OSCAR: the covariance-aware rotation (what it equalises and spreads), its value target, the clip rule, the
queries it is fitted on, clipped INT2 in the rotated basis, exact bits with sinks and window, the fitted state."""

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvcomp.cache import CompressedCache
from kvcomp.calibration import CalibrationData, calibrate
from kvcomp.calibration.queries import query_moments
from kvcomp.codecs import Activations, ModelInfo, build_codec
from kvcomp.codecs.base import StreamRequest
from kvcomp.codecs.oscar import OscarCodec, OscarConfig, clip_rows
from kvcomp.errors import CalibrationMismatchError, ConfigError
from kvcomp.stages.covariance_rotation import (bit_reversal, covariance_rotation, hadamard_matrix,
                                               score_weighted_covariance, spread_permutation)
from kvcomp.stages.rope import apply_rope
from tests.codec_matrix import CALIBRATION, calibration_windows
from tests.helpers import info_of

D = 16
INFO = ModelInfo(name="planted", num_layers=2, num_kv_heads=2, head_dim=D, has_rope=False, fingerprint="planted")


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path))


def planted_covariance(groups: int, seed: int = 0) -> torch.Tensor:
    """``V diag(λ) V^T`` per group: a random basis and a spectrum over five decades."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(groups, D, D, generator=g, dtype=torch.float64))[0]
    spectrum = torch.logspace(-3, 2, D, dtype=torch.float64)[torch.randperm(D, generator=g)]
    return basis @ torch.diag(spectrum) @ basis.transpose(1, 2)


def test_rotation_is_orthogonal_and_gives_every_coordinate_an_equal_share_of_the_attention_metric():
    c = planted_covariance(groups=3)
    r = covariance_rotation(c)
    assert torch.allclose(r.transpose(1, 2) @ r, torch.eye(D, dtype=torch.float64).expand(3, D, D), atol=1e-10)
    share = torch.diagonal(r.transpose(1, 2) @ c @ r, dim1=1, dim2=2)
    trace = torch.diagonal(c, dim1=1, dim2=2).sum(-1, keepdim=True)
    assert torch.allclose(share, (trace / D).expand(3, D), rtol=1e-8)
    # neither the planted basis nor a data-free Hadamard rotation does that: the eigenbasis U is what makes it exact
    h = hadamard_matrix(D)
    assert torch.diagonal(c, dim1=1, dim2=2).std(-1).min() > 1
    assert torch.diagonal(h.T @ c @ h, dim1=1, dim2=2).std(-1).min() > 1


def test_hadamard_factor_is_sylvesters_and_the_permutation_spreads_the_top_ranked_columns_over_groups():
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64) / math.sqrt(2)
    assert torch.allclose(hadamard_matrix(8), torch.kron(torch.kron(h2, h2), h2))
    assert bit_reversal(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    eigenvalues = torch.rand(1, D, generator=torch.Generator().manual_seed(1))
    perm = spread_permutation(eigenvalues)[0]
    assert sorted(perm.tolist()) == list(range(D))
    ranked = torch.argsort(eigenvalues[0], descending=True)
    position = {int(column): p for p, column in enumerate(perm)}
    for top in (2, 4, 8):  # the `top` largest land in `top` distinct groups of D / top channels
        assert len({position[int(c)] // (D // top) for c in ranked[:top]}) == top


def test_value_target_weighs_each_value_by_its_keys_logit_energy():
    c_q = torch.zeros(1, D, D, dtype=torch.float64)
    c_q[0, 0, 0] = 4.0  # the queries only ever read channel 0 of the keys
    keys, values = torch.zeros(1, 1, 6, D), torch.zeros(1, 1, 6, D)
    keys[0, 0, :3, 0], keys[0, 0, 3:, 1] = 1.0, 5.0  # tokens 3..5: keys no query sees (logit energy 0)
    values[0, 0, :3, 2], values[0, 0, 3:, 3] = 1.0, 100.0  # ... with huge values along channel 3
    c_s = score_weighted_covariance(values, keys, c_q)[0]
    expected = torch.zeros(D, D, dtype=torch.float64)
    expected[2, 2] = 1.0  # weights 2, 2, 2, 0, 0, 0 (mean 1) times v v^T = e2 e2^T, over 6 tokens
    assert torch.allclose(c_s, expected)
    # and the formula token by token on random data
    g = torch.Generator().manual_seed(2)
    keys, values = torch.randn(2, 2, 5, D, generator=g), torch.randn(2, 2, 5, D, generator=g)
    c_q = planted_covariance(2)
    for h in range(2):
        k, v = keys[:, h].reshape(-1, D).double(), values[:, h].reshape(-1, D).double()
        w = torch.stack([row @ c_q[h] @ row for row in k])
        direct = sum(wi / w.mean() * torch.outer(vi, vi) for wi, vi in zip(w, v)) / len(w)
        assert torch.allclose(score_weighted_covariance(values, keys, c_q)[h], direct)


def test_clip_threshold_is_the_reference_order_statistic_of_each_rows_magnitudes():
    row = torch.arange(1.0, D + 1) * torch.tensor([1.0, -1.0]).repeat(D // 2)
    clipped = clip_rows(row[None], 0.9)[0]  # floor(0.9 x 16) = 14: the 15th smallest magnitude, 15
    assert clipped.abs().max() == 15 and torch.equal(clipped[:-1], row[:-1]) and clipped[-1] == -15
    wide = torch.randn(3, 128, generator=torch.Generator().manual_seed(3))
    changed = (clip_rows(wide, 0.96) != wide).sum(-1)  # floor(0.96 x 128) = 122: the 5 largest magnitudes clipped
    assert changed.tolist() == [5, 5, 5]
    assert torch.equal(clip_rows(wide, 0.0), wide) and torch.equal(clip_rows(wide, 1.0), wide)


class _Planted(Activations):
    """Random keys and values and planted query second moments, one per layer and KV head."""

    def __init__(self):
        g = torch.Generator().manual_seed(4)
        self.num_layers, self.shape, self.device = 2, (3, 2, 10, D), torch.device("cpu")
        self.fields = [{kind: torch.randn(self.shape, generator=g) for kind in ("key", "value")} for _ in range(2)]
        self.query_moments = {layer: planted_covariance(2, seed=10 + layer).float() for layer in range(2)}

    def layer(self, layer):
        return self.fields[layer]


def _equal_share(r, c):
    share = torch.diagonal(r.transpose(-1, -2).double() @ c.double() @ r.double(), dim1=-2, dim2=-1)
    return torch.allclose(share, share.mean(-1, keepdim=True).expand_as(share), rtol=1e-5)


@pytest.mark.parametrize("granularity", ["layer", "kv_head"])
def test_fit_rotates_keys_by_the_query_statistics_per_layer_or_per_kv_head(granularity):
    codec = OscarCodec(OscarConfig(granularity=granularity), INFO)
    activations = _Planted()
    codec.install_state(codec.fit(activations))
    groups = 1 if granularity == "layer" else 2
    for layer in range(2):
        r = codec.rotations[(layer, "key")]
        assert r.shape == (groups, D, D)
        c_q = activations.query_moments[layer]
        target = c_q.mean(0, keepdim=True) if granularity == "layer" else c_q
        assert _equal_share(r, target)
        keys, values = activations.fields[layer]["key"], activations.fields[layer]["value"]
        c_s = score_weighted_covariance(values, keys, c_q)
        assert _equal_share(codec.rotations[(layer, "value")], c_s.mean(0, keepdim=True) if groups == 1 else c_s)
    assert codec.overhead_bits() == 32 * 2 * 2 * groups * D * D


def test_fit_without_query_statistics_is_refused():
    activations = _Planted()
    activations.query_moments = None
    with pytest.raises(ConfigError, match="query statistics"):
        OscarCodec(OscarConfig(), INFO).fit(activations)


def test_encoded_rows_are_clipped_int2_levels_in_the_rotated_basis():
    codec = OscarCodec(OscarConfig(), INFO)
    codec.install_state(codec.fit(_Planted()))
    x = torch.randn(2, 2, 8, D, generator=torch.Generator().manual_seed(5)) * 3
    payload = codec.encode(StreamRequest(1, "value", tokens=x))
    decoded = codec.decode(payload, StreamRequest(1, "value", dtype=torch.float32))
    r = codec.rotations[(1, "value")]
    levels = codec.quantizer.decode(payload.tensors, D, torch.float32)  # what is stored, in the rotated basis
    assert torch.allclose(decoded, levels @ r.transpose(1, 2), atol=1e-5)
    assert all(len(torch.unique(row)) <= 4 for row in levels.reshape(-1, D))  # 2 bits, one group per row
    rotated = x @ r
    tau = clip_rows(rotated, 0.92).abs().amax(-1)
    assert (tau < rotated.abs().amax(-1)).all() and (levels.abs().amax(-1) <= tau * (1 + 1e-3)).all()
    assert (decoded - x).norm() / x.norm() < 0.6


def test_measured_cache_holds_exactly_the_sinks_window_and_int2_rows(tiny_llama):
    codec = build_codec({"name": "oscar", "sinks": 2, "window": 4, "flush_block": 4}, info_of(tiny_llama))
    windows = calibration_windows()
    calibrate(codec, CALIBRATION, lambda: CalibrationData(tiny_llama, None, windows, None).activations(codec))
    cache = CompressedCache(codec, "simulated")
    ids = torch.randint(1, 96, (2, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        tiny_llama(ids, cache=cache)
    # 40 tokens: 2 sinks, 32 encoded (blocks of 4 once 4 + 4 wait), 6 recent; float32 model
    streams = 2 * 2 * 2 * 2 * 16  # layers x K/V x batch x kv_heads x head_dim
    assert cache.full_precision_nbytes * 8 == streams * (2 + 6) * 32
    assert cache.payload_nbytes * 8 == streams * 32 * (2 + 2 * 16 / 16)  # 2-bit codes, 16-bit scale and zero per head
    assert codec.bits_per_value() == 4.0


def test_paper_count_is_2_28_bits_per_element_on_128_dim_heads():
    model = ModelInfo(name="qwen3-like", num_layers=2, num_kv_heads=8, head_dim=128)
    codec = OscarCodec(OscarConfig(), model)
    assert codec.bits_per_value() == 2.25 and round(codec.paper_bits_per_value(), 2) == 2.28
    assert OscarCodec(OscarConfig(param_dtype="float32"), model).bits_per_value() == 2.5  # the reference's serving
    assert codec.policy("key", 0).split(64 + 8 + 263) == (64, 8, 263)  # the recent window holds 256..263 tokens


def test_query_moments_are_those_of_the_post_rope_queries_of_each_kv_head_group(tiny_llama):
    info = info_of(tiny_llama)
    windows = calibration_windows()[:2, :20]
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, kw: seen.setdefault(m.layer_idx, []).append(kw), with_kwargs=True)
             for name, m in tiny_llama.named_modules() if name.endswith("self_attn")]
    try:
        moments = query_moments(tiny_llama, info, windows, drop_first=3)
    finally:
        for hook in hooks:
            hook.remove()
    assert tiny_llama.config._attn_implementation == "kvcomp"  # the installation is back
    for layer, calls in seen.items():
        queries = []
        for kw in calls:
            attention = tiny_llama.model.layers[layer].self_attn
            q = attention.q_proj(kw["hidden_states"]).view(1, 20, -1, D).transpose(1, 2)
            q, _ = apply_rotary_pos_emb(q, q, *kw["position_embeddings"])
            queries.append(q[0, :, 3:].detach().double())  # [query heads, tokens, D]
        q = torch.cat(queries, 1).view(2, 2, -1, D).reshape(2, -1, D)  # KV head h reads query heads 2h, 2h + 1
        assert torch.allclose(moments[layer].double(), q.transpose(1, 2) @ q / q.shape[1], rtol=1e-5, atol=1e-6)


def test_fitted_state_saves_loads_and_serves_other_clips_and_schedules(tiny_llama, tmp_path):
    path = tmp_path / "oscar.safetensors"
    info, windows = info_of(tiny_llama), calibration_windows()
    fitted = build_codec({"name": "oscar"}, info)
    calibrate(fitted, CALIBRATION, lambda: CalibrationData(tiny_llama, None, windows, None).activations(fitted), path)
    eye = torch.eye(info.head_dim).expand(1, -1, -1)
    assert all(torch.allclose(r.transpose(1, 2) @ r, eye, atol=1e-5) for r in fitted.rotations.values())
    activations = CalibrationData(tiny_llama, None, windows, None).activations(fitted)
    keys = apply_rope(activations.layer(1)["key"].float(), *(t[None] for t in activations.rope))  # post-RoPE keys
    c_s = score_weighted_covariance(activations.layer(1)["value"], keys, activations.query_moments[1])
    expected = covariance_rotation(c_s.mean(0, keepdim=True)).float()
    assert torch.allclose(fitted.rotations[(1, "value")], expected, atol=1e-5)
    other = build_codec({"name": "oscar", "key_clip_ratio": 0.5, "sinks": 0}, info)  # inference-only fields
    report = calibrate(other, CALIBRATION, lambda: pytest.fail("must reuse the artifact"), path)
    assert report["reused"] and all(torch.equal(other.rotations[k], r) for k, r in fitted.rotations.items())
    per_head = build_codec({"name": "oscar", "granularity": "kv_head"}, info)
    with pytest.raises(CalibrationMismatchError, match="granularity"):
        calibrate(per_head, CALIBRATION, None, path)


@pytest.mark.parametrize("overrides, message", [
    ({"granularity": "head"}, "granularity"),
    ({"key_clip_ratio": 1.5}, "key_clip_ratio"),
    ({"group_size": 6}, "group_size"),
    ({"flush_block": 0}, "flush_block"),
    ({"param_dtype": "int8"}, "param_dtype"),
])
def test_bad_settings_are_refused_naming_them(overrides, message):
    with pytest.raises(ConfigError, match=message):
        OscarCodec(OscarConfig(**overrides), INFO)
    with pytest.raises(ConfigError, match="power of two"):
        OscarCodec(OscarConfig(), ModelInfo(name="m", num_layers=1, num_kv_heads=1, head_dim=48))
