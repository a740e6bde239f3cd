"""An experiment's tables from its sweeps: ``python scripts/render_tables.py EXPERIMENT [ARGS...]`` runs the renderer
beside that experiment's README, ``experiments/EXPERIMENT/render.py``, with ARGS (``EXPERIMENT --help`` lists them)."""

import argparse
import runpy
import sys
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def renderers() -> list[str]:
    """The experiments that render tables (a ``render.py`` beside their README)."""
    return sorted(p.parent.name for p in EXPERIMENTS.glob("*/render.py"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=renderers())
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the renderer's own arguments")
    args = parser.parse_args(argv)
    path = EXPERIMENTS / args.experiment / "render.py"
    sys.argv = [str(path), *args.args]
    runpy.run_path(str(path), run_name="__main__")


if __name__ == "__main__":
    main()
