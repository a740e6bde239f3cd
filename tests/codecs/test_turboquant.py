"""TurboQuant, vLLM's TurboQuant presets and EDEN: the Lloyd-Max codebook against the published values, prod's
unbiased inner products, EDEN's two scales, and the presets' bytes and boundary layers against vLLM's."""

import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from kvcomp.codecs import ModelInfo, build_codec
from kvcomp.codecs.base import StreamRequest
from kvcomp.config import register_configs
from kvcomp.errors import ConfigError
from kvcomp.stages.lloyd_max import ProdQuantizer, RotatedScalarQuantizer, Rotation, lloyd_max
from kvcomp.stages.skip_layers import SKIPPED_BITS

CONF = Path(__file__).resolve().parents[2] / "conf"
register_configs()

# Lloyd-Max centroids of N(0, 1), positive half (Max 1960; EDEN's reference tables, torch/quantization_constants.py)
GAUSSIAN_CENTROIDS = {
    1: [0.7978845608028654],
    2: [0.4527800398860679, 1.5104176087114887],
    3: [0.24509416307340598, 0.7560052489539643, 1.3439092613750225, 2.151945669890335],
    4: [0.12839501671105813, 0.38804823445328507, 0.6567589957631145, 0.9423402689122875,
        1.2562309480263467, 1.6180460517130526, 2.069016730231837, 2.732588804065177],
}
# TurboQuant, Theorem 1: D_mse of a unit vector is about 0.36, 0.117, 0.03, 0.009 for b = 1..4 (digits printed)
PAPER_DISTORTION = {1: (0.36, 2), 2: (0.117, 3), 3: (0.03, 2), 4: (0.009, 3)}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_gaussian_codebook_is_max_lloyd(bits):
    codebook = lloyd_max(bits, 64, "gaussian")
    positive = codebook.centroids[1 << (bits - 1):] * math.sqrt(64)
    torch.testing.assert_close(positive, torch.tensor(GAUSSIAN_CENTROIDS[bits]), rtol=2e-6, atol=0)
    torch.testing.assert_close(codebook.centroids, -codebook.centroids.flip(0))
    value, digits = PAPER_DISTORTION[bits]
    assert math.floor(codebook.distortion * 10 ** digits) == round(value * 10 ** digits)  # the paper truncates


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_exact_density_tends_to_the_gaussian_and_matches_measured_error(bits):
    """Lemma 1's density: at d = 16 clearly below the Gaussian codebook's error (no tails beyond +-1), within 2 %
    of it at d = 128, and 10x closer at d = 4096; random unit vectors quantized by the rotated quantizer show the
    predicted error."""
    gaussian = lloyd_max(bits, 128, "gaussian").distortion
    gap = {d: abs(lloyd_max(bits, d, "beta").distortion / gaussian - 1) for d in (16, 128, 4096)}
    assert gap[16] > 0.04 and gap[128] < 0.02 and gap[4096] < gap[128] / 10, gap
    quantizer = RotatedScalarQuantizer(Rotation("random", 64, seed=3), bits, "beta", scale_dtype=torch.float32)
    x = torch.randn(4000, 64, generator=torch.Generator().manual_seed(0))
    x = x / x.norm(dim=-1, keepdim=True)
    measured = (quantizer.decode(quantizer.encode(x)) - x).square().sum(-1).mean().item()
    assert measured == pytest.approx(quantizer.codebook.distortion, rel=0.04)


def _draws(make, x: torch.Tensor, count: int) -> torch.Tensor:
    """Reconstructions of ``x`` by ``make(seed)`` for seeds 0..count-1."""
    return torch.stack([make(seed).decode(make(seed).encode(x)) for seed in range(count)])


def test_prod_inner_products_are_unbiased_and_mse_ones_are_not():
    """TurboQuant-prod at 2 bits (1 bit of mse + the QJL sketch): over the sketch matrix's draws the mean of
    <y, x_hat> is <y, x>; TurboQuant-mse at 1 bit shrinks it (by about 2/pi) over the rotation's draws."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, generator=gen), torch.randn(32, generator=gen)
    y = y + 2 * x  # correlated, so that the shrinkage is visible
    mse = RotatedScalarQuantizer(Rotation("random", 32, seed=5), 1, "beta", scale_dtype=torch.float32)
    prod = _draws(lambda seed: ProdQuantizer(mse, seed=seed), x, 1500) @ y
    error = prod.std() / math.sqrt(len(prod))
    assert abs(prod.mean() - y @ x) < 4 * error, (prod.mean(), y @ x, error)
    shrunk = _draws(lambda seed: RotatedScalarQuantizer(Rotation("random", 32, seed), 1, "beta",
                                                         scale_dtype=torch.float32), x, 500) @ y
    assert shrunk.mean() < 0.85 * (y @ x)


def test_eden_unbiased_scale_is_unbiased_and_biased_scale_has_the_least_error():
    """Over Haar rotations, EDEN's unbiased scale averages to x; the biased one and TurboQuant's S = 1 shrink it.
    Per vector the biased (MSE-optimal) scale never does worse than S = 1 or the unbiased one."""
    x = torch.randn(32, generator=torch.Generator().manual_seed(2))

    def quantizer(scale):
        return lambda seed: RotatedScalarQuantizer(Rotation("random", 32, seed), 2, "gaussian", scale, torch.float32)

    draws = {scale: _draws(quantizer(scale), x, 600) for scale in ("one", "biased", "unbiased")}
    unbiased = draws["unbiased"]
    error = unbiased.std(0).norm() / math.sqrt(len(unbiased))
    assert (unbiased.mean(0) - x).norm() < 2 * error, ((unbiased.mean(0) - x).norm(), error)
    for scale in ("one", "biased"):
        assert (draws[scale].mean(0) - x).norm() > 5 * error
    errors = {scale: (d - x).square().sum(-1) for scale, d in draws.items()}
    assert (errors["biased"] <= errors["one"] * (1 + 1e-5)).all()
    assert (errors["biased"] <= errors["unbiased"] * (1 + 1e-5)).all()
    assert errors["biased"].mean() < 0.99 * errors["one"].mean()


def test_norm_correction_keeps_the_norm():
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(4)) * 3
    rotation = Rotation("plain_hadamard", 128)
    for scale, kept in (("unit", True), ("one", False)):
        q = RotatedScalarQuantizer(rotation, 3, "gaussian", scale, torch.float32)
        ratio = q.decode(q.encode(x)).norm(dim=-1) / x.norm(dim=-1)
        assert torch.allclose(ratio, torch.ones(64), atol=1e-5) == kept


def test_hadamard_rotations_are_orthogonal_and_plain_is_vllm_s():
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(6))
    for kind in ("random", "hadamard", "plain_hadamard"):
        rotation = Rotation(kind, 64, seed=1)
        torch.testing.assert_close(rotation.forward(x).norm(dim=-1), x.norm(dim=-1))
        torch.testing.assert_close(rotation.inverse(rotation.forward(x)), x, atol=1e-5, rtol=1e-5)
    sylvester = torch.ones(1, 1)
    while sylvester.shape[0] < 64:
        sylvester = torch.cat([torch.cat([sylvester, sylvester], 1), torch.cat([sylvester, -sylvester], 1)], 0)
    torch.testing.assert_close(Rotation("plain_hadamard", 64).forward(x), x @ sylvester / 8)


# vLLM's TQ_PRESETS (vllm/model_executor/layers/quantization/turboquant/config.py): key bits, value bits, nc
VLLM_PRESETS = {
    "turboquant_k8v4": (8, 4, False),
    "turboquant_4bit_nc": (4, 4, True),
    "turboquant_k3v4_nc": (3, 4, True),
    "turboquant_3bit_nc": (3, 3, True),
}


def _preset(name: str) -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=[f"codec={name}"]).codec


@pytest.mark.parametrize("preset", list(VLLM_PRESETS))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_vllm_presets_store_vllm_s_bytes_and_keep_the_boundary_layers(preset, head_dim):
    """Keys ceil(d b / 8) + 2 bytes per head and token (k8: d), values ceil(d b / 8) + 4, as vLLM's
    key_packed_size / value_packed_size, in the payload too; layers 0, 1, L-2, L-1 kept in 16 bits."""
    key_bits, value_bits, nc = VLLM_PRESETS[preset]
    config = _preset(preset)
    assert (config.key_bits, config.value_bits, config.norm_correction) == (key_bits, value_bits, nc)
    codec = build_codec(config, ModelInfo("m", 28, 4, head_dim))
    expected = {"key": head_dim if key_bits == 8 else math.ceil(head_dim * key_bits / 8) + 2,
                "value": math.ceil(head_dim * value_bits / 8) + 4}
    x = torch.randn(2, 4, 3, head_dim, generator=torch.Generator().manual_seed(7))
    for kind, nbytes in expected.items():
        assert codec.code_bits_per_value(kind, 5) * head_dim == 8 * nbytes
        payload = codec.encode(StreamRequest(layer=5, kind=kind, tokens=x))
        assert payload.nbytes == nbytes * 2 * 4 * 3
        for layer in (0, 1, 26, 27):
            assert codec.policy(kind, layer).block_size is None and codec.code_bits_per_value(kind, layer) == SKIPPED_BITS
        assert codec.policy(kind, 2).block_size == 1 and codec.policy(kind, 25).block_size == 1


def test_eden_costs_what_turboquant_mse_costs():
    model = ModelInfo("m", 4, 2, 64)
    turboquant, eden = build_codec({"name": "turboquant"}, model), build_codec({"name": "eden"}, model)
    assert eden.bits_per_value() == turboquant.bits_per_value() == 3 + 16 / 64
    prod = build_codec({"name": "turboquant", "variant": "prod"}, model)
    assert prod.bits_per_value() == 3 + 32 / 64


@pytest.mark.parametrize("config, message", [
    ({"name": "turboquant", "key_bits": 5}, r"key_bits=5 is not supported; valid: 1..4 \(mse\), or 8"),
    ({"name": "turboquant", "variant": "prod", "value_bits": 1}, r"value_bits=1 is not supported; valid: 2..4 \(prod\)"),
    ({"name": "turboquant", "variant": "both"}, "unknown turboquant variant 'both'; valid choices: mse, prod"),
    ({"name": "turboquant", "rotation": "hadamard"}, "rotation=hadamard needs a power-of-two head_dim, got 48"),
    ({"name": "turboquant", "boundary_layers": 2}, "boundary_layers=2 must be >= 0 and leave a layer"),
    ({"name": "eden", "scale": "optimal", "rotation": "random"}, "unknown eden scale 'optimal'; valid choices: biased, unbiased"),
    ({"name": "eden", "rotation": "random", "density": "student"}, "valid choices: beta, gaussian"),
])
def test_bad_settings_are_refused(config, message):
    with pytest.raises(ConfigError, match=message):
        build_codec(config, ModelInfo("m", 4, 2, 48))
