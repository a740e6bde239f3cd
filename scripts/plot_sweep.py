"""Redraw the rate-distortion plot of one or several sweeps together.

Each SOURCE is a sweep directory (its members' results.json, or its summary.csv) or a summary CSV
(e.g. the committed experiments/*/results/*.csv). Rows of every source go on one figure: one panel
per (model, benchmark), one line per codec family, the fp16 reference as a horizontal line.

    python scripts/plot_sweep.py experiments/qjl/results/embedded_perplexity.csv \\
        experiments/csr/results/embedded_perplexity.csv --y ppl_streaming --out rd_ppl
    python scripts/plot_sweep.py multirun/DATE/TIME --x cr

Writes OUT.png and OUT.svg (default: rate_distortion in the first source's directory).
"""

import argparse
import sys
from pathlib import Path

from kvcomp.plots import X_AXES, metrics, read_rows, write_rate_distortion


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", nargs="+", type=Path, help="sweep directories or summary CSV files")
    parser.add_argument("--x", choices=sorted(X_AXES), default="bits", help="bits per value, or compression ratio")
    parser.add_argument("--y", default=None, help="the metric (default: the first of ppl_streaming, ppl_chunked, "
                        "ppl_simulated, acc_avg, score_avg present)")
    parser.add_argument("--out", type=Path, default=None, help="output path without suffix")
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    rows = []
    for source in args.sources:
        try:
            rows += read_rows(source)
        except FileNotFoundError as error:
            parser.error(str(error))
    first = args.sources[0]
    out = args.out or (first if first.is_dir() else first.parent) / "rate_distortion"
    try:
        paths = write_rate_distortion(rows, out, x=args.x, y=args.y, title=args.title)
    except ValueError as error:
        parser.error(str(error))
    if not paths:
        parser.error(f"no row holds a metric to draw (metrics found: {', '.join(metrics(rows)) or 'none'})")
    print("\n".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
