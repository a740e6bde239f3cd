"""Summarise a sweep directory by hand: summary.md / summary.csv and the rate-distortion plot.

A multirun does this itself when its last member ends. Run it when the launching process did not
live that long (e.g. it was killed while its SLURM jobs went on), or to refresh a sweep whose members
were re-run one by one:

    python scripts/aggregate_sweep.py multirun/DATE/TIME [--x bits|cr] [--y METRIC]

Exits with status 1 when a member failed (each is listed), like the multirun itself.
"""

import argparse
import logging
import sys
from pathlib import Path

from kvcomp.plots import X_AXES
from kvcomp.sweep import aggregate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--x", choices=sorted(X_AXES), default="bits", help="plot axis: bits per value or compression ratio")
    parser.add_argument("--y", default=None, help="plotted metric (default: the first of ppl_streaming, ppl_chunked, "
                        "ppl_simulated, acc_avg, score_avg present)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not args.sweep_dir.is_dir():
        parser.error(f"{args.sweep_dir} is not a directory")
    return 1 if aggregate(args.sweep_dir, x=args.x, y=args.y) else 0


if __name__ == "__main__":
    sys.exit(main())
