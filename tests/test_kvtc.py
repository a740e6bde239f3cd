"""kvtc as a codec (model scope): the DP budget, DEFLATE payloads, per-layer decoding (also in the codec matrix)."""

import pytest
import torch

from kvcomp.stages.transform_coding import decode_rows, inflate
from tests.codec_matrix import make_codec


@pytest.fixture(autouse=True)
def cache_home(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path_factory.getbasetemp() / "kvcomp-cache"))


def test_plans_meet_the_budget_and_payloads_are_the_deflated_plan_streams(tiny_llama):
    codec = make_codec(tiny_llama, "kvtc")
    p = codec.model.num_layers * codec.width
    assert codec.budget_bits == 16 * p // 4
    for plan in codec.plans.values():
        assert 0 < plan.bits <= codec.budget_bits
    keys = [torch.randn(2, 2, 8, 16) for _ in range(2)]
    values = [torch.randn(2, 2, 8, 16) for _ in range(2)]
    payload = codec.encode_model(keys, values)
    assert payload.nbytes == sum(row.numel() for rows in payload.ragged.values() for row in rows)
    stream = inflate(payload.ragged["key"][1].numpy().tobytes())  # batch row 1: 8 tokens
    rounding = 8 * len(codec.plans["key"].groups)  # each group's packed codes are rounded up to whole bytes
    assert abs(stream.numel() * 8 - 8 * codec.plans["key"].bits) <= rounding
    whole = codec.pca["key"].reconstruct(decode_rows(stream, codec.plans["key"], 8))  # [8, p]: every layer
    k1, _ = codec.decode_model(payload, 1, torch.float32)  # layer 1 alone, from its columns
    torch.testing.assert_close(k1[1], whole[:, codec.width:2 * codec.width].view(8, 2, 16).transpose(0, 1))
    more = make_codec(tiny_llama, "kvtc", compression_ratio=2)  # more bits, less error
    assert more.plans["key"].error < codec.plans["key"].error
