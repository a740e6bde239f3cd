"""Registers, spills (and how many of their instructions sit in the tile loop), shared memory and occupancy of the
decode kernels compiled for sm_90 (H100/H200), read without a GPU (writes the "Decode kernel resources" section of BENCHMARKS.md).

Each kernel launch that :func:`kvcomp.kernels.decode_attention_triton.decode_launches` makes for a
decode step over a codec's cache (Llama-3.1 heads: 8 KV heads, head_dim 128, ``--ratios`` query heads
per KV head, 4 for 8B and 8 for 70B; sinks, payload and tail as the codec's schedule leaves them; random payload), and the QJL
score kernel, is compiled by Triton for ``cuda`` capability 9.0 through a stand-in driver and assembled
with Triton's ptxas (:mod:`tools.resources`). Every distinct launch (key format x value format
x compile-time constants) is one row. These are static facts of the compiled code, not timings.

    python -m tools.kernel_resources --write
    python -m tools.kernel_resources --block-tokens 16 32 64 --warps 4 8   # other tile shapes
    # the GPU machine's Triton 3.6 (one section per Triton version):
    # (T36: a folder outside the checkout)
    pip download --no-deps --only-binary=:all: triton==3.6.0 -d "$T36"
    python -m zipfile -e "$T36"/triton-3.6.0-*.whl "$T36" && chmod +x "$T36"/triton/backends/nvidia/bin/*
    PYTHONPATH="$T36" python -m tools.kernel_resources --write
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton

from kvcomp.codecs import ModelInfo, build_codec, needs_calibration
from kvcomp.codecs.base import StreamRequest
from kvcomp.errors import at_least
from kvcomp.kernels.decode_attention_triton import decode_launches, payload_launch_inputs
from kvcomp.kernels.qjl_scores_triton import qjl_score_launch

from benchmarks.bench_decode_attention import CODECS, cache_state, synthetic_state
from benchmarks.benchmarking import LLAMA31_8B, write_section
from tools.resources import compile_launch, kernel_resources
from tools.static_model import disassemble, loop_local_accesses

SECTION = f"## Decode kernel resources on sm_90, Triton {triton.__version__} (static, compiled without a GPU)"
BATCH = 16  # sequences per step (the launches' code does not depend on it, their register cap does)
QJL_LAYER = 31  # a layer past QJL's initial_layers: the authors' 256 + 256 sign bits per key


def codec_launches(name: str, ratio: int, context: int, block_tokens: int | None):
    """The split-kernel launches of one decode step over ``name``'s cache, one per distinct compilation."""
    info = ModelInfo("llama31_8b", 1, LLAMA31_8B["kv_heads"], LLAMA31_8B["head_dim"])
    codec = build_codec(CODECS[name], info)
    if needs_calibration(codec):
        synthetic_state(codec, torch.Generator().manual_seed(0))
    # a batch whose grid crowds the multiprocessors (CPU tensors: 4 of them), where the launcher caps registers
    keys, values, rope, _ = cache_state(codec, BATCH, context, torch.device("cpu"))
    query = torch.randn(BATCH, info.num_kv_heads * ratio, info.head_dim, dtype=torch.bfloat16)
    valid = torch.ones(BATCH, context, dtype=torch.bool)  # decode steps read the attention mask
    query, keys, values, valid, rope, options = payload_launch_inputs(query, keys, values, valid, rope,
                                                                      {"block_tokens": block_tokens})
    _, launches = decode_launches(query, keys, values, info.head_dim**-0.5, valid, rope, **options)
    distinct = {}
    for launch in launches:
        constants = tuple((k, v) for k, v in launch.args.items() if k.isupper() or k == "num_warps")
        distinct.setdefault(constants, launch)
    return list(distinct.values())


def describe(launch) -> str:
    args = launch.args
    if "K_FORMAT" not in args:
        return f"merge ({args['BLOCK_R']} query rows per program)"
    keys, values = ("dense" if args[name] is None else args[name].name for name in ("K_FORMAT", "V_FORMAT"))
    keys += ((" (stored layout)" if args["PACKED_K"] else "") + (" + RoPE" if args["ROPE"] else "")
             + (" + offset" if args["offset"] else "") + (" + residual sketch" if args["RESIDUAL_FORMAT"] else ""))
    return f"keys {keys}, values {values}" + (" (stored layout)" if args["PACKED_V"] else "")


def rows_for(launch, label: str, warps: list[int | None], ratio: int) -> list[dict]:
    rows = []
    for num_warps in warps:
        if num_warps is not None:
            launch.args["num_warps"] = num_warps
        compiled = compile_launch(launch)
        found = kernel_resources(compiled)
        stores, loads = loop_local_accesses(disassemble(compiled.asm["cubin"]))
        rows.append({"ratio": ratio, "kernel": label, "launch": describe(launch) if label != "qjl scores" else "sign bits (score kernel, unfused)",
                     "block_t": launch.args.get("BLOCK_T", launch.args.get("BLOCK_G", "")), "loop": f"{stores} / {loads}", **found})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| query heads per KV head | kernel | launch | tokens per tile | warps | registers / thread | spill stores (B) "
             "| spill loads (B) | spill instructions in the tile loop (STL / LDL) | shared (B) | occupancy |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['ratio']} | {r['kernel']} | {r['launch']} | {r['block_t']} | {r['num_warps']} | {r['registers']} | "
                     f"{r['spill_stores']} | {r['spill_loads']} | {r['loop']} | {r['shared']} | {r['occupancy']:.0%} |")
    return "\n".join(lines)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", nargs="+", default=list(CODECS), choices=list(CODECS))
    parser.add_argument("--ratios", type=at_least(1), nargs="+", default=[4, 8],
                        help="query heads per KV head (4: Llama-3.1-8B, 8: Llama-3.1-70B)")
    parser.add_argument("--context", type=at_least(1), default=2048)
    parser.add_argument("--block-tokens", type=at_least(1), nargs="+", default=[None], help="tokens per tile (default: the kernel's)")
    parser.add_argument("--warps", type=at_least(1), nargs="+", default=[None], help="warps per program (default: the kernel's)")
    parser.add_argument("--no-qjl", action="store_true", help="leave out the QJL score kernel")
    parser.add_argument("--write", action="store_true", help="replace this section of BENCHMARKS.md")
    args = parser.parse_args(argv)
    rows = []
    for ratio in args.ratios:
        merges = {}
        for name in args.codecs:
            for block_tokens in args.block_tokens:
                for launch in codec_launches(name, ratio, args.context, block_tokens):
                    if "K_FORMAT" in launch.args:
                        rows += rows_for(launch, name, args.warps, ratio)
                    else:  # the merge kernel: one compilation per query-row tile (tl.dot launches pad rows to 16)
                        merges.setdefault(launch.args["BLOCK_R"], launch)
        for _, merge in sorted(merges.items()):
            rows += rows_for(merge, "merge", args.warps, ratio)
        if not args.no_qjl:
            h, d = LLAMA31_8B["kv_heads"], LLAMA31_8B["head_dim"]
            codec = build_codec({"name": "qjl"}, ModelInfo("llama31_8b", 32, h, d))
            payload = codec.encode(StreamRequest(QJL_LAYER, "key", tokens=torch.randn(1, h, args.context, d)))
            _, launch = qjl_score_launch(torch.randn(1, h, ratio, d), codec.sketched_keys(payload, QJL_LAYER))
            rows += rows_for(launch, "qjl scores", args.warps, ratio)
    ptxas = "Triton " + triton.__version__
    body = (f"Static resources of every distinct decode launch (`python -m tools.kernel_resources --write` with {ptxas} "
            "first on the path, see the script's docstring; "
            f"its ptxas, target sm_90a; head_dim 128; Llama-3.1 heads). Occupancy: resident warps "
            "over 64 by the sm_90 rules (64 K registers per SM in 256-register warp units, 228 KB shared memory, 1 KB "
            "reserved per block). Spill instructions in the tile loop: the local-memory stores and loads among the "
            "instructions of the kernel's tile loop on any path (`static_model.loop_local_accesses`), paid every tile; "
            "the others are paid once per program. The GPU machine runs Triton 3.6.\n\n" + table(rows))
    print(body)
    if args.write:
        write_section(Path(__file__).resolve().parent.parent / "BENCHMARKS.md", SECTION, body)
    return body


if __name__ == "__main__":
    main()
