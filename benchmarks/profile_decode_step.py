"""Where the time of one decode step goes, for rows of ``benchmarks/bench_decode_e2e.py`` (GPU diagnosis).

For each row the model of ``bench_decode_e2e.py`` (random weights, Llama-3.1-8B layer shapes) prefills a
random prompt, runs warm-up steps, times steps with CUDA events, and profiles two more with
``torch.profiler`` (host and device activities): the operators with the most device time and the most host
time. For ``DynamicCache`` it then times steps with each SDPA backend forced (flash, memory-efficient,
cuDNN, math), to show which one transformers' ``sdpa`` attention dispatches to and what each costs.

    python -m benchmarks.profile_decode_step --rows DynamicCache fp16 kivi-2 --batch 8 --context 16384
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kvcomp.errors import at_least

from benchmarks.bench_decode_e2e import ROWS, SETTINGS, build_models, new_cache, prefill, step_ms


def steps(model, cache, token, device, count: int) -> tuple[float, torch.Tensor]:
    times = []
    for _ in range(count):
        ms, token = step_ms(model, cache, token, device)
        times.append(ms)
    return statistics.median(times), token


@torch.inference_mode()
def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=["DynamicCache", "fp16", "kivi-2"])
    parser.add_argument("--batch", type=at_least(1), default=8)
    parser.add_argument("--context", type=at_least(1), default=16384)
    parser.add_argument("--layers", type=at_least(1), default=4)
    parser.add_argument("--top", type=at_least(1), default=12)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this diagnosis needs a CUDA GPU")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    device, setting = torch.device("cuda"), SETTINGS["cuda"]
    models = build_models(setting, args.layers, device)
    ids = torch.randint(0, models[0].config.vocab_size, (args.batch, args.context), device=device)
    for name in args.rows:
        model, cache = new_cache(name, models, args.context + 64)
        token = prefill(model, cache, ids, setting["chunk"])
        _, token = steps(model, cache, token, device, 4)
        ms, token = steps(model, cache, token, device, 8)
        print(f"\n=== {name}, batch {args.batch} x {args.context}: {ms:.2f} ms per step (median of 8)", flush=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
            _, token = steps(model, cache, token, device, 2)
        averages = trace.key_averages()
        for key in ("device_time_total", "cuda_time_total"):  # the name changed across torch versions
            try:
                print(averages.table(sort_by=key, row_limit=args.top, max_name_column_width=60))
                break
            except (AttributeError, KeyError, ValueError):
                continue
        print(averages.table(sort_by="self_cpu_time_total", row_limit=args.top // 2, max_name_column_width=60))
        if name == "DynamicCache":
            for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
                try:
                    with sdpa_kernel([backend]):
                        ms, token = steps(model, cache, token, device, 8)
                    print(f"DynamicCache with SDPA forced to {backend.name}: {ms:.2f} ms per step", flush=True)
                except RuntimeError as failure:
                    print(f"DynamicCache with SDPA forced to {backend.name}: cannot run ({str(failure)[:100]})", flush=True)
        del cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
