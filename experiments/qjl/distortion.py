"""QJL's logit distortion per layer vs sketch size on the embedded model (the paper's Fig. 3, spec §4.4).

Captures the post-RoPE queries and keys of every layer for one held-out Wikipedia window, sketches the
keys with QJL (no outlier split, as the authors' ``plot_distortion.py``) at several ``m / d`` and prints the
relative distortion ``||Q K_hat^T - Q K^T||_F / ||Q K^T||_F`` of the raw logits, per layer. The paper
reports (without numbers) that distortion falls as ``1/sqrt(m)`` and that the first layer is markedly
worse than the others.

    python experiments/qjl/distortion.py            # SmolLM2-135M, 512 tokens, m/d = 1, 2, 4, 8
"""

from __future__ import annotations

import argparse

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvcomp.cache import install
from kvcomp.codecs import ModelInfo, build_codec
from kvcomp.codecs.base import StreamRequest
from kvcomp.data import load_corpus
from kvcomp.errors import at_least
from kvcomp.models import load_model

CAPTURED: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _capturing_attention(module, query, key, value, attention_mask, **kwargs):
    CAPTURED[module.layer_idx] = (query.detach(), key.detach())
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def capture_queries_and_keys(model, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Post-RoPE ``(queries [1, Hq, T, D], keys [1, H, T, D])`` of every layer for one forward of ``ids``."""
    AttentionInterface.register("kvcomp_capture", _capturing_attention)
    model.set_attn_implementation("kvcomp_capture")
    CAPTURED.clear()
    with torch.no_grad():
        model(ids)
    install(model)
    return dict(CAPTURED)


def relative_distortion(codec, layer: int, queries: torch.Tensor, keys: torch.Tensor) -> float:
    exact = queries @ keys.repeat_interleave(queries.shape[1] // keys.shape[1], dim=1).transpose(-1, -2)
    estimated = codec.payload_scores(queries, codec.encode(StreamRequest(layer, "key", tokens=keys)), layer)
    return ((estimated - exact).norm() / exact.norm()).item()


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=at_least(1), default=512)
    parser.add_argument("--ratios", type=at_least(1), nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args(argv)
    model, tokenizer = load_model("embedded", dtype="float32", device="cpu")
    text = " ".join(load_corpus("enwiki", "evaluation")[:3])
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens]
    captured = capture_queries_and_keys(model, ids)
    info = ModelInfo.from_hf_config(model.config)
    codecs = {
        ratio: build_codec({"name": "qjl", "sketch_dim": ratio * info.head_dim, "outlier_channels": 0, "initial_layers": 0,
                            "key_buffer": 32}, info)
        for ratio in args.ratios
    }
    lines = ["| layer | " + " | ".join(f"m/d = {r}" for r in args.ratios) + " |", "|---|" + "---|" * len(args.ratios)]
    for layer, (queries, keys) in sorted(captured.items()):
        keys = keys[:, :, : keys.shape[2] // 32 * 32]
        queries = queries[:, :, : keys.shape[2]]
        cells = [f"{relative_distortion(codecs[r], layer, queries, keys):.3f}" for r in args.ratios]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    return table


if __name__ == "__main__":
    main()
