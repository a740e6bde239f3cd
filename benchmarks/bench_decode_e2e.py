"""End to end decode speed and memory of every compressed cache against transformers' DynamicCache
(writes its section of BENCHMARKS.md).

A random-weight Llama with Llama-3.1-8B layer shapes (hidden 4096, 32 query / 8 KV heads, head_dim 128,
MLP 14336, vocabulary 32000) and ``--layers`` layers (4), bf16. For every batch x context a random
prompt is prefilled in 2,048-token chunks, then greedy decode steps run after warm-up steps. Rows:

- ``DynamicCache``: the model as transformers builds it, ``sdpa`` attention;
- every codec: ``CompressedCache`` (``exact_prefill``, ``check_finite="deferred"``) on a copy with the
  same weights after ``install(model, "triton")``, so decode steps take the codec's fused kernels where
  it has them. Calibrated codecs get random codebooks and statistics (speed does not depend on them).

Per row: median ms per decode step (CUDA events around each step), tokens per second, peak GPU memory
(``max_memory_allocated`` from the prefill on, model weights included), the ratio to DynamicCache's
step, and the synchronising CUDA calls of one more step (``torch.cuda.set_sync_debug_mode``: 0 means the
host never waits for the device within a step; CUDA-graph capture is not attempted). Compressed caches
are preallocated (``capacity``: prompt + every step), so decode steps allocate no storage.

``--max-batch``: the largest batch whose 32K-token caches (one prefill, copied into every row: :func:`_fits`) and two
decode steps fit on the device, found by real allocations (out-of-memory errors caught) for each row: batches 1 and 2
give the bytes a sequence adds, the search starts at the batch that fills the memory and steps out from it
(:func:`largest_batch`); ``--max-batch-gib`` caps the allocator (``torch.cuda.set_per_process_memory_fraction``) so that
each try decodes fewer sequences. ``--agreement``: teacher-forced decoding through the fused path and through the torch
path of the same codec, fed the same tokens: relative error of the logits and greedy agreement.

    python -m benchmarks.bench_decode_e2e --write                       # on a CUDA GPU (about 10 minutes)
    python -m benchmarks.bench_decode_e2e --max-batch --agreement --write
    python -m benchmarks.bench_decode_e2e --shapes 16x32768 --rows DynamicCache kivi-2 --max-batch --max-batch-gib 16
    TRITON_INTERPRET=1 python -m benchmarks.bench_decode_e2e --smoke    # CPU check of the script itself
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import warnings
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvcomp.cache import CompressedCache, install, with_cache
from kvcomp.cache.host_syncs import HostSyncs
from kvcomp.codecs import ModelInfo, build_codec
from kvcomp.codecs.codebook import CodebookCodec
from kvcomp.errors import at_least
from kvcomp.kernels import sdpa_without_cudnn

from benchmarks.bench_decode_attention import CODECS as KERNEL_CODECS
from benchmarks.bench_decode_attention import synthetic_state
from benchmarks.bench_decode_overhead import machine
from benchmarks.benchmarking import (
    SDPA_BACKENDS, batch_by_context, check_smoke, revision, script_device, write_section,
)

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## End-to-end decode through the compressed caches"
BASELINE = "DynamicCache"
E2E_CODECS = ("kivi-2", "kivi-4", "temporalkv-2", "channelkv-2", "kvquant-2", "fp8", "int8-token-head", "int4-token-head",
              "nvfp4", "eden-2", "kvarn", "turboquant-k3v4-nc")  # the kernel benchmark's, but QJL's 3-bit layer
ROWS = {BASELINE: None, "fp16": {"name": "fp16"}, **{name: KERNEL_CODECS[name] for name in E2E_CODECS}, "qjl": {"name": "qjl"}}
SETTINGS = {
    "cuda": dict(model=dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                            head_dim=128, vocab_size=32000),
                 dtype=torch.bfloat16, shapes=((8, 16384), (16, 16384), (8, 32768), (16, 32768)), chunk=2048,
                 warmup=4, steps=16, max_batch_context=32768, max_batch_limit=4096, agreement=(2, 1536, 64)),
    "smoke": dict(model=dict(hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=32, vocab_size=100),
                  dtype=torch.float32, shapes=((2, 192),), chunk=64, warmup=1, steps=2, max_batch_context=192,
                  max_batch_limit=2, agreement=(2, 192, 2)),
}


def build_models(setting: dict, layers: int, device: torch.device):
    """``(plain, hooked)``: the same random weights with ``sdpa`` attention, and after ``install``."""
    torch.manual_seed(0)
    longest = max([p for _, p in setting["shapes"]] + [setting["max_batch_context"]])
    config = LlamaConfig(**setting["model"], num_hidden_layers=layers, max_position_embeddings=longest + 256)
    with torch.device(device):
        plain = LlamaForCausalLM(config).to(setting["dtype"]).eval()
    plain.set_attn_implementation("sdpa")
    hooked = copy.deepcopy(plain)
    install(hooked, "triton")
    return plain, hooked


def new_cache(name: str, models: tuple, capacity: int, backend: str = "triton"):
    """``(model, cache)`` of a row, compressed caches preallocated for ``capacity`` tokens per sequence;
    codecs with codebooks get random ones."""
    if ROWS[name] is None:
        return models[0], DynamicCache(config=models[0].config)
    model = models[1]
    install(model, backend)
    codec = build_codec(ROWS[name], ModelInfo.from_hf_config(model.config))
    if isinstance(codec, CodebookCodec):
        synthetic_state(codec, torch.Generator().manual_seed(0))
    return model, CompressedCache(codec, protocol="exact_prefill", check_finite="deferred", capacity=capacity)


def forward(model, cache, ids: torch.Tensor) -> torch.Tensor:
    """Last-position logits ``[B, vocab]`` after ``ids``."""
    return model(ids, **with_cache(model, cache), use_cache=True, logits_to_keep=1).logits[:, -1]


def prefill(model, cache, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    for start in range(0, ids.shape[1], chunk):
        logits = forward(model, cache, ids[:, start : start + chunk])
    return logits.argmax(-1, keepdim=True)


def step_ms(model, cache, token: torch.Tensor, device: torch.device) -> tuple[float, torch.Tensor]:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        token = forward(model, cache, token).argmax(-1, keepdim=True)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end), token
    import time

    begin = time.perf_counter()
    token = forward(model, cache, token).argmax(-1, keepdim=True)
    return 1e3 * (time.perf_counter() - begin), token


def host_syncs(model, cache, token: torch.Tensor, device: torch.device) -> tuple[float, torch.Tensor]:
    """Synchronising CUDA calls (device-to-host reads, stream syncs) during one decode step, counted by
    torch's sync debug mode; on a CPU, the operations that would synchronise on a GPU
    (:class:`~kvcomp.cache.host_syncs.HostSyncs`)."""
    if device.type != "cuda":
        with HostSyncs() as syncs:
            token = forward(model, cache, token).argmax(-1, keepdim=True)
        return float(len(syncs.found)), token
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            token = forward(model, cache, token).argmax(-1, keepdim=True)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return float(sum("synchroniz" in str(w.message) for w in caught)), token


def _fresh(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


@torch.inference_mode()
def speed(setting: dict, models: tuple, rows: list[str], device: torch.device, log) -> list[dict]:
    """One table row per (shape, cache row), rows measured one after another on a fresh cache."""
    out = []
    vocab = models[0].config.vocab_size
    for batch, context in setting["shapes"]:
        ids = torch.randint(0, vocab, (batch, context), generator=torch.Generator().manual_seed(batch)).to(device)
        baseline = None
        for name in rows:
            _fresh(device)
            try:
                ms, syncs = _steps(name, models, ids, setting, device)
            except Exception as failure:  # one cache that fails on this device must not cost the other rows
                out.append({"batch": batch, "context": context, "cache": name, "failed": f"{type(failure).__name__}: {failure}"})
                log(f"[bench] batch {batch} x {context} {name}: failed ({out[-1]['failed']})")
                continue
            baseline = ms if name == BASELINE else baseline
            out.append({"batch": batch, "context": context, "cache": name, "ms": ms, "tokens_per_s": 1e3 * batch / ms,
                        "peak_gib": _peak(device), "ratio": ms / baseline if baseline else float("nan"), "syncs": syncs})
            log(f"[bench] batch {batch} x {context} {name}: {ms:.2f} ms/step, peak {out[-1]['peak_gib']:.2f} GiB")
    return out


def _steps(name: str, models: tuple, ids: torch.Tensor, setting: dict, device: torch.device) -> tuple[float, float]:
    """Median ms of a row's decode steps after its prefill, and the host syncs of one more step."""
    model, cache = new_cache(name, models, ids.shape[1] + setting["warmup"] + setting["steps"] + 2)
    token = prefill(model, cache, ids, setting["chunk"])
    times = []
    for i in range(setting["warmup"] + setting["steps"]):
        ms, token = step_ms(model, cache, token, device)
        if i >= setting["warmup"]:
            times.append(ms)
    syncs, _ = host_syncs(model, cache, token, device)
    return statistics.median(times), syncs


def _fits(name: str, batch: int, setting: dict, models: tuple, device: torch.device) -> tuple[bool, float]:
    """Whether ``batch`` sequences of ``max_batch_context`` tokens and two decode steps fit, and the GiB then allocated
    (the weights and the caches; NaN where they did not fit, or on a CPU). One sequence is prefilled and its cache
    copied into every row (``batch_repeat_interleave``), as a server prefills each request on its own: a batched
    prefill's attention temporaries (keys and values repeated for every query head, a compressed cache's decoded
    history) grow with batch x context and, at 32K tokens, outweigh the cache itself (with the
    allocator capped at 16 GiB on an H200, a batched prefill fitted DynamicCache 8 sequences, KIVI-2 and TemporalKV-2 7,
    int8 per token-head 6)."""
    _fresh(device)
    try:
        model, cache = new_cache(name, models, setting["max_batch_context"] + 3)
        ids = torch.randint(0, models[0].config.vocab_size, (1, setting["max_batch_context"]), device=device)
        token = prefill(model, cache, ids, setting["chunk"])
        cache.batch_repeat_interleave(batch)  # the one sequence's cache copied into every row
        token = token.repeat_interleave(batch, 0)
        for _ in range(2):
            token = forward(model, cache, token).argmax(-1, keepdim=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return True, torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    except torch.cuda.OutOfMemoryError:
        return False, float("nan")
    finally:
        cache = model = None  # noqa: F841  (release before the next try)
        _fresh(device)


def _estimate(held: tuple[float, float], capacity_gib: float, limit: int) -> int | None:
    """The batch that fills ``capacity_gib``, from the GiB held at batches 1 and 2 (what a sequence adds, and the
    rest: the peaks would be the one prefill's, the same for both); ``None`` where they say nothing (a CPU)."""
    per_sequence = held[1] - held[0]
    if not per_sequence > 0:
        return None
    return max(2, min(limit, int((capacity_gib - (held[0] - per_sequence)) / per_sequence)))


def largest_batch(fits, guess: int | None, limit: int) -> int:
    """The largest batch in ``[2, limit]`` for which ``fits(batch)`` holds, given that 2 does: from ``guess`` (the
    estimate) in steps of 1 % of it that double until the answer changes, then by bisection; without a guess,
    doubling from 2. Few tries where the estimate is close: each try at a large batch is a long prefill."""
    low, high = 2, limit + 1  # fits(low) holds; fits(high) does not, or high is past the limit
    if guess is None:
        probe = 4
        while probe <= limit and fits(probe):
            low, probe = probe, probe * 2
        high = min(probe, limit + 1)
    else:
        step, probe = max(1, guess // 100), guess
        if fits(probe):
            low = probe
            while low + step <= limit and fits(low + step):
                low, step = low + step, step * 2
            high = min(low + step, limit + 1)
        else:
            high = probe
            while high - step > low and not fits(high - step):
                high, step = high - step, step * 2
            low = max(low, high - step)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


@torch.inference_mode()
def max_batch(setting: dict, models: tuple, rows: list[str], device: torch.device, log) -> list[dict]:
    """Per row, the largest batch whose ``max_batch_context``-token caches and two decode steps (:func:`_fits`) fit in
    ``max_batch_gib`` (the allocator capped there; default the device's memory), by real allocations. Batches 1 and 2
    give the bytes a sequence adds; :func:`largest_batch` starts from the batch that fills the capacity."""
    out = []
    cap = setting.get("max_batch_gib")
    capacity = float("nan")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total) if cap else 1.0, device.index)
        capacity = cap or total
    limit = setting["max_batch_limit"]
    for name in rows:
        tries = []

        def fits(batch: int, name=name, tries=tries) -> bool:
            tries.append(batch)
            return _fits(name, batch, setting, models, device)[0]

        first = _fits(name, 1, setting, models, device)
        second = _fits(name, 2, setting, models, device) if first[0] else (False, float("nan"))
        if not second[0]:
            low = 1 if first[0] else 0
        else:
            low = largest_batch(fits, _estimate((first[1], second[1]), capacity, limit), limit)
        out.append({"cache": name, "max_batch": low, "capped": low == limit, "tries": 2 + len(tries)})
        log(f"[bench] largest batch at {setting['max_batch_context']} tokens, {name}: {low} ({2 + len(tries)} tries: "
            f"1, 2, {', '.join(map(str, tries))})")
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0, device.index)
    base = next(r["max_batch"] for r in out if r["cache"] == BASELINE) if BASELINE in rows else 0
    for row in out:
        row["vs_bf16"] = row["max_batch"] / base if base else float("nan")
    return out


@torch.inference_mode()
def agreement(setting: dict, models: tuple, rows: list[str], device: torch.device, log) -> list[dict]:
    """Teacher-forced: the torch path's greedy tokens are fed to both paths of each codec."""
    batch, context, steps = setting["agreement"]
    ids = torch.randint(0, models[0].config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(7)).to(device)
    out = []
    def run(backend: str, cache, tokens: torch.Tensor) -> torch.Tensor:
        install(models[1], backend)  # both paths share the hooked model: its modules carry the backend
        return forward(models[1], cache, tokens)

    def compare(name: str) -> dict:
        caches = {backend: new_cache(name, models, context + steps + 1, backend)[1] for backend in ("torch", "triton")}
        logits = {b: run(b, c, ids) for b, c in caches.items()}
        errors, agree = [], []
        for _ in range(steps):
            token = logits["torch"].argmax(-1, keepdim=True)
            logits = {b: run(b, c, token) for b, c in caches.items()}
            errors.append(float((logits["triton"].float() - logits["torch"].float()).norm() / logits["torch"].float().norm()))
            agree.append(float((logits["triton"].argmax(-1) == logits["torch"].argmax(-1)).float().mean()))
        return {"cache": name, "rel_error": statistics.mean(errors), "max_rel_error": max(errors),
                "agreement": statistics.mean(agree)}

    for name in [r for r in rows if r != BASELINE]:
        try:
            out.append(compare(name))
            log(f"[bench] teacher-forced {name}: logits rel. error {out[-1]['rel_error']:.2e}, "
                f"argmax agreement {out[-1]['agreement']:.3f}")
        except Exception as failure:  # reported in the table; the other codecs are still compared
            out.append({"cache": name, "failed": f"{type(failure).__name__}: {failure}"})
            log(f"[bench] teacher-forced {name}: failed ({out[-1]['failed']})")
        finally:
            install(models[1], "triton")
    return out


def tables(speed_rows, batch_rows, agree_rows, setting: dict) -> str:
    lines = ["| batch | context | cache | ms per decode step | tokens/s | peak GiB | vs DynamicCache | host syncs per step |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['context']} | {r['cache']} | failed: {r['failed'][:200]} | | | | |" if "failed" in r else
              f"| {r['batch']} | {r['context']} | {r['cache']} | {r['ms']:.2f} | {r['tokens_per_s']:.0f} | {r['peak_gib']:.2f} | "
              f"{r['ratio']:.2f}x | {r['syncs']:.0f} |" for r in speed_rows]
    if batch_rows:
        cap = f", the allocator capped at {setting['max_batch_gib']:g} GiB" if setting.get("max_batch_gib") else ""
        lines += ["", f"Largest batch at {setting['max_batch_context']} tokens (real allocations{cap}):", "",
                  "| cache | largest batch | vs DynamicCache (bf16) | tries |", "|---|---|---|---|"]
        lines += [f"| {r['cache']} | {r['max_batch']}{'+' if r['capped'] else ''} | {r['vs_bf16']:.2f}x | {r['tries']} |"
                  for r in batch_rows]
    if agree_rows:
        batch, context, steps = setting["agreement"]
        lines += ["", f"Fused vs torch path, teacher-forced ({batch} x {context}-token prompt, {steps} steps):", "",
                  "| codec | logits rel. error (mean) | max | greedy agreement |", "|---|---|---|---|"]
        lines += [f"| {r['cache']} | failed: {r['failed'][:200]} | | |" if "failed" in r else
                  f"| {r['cache']} | {r['rel_error']:.2e} | {r['max_rel_error']:.2e} | {r['agreement']:.3f} |" for r in agree_rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=at_least(1), default=4)
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--shapes", nargs="+", type=batch_by_context, metavar="BATCHxCONTEXT",
                        help="speed rows only at these shapes (default: 8 and 16 x 16K and 32K)")
    parser.add_argument("--max-batch", action="store_true", help="also search the largest batch at 32K tokens")
    parser.add_argument("--max-batch-gib", type=float, metavar="GIB",
                        help="cap the allocator there for --max-batch (fewer sequences per try: a try fits a lease)")
    parser.add_argument("--agreement", action="store_true", help="also compare the fused and torch paths")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run (TRITON_INTERPRET=1) checking the script (a failed row fails it)")
    parser.add_argument("--write", action="store_true", help="replace this benchmark's section of BENCHMARKS.md")
    args = parser.parse_args(argv)
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    name = "smoke" if args.smoke else "cuda"
    device = script_device(parser, args)
    setting = SETTINGS[name]
    if args.shapes and not args.smoke:
        setting = {**setting, "shapes": tuple(args.shapes)}
    if args.max_batch_gib and not args.smoke:
        setting = {**setting, "max_batch_gib": args.max_batch_gib}
    layers = 2 if args.smoke else args.layers
    models = build_models(setting, layers, device)
    with sdpa_without_cudnn():
        speed_rows = speed(setting, models, args.rows, device, log)
        batch_rows = max_batch(setting, models, args.rows, device, log) if args.max_batch or args.smoke else []
        agree_rows = agreement(setting, models, args.rows, device, log) if args.agreement or args.smoke else []
    body = tables(speed_rows, batch_rows, agree_rows, setting)
    if not args.smoke:
        command = "python -m benchmarks.bench_decode_e2e " + " ".join(argv if argv is not None else sys.argv[1:])
        body = "\n".join([f"Command: `{command.strip()}` at revision {revision()}.", f"Machine: {machine(device)}.", "",
                          f"Random-weight Llama, Llama-3.1-8B layer shapes, {layers} layers, bf16; SDPA {SDPA_BACKENDS}.",
                          "", body])
    print(body)
    if args.write and not args.smoke:
        write_section(ROOT / "BENCHMARKS.md", SECTION, body)
    check_smoke(args.smoke, [f"{r['cache']}: {r['failed']}" for r in (*speed_rows, *batch_rows, *agree_rows) if "failed" in r])
    return body


if __name__ == "__main__":
    main()
