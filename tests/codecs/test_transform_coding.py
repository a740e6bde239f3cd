"""kvtc's transform coding stage: feature layout, PCA, byte stream round trip, DEFLATE (kvcomp.stages.transform_coding)."""

import pytest
import torch

from kvcomp.stages.bit_allocation import allocate
from kvcomp.stages.transform_coding import PCABasis, decode_rows, deflate, encode_rows, feature_rows, fit_pca, inflate


def test_feature_rows_are_layer_head_dim_ordered():
    layers = [torch.randn(2, 3, 5, 4) for _ in range(2)]  # [B, H, T, d]
    rows = feature_rows(layers)
    assert rows.shape == (10, 2 * 3 * 4)
    b, t, layer, head = 1, 3, 1, 2
    torch.testing.assert_close(rows[b * 5 + t, layer * 12 + head * 4: layer * 12 + head * 4 + 4], layers[layer][b, head, t])


def test_full_rank_pca_round_trips_and_one_layer_decodes_alone():
    torch.manual_seed(0)
    rows = torch.randn(300, 24) @ torch.randn(24, 24) + 5.0
    pca = fit_pca(rows, rank=24, dtype=torch.float32)
    torch.testing.assert_close(pca.basis.T @ pca.basis, torch.eye(24), atol=1e-4, rtol=0)
    torch.testing.assert_close(pca.reconstruct(pca.project(rows)), rows, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(pca.reconstruct(pca.project(rows), slice(8, 16)), rows[:, 8:16], atol=1e-3, rtol=1e-4)
    stored = fit_pca(rows, rank=24)  # fp16, as stored
    assert stored.basis.dtype == torch.float16 and isinstance(stored, PCABasis)


def test_low_rank_pca_keeps_the_leading_components():
    torch.manual_seed(0)
    rows = torch.randn(500, 3) @ torch.randn(3, 20) * 4 + 0.01 * torch.randn(500, 20)
    pca = fit_pca(rows, rank=3, dtype=torch.float32)
    error = (pca.reconstruct(pca.project(rows)) - rows).square().mean() / rows.var(0).sum()
    assert error < 1e-4


def test_byte_stream_round_trips_the_plan_and_its_size_is_the_plan_bits():
    torch.manual_seed(0)
    coefficients = torch.randn(40, 50) * torch.linspace(6, 0.1, 50)
    plan = allocate(coefficients, 8 * 50, sizes=(1, 16))
    assert {kind for _, _, kind in plan.groups} - {"none"}, "the plan keeps something"
    stream = encode_rows(coefficients, plan)
    assert stream.numel() * 8 == plan.bits * 40  # whole bytes here: every group's codes fill bytes
    decoded = decode_rows(inflate(deflate(stream), stream.numel()), plan, 40)
    torch.testing.assert_close(decoded, plan.apply(coefficients))


def test_inflate_refuses_a_bomb_and_a_short_stream_without_inflating_them():
    import tracemalloc
    import zlib

    from kvcomp.errors import DamagedPayloadError

    bomb = zlib.compress(bytes(512 * 2**20), 9)  # 512 MiB of zeros in about 0.5 MB
    tracemalloc.start()
    with pytest.raises(DamagedPayloadError, match="more than 1000 bytes"):
        inflate(bomb, 1000)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 * 2**20, peak
    with pytest.raises(DamagedPayloadError, match="holds 10 bytes where its plan implies 11"):
        inflate(zlib.compress(bytes(10)), 11)
    with pytest.raises(DamagedPayloadError, match="corrupt"):
        inflate(b"not deflate", 4)
    assert inflate(zlib.compress(bytes(range(7))), 7).tolist() == list(range(7))
