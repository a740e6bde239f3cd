"""Shared pieces of the GPU kernel benchmarks in this package (timing, L2 rotation, BENCHMARKS.md sections)."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

LLAMA31_8B = dict(query_heads=32, kv_heads=8, head_dim=128)  # attention shapes of Llama-3.1-8B
# the GPU benchmark scripts' --smoke runs: two of Llama's KV heads (the interpreter runs one program at a time)
SMOKE_SHAPE = dict(LLAMA31_8B, query_heads=8, kv_heads=2)
SDPA_BACKENDS = "flash, memory-efficient or math (cuDNN excluded)"




class Timer:
    """Median milliseconds of ``fn`` over ``reps`` calls after ``warmup``: CUDA events on a GPU, wall clock on a CPU.
    ``make_inputs`` runs before each call, outside the timed region (fresh inputs every repetition). ``host_ms``: the
    last call's median host time, the wall clock until ``fn`` returns without waiting for the device (the launches
    queued; on a CPU the same as the time): where it is near the time, the host bounds the step. The events enclose
    the call's host work before its first launch, during which the device idles. ``device_ms``: the last call's median
    with that work hidden, as a model's layers hide it when the host runs ahead of the device: each of ``reps`` more
    calls is queued behind a spacer kernel (``torch.cuda._sleep``) that outlasts the host, so the events time the
    device's work alone (a call the spacer did not outlast is dropped and the spacer doubled, up to
    ``SPACER_DOUBLINGS`` times: a call that waits for the device itself is never outlasted, and its ``device_ms`` is
    NaN)."""

    SPACER_CYCLES = 1 << 22  # about 2 ms at an H100's or H200's clocks, several times a call's host time
    SPACER_DOUBLINGS = 5

    def __init__(self, device: torch.device, warmup: int, reps: int, device_time: bool = True):
        """``device_time``: also time the calls behind a spacer (``device_ms``); off for calls without host work to
        hide (a copy, an encoder's throughput), which then take half the time."""
        self.device, self.warmup, self.reps, self.device_time = device, warmup, reps, device_time
        self.host_ms = self.device_ms = float("nan")

    def __call__(self, fn, make_inputs) -> float:
        for _ in range(self.warmup):
            fn(*make_inputs())
        times, hosts, devices, spacer = [], [], [], self.SPACER_CYCLES
        for _ in range(self.reps):
            inputs = make_inputs()
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                begin = time.perf_counter()
                fn(*inputs)
                hosts.append(1e3 * (time.perf_counter() - begin))
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
                if self.device_time and spacer <= self.SPACER_CYCLES << self.SPACER_DOUBLINGS:
                    ms, hidden = self._behind_spacer(fn, make_inputs(), spacer)
                    if hidden:
                        devices.append(ms)
                    else:
                        spacer *= 2
            else:
                begin = time.perf_counter()
                fn(*inputs)
                times.append(1e3 * (time.perf_counter() - begin))
                hosts.append(times[-1])
                devices.append(times[-1])
        self.host_ms = statistics.median(hosts)
        self.device_ms = statistics.median(devices) if devices else float("nan")
        return statistics.median(times)

    @staticmethod
    def _behind_spacer(fn, inputs, cycles: int) -> tuple[float, bool]:
        """``(ms, hidden)`` of one call queued behind a spacer kernel of ``cycles``; ``hidden``: the spacer was still
        running when the call returned, so every launch was queued before the timed region began."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        start.record()
        fn(*inputs)
        hidden = not start.query()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end), hidden


def buffer_sets(bytes_per_set: int, l2_bytes: int) -> int:
    """How many independent input sets to rotate so that together they exceed twice the L2 cache."""
    return max(2, -(-2 * l2_bytes // max(bytes_per_set, 1)))


def l2_cache_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"


def revision() -> str:
    """The revision a benchmark ran at: the ``KVCOMP_REVISION`` environment variable where a launcher sets it
    (a copy of the checkout sent to a GPU machine carries a stale ``.git``), else ``git describe``."""
    if os.environ.get("KVCOMP_REVISION"):
        return os.environ["KVCOMP_REVISION"]
    try:
        git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True)
    except OSError:
        return "unknown"
    return git.stdout.strip() if git.returncode == 0 and git.stdout.strip() else "unknown"


def write_section(path: Path, section: str, body: str) -> None:
    """Replace the section titled ``section`` of BENCHMARKS.md in place (or append it), leaving the others
    as they are."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = section + "\n\n" + body.strip() + "\n"
    start = text.find(section)
    if start < 0:
        path.write_text(text.rstrip() + "\n\n" + block)
        return
    end = text.find("\n## ", start + len(section))
    path.write_text(text[:start] + block + (text[end:] if end >= 0 else ""))


def script_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    """The device of a GPU script: the CPU for ``--smoke`` (a tiny run on Triton's interpreter that checks the script),
    else a CUDA GPU, exiting where there is none; ``--cuda-graphs`` (where the script has it) needs the GPU."""
    if args.smoke and getattr(args, "cuda_graphs", False):
        parser.error("--cuda-graphs captures CUDA graphs: it needs a GPU, not --smoke")
    if args.smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit(f"{parser.prog} needs a CUDA GPU (use --smoke for a CPU check of the script)")
    return torch.device("cuda")


def batch_by_context(text: str) -> tuple[int, int]:
    """An argparse type: ``BATCHxCONTEXT`` (e.g. ``16x32768``) as ``(batch, context)``."""
    try:
        batch, context = (int(x) for x in text.lower().split("x"))
    except ValueError:
        batch = context = 0
    if batch < 1 or context < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected BATCHxCONTEXT with positive integers, e.g. 16x32768")
    return batch, context


def check_smoke(smoke: bool, failures: list[str]) -> None:
    """End a ``--smoke`` run, a GPU benchmark script's check on the CPU, with an error naming the rows that failed
    (``failures``: one line each). On a GPU a benchmark reports a failing row in its table and measures the others;
    a check of the script must not pass with failing rows."""
    if smoke and failures:
        shown = "; ".join(failures[:3]) + ("; ..." if len(failures) > 3 else "")
        raise SystemExit(f"--smoke: {len(failures)} row(s) failed: {shown}")


def publish(section: str, body: str, write: bool) -> str:
    """Print a benchmark's tables and, with ``write``, replace its section of the checkout's BENCHMARKS.md."""
    print(body)
    if write:
        write_section(Path(__file__).resolve().parents[1] / "BENCHMARKS.md", section, body)
    return body
