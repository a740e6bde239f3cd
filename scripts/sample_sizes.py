"""The half-widths behind the leaderboard's sample sizes: for each compressed perplexity row of a sweep, its change
from the reference with the 95 % paired interval, and every pair of rows against each other on the same windows,
on the first N windows for each N asked (a run's windows are spread over the split, so its first N are a sample).

    python run.py -m model=smollm2_135m benchmark=leaderboard_perplexity benchmark.num_windows=16 \\
        codec=temporalkv,channelkv,kvquant hydra.sweep.dir=multirun/sample_sizes
    python scripts/sample_sizes.py multirun/sample_sizes --windows 8 16
"""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

from kvcomp.benchmarks.intervals import paired_change_interval
from kvcomp.results import load_rows


def change(a: dict, b: dict, protocol: str, n: int) -> str:
    """``a``'s perplexity over ``b``'s on the first ``n`` windows, with the paired interval, in percent."""
    nll_a, nll_b, tokens = a[f"nll_{protocol}"][:n], b[f"nll_{protocol}"][:n], a["tokens_per_window"][:n]
    point = math.exp((sum(nll_a) - sum(nll_b)) / sum(tokens)) - 1
    low, high = paired_change_interval(nll_a, nll_b, tokens)
    verdict = "significant" if low > 0 or high < 0 else "not significant"
    return f"{100 * point:+.2f} % [{100 * low:+.2f}, {100 * high:+.2f}] ({verdict})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sample_sizes.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--windows", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--protocol", default="chunked")
    args = parser.parse_args(argv)
    rows, _ = load_rows(args.sweep)
    rows = [r for r in rows if isinstance(r.get(f"nll_{args.protocol}"), list)]
    reference = next((r for r in rows if r.get("reference_key")), None)
    if reference is None:
        raise SystemExit(f"sample_sizes.py: {args.sweep} holds no reference row with per-window NLLs ({args.protocol})")
    codecs = {r["codec"].split("(")[0]: r for r in rows if not r.get("reference_key")}
    for n in args.windows:
        print(f"first {n} windows")
        for name, row in codecs.items():
            print(f"  {name} against the reference: {change(row, reference, args.protocol, n)}")
        for (a, row_a), (b, row_b) in itertools.combinations(sorted(codecs.items()), 2):
            print(f"  {a} against {b}: {change(row_a, row_b, args.protocol, n)}")


if __name__ == "__main__":
    main()
