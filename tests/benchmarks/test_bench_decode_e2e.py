"""python -m benchmarks.bench_decode_e2e --smoke: the end-to-end decode benchmark's code path (speed rows, the largest
batch search, the teacher-forced fused vs torch comparison) on a tiny model under the Triton interpreter."""

from importlib import import_module

import pytest

pytest.importorskip("triton")


def test_end_to_end_benchmark_runs_and_the_fused_path_agrees(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    module = import_module("benchmarks.bench_decode_e2e")
    table = module.main(["--smoke", "--rows", "DynamicCache", "kivi-2"])
    speed, batches, agreement = table.split("\n\n")[0], table.split("real allocations")[1], table.split("teacher-forced")[1]
    assert "| 2 | 192 | DynamicCache |" in speed and "| 2 | 192 | kivi-2 |" in speed
    kivi = next(line for line in speed.splitlines() if line.startswith("| 2 | 192 | kivi-2 |"))
    assert kivi.endswith("| 0 |")  # host syncs of a decode step (found on the CPU by HostSyncs)
    assert "| kivi-2 | 2+ |" in batches  # capped at the smoke limit: nothing runs out of memory on a CPU
    row = next(line for line in agreement.splitlines() if line.startswith("| kivi-2 |")).split(" | ")
    assert 0 < float(row[1]) < 1e-4 and float(row[3].rstrip(" |")) == 1.0  # two real paths, equal up to fp32 rounding


@pytest.mark.parametrize("guess", [None, 2, 30, 37, 38, 45, 500, 4096])
def test_the_largest_batch_search_finds_the_boundary_from_any_estimate(guess):
    """The search returns the largest batch that fits whatever the estimate, in few tries where it is close."""
    module = import_module("benchmarks.bench_decode_e2e")
    tries = []

    def fits(batch):
        tries.append(batch)
        return batch <= 37

    assert module.largest_batch(fits, guess, 4096) == 37
    if guess in (37, 38):  # at the boundary: the guess and its neighbour
        assert len(tries) == 2
    assert len(tries) <= 24  # a guess 100x off: stepping out by doubling, then bisection
    assert module.largest_batch(lambda batch: True, guess if guess is None else min(guess, 64), 64) == 64  # the limit


def test_the_estimate_fills_the_capacity_from_what_two_batches_hold():
    module = import_module("benchmarks.bench_decode_e2e")
    assert module._estimate((3.5, 4.0), 16.0, 4096) == 26  # 3 GiB besides 0.5 GiB a sequence: (16 - 3) / 0.5
    assert module._estimate((3.5, 4.0), 16.0, 20) == 20
    assert module._estimate((float("nan"), float("nan")), 16.0, 4096) is None  # a CPU: nothing measured
