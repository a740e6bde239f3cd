"""QJL: the estimator's statistics against the paper's formulas, bit accounting, codec and cache behaviour.

Statistical tests use a fixed seed and tolerances of 4 standard errors computed from the samples
themselves (the standard error of a mean from the formula's variance, of a variance from the sample's
fourth central moment), never hand-tuned margins.
"""

import math

import pytest
import torch

from kvcomp.cache import CompressedCache
from kvcomp.codecs import ModelInfo, build_codec, expected_cache_bits
from kvcomp.codecs.base import StreamRequest
from kvcomp.errors import ConfigError
from kvcomp.kernels.formats import SketchedKeys
from kvcomp.kernels.qjl_scores import qjl_scores_reference
from kvcomp.stages.jl_sketch import (
    channel_mask,
    estimator_scale,
    group_outlier_channels,
    jl_projection,
    orthogonal_row_bias,
    sign_sketch,
    unpack_signs,
)
from tests.helpers import info_of

D, M, DRAWS = 32, 64, 20000


def _pair(seed=0, d=D):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(d, generator=g, dtype=torch.float64)
    k = 0.6 * q + torch.randn(d, generator=g, dtype=torch.float64)  # correlated, so <q, k> is far from 0
    return q, k


def _qjl_estimates(q, k, projections):
    """Prod_QJL(q, k) (Eq. 4) for each projection ``[N, m, d]``, through the codec's sketch and packing."""
    m = projections.shape[1]
    signs = unpack_signs(sign_sketch(k.float(), projections.float()), m).double()  # [N, m]
    return estimator_scale(m) * k.norm() * ((projections @ q) * signs).sum(-1)


def _gaussian_variance(q, k, m):
    """Var[Prod_QJL] for i.i.d. Gaussian S (spec §3): ((pi/2) |q|^2 |k|^2 - <q,k>^2) / m."""
    return ((math.pi / 2) * q.square().sum() * k.square().sum() - q.dot(k) ** 2).item() / m


def _mean_and_variance_errors(samples):
    """Sample mean, sample variance and the standard error of the sample variance."""
    mean = samples.mean()
    centered = samples - mean
    variance = centered.square().mean()
    fourth = centered.pow(4).mean()
    return mean.item(), variance.item(), math.sqrt((fourth - variance**2).item() / len(samples))


def test_gaussian_estimator_is_unbiased_with_the_papers_variance():
    """Lemma 3.2 (unbiased) and the exact variance, with i.i.d. Gaussian S."""
    q, k = _pair()
    projections = torch.randn(DRAWS, M, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mean, variance, variance_se = _mean_and_variance_errors(_qjl_estimates(q, k, projections))
    expected_variance = _gaussian_variance(q, k, M)
    assert abs(mean - q.dot(k).item()) < 4 * math.sqrt(expected_variance / DRAWS)
    assert abs(variance - expected_variance) < 4 * variance_se


def _orthogonal_estimates(q, k, row_norm, draws=4000):
    projections = torch.stack([jl_projection(M, D, "orthogonal", row_norm, seed) for seed in range(draws)]).double()
    return _qjl_estimates(q, k, projections)


def test_orthogonal_rows_cut_the_variance_and_scale_by_beta_d():
    """Block-QR projection with rows of norm sqrt(d) (spec §2.3): mean = beta_d <q,k>, variance well below
    the Gaussian formula (the spec measured about 0.35x)."""
    q, k = _pair()
    samples = _orthogonal_estimates(q, k, "sqrt_d")
    mean, variance, variance_se = _mean_and_variance_errors(samples)
    true = q.dot(k).item()
    assert abs(mean - orthogonal_row_bias(D) * true) < 4 * math.sqrt(variance / len(samples))
    assert variance + 4 * variance_se < 0.6 * _gaussian_variance(q, k, M)


def test_chi_row_norms_make_the_orthogonal_estimator_unbiased():
    q, k = _pair(seed=3)
    samples = _orthogonal_estimates(q, k, "chi")
    mean, variance, _ = _mean_and_variance_errors(samples)
    assert abs(mean - q.dot(k).item()) < 4 * math.sqrt(variance / len(samples))


def test_orthogonal_row_bias_values_from_the_spec():
    assert orthogonal_row_bias(128) == pytest.approx(1.00196, abs=1e-5)
    assert orthogonal_row_bias(64) == pytest.approx(1.0039, abs=1e-4)


def test_two_part_outlier_estimator_is_unbiased_with_summed_variances():
    """Inlier and outlier sketches on disjoint channels of one Gaussian S are independent (spec A3): the sum
    is unbiased and its variance is the sum of the two Gaussian formulas (m and m_o rows)."""
    q, k = _pair(seed=5)
    group, m_out, draws = 4, 16, 6000
    keys = k.float().expand(1, 1, group, D).clone()
    channels = torch.tensor([[[[3, 17, 30]]]])
    mask = channel_mask(channels, D, group)
    k_in, k_out = keys * ~mask, keys * mask
    g = torch.Generator().manual_seed(7)
    samples = []
    for _ in range(draws):
        projection = torch.randn(M, D, generator=g)
        sketched = SketchedKeys(
            sign_sketch(k_in, projection), k_in.norm(dim=-1), projection, group,
            sign_sketch(k_out, projection[:m_out]), k_out.norm(dim=-1), channels.to(torch.uint8),
        )
        samples.append(qjl_scores_reference(q.float().view(1, 1, 1, D), sketched)[0, 0, 0, 0])
    samples = torch.stack(samples).double()
    mean, variance, variance_se = _mean_and_variance_errors(samples)
    outlier = mask[0, 0, 0].double()
    q_in, q_out, ki, ko = q * (1 - outlier), q * outlier, k * (1 - outlier), k * outlier
    expected_variance = _gaussian_variance(q_in, ki, M) + _gaussian_variance(q_out, ko, m_out)
    assert abs(mean - q.dot(k).item()) < 4 * math.sqrt(expected_variance / draws)
    assert abs(variance - expected_variance) < 4 * variance_se


def test_projection_is_seeded_and_block_orthogonal():
    s = jl_projection(80, 32, seed=4)
    assert torch.equal(s, jl_projection(80, 32, seed=4))
    assert not torch.equal(s, jl_projection(80, 32, seed=5))
    assert torch.allclose(s.norm(dim=1), torch.full((80,), math.sqrt(32)), atol=1e-4)
    gram = s[:32] @ s[:32].T
    assert torch.allclose(gram, 32 * torch.eye(32), atol=1e-3)  # one block: orthogonal rows
    assert torch.allclose(s[64:] @ s[64:].T, 32 * torch.eye(16), atol=1e-3)  # the last, narrower block too


def test_group_outlier_channels_pick_the_large_channels():
    x = torch.randn(2, 3, 8, 16, generator=torch.Generator().manual_seed(0))
    x[:, :, :4, 5] *= 50  # first group of 4 tokens: channel 5 dominates; second group: channel 11
    x[:, :, 4:, 11] *= 50
    channels = group_outlier_channels(x, 4, 1)
    assert (channels[:, :, 0, 0] == 5).all() and (channels[:, :, 1, 0] == 11).all()


# Spec §2.7: key bits per token per head for d = 128, two fp16 norms, uint8 channel ids amortised over 32 tokens.
KEY_BITS_128 = [((256, 256, 8), 546), ((512, 128, 8), 674), ((256, 128, 8), 418), ((256, 0, 0), 272), ((512, 0, 0), 528)]


@pytest.mark.parametrize("sizes,bits", KEY_BITS_128)
def test_key_bits_reproduce_the_spec_table(sizes, bits):
    m, m_out, n_out = sizes
    config = {"name": "qjl", "sketch_dim": m, "outlier_sketch_dim": m_out or 8, "outlier_channels": n_out, "initial_layers": 0}
    codec = build_codec(config, ModelInfo("llama", 32, 8, 128))
    assert codec.key_bits_per_token(0) == bits


@pytest.mark.parametrize("value_bits,per_coordinate", [(2, 3.0), (4, 5.0)])
def test_value_bits_reproduce_the_spec_table(value_bits, per_coordinate):
    codec = build_codec({"name": "qjl", "value_bits": value_bits}, ModelInfo("llama", 32, 8, 128))
    assert codec.code_bits_per_value("value", 0) == per_coordinate


def test_authors_defaults_cost_3_87_bits_not_3():
    """The QJL authors' README defaults (15 initial layers m=512/m_o=128, then 256/256, 2-bit values) on a 32-layer
    model."""
    codec = build_codec({"name": "qjl"}, ModelInfo("llama", 32, 8, 128))
    assert codec.bits_per_value() == pytest.approx((15 * (674 / 128 + 3) / 2 + 17 * (546 / 128 + 3) / 2) / 32)
    assert codec.bits_per_value() == pytest.approx(3.867, abs=1e-3)


TINY_QJL = {
    "name": "qjl", "sketch_dim": 40, "outlier_sketch_dim": 16, "initial_layers": 1, "initial_sketch_dim": 64,
    "initial_outlier_sketch_dim": 24, "outlier_channels": 2, "group_size": 4, "key_buffer": 8,
    "value_group_size": 8, "value_window": 4,
}


def _keys(codec, tokens=16, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, codec.model.num_kv_heads, tokens, codec.model.head_dim, generator=g) * 2


@pytest.mark.parametrize("layer", [0, 1])
def test_decoded_keys_give_the_estimators_logits(layer):
    """<q, k_hat> of the decoded keys equals the estimator evaluated from the packed bits (GQA 3:1)."""
    info = ModelInfo("tiny", 2, 2, 16)
    codec = build_codec(TINY_QJL, info)
    payload = codec.encode(StreamRequest(layer, "key", tokens=_keys(codec)))
    assert {t.dtype for k, t in payload.tensors.items() if "signs" in k} == {torch.uint8}
    assert payload.tensors["signs"].shape[-1] * 8 == codec.sketch_sizes(layer)[0]
    k_hat = codec.decode(payload, StreamRequest(layer, "key", dtype=torch.float32))
    query = torch.randn(2, 6, 3, 16, generator=torch.Generator().manual_seed(1))
    via_decode = query @ k_hat.repeat_interleave(3, dim=1).transpose(-1, -2)
    assert torch.allclose(codec.payload_scores(query, payload, layer), via_decode, atol=1e-4)


def test_without_outliers_the_score_is_the_single_sketch_estimator():
    info = ModelInfo("tiny", 1, 1, 16)
    codec = build_codec(TINY_QJL | {"outlier_channels": 0, "initial_layers": 0}, info)
    keys = _keys(codec, batch=1)
    payload = codec.encode(StreamRequest(0, "key", tokens=keys))
    assert set(payload.tensors) == {"signs", "inlier_norm"}
    query = torch.randn(1, 1, 1, 16)
    s = codec.sketch(0).projection
    by_hand = estimator_scale(40) * keys.norm(dim=-1) * ((s @ query[0, 0, 0]) * torch.sign(keys @ s.T)).sum(-1)
    assert torch.allclose(codec.payload_scores(query, payload, 0)[0, 0, 0], by_hand[0, 0], atol=1e-3, rtol=1e-3)


def test_estimation_error_shrinks_with_the_sketch_size():
    info = ModelInfo("tiny", 1, 2, 32)
    query = torch.randn(1, 2, 4, 32, generator=torch.Generator().manual_seed(2))
    errors = []
    for m in (32, 128, 512):
        codec = build_codec({"name": "qjl", "sketch_dim": m, "outlier_channels": 0, "initial_layers": 0, "group_size": 8,
                             "key_buffer": 32}, info)
        keys = _keys(codec, tokens=32, batch=1)
        errors.append((codec.payload_scores(query, codec.encode(StreamRequest(0, "key", tokens=keys)), 0) - query @ keys.transpose(-1, -2)).square().mean())
    assert errors[0] > 2 * errors[1] > 4 * errors[2]


@pytest.mark.parametrize(
    "override,message",
    [
        ({"sketch_dim": 100}, "multiple of 8"),
        ({"outlier_sketch_dim": 512}, "<= sketch_dim"),
        ({"key_buffer": 48}, "multiple of group_size"),
        ({"projection": "hadamard"}, "valid choices: gaussian, orthogonal"),
        ({"outlier_channels": 64}, "outlier_channels"),
        ({"value_group_size": 48}, "does not divide head_dim"),
        ({"norm_dtype": "int8"}, "norm_dtype"),
    ],
)
def test_config_errors_name_the_problem(override, message):
    with pytest.raises(ConfigError, match=message):
        build_codec({"name": "qjl"} | override, ModelInfo("m", 2, 2, 64))


@torch.no_grad()
def test_cache_holds_packed_sketches_and_counts_every_bit(tiny_llama):
    codec = build_codec(TINY_QJL, info_of(tiny_llama))
    cache = CompressedCache(codec)
    ids = torch.randint(0, 96, (2, 29), generator=torch.Generator().manual_seed(0))
    tiny_llama(ids, past_key_values=cache)
    keys = cache.layers[0].key_stream
    assert keys.num_encoded == 24 and keys.num_tail == 5  # sketched in chunks of key_buffer = 8 tokens
    assert cache.layers[0].value_stream.num_tail == 4  # value_window
    assert 8 * cache.nbytes == expected_cache_bits(codec, 29, 2, 32)


@torch.no_grad()
def test_more_sketch_bits_track_the_model_better(tiny_llama):
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(3))
    plain = tiny_llama(ids).logits
    errors = []
    for m in (16, 256):
        config = TINY_QJL | {"sketch_dim": m, "initial_sketch_dim": m, "outlier_sketch_dim": 8, "initial_outlier_sketch_dim": 8,
                             "value_bits": 8, "value_window": 0}
        cache = CompressedCache(build_codec(config, info_of(tiny_llama)), "simulated")
        errors.append((tiny_llama(ids, past_key_values=cache).logits - plain).square().mean())
    assert errors[1] < errors[0] / 2
