"""Launch configurations of the fused decode-attention kernel on a GPU: warps per program, tokens per tile,
register path or ``tl.dot`` (writes its section of BENCHMARKS.md).

For each codec of ``benchmarks/bench_decode_attention.py`` and each batch x context, one decode step of the
split + merge kernels is timed for every configuration (CUDA-event medians, fresh query per call, caches
rotated beyond twice the L2 cache), beside PyTorch SDPA on bf16 K/V, and each configuration's output is
checked against the float64 torch reference on a fresh random cache (``||out - ref|| / ||ref||``).

    python -m benchmarks.sweep_decode_kernel --write                      # on a CUDA GPU
    TRITON_INTERPRET=1 python -m benchmarks.sweep_decode_kernel --smoke   # CPU check of the script itself
"""

from __future__ import annotations

import argparse
import sys

import torch

from kvcomp.codecs import ModelInfo, build_codec, needs_calibration
from kvcomp.errors import at_least
from kvcomp.kernels.decode_attention import decode_attention_reference, relative_error
from kvcomp.kernels.decode_attention_triton import decode_attention_triton
from kvcomp.kernels.decode_plan import DecodePlans

from benchmarks.bench_decode_attention import CODECS, cache_state, copy_bandwidth, fastest_sdpa, synthetic_state
from benchmarks.benchmarking import (
    LLAMA31_8B, SMOKE_SHAPE, Timer, batch_by_context, buffer_sets, check_smoke, device_name, l2_cache_bytes, publish,
    revision, script_device,
)

SECTION = "## Launch configurations of the fused decode kernel"
# label -> options of decode_attention_triton; the first is the library's default (tl.dot, 4 warps, or 2 where the grid
# crowds the multiprocessors; 32-token tiles, 128 for the formats default_tile names; operands of the query's type, bf16
# here; the payloads' register cap where the grid crowds the multiprocessors)
CONFIGS = {
    "default": {},
    "register, 16 warps, 16 tokens": dict(dot=False, num_warps=16, block_tokens=16),
    "register, 8 warps, 32 tokens": dict(dot=False, num_warps=8, block_tokens=32),
    "register, 4 warps, 32 tokens": dict(dot=False, num_warps=4, block_tokens=32),
    "register, 4 warps, 64 tokens": dict(dot=False, num_warps=4, block_tokens=64),
    "register, 4 warps, 128 tokens": dict(dot=False, num_warps=4, block_tokens=128),
    "register, 2 warps, 64 tokens": dict(dot=False, num_warps=2, block_tokens=64),
    "register, 1 warp, 32 tokens": dict(dot=False, num_warps=1, block_tokens=32),
    "tl.dot, 4 warps, 32 tokens": dict(dot=True, num_warps=4, block_tokens=32),
    "tl.dot, 4 warps, 64 tokens": dict(dot=True, num_warps=4, block_tokens=64),
    "tl.dot, 4 warps, 128 tokens": dict(dot=True, num_warps=4, block_tokens=128),
    "tl.dot, 8 warps, 128 tokens": dict(dot=True, num_warps=8, block_tokens=128),
    "tl.dot, 4 warps, float32 operands": dict(dot=True, num_warps=4, operands="float32"),  # TF32 operands for a bf16 query
    # registers per thread on the tl.dot path: the compiler's choice (KIVI's default before its payloads' cap), 128 (four
    # programs per multiprocessor; the codebook kernels then spill 8-260 bytes per thread) and 168 (three; TemporalKV-2
    # spills 24 bytes under Triton 3.6, ChannelKV-2 and KVQuant-2 compile to 168 or fewer without the cap)
    "tl.dot, 4 warps, no register cap": dict(dot=True, num_warps=4, registers=0),
    "tl.dot, 4 warps, 128 registers": dict(dot=True, num_warps=4, registers=128),
    "tl.dot, 4 warps, 168 registers": dict(dot=True, num_warps=4, registers=168),
    # 2 warps on the tl.dot path: packed ints' and natively read payloads' default where the grid gives a multiprocessor
    # eight programs or more, capped at 128 registers (decode_attention_triton._launch_shape; predicted)
    "tl.dot, 2 warps, 128 registers": dict(dot=True, num_warps=2, registers=128),
    "tl.dot, 2 warps, no register cap": dict(dot=True, num_warps=2, registers=0),
    # fp16 operands for a bf16 model: packed-int keys decoded two codes at a time for 2-bit codes too (uniform_triton.
    # paired_keys; predicted 12 % faster for KIVI-2 at 16 x 32K, not the default: fp16 overflows beyond 65504)
    "tl.dot, float16 operands": dict(operands="float16"),
}


def sweep(codec, name: str, batch: int, context: int, timer: Timer, device, l2_bytes: int, configs: dict, log,
          hq: int) -> list[dict]:
    d = codec.model.head_dim
    first = cache_state(codec, batch, context, device)
    states = [first] + [cache_state(codec, batch, context, device) for _ in range(buffer_sets(first[3], l2_bytes) - 1)]
    turn = iter(range(10**9))

    def inputs():
        keys, values, rope, _ = states[next(turn) % len(states)]
        return torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16), keys, values, rope

    check = cache_state(codec, batch, context, device)
    q = torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16)
    reference = decode_attention_reference(q, check[0], check[1], d**-0.5, None, check[2], torch.float64)
    rows = []
    for label, options in configs.items():
        planned = DecodePlans()  # a model's layers share their step's plan and workspace: each call is one such layer

        def step(q, keys, values, rope, planned=planned, options=options):
            return decode_attention_triton(q, keys, values, d**-0.5, None, key_rope=rope, step=planned, **options)

        try:
            error = relative_error(step(q, check[0], check[1], check[2]), reference)
            ms = timer(step, inputs)
            device_ms = timer.device_ms
        except Exception as failure:  # a configuration that does not compile or run is reported, not fatal
            rows.append({"codec": name, "batch": batch, "context": context, "config": label, "ms": float("nan"),
                         "device_ms": float("nan"), "bytes": first[3], "error": float("nan"), "failure": f"{type(failure).__name__}: {str(failure)[:80]}"})
            log(f"[sweep] {name} {batch}x{context} {label}: FAILED {rows[-1]['failure']}")
            continue
        rows.append({"codec": name, "batch": batch, "context": context, "config": label, "ms": ms, "device_ms": device_ms,
                     "bytes": first[3],
                     "error": error, "failure": ""})
        log(f"[sweep] {name} {batch}x{context} {label}: {ms:.4f} ms ({device_ms:.4f} on the device), error {error:.2g}")
    return rows


def table(rows: list[dict], sdpa: dict, copy_gbps: float) -> str:
    lines = ["| codec | batch x context | configuration | median ms | device ms | vs SDPA | GB/s | % of copy bandwidth | "
             "vs default | relative error |", "|---|---|---|---|---|---|---|---|---|---|"]
    default = {(r["codec"], r["batch"], r["context"]): r["ms"] for r in rows if r["config"].startswith("default")}
    default = {key: default.get(key, float("nan")) for key in {(r["codec"], r["batch"], r["context"]) for r in rows}}
    for r in rows:
        shape = (r["batch"], r["context"])
        if r["failure"]:
            lines.append(f"| {r['codec']} | {shape[0]} x {shape[1]} | {r['config']} | failed: {r['failure']} | | | | | | |")
            continue
        gbps = r["bytes"] / r["ms"] / 1e6
        lines.append(f"| {r['codec']} | {shape[0]} x {shape[1]} | {r['config']} | {r['ms']:.4f} | {r['device_ms']:.4f} | "
                     f"{sdpa[shape] / r['ms']:.2f}x | "
                     f"{gbps:.0f} | {100 * gbps / copy_gbps:.0f}% | {default[(r['codec'], *shape)] / r['ms']:.2f}x | {r['error']:.2g} |")
    return "\n".join(lines)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", type=batch_by_context, default=[(16, 32768), (1, 32768)], metavar="BATCHxCONTEXT")
    parser.add_argument("--codecs", nargs="+", default=["kivi-2", "temporalkv-2", "qjl"], choices=list(CODECS))
    parser.add_argument("--configs", nargs="+", type=int, help="indices into CONFIGS (default: all)")
    parser.add_argument("--warmup", type=at_least(0), default=5)
    parser.add_argument("--reps", type=at_least(1), default=20)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny CPU run (TRITON_INTERPRET=1, two KV heads) checking the script (a failed row fails it)")
    parser.add_argument("--write", action="store_true", help="replace this benchmark's section of BENCHMARKS.md")
    args = parser.parse_args(argv)
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    configs = {label: options for i, (label, options) in enumerate(CONFIGS.items()) if args.configs is None or i in args.configs}
    device = script_device(parser, args)
    if args.smoke:
        shapes, timer, shape = [(1, 160)], Timer(device, 0, 1), SMOKE_SHAPE
        configs = {label: {**options, "block_tokens": 32} for label, options in list(configs.items())[:2]}
    else:
        shapes, timer, shape = args.shapes, Timer(device, args.warmup, args.reps), LLAMA31_8B
    l2_bytes = l2_cache_bytes(device)
    info = ModelInfo("llama31_8b", 1, shape["kv_heads"], shape["head_dim"])
    generator = torch.Generator().manual_seed(0)
    copy_gbps = copy_bandwidth(Timer(device, timer.warmup, timer.reps, device_time=False), device)
    rows, sdpa = [], {}
    for batch, context in shapes:
        h, hq, d = shape["kv_heads"], shape["query_heads"], shape["head_dim"]
        dense = [(torch.randn(batch, h, context, d, device=device, dtype=torch.bfloat16),
                  torch.randn(batch, h, context, d, device=device, dtype=torch.bfloat16))
                 for _ in range(buffer_sets(4 * batch * h * context * d, l2_bytes))]
        turn = iter(range(10**9))

        def dense_inputs():
            return torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16), *dense[next(turn) % len(dense)]

        sdpa[(batch, context)] = fastest_sdpa(timer, dense_inputs)[0]
        dense.clear()
        for name in args.codecs:
            codec = build_codec(CODECS[name], info)
            if needs_calibration(codec):
                synthetic_state(codec, generator)
            rows += sweep(codec, name, batch, context, timer, device, l2_bytes, configs, log, hq)
    body = "\n".join([
        f"Command: `{' '.join(['python -m benchmarks.sweep_decode_kernel', *(argv if argv is not None else sys.argv[1:])])}` "
        f"at revision {revision()}. Device: {device_name(device)}; measured copy bandwidth {copy_gbps:.0f} GB/s. "
        f"One decode step of one layer (split + merge kernels), Llama-3.1-8B heads; CUDA events, median of {timer.reps} "
        f"after {timer.warmup} warm-up calls; SDPA: the faster of flash and memory-efficient on bf16 K/V.", "",
        table(rows, sdpa, copy_gbps)])
    published = publish(SECTION, body, args.write and not args.smoke)
    check_smoke(args.smoke, [f"{r['codec']} {r['config']}: {r['failure']}" for r in rows if r["failure"]])
    return published


if __name__ == "__main__":
    main()
