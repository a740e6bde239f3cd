"""Where the host time of one layer's fused decode call goes (GPU diagnosis).

``benchmarks/bench_decode_attention.py`` reports each call's host ms (the wall clock until the call returns). On an
H200 machine that was 0.24-0.31 ms at batch 1 x 4K and 0.5 ms at 16 x 32K for KIVI-2, where this CPU takes
0.12 ms at either batch with the launches bound but not sent (``tools/kernel_model.py``'s host term). For each
codec and shape this script makes the call as that benchmark times it (one step's plan and workspace, a fresh query
each call), warms it up, then over ``--calls`` calls prints: the host ms per call (median), the Python functions with
the most own time (``cProfile``: time spent in a C call, such as a launch or a torch operator, counts as its caller's),
and the torch operators with the most own host time per call (``torch.profiler``). ``--cuda-graphs``: the same for
the call captured in CUDA graphs (:mod:`kvcomp.kernels.decode_graphs`).

    python -m benchmarks.profile_decode_call --codecs kivi-2 --shapes 1x4096 16x32768 --cuda-graphs
    TRITON_INTERPRET=1 python -m benchmarks.profile_decode_call --smoke   # tiny CPU run that checks the script
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import pstats
import statistics
import time

import torch

from kvcomp.codecs import ModelInfo, build_codec, needs_calibration
from kvcomp.errors import at_least
from kvcomp.kernels.decode_attention import decode_attention
from kvcomp.kernels.decode_graphs import DecodeGraphs
from kvcomp.kernels.decode_plan import DecodePlans, DecodeWorkspace

from benchmarks.bench_decode_attention import CODECS, LLAMA31_8B, cache_state, synthetic_state
from benchmarks.benchmarking import SMOKE_SHAPE, batch_by_context, script_device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def profile_call(name: str, batch: int, context: int, device: torch.device, calls: int, graphs: bool, top: int,
                 shape: dict = LLAMA31_8B) -> str:
    """The report of one codec's call at ``batch x context`` and the attention ``shape`` (module docstring)."""
    codec = build_codec(CODECS[name], ModelInfo("llama31_8b", 1, shape["kv_heads"], shape["head_dim"]))
    if needs_calibration(codec):
        synthetic_state(codec, torch.Generator().manual_seed(0))
    keys, values, rope, _ = cache_state(codec, batch, context, device)
    hq, d = shape["query_heads"], shape["head_dim"]
    planned = DecodePlans(DecodeWorkspace(DecodeGraphs() if graphs else None))
    queries = itertools.cycle([torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16) for _ in range(4)])

    def call():
        return decode_attention(next(queries), keys, values, d**-0.5, None, rope, "triton", step=planned)

    for _ in range(3 if graphs else 1):  # compiles, then (graphs) remembers the call, captures it
        call()
    hosts = []
    for _ in range(calls):
        sync(device)
        begin = time.perf_counter()
        call()
        hosts.append(1e3 * (time.perf_counter() - begin))
    sync(device)
    profiler = cProfile.Profile()
    for _ in range(calls):
        sync(device)
        profiler.enable()
        call()
        profiler.disable()
    sync(device)
    functions = io.StringIO()
    pstats.Stats(profiler, stream=functions).sort_stats("tottime").print_stats(top)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            sync(device)
            call()
        sync(device)
    operators = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    title = f"{name}{' (CUDA graphs)' if graphs else ''} at {batch} x {context}"
    return "\n".join([f"=== {title}: host ms per call, median of {calls}: {statistics.median(hosts):.4f} "
                      f"(min {min(hosts):.4f}, max {max(hosts):.4f})",
                      f"--- Python functions by own time over {calls} calls", functions.getvalue().strip(),
                      f"--- torch operators by own host time over {calls} calls", operators.strip(), ""])


@torch.inference_mode()
def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", nargs="+", default=["kivi-2", "temporalkv-2"], choices=list(CODECS))
    parser.add_argument("--shapes", nargs="+", type=batch_by_context, default=[(1, 4096), (16, 32768)],
                        metavar="BATCHxCONTEXT")
    parser.add_argument("--calls", type=at_least(1), default=50)
    parser.add_argument("--top", type=at_least(1), default=15)
    parser.add_argument("--cuda-graphs", action="store_true", help="also profile each call captured in CUDA graphs")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny CPU run (TRITON_INTERPRET=1, two KV heads) that checks the script")
    args = parser.parse_args(argv)
    device = script_device(parser, args)
    shapes, calls, shape = ([(1, 160)], 2, SMOKE_SHAPE) if args.smoke else (args.shapes, args.calls, LLAMA31_8B)
    reports = []
    for batch, context in shapes:
        for name in args.codecs:
            for graphs in (False, True) if args.cuda_graphs else (False,):
                reports.append(profile_call(name, batch, context, device, calls, graphs, args.top, shape))
                print(reports[-1], flush=True)
    return "\n".join(reports)


if __name__ == "__main__":
    main()
