"""Per-decode-step time of the compressed cache with the ``fp16`` codec against transformers' DynamicCache
(writes its section of BENCHMARKS.md).

The ``fp16`` codec keeps every token in full precision, so any difference from DynamicCache is the cost
of the compressed cache's path itself (streams, update bookkeeping, the kvcomp attention function and
its pre-hooks). One random-weight Llama, one random prompt and one greedy decode loop serve every row:
DynamicCache runs on the model as transformers builds it (``sdpa`` attention), CompressedCache on a copy
with the same weights after ``install(model)`` (``kvcomp`` attention, torch path). Each repeat prefills
a fresh cache per row, runs the warm-up steps, then the timed steps in lockstep (step ``i`` of every
row before step ``i + 1``, the row order rotated each step), so drift and background load hit every
row alike. A step is one model forward of one new token per sequence with ``past_key_values`` plus the
argmax: wall clock on the CPU, CUDA events (device synchronised around each step) on a GPU. The table
gives the median over the repeats of each repeat's median step, the range of those medians, and the
median over the repeats of the per-repeat ratio to DynamicCache (target: fp16 <= 1.15x).

- ``cpu`` (Python overhead): Llama with hidden 256, 4 layers, 4 query / 2 KV heads, head_dim 64, MLP 688,
  vocabulary 1000; float32, ``--threads`` threads (1), batch 1 and 4 with a 512-token prompt and batch 4
  with a 4,096-token prompt (prefilled in 512-token chunks),
  64 timed steps after 4 warm-up steps; rows fp16 under ``streaming`` and ``exact_prefill``, plus
  ``decode_per_step=True`` and ``check_finite=False`` variants (``exact_prefill``);
- ``cuda``: Llama-3.1-8B layer shapes (hidden 4096, 32 query / 8 KV heads, head_dim 128, MLP 14336),
  vocabulary 32000, 4 layers, bf16, batch 8, a 16,384-token prompt prefilled in 2,048-token chunks, 24
  timed steps after 4 warm-up steps, ``exact_prefill``.

    python -m benchmarks.bench_decode_overhead --write     # CPU; CPU and GPU rows where CUDA is available
    python -m benchmarks.bench_decode_overhead --smoke     # a few seconds: checks the script (a test runs it)
"""

from __future__ import annotations

import argparse
import copy
import inspect
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvcomp.cache import CompressedCache, install, with_cache
from kvcomp.codecs import ModelInfo, build_codec
from kvcomp.errors import at_least
from kvcomp.kernels import sdpa_without_cudnn

from benchmarks.benchmarking import SDPA_BACKENDS, revision, write_section

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Decode-step overhead of the compressed cache"
SUBSECTIONS = {"cpu": "### CPU: tiny Llama, float32 (Python overhead)",
               "cuda": "### GPU: Llama-3.1-8B layer shapes, bf16"}
TARGET = 1.15
SETTINGS = {
    "cpu": dict(model=dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, vocab_size=1000),
                dtype=torch.float32, shapes=((1, 512), (4, 512), (4, 4096)), chunk=512, warmup=4, steps=64,
                protocols=("streaming", "exact_prefill"), variants=True),
    "cuda": dict(model=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=128, vocab_size=32000),
                 dtype=torch.bfloat16, shapes=((8, 16384),), chunk=2048, warmup=4, steps=24,
                 protocols=("exact_prefill",), variants=True),
    "smoke": dict(model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, vocab_size=100),
                  dtype=torch.float32, shapes=((2, 40),), chunk=16, warmup=1, steps=3,
                  protocols=("streaming", "exact_prefill"), variants=True),
}
BASELINE = "DynamicCache"


def rows_of(setting: dict) -> dict[str, dict | None]:
    """Row name -> CompressedCache keyword arguments (None: the DynamicCache baseline). The
    ``decode_per_step`` row only where this CompressedCache accepts the option."""
    rows: dict[str, dict | None] = {BASELINE: None}
    for protocol in setting["protocols"]:
        rows[f"fp16, {protocol}"] = {"protocol": protocol}
    if setting["variants"]:
        accepted = inspect.signature(CompressedCache).parameters
        if "decode_per_step" in accepted:
            rows["fp16, exact_prefill, decode_per_step"] = {"protocol": "exact_prefill", "decode_per_step": True}
        if "check_finite" in accepted:
            rows["fp16, exact_prefill, check_finite=False"] = {"protocol": "exact_prefill", "check_finite": False}
    return rows


def build_models(setting: dict, device: torch.device):
    """``(plain, hooked)``: the same random weights twice, transformers' ``sdpa`` attention as it comes, and
    with ``install`` (kvcomp attention function and pre-hooks), so that the baseline pays none of kvcomp."""
    torch.manual_seed(0)
    longest = max(prompt for _, prompt in setting["shapes"])
    config = LlamaConfig(**setting["model"], max_position_embeddings=longest + 256)
    with torch.device(device):
        plain = LlamaForCausalLM(config).to(setting["dtype"]).eval()
    plain.set_attn_implementation("sdpa")
    hooked = copy.deepcopy(plain)
    install(hooked)
    return plain, hooked


class Run:
    """One row's cache within one repeat: prefilled, then stepped one greedy token at a time."""

    def __init__(self, models: tuple, options: dict | None, ids: torch.Tensor, chunk: int):
        self.model = model = models[0] if options is None else models[1]
        if options is None:
            self.cache = DynamicCache(config=model.config)
        else:
            codec = build_codec({"name": "fp16"}, ModelInfo.from_hf_config(model.config))
            self.cache = CompressedCache(codec, **options)
        for start in range(0, ids.shape[1], chunk):
            self.token = self.forward(ids[:, start : start + chunk])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The greedy next token ``[B, 1]`` after ``ids``."""
        return self.model(ids, **with_cache(self.model, self.cache), use_cache=True, logits_to_keep=1).logits.argmax(-1)

    def step(self) -> None:
        self.token = self.forward(self.token)


def timed(run: Run, device: torch.device) -> float:
    """Milliseconds of one decode step of ``run``."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        run.step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    begin = time.perf_counter()
    run.step()
    return 1e3 * (time.perf_counter() - begin)


@torch.inference_mode()
def measure(setting_name: str, device: torch.device, repeats: int, log=print) -> list[dict]:
    """One table row per (batch, cache row): median step ms, range over repeats, ratio to DynamicCache."""
    setting = SETTINGS[setting_name]
    models = build_models(setting, device)
    vocab = models[0].config.vocab_size
    rows = rows_of(setting)
    out = []
    for batch, prompt in setting["shapes"]:
        generator = torch.Generator().manual_seed(batch)
        ids = torch.randint(0, vocab, (batch, prompt), generator=generator).to(device)
        medians: dict[str, list[float]] = {name: [] for name in rows}
        ratios: dict[str, list[float]] = {name: [] for name in rows}
        for repeat in range(repeats):
            runs = {name: Run(models, options, ids, setting["chunk"]) for name, options in rows.items()}
            order = list(runs)
            times: dict[str, list[float]] = {name: [] for name in runs}
            for step in range(setting["warmup"] + setting["steps"]):
                shift = step % len(order)
                for name in order[shift:] + order[:shift]:
                    ms = timed(runs[name], device)
                    if step >= setting["warmup"]:
                        times[name].append(ms)
            first = next(iter(runs.values())).token
            for name, run in runs.items():  # same model, same prompt: the fp16 rows decode the same tokens
                if setting["dtype"] == torch.float32 and not torch.equal(run.token, first):
                    log(f"[bench] warning: {setting_name} batch {batch} {name}: greedy tokens differ from {BASELINE}")
            for name in runs:
                medians[name].append(statistics.median(times[name]))
                ratios[name].append(medians[name][-1] / medians[BASELINE][-1])
            del runs
            log(f"[bench] {setting_name} batch {batch} repeat {repeat + 1}/{repeats}: "
                + ", ".join(f"{name} {values[-1]:.3f} ms" for name, values in medians.items()))
        for name in rows:
            values = medians[name]
            out.append({"setting": setting_name, "batch": batch, "prompt": prompt, "cache": name, "ms": statistics.median(values),
                        "low": min(values), "high": max(values), "ratio": statistics.median(ratios[name])})
    return out


def table(rows: list[dict]) -> str:
    lines = ["| batch | prompt | cache | attention | ms per decode step | range over repeats | vs DynamicCache |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        cache = r["cache"] if r["cache"] == BASELINE else f"CompressedCache {r['cache']}"
        attention = "sdpa" if r["cache"] == BASELINE else "kvcomp (torch)"
        lines.append(f"| {r['batch']} | {r['prompt']} | {cache} | {attention} | {r['ms']:.3f} | {r['low']:.3f}-{r['high']:.3f} | "
                     f"{r['ratio']:.3f}x |")
    return "\n".join(lines)


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine(device: torch.device) -> str:
    software = f"torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}"
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}; {software}"
    threads = f"{torch.get_num_threads()} torch thread(s) of {len(os.sched_getaffinity(0))} CPUs"
    return f"{cpu_model()} ({threads}); {software}"


def describe(name: str, args) -> str:
    s = SETTINGS[name]
    m = s["model"]
    return (f"Random-weight Llama: hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, "
            f"{m['num_attention_heads']} query / {m['num_key_value_heads']} KV heads, head_dim {m['head_dim']}, "
            f"MLP {m['intermediate_size']}, vocabulary {m['vocab_size']}; {str(s['dtype']).removeprefix('torch.')}; "
            f"random prompts ({', '.join(f'batch {b} x {p} tokens' for b, p in s['shapes'])}) prefilled in "
            f"{s['chunk']}-token chunks; {s['steps']} timed greedy "
            f"decode steps after {s['warmup']} warm-up steps, rows in lockstep; median of {args.repeats} repeats."
            + (f" SDPA {SDPA_BACKENDS}." if name == "cuda" else ""))


def subsection(name: str, device: torch.device, rows: list[dict], args, command: str) -> str:
    ratios = [r["ratio"] for r in rows if r["cache"] != BASELINE and "check_finite" not in r["cache"]
              and "decode_per_step" not in r["cache"]]
    verdict = "meet" if max(ratios) <= TARGET else "miss"
    return "\n".join([
        SUBSECTIONS[name], "",
        f"Command: `{command}` at revision {revision()}.",
        f"Machine: {machine(device)}.", "",
        describe(name, args), "",
        table(rows), "",
        f"The fp16 rows {verdict} the target of <= {TARGET}x (worst {max(ratios):.3f}x). The fp16 codec never "
        "encodes, so `decode_per_step=True` takes the same path (the row is a check, and the place for codecs "
        "with encoded blocks); `check_finite=False` shows the cost of the per-layer finiteness check of "
        "the incoming K/V (a host sync per layer on a GPU).",
    ])


def unmeasured(name: str, args) -> str:
    if name == "cuda":
        return "\n".join([
            SUBSECTIONS[name], "",
            "Not measured yet: no GPU run is recorded. On a CUDA machine the same command adds this "
            "subsection:", "",
            "    python -m benchmarks.bench_decode_overhead --write", "",
            describe(name, args) + " CUDA events, device synchronised around each step.",
        ])
    return "\n".join([SUBSECTIONS[name], "", "Not measured yet:", "",
                      "    python -m benchmarks.bench_decode_overhead --device cpu --write"])


def kept_subsection(path: Path, name: str) -> str | None:
    """The subsection ``name`` as an earlier run wrote it, when that run measured it."""
    if not path.exists():
        return None
    text = path.read_text()
    start = text.find(SECTION)
    if start < 0:
        return None
    end = text.find("\n## ", start + len(SECTION))
    section = text[start : end if end >= 0 else len(text)]
    begin = section.find(SUBSECTIONS[name])
    if begin < 0:
        return None
    rest = section[begin + len(SUBSECTIONS[name]) :]
    stop = rest.find("\n### ")
    body = SUBSECTIONS[name] + (rest if stop < 0 else rest[:stop])
    return None if "Not measured yet" in body else body.strip()


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    parser.add_argument("--device", nargs="+", choices=["cpu", "cuda"], default=default_devices,
                        help="settings to measure (default: cpu, and cuda where available)")
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--threads", type=at_least(1), default=1, help="torch threads for the cpu setting")
    parser.add_argument("--write", action="store_true", help="replace this benchmark's section of BENCHMARKS.md")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat: checks the script in seconds")
    args = parser.parse_args(argv)
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    if args.smoke:
        args.repeats, threads = 1, torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            body = table(measure("smoke", torch.device("cpu"), 1, log))
        finally:
            torch.set_num_threads(threads)  # in-process callers (the test) keep theirs
        print(body)
        return body
    if "cuda" in args.device and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU")
    command = "python -m benchmarks.bench_decode_overhead " + " ".join(argv if argv is not None else sys.argv[1:])
    path = ROOT / "BENCHMARKS.md"
    parts = []
    for name in ("cpu", "cuda"):
        if name in args.device:
            device = torch.device(name)
            if name == "cpu":
                torch.set_num_threads(args.threads)
            with sdpa_without_cudnn():
                rows = measure(name, device, args.repeats, log)
            parts.append(subsection(name, device, rows, args, command.strip()))
        else:
            parts.append(kept_subsection(path, name) or unmeasured(name, args))
    body = "\n\n".join(parts)
    print(body)
    if args.write:
        write_section(path, SECTION, body)
    return body


if __name__ == "__main__":
    main()
