"""AQUA-KV and HIGGS: the Hadamard transform, Gaussian grids, ridge fits, the HIGGS quantizer, bits, and
the closed-loop calibration (the codecs also run the codec matrix: ``tests/codec_matrix.py``)."""

import math

import pytest
import torch

from kvcomp.codecs import ModelInfo, build_codec
from kvcomp.codecs.aquakv import tokens_major
from kvcomp.codecs.base import Activations, LayerRequest, StreamRequest
from kvcomp.codecs.higgs import higgs_group
from kvcomp.stages.grids import grid_mse, lloyd_grid, nearest
from kvcomp.stages.hadamard import fwht
from kvcomp.stages.higgs import HiggsQuantizer
from kvcomp.stages.ridge import RidgeFit
from tests.codec_matrix import make_codec
from tests.helpers import info_of

pytestmark = pytest.mark.usefixtures("session_cache")


@pytest.mark.parametrize("g", [1, 2, 8, 64])
def test_hadamard_is_orthogonal_and_self_inverse_up_to_scale(g):
    h = fwht(torch.eye(g, dtype=torch.float64))
    assert set(h.unique().tolist()) <= {-1.0, 1.0}
    torch.testing.assert_close(h @ h.T, g * torch.eye(g, dtype=torch.float64))
    x = torch.randn(3, 5, g, dtype=torch.float64)
    torch.testing.assert_close(fwht(fwht(x)) / g, x)
    torch.testing.assert_close(fwht(x), x @ h)


def test_hadamard_refuses_other_lengths():
    with pytest.raises(ValueError, match="power-of-two"):
        fwht(torch.zeros(2, 12))


def _best_uniform_mse(n: int) -> float:
    """MSE per coordinate of the best uniform product grid of ``n`` points in 2-D (spacing searched)."""
    m = int(math.isqrt(n))
    best = float("inf")
    for step in torch.linspace(0.2, 2.0, 91).tolist():
        levels = (torch.arange(m) - (m - 1) / 2) * step
        grid = torch.cartesian_prod(levels, levels)
        best = min(best, grid_mse(grid, samples=50_000))
    return best


def test_lloyd_grids_beat_uniform_grids_and_improve_with_size():
    mses = []
    for n in (16, 64, 256):
        grid = lloyd_grid(n, samples=20_000, steps=60, seed=0)
        mse = grid_mse(grid, samples=50_000)
        assert mse < _best_uniform_mse(n), n
        mses.append(mse)
    assert mses[0] > mses[1] > mses[2]
    assert mses[0] < 0.1175  # below the 1-D Lloyd-Max 2-bit MSE (spec §5.1)


def test_the_default_grids_ship_with_the_package(tmp_path, monkeypatch):
    """HIGGS' 2/3/4-bit grids are read from the package (checked), never computed; a damaged shipped file
    is reported and the grid is computed and cached instead."""
    import shutil

    from kvcomp.stages import grids

    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(grids, "_LOADED", {})
    monkeypatch.setattr(grids, "lloyd_grid", lambda *a, **k: pytest.fail("a shipped grid was computed"))
    for n, mse in ((16, 0.1079), (64, 0.0298), (256, 0.0078)):
        grid = grids.gaussian_grid(n)
        assert grid.shape == (n, 2) and abs(grid_mse(grid) - mse) < 5e-4
    assert not (tmp_path / "cache" / "grids").exists()

    shipped = shutil.copytree(grids.PACKAGED, tmp_path / "grid_data")
    next(shipped.glob("*n16-*")).write_bytes(b"damaged")
    monkeypatch.setattr(grids, "PACKAGED", shipped)
    monkeypatch.setattr(grids, "_LOADED", {})
    monkeypatch.setattr(grids, "lloyd_grid", lambda n, d, *a: torch.zeros(n, d))
    assert torch.equal(grids.gaussian_grid(16), torch.zeros(16, 2))
    assert (tmp_path / "cache" / "grids" / next(shipped.glob("*n16-*")).name).is_file()


def test_nearest_is_the_closest_grid_point():
    grid, x = torch.randn(16, 2), torch.randn(500, 2)
    torch.testing.assert_close(nearest(x, grid), torch.cdist(x, grid).argmin(1))


def test_ridge_without_damping_equals_lstsq_and_damping_is_the_closed_form():
    x, y = torch.randn(200, 6, dtype=torch.float64), torch.randn(200, 3, dtype=torch.float64)
    fit = RidgeFit(6, 3)
    fit.add(x[:77], y[:77])  # accumulated in pieces
    fit.add(x[77:], y[77:])
    xb = torch.cat([x, torch.ones(200, 1, dtype=torch.float64)], 1)
    w = torch.linalg.lstsq(xb, y).solution
    plain = fit.solve(damping=0.0)
    torch.testing.assert_close(plain.weight.double(), w[:-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain.bias.double(), w[-1], atol=1e-5, rtol=1e-5)
    h = xb.T @ xb
    w = torch.linalg.solve(h + 0.1 * h.diagonal().mean() * torch.eye(7, dtype=torch.float64), xb.T @ y)
    damped = fit.solve(damping=0.1)
    torch.testing.assert_close(damped.weight.double(), w[:-1], atol=1e-5, rtol=1e-5)


def test_reduced_rank_fit_recovers_a_planted_low_rank_map():
    x = torch.randn(2000, 16)
    planted = torch.randn(16, 2) @ torch.randn(2, 12)
    y = x @ planted + 0.5
    fit = RidgeFit(16, 12)
    fit.add(x, y)
    low = fit.solve(damping=0.0, rank=3)
    assert low.weight.shape == (16, 3) and low.up.shape == (3, 12)
    torch.testing.assert_close(low(x), y, atol=1e-3, rtol=1e-3)
    assert torch.linalg.matrix_rank(fit.solve(damping=0.0, rank=1).weight @ fit.solve(damping=0.0, rank=1).up) == 1


@pytest.mark.parametrize("bits,bound", [(2, 0.115), (3, 0.035), (4, 0.01)])
def test_higgs_error_on_gaussian_data_is_the_grid_error(bits, bound):
    grid = lloyd_grid(2 ** (2 * bits), samples=20_000, steps=60)
    quantizer = HiggsQuantizer(grid, 64)
    x = 3.0 * torch.randn(400, 192)
    encoded = quantizer.encode(x)
    x_hat = quantizer.decode(encoded, 192)
    assert ((x_hat - x).square().sum() / x.square().sum()).item() < bound
    assert encoded["codes"].dtype == torch.uint8 and encoded["scale"].dtype == torch.float16
    assert sum(t.numel() * t.element_size() for t in encoded.values()) * 8 / x.numel() == quantizer.bits_per_value(192)


def test_higgs_group_rule():
    assert higgs_group(1024, 1024, False) == 1024 and higgs_group(192, 1024, False) == 64
    assert higgs_group(512, 1024, False) == 512 and higgs_group(192, 1024, True) == 256
    assert higgs_group(4096, 1024, True) == 1024


def test_bits_follow_the_paper_and_the_measured_bytes():
    """§3.5: HIGGS gs1024 costs log2(n)/2 + 16/1024; AQUA-KV (28 layers, layer 0 at 4 bits) 2.087 / 3.05."""
    llama3b = ModelInfo("llama-3.2-3b-shape", num_layers=28, num_kv_heads=8, head_dim=128)
    for bits in (2, 3, 4):
        higgs = build_codec({"name": "higgs", "bits": bits}, llama3b)
        assert higgs.bits_per_value() == pytest.approx(bits + 16 / 1024)
        x = torch.randn(1, 8, 5, 128)
        assert higgs.encode(StreamRequest(3, "key", tokens=x)).nbytes * 8 / x.numel() == pytest.approx(higgs.bits_per_value())
    aqua = build_codec({"name": "aquakv", "bits": 2}, llama3b)
    assert aqua.bits_per_value() == pytest.approx((4.015625 + 27 * 2.015625) / 28)
    assert round(aqua.bits_per_value(), 2) == 2.09
    assert round(build_codec({"name": "aquakv", "bits": 3}, llama3b).bits_per_value(), 2) == 3.05
    bf16_first = build_codec({"name": "aquakv", "bits": 2, "first_layer_bits": 16}, llama3b)
    assert bf16_first.bits_per_value() == pytest.approx((16 + 27 * 2.015625) / 28)  # Table D: 2.52
    quanto = build_codec({"name": "aquakv", "bits": 2, "quantizer": "quanto"}, llama3b)
    assert quanto.code_bits_per_value("key", 5) == 2.5
    smollm = ModelInfo("smollm2-shape", num_layers=30, num_kv_heads=3, head_dim=64)
    assert build_codec({"name": "higgs", "bits": 2}, smollm).bits_per_value() == pytest.approx(2 + 16 / 64)


def test_layer_scope_round_trip_decodes_what_encode_reconstructed(tiny_llama):
    codec = make_codec(tiny_llama, "aquakv")
    assert set(codec.predictors) == {(1, "key"), (1, "value")}
    x = [torch.randn(2, 2, 12, 16) for _ in range(4)]
    encoded, previous = [], None
    for layer in range(2):
        enc = codec.encode(LayerRequest(layer, keys=x[2 * layer], values=x[2 * layer + 1], previous=previous))
        encoded.append(enc)
        previous = (enc.keys, enc.values)
    previous = None
    for layer, enc in enumerate(encoded):
        keys, values = codec.decode((enc.key, enc.value), LayerRequest(layer, previous=previous, dtype=torch.float32))
        assert torch.equal(keys, enc.keys) and torch.equal(values, enc.values)
        previous = (keys, values)
    relative = (encoded[1].keys - x[2]).norm() / x[2].norm()
    assert 0 < relative < 0.5


class _Synthetic(Activations):
    """Two layers of activations: layer 1's keys equal layer 0's, layer 1's values equal layer 1's keys
    (layer 0's values are independent noise)."""

    def __init__(self, keys):
        self.keys, self.num_layers, self.shape, self.device = keys, 2, tuple(keys.shape), torch.device("cpu")
        self.noise = torch.randn_like(keys)

    def layer(self, layer):
        return {"key": self.keys, "value": self.keys if layer else self.noise}


class _Shift:
    """A quantizer with a known error: it reconstructs ``x + shift``."""

    def __init__(self, shift):
        self.shift = shift

    def encode(self, x, range_checks=None):
        return {"x": x.clone()}

    def decode(self, tensors):
        return tensors["x"] + self.shift

    def bits_per_value(self):
        return 32.0


def test_calibration_fits_on_reconstructions_not_originals():
    """Layer 0 is stored with a +1 error. Fitted on originals, layer 1's key predictor would be the identity;
    fitted on what inference gives it (K_0 + 1), it must learn the bias -1. The value predictor sees layer
    1's reconstructed keys (K_1 + 0.5 after a +0.5 residual error), so its bias is -0.5."""
    info = ModelInfo("synthetic", num_layers=2, num_kv_heads=2, head_dim=8)
    codec = build_codec({"name": "aquakv", "damping": 0.0, "predictor_dtype": "float32"}, info)
    codec.first, codec.residual = _Shift(1.0), _Shift(0.5)
    codec.fit(_Synthetic(torch.randn(16, 2, 40, 8)))
    key, value = codec.predictors[(1, "key")], codec.predictors[(1, "value")]
    torch.testing.assert_close(key.weight, torch.eye(16), atol=1e-4, rtol=0)
    torch.testing.assert_close(key.bias, torch.full((16,), -1.0), atol=1e-4, rtol=0)
    torch.testing.assert_close(value.weight, torch.cat([torch.eye(16), torch.zeros(16, 16)]), atol=1e-4, rtol=0)
    torch.testing.assert_close(value.bias, torch.full((16,), -0.5), atol=1e-4, rtol=0)
    summary = codec.summary()
    assert summary["key_heldout_reconstruction_relmse"][1] > 0 and summary["predictors_mib"] > 0


def test_ablation_options(tiny_llama):
    no_keys = make_codec(tiny_llama, "aquakv", key_predictor=False, predictor_rank=4)
    assert set(no_keys.predictors) == {(1, "value")}
    assert no_keys.predictors[(1, "value")].up.shape == (4, 32)
    full = make_codec(tiny_llama, "aquakv")
    assert no_keys.overhead_bits() < full.overhead_bits()
    assert full.summary()["key_heldout_prediction_relmse"][0] == 1.0  # layer 0: no predictor
    previous_layer = make_codec(tiny_llama, "aquakv", value_inputs="previous_layer")
    assert previous_layer.predictors[(1, "value")].weight.shape == (64, 32)
    with pytest.raises(Exception, match="valid choices"):
        build_codec({"name": "aquakv", "quantizer": "nf4"}, info_of(tiny_llama))


def test_tokens_major_layout():
    x = torch.arange(2 * 3 * 4 * 5).view(2, 3, 4, 5)
    assert tokens_major(x)[1, 2].tolist() == torch.cat([x[1, h, 2] for h in range(3)]).tolist()


def test_post_rope_calibration_sees_the_keys_the_model_caches(tiny_llama):
    from transformers import DynamicCache

    from kvcomp.calibration import CalibrationData
    from kvcomp.stages.rope import apply_rope
    from tests.codec_matrix import calibration_windows

    post = make_codec(tiny_llama, "aquakv", pre_rope=False)
    windows = calibration_windows()
    activations = CalibrationData(tiny_llama, None, windows, None).activations(post)
    cache = DynamicCache(config=tiny_llama.config)
    with torch.no_grad():
        tiny_llama(windows[:1], past_key_values=cache)
    rotated = apply_rope(activations.layer(1)["key"][:1].float(), *(t[None] for t in activations.rope))
    torch.testing.assert_close(rotated, cache.layers[1].keys, atol=0.02, rtol=0.02)  # bf16 activations
    pre = make_codec(tiny_llama, "aquakv")
    assert not torch.allclose(post.predictors[(1, "key")].weight, pre.predictors[(1, "key")].weight)
