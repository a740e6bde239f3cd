"""What a compressed cache holds, what one request peaks at, and how fast it decodes, against DynamicCache, on
the CPU.

A random-weight Llama with Llama-3.1-8B attention shapes per layer (8 KV heads, head_dim 128; hidden 1024,
8 query heads, MLP 2048, 2 layers, vocabulary 1000), bfloat16, batch 1, a random prompt (``exact_prefill``).

- **Decode** (one process): each cache prefills the prompt, then takes the timed greedy decode steps; the table
  gives the median step (wall clock) over the repeats' medians, the caches' order rotated each repeat, and the
  bytes the cache holds after them (every distinct tensor storage reachable from it,
  :func:`kvcomp.cache.memory.held_nbytes`), each against DynamicCache's.
- **Peak** (``--peak``; a fresh process per cache and length): the process's peak resident memory over the whole
  request (prefill and decode steps) above what it held once the model was loaded and warmed up (Linux's
  ``VmHWM``, reset through ``/proc/self/clear_refs`` before the request), and the budget figures derived from the
  held bytes per token: the longest context of one sequence, and the most 32K-token sequences, that fit
  ``--budget-gib`` of cache.

Caches: DynamicCache, fp16, KIVI-2 and vLLM's int4 per token-head (the default torch path, which reads the
payloads tile by tile, :mod:`kvcomp.cache.tiles`, and ``decoded_copy=True``).

    python -m benchmarks.bench_cpu_memory --write                 # decode at 8K tokens
    python -m benchmarks.bench_cpu_memory --prompt 32768 --write  # ... at 32K (another subsection)
    python -m benchmarks.bench_cpu_memory --peak --write          # peak memory at 2K, 8K and 32K
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvcomp.cache import CompressedCache, install, with_cache
from kvcomp.cache.memory import held_nbytes, model_storages
from kvcomp.codecs import Codec, ModelInfo, build_codec
from kvcomp.errors import at_least

from benchmarks.benchmarking import revision, write_section

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## CPU: memory and decode speed of the default path"
MODEL = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=8, head_dim=128, vocab_size=1000, max_position_embeddings=65536)
CACHES = {
    "DynamicCache": None,
    "fp16": ({"name": "fp16"}, {}),
    "kivi-2": ({"name": "kivi", "bits": 2}, {}),
    "kivi-2, decoded_copy": ({"name": "kivi", "bits": 2}, {"decoded_copy": True}),
    "int4 per token-head": ({"name": "int_token_head", "bits": 4}, {}),
    "int4 per token-head, decoded_copy": ({"name": "int_token_head", "bits": 4}, {"decoded_copy": True}),
}


def build_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**MODEL)).to(torch.bfloat16).eval()


def make_cache(model, name: str):
    if CACHES[name] is None:
        return DynamicCache(config=model.config)
    config, options = CACHES[name]
    return CompressedCache(build_codec(config, ModelInfo.from_hf_config(model.config)), "exact_prefill", **options)


def arguments(model, cache) -> dict:
    return {"past_key_values": cache} if isinstance(cache, DynamicCache) else with_cache(model, cache)


@torch.inference_mode()
def request(model, cache, ids: torch.Tensor, steps: int, clock=None) -> list[float]:
    """Prefill ``ids`` into ``cache`` and take ``steps`` greedy decode steps; each step's seconds."""
    kwargs = arguments(model, cache)
    token = model(ids, **kwargs, use_cache=True, logits_to_keep=1).logits.argmax(-1)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        token = model(token, **kwargs, use_cache=True, logits_to_keep=1).logits.argmax(-1)
        times.append(time.perf_counter() - start)
    return times


def decode_rows(prompt: int, steps: int, repeats: int) -> list[dict]:
    model = build_model()
    install(model)  # DynamicCache is read by the model's own attention (kvcomp's attention leaves it alone)
    weights = model_storages(model)
    ids = torch.randint(0, MODEL["vocab_size"], (1, prompt), generator=torch.Generator().manual_seed(0))
    names = list(CACHES)
    medians, held = {n: [] for n in names}, {}
    for repeat in range(repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            cache = make_cache(model, name)
            medians[name].append(statistics.median(request(model, cache, ids, steps)))
            held[name] = held_nbytes(cache, weights, skip=(Codec,))
            del cache
    base_ms, base_held = 1e3 * statistics.median(medians["DynamicCache"]), held["DynamicCache"]
    return [{"cache": n, "ms": 1e3 * statistics.median(medians[n]),
             "range": (1e3 * min(medians[n]), 1e3 * max(medians[n])),
             "time_ratio": statistics.median(m / b for m, b in zip(medians[n], medians["DynamicCache"])),
             "held": held[n], "held_ratio": held[n] / base_held, "base_ms": base_ms} for n in names]


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_member(name: str, prompt: int, steps: int) -> dict:
    """One request in this process: its peak resident bytes above the loaded, warmed-up model."""
    model = build_model()
    install(model)
    weights = model_storages(model)
    warm = torch.randint(0, MODEL["vocab_size"], (1, 64))
    request(model, make_cache(model, name), warm, 2)
    ids = torch.randint(0, MODEL["vocab_size"], (1, prompt), generator=torch.Generator().manual_seed(0))
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    cache = make_cache(model, name)
    request(model, cache, ids, steps)
    return {"cache": name, "prompt": prompt, "peak": _status("VmHWM") - before,
            "held": held_nbytes(cache, weights, skip=(Codec,)), "tokens": prompt + steps}


def peak_rows(prompts: list[int], steps: int, threads: int) -> list[dict]:
    rows = []
    for prompt in prompts:
        for name in CACHES:
            command = [sys.executable, "-m", "benchmarks.bench_cpu_memory", "--member", name, "--prompt", str(prompt),
                       "--steps", str(steps), "--threads", str(threads)]
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.splitlines()[-1]))
    return rows


def decode_table(rows: list[dict]) -> str:
    lines = ["| cache | ms per decode step | range over repeats | vs DynamicCache | held MiB | held vs DynamicCache |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['cache']} | {r['ms']:.1f} | {r['range'][0]:.1f}-{r['range'][1]:.1f} | {r['time_ratio']:.2f}x | "
                     f"{r['held'] / 2**20:.2f} | {r['held_ratio']:.3f}x |")
    return "\n".join(lines)


def peak_table(rows: list[dict], budget_gib: float) -> str:
    budget = budget_gib * 2**30
    lines = [f"| prompt | cache | peak MiB above the model | vs DynamicCache | held MiB | longest context in {budget_gib:g} GiB "
             f"| 32K sequences in {budget_gib:g} GiB |", "|---|---|---|---|---|---|---|"]
    base = {r["prompt"]: r["peak"] for r in rows if r["cache"] == "DynamicCache"}
    for r in rows:
        per_token = r["held"] / r["tokens"]
        lines.append(f"| {r['prompt']} | {r['cache']} | {r['peak'] / 2**20:.1f} | {r['peak'] / base[r['prompt']]:.2f}x | "
                     f"{r['held'] / 2**20:.2f} | {int(budget / per_token):,} | {int(budget / (per_token * 32768))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=at_least(1), default=8192)
    parser.add_argument("--steps", type=at_least(1), default=16)
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--threads", type=at_least(1), default=2)
    parser.add_argument("--peak", action="store_true", help="peak memory per request, a fresh process per row")
    parser.add_argument("--prompts", type=at_least(1), nargs="+", default=[2048, 8192, 32768], help="with --peak")
    parser.add_argument("--budget-gib", type=float, default=16.0)
    parser.add_argument("--member", choices=list(CACHES), help=argparse.SUPPRESS)  # one --peak row (a subprocess)
    parser.add_argument("--write", action="store_true", help="replace this benchmark's subsection of BENCHMARKS.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.member:
        print(json.dumps(peak_member(args.member, args.prompt, args.steps)))
        return ""
    prompts = f" --prompts {' '.join(map(str, args.prompts))}" * (args.prompts != [2048, 8192, 32768])
    flags = f" --peak{prompts}" if args.peak else f" --prompt {args.prompt}" * (args.prompt != 8192)
    command = f"python -m benchmarks.bench_cpu_memory{flags}{' --write' if args.write else ''}"
    setting = (f"Command: `{command}` at revision {revision()}; {args.threads} torch threads of {os.cpu_count()} CPUs, "
               f"torch {torch.__version__}.")
    if args.peak:
        rows = peak_rows(args.prompts, args.steps, args.threads)
        heading = "### Peak memory of one request"
        body = peak_table(rows, args.budget_gib)
        detail = (f"Prompts of {', '.join(map(str, args.prompts))} tokens, then {args.steps} decode steps. Budget "
                  "figures: the budget over the held bytes per token.")
    else:
        rows = decode_rows(args.prompt, args.steps, args.repeats)
        heading = f"### Decode at {args.prompt} tokens"
        body = decode_table(rows)
        detail = (f"A {args.prompt}-token prompt, {args.steps} timed decode steps, median of {args.repeats} repeats; "
                  f"DynamicCache's step: {rows[0]['base_ms']:.1f} ms.")
    text = "\n".join([heading, "", setting, "", detail, "", body])
    if args.write:
        write_subsection(ROOT / "BENCHMARKS.md", text)
    return text


def write_subsection(path: Path, text: str) -> None:
    """Replace (or add) the subsection ``text`` begins with in this benchmark's section, keeping the others, in
    heading order."""
    current = path.read_text()
    start = current.find(SECTION)
    kept = []
    if start >= 0:
        end = current.find("\n## ", start + len(SECTION))
        body = current[start + len(SECTION):end if end >= 0 else len(current)]
        kept = ["### " + part.strip() for part in body.split("\n### ")[1:]]
    heading = text.splitlines()[0]
    parts = sorted([p for p in kept if p.splitlines()[0] != heading] + [text.strip()], key=lambda p: p.splitlines()[0])
    write_section(path, SECTION, "\n\n".join(parts))


if __name__ == "__main__":
    output = main()
    if output:
        print(output)
