"""Bytes a compressed cache holds, measured, against transformers' DynamicCache.

A random-weight Llama with Llama-3.1-8B attention shapes per layer (8 KV heads, head_dim 128; hidden 1024,
8 query heads, MLP 2048, 2 layers, vocabulary 1000), bfloat16 on the CPU, batch 1: a 2,048-token
prompt (``exact_prefill``) and 64 greedy decode steps. For every codec and attention path the table
gives what the cache reports (storage = full-precision sinks/tails + encoded payloads + per-sequence
state; bookkeeping = position ids; working = the torch path's decoded copy and spare capacity of growing
buffers) and what it holds: the bytes of every distinct tensor storage reachable from the cache object
(:func:`kvcomp.cache.memory.held_nbytes`; the model's weights and the codec's fitted state are not the
cache's). ``DynamicCache`` is measured the same way.

Paths: ``tiles`` (the default: decode steps read the payloads tile by tile where the codec has a payload reader,
:mod:`kvcomp.cache.tiles`, no decoded copy), ``decoded_copy`` (decode each block once, keep the decoded
copy). ``decode_per_step`` (no decoded copy, every read decodes every block) and the fused kernels' path hold what
``tiles`` holds for these codecs (``tests/cache/test_memory.py`` walks them).

    python -m benchmarks.bench_cache_memory --write
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvcomp.cache import CompressedCache, install, with_cache
from kvcomp.cache.memory import held_nbytes, model_storages
from kvcomp.codecs import Codec, ModelInfo, build_codec
from kvcomp.errors import at_least

from benchmarks.benchmarking import write_section

SECTION = "## Memory held by the compressed cache"
MODEL = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=8, head_dim=128, vocab_size=1000, max_position_embeddings=4096)
CODECS = {
    "fp16": {"name": "fp16"},
    "kivi-2": {"name": "kivi", "bits": 2, "group_size": 32, "residual_length": 128},
    "kivi-4": {"name": "kivi", "bits": 4, "group_size": 32, "residual_length": 128},
    "uniform-2 (per token, g=64)": {"name": "uniform", "bits": 2, "group_size": 64},
    "qjl (authors' defaults)": {"name": "qjl"},
}
PATHS = {"tiles": {}, "decoded_copy": {"decoded_copy": True}}  # decode_per_step holds what tiles hold for these


@torch.inference_mode()
def run(model, cache, prompt: int, steps: int):
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    token = model(ids, **with_cache(model, cache), use_cache=True, logits_to_keep=1).logits.argmax(-1)
    for _ in range(steps):
        token = model(token, **with_cache(model, cache), use_cache=True, logits_to_keep=1).logits.argmax(-1)
    return cache


def measure(prompt: int, steps: int) -> list[dict]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL)).to(torch.bfloat16).eval()
    weights = model_storages(model)
    dynamic = run(model, DynamicCache(config=model.config), prompt, steps)
    base = held_nbytes(dynamic, weights)
    rows = [{"codec": "DynamicCache", "path": "sdpa", "held": base, "reported": None}]
    install(model)
    info = ModelInfo.from_hf_config(model.config)
    for name, config in CODECS.items():
        for path, options in PATHS.items():
            if name == "fp16" and path != "tiles":
                continue
            cache = run(model, CompressedCache(build_codec(config, info), "exact_prefill", **options), prompt, steps)
            rows.append({"codec": name, "path": path, "held": held_nbytes(cache, weights, skip=(Codec,)),
                         "payload": cache.payload_nbytes, "full": cache.full_precision_nbytes,
                         "state": cache.state_nbytes, "bookkeeping": cache.bookkeeping_nbytes,
                         "working": cache.working_nbytes,
                         "reported": cache.nbytes + cache.bookkeeping_nbytes + cache.working_nbytes})
    for row in rows:
        row["ratio"] = row["held"] / base
    return rows


def table(rows: list[dict]) -> str:
    mib = 1 << 20
    lines = ["| cache | path | payload MiB | full-precision MiB | bookkeeping MiB | working MiB | reported MiB | "
             "held MiB (walk) | held vs DynamicCache |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["reported"] is None:
            lines.append(f"| {r['codec']} | {r['path']} | | | | | | {r['held'] / mib:.2f} | 1.000x |")
            continue
        lines.append(f"| {r['codec']} | {r['path']} | {r['payload'] / mib:.2f} | {r['full'] / mib:.2f} | "
                     f"{r['bookkeeping'] / mib:.3f} | {r['working'] / mib:.2f} | {r['reported'] / mib:.2f} | "
                     f"{r['held'] / mib:.2f} | {r['ratio']:.3f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt", type=at_least(1), default=2048)
    parser.add_argument("--steps", type=at_least(1), default=64)
    parser.add_argument("--write", action="store_true", help="replace the section of BENCHMARKS.md")
    args = parser.parse_args(argv)
    rows = measure(args.prompt, args.steps)
    text = "\n".join([
        f"Command: `python -m benchmarks.bench_cache_memory{' --write' if args.write else ''}` (prompt {args.prompt} "
        f"tokens, {args.steps} decode steps; bytes, so the CPU measures them exactly).", "",
        table(rows), "",
        "Per-sequence state is 0 for these codecs. Reported = storage + bookkeeping + working memory; it "
        "equals the walk (`tests/cache/test_memory.py` checks this within 1 % for every codec and path).",
    ])
    if args.write:
        write_section(Path(__file__).resolve().parent.parent / "BENCHMARKS.md", SECTION, text)
    return text


if __name__ == "__main__":
    print(main())
