"""The Triton QJL score kernel against its torch reference (under TRITON_INTERPRET=1 on the CPU), and the
attention path that serves decode steps from the key payload."""

from importlib import import_module

import pytest
import torch

from kvcomp.cache import CompressedCache, install
from kvcomp.codecs import build_codec
from kvcomp.errors import ConfigError
from kvcomp.kernels import check_kernel_backend
from kvcomp.kernels.formats import SketchedKeys
from kvcomp.kernels.qjl_scores import qjl_scores, qjl_scores_reference
from kvcomp.stages.jl_sketch import channel_mask, group_outlier_channels, jl_projection, sign_sketch
from tests.codec_matrix import QJL_FUSED, QJL_TINY
from tests.helpers import info_of, reads_taken

pytest.importorskip("triton")

# (batch, kv heads, query rows per kv head, head_dim, groups, group size, m, m_o, n_out)
SHAPES = [
    (1, 1, 1, 64, 1, 32, 256, 256, 8),  # the authors' general-layer sketch, one decode query
    (2, 2, 4, 32, 3, 32, 40, 16, 4),  # GQA 4:1, odd number of groups, m not a power of two
    (2, 3, 5, 16, 5, 8, 24, 8, 2),  # odd query rows, groups smaller than the 16-token tile
    (1, 2, 2, 128, 2, 32, 512, 128, 8),  # the initial-layer sketch at head_dim 128
    (2, 2, 3, 32, 3, 16, 64, 0, 0),  # no outlier split
    (1, 1, 70, 16, 1, 16, 16, 8, 1),  # more query rows than one tile (two row blocks)
]


def _sketched(b, h, d, groups, group, m, m_out, n_out, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, h, groups * group, d, generator=g) * 2
    keys[..., 3] *= 8  # a large channel, as in deeper layers
    projection = jl_projection(m, d, seed=seed)
    if not n_out:
        return SketchedKeys(sign_sketch(keys, projection), keys.norm(dim=-1).half(), projection, group)
    channels = group_outlier_channels(keys, group, n_out)
    outliers = keys * channel_mask(channels, d, group)
    inliers = keys - outliers
    return SketchedKeys(
        sign_sketch(inliers, projection), inliers.norm(dim=-1).half(), projection, group,
        sign_sketch(outliers, projection[:m_out]), outliers.norm(dim=-1).half(), channels.to(torch.uint8),
    )


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_triton_scores_match_the_reference(shape):
    b, h, r, d, groups, group, m, m_out, n_out = shape
    keys = _sketched(b, h, d, groups, group, m, m_out, n_out)
    query = torch.randn(b, h, r, d, generator=torch.Generator().manual_seed(1))
    reference = qjl_scores_reference(query, keys)
    kernel = qjl_scores(query, keys, "triton")
    assert kernel.shape == (b, h, r, groups * group) and kernel.dtype == torch.float32
    assert torch.allclose(kernel, reference, rtol=1e-4, atol=1e-4 * reference.abs().max().item())


NEW_TOKENS = 6  # row 0 (27 prompt tokens) reaches 32: a key block of either config is encoded while decoding


def _generate(model, codec, ids, mask, protocol):
    cache = CompressedCache(codec, protocol)
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, past_key_values=cache, pad_token_id=0,
        output_logits=True, return_dict_in_generate=True,
    )
    return torch.stack(out.logits, dim=1), cache


def _check_fused_decode_matches_reference(model, protocol, config=QJL_TINY, mode="scores"):
    codec = build_codec(config, info_of(model))
    ids = torch.randint(1, 96, (2, 27), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    reference, _ = _generate(model, codec, ids, mask, protocol)
    install(model, kernel_backend="triton")
    try:
        with reads_taken() as taken:
            fused, cache = _generate(model, codec, ids, mask, protocol)
        steps = [read for i, read in taken if i == 1][2:]  # after the prefill (two row groups: row 1 is padded)
        assert len(steps) == 2 * (NEW_TOKENS - 1)
        assert set(steps) == {"FusedDecode" if mode == "attention" else "FromSegments"}
    finally:
        install(model, kernel_backend="torch")
    assert torch.allclose(fused, reference, atol=1e-4, rtol=1e-4)
    return cache.layers[1].key_stream


# tiny Mistral without a sliding window is tiny Llama weight for weight (equal logits, the same attention path through
# kvcomp): its runs would repeat Llama's exactly
FAMILIES_RUN = ["llama", "qwen2"]


@pytest.mark.parametrize("tiny_model", FAMILIES_RUN, indirect=True)
@torch.no_grad()
def test_decode_steps_scored_from_the_payload_match_the_reference_path(tiny_model):
    """kernel_backend=triton scores encoded keys with the kernel (keys never decoded); the logits of every
    generated token equal the torch reference path (decode + SDPA), with GQA and left padding."""
    keys = _check_fused_decode_matches_reference(tiny_model, "exact_prefill")
    assert keys.num_encoded >= 32 and keys.decoded.length == 0  # scored from the payload, never decoded





@pytest.mark.parametrize("tiny_model", FAMILIES_RUN, indirect=True)
@torch.no_grad()
def test_decode_steps_run_the_fused_attention_kernel_on_the_sign_bits(tiny_model):
    """Sketch sizes the fused kernel reads: a QJL step scores the sign bits and weights the packed values in
    one kernel (no decoded K or V); every generated token's logits equal the torch reference path."""
    keys = _check_fused_decode_matches_reference(tiny_model, "exact_prefill", QJL_FUSED, mode="attention")
    assert keys.num_encoded >= 16 and keys.decoded.length == 0


@torch.no_grad()
def test_streaming_prefill_then_payload_scored_decode(tiny_llama):
    """A streaming prefill takes the reference path (it needs per-query states); the decode steps after it
    read the payload, so blocks encoded while decoding are never decoded, and the prefill's decoded copy is freed at
    the first of them."""
    keys = _check_fused_decode_matches_reference(tiny_llama, "streaming")
    assert keys.decoded.length == 0 and keys.num_encoded > 27 // 8 * 8  # row 0: its prefill blocks, then decoded ones


def test_triton_backend_needs_cuda_or_the_interpreter(monkeypatch):
    check_kernel_backend("torch", "cpu")
    check_kernel_backend("triton", "cpu")  # TRITON_INTERPRET=1 (conftest)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="CUDA device"):
        check_kernel_backend("triton", "cpu")


def test_install_rejects_an_unknown_backend(tiny_llama):
    with pytest.raises(ConfigError, match="valid choices: torch, triton"):
        install(tiny_llama, kernel_backend="cuda")


def test_gpu_benchmark_script_runs_on_the_interpreter():
    """python -m benchmarks.bench_qjl_decode --smoke: the GPU benchmark's code path on a tiny CPU shape."""
    module = import_module("benchmarks.bench_qjl_decode")
    table = module.main(["--smoke"])
    assert table.count("| qjl scores (Triton) |") == 2
    fused = next(line for line in table.splitlines() if "qjl step, fused" in line)  # the authors' sketch is fused
    assert 0 < float(fused.split(" | ")[-1].rstrip(" |")) < 1e-2  # float64 reference, bf16 output
    assert "| 68.2 |" in table  # authors' sketch: 512 sign bits + two fp16 norms + 8 uint8 ids per 32 tokens
