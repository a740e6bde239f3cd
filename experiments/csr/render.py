"""CSR tables from a sweep's results.

Default: the NeuralDict table (CSR Tables 3-6's quantity): the held-out relative MSE of the trained dictionaries,
mean over layer groups, per run and kind, after the k-means initialisation, after epochs 10 and 20, and for the
kept dictionaries, with epochs run and training time. ``--summary``: the sweep's summary.csv with short codec
names (CSR-s plus the options that differ from the defaults, KIVI-b) and the chosen columns.

    python scripts/render_tables.py csr multirun/csr/embedded_ldiv
    python scripts/render_tables.py csr multirun/csr/embedded_ldiv --out experiments/csr/results/embedded_ldiv_mse.md
    python scripts/render_tables.py csr multirun/csr/embedded_perplexity --summary
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path

from kvcomp.artifacts import write_text_atomic
from kvcomp.errors import unknown_choice

COLUMNS = ("kmeans_relative_mse", "epoch10_relative_mse", "epoch20_relative_mse", "heldout_relative_mse")
SUMMARY_COLUMNS = ("bits_per_value", "bits_with_online_bank", "bits_per_value_measured", "ppl_streaming", "ppl_simulated")
CSR_DEFAULTS = {"online_atoms": "256", "coder": "mp", "online_sampling": "reverse_sequential", "guard_fraction": "0.0",
                "recent_window": "0", "dict_scope": "per_head", "diversity": "True"}


def short_name(codec: str) -> str:
    """``CSR-8 online_atoms=0``, ``KIVI-4``, ``fp16`` from a codec's description."""
    csr = re.match(r"csr\(sparsity=(\d+)", codec)
    if csr:
        changed = [f"{k}={v}" for k, default in CSR_DEFAULTS.items()
                   if (v := re.search(rf"\b{k}=([^,)]+)", codec)[1]) != default]
        return " ".join([f"CSR-{csr[1]}", *changed])
    kivi = re.match(r"kivi\(bits=(\d+)", codec)
    return f"KIVI-{kivi[1]}" if kivi else codec.split("(")[0]


def summary_table(path: Path, columns=SUMMARY_COLUMNS) -> str:
    lines = ["| codec | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for row in csv.DictReader(path.open()):
        cells = []
        for column in columns:
            value = row.get(column) or ""
            try:
                cells.append(f"{float(value):.3f}" if column.startswith("ppl") else f"{float(value):.2f}")
            except ValueError:
                cells.append(value or "-")
        lines.append(f"| {short_name(row['codec'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def dictionary_rows(results: dict) -> list[dict]:
    """One row per kind of a run's ``results.json``: its overrides and the mean of each column over layer groups."""
    groups = results.get("calibration", {}).get("csr_dictionaries", {})
    rows = []
    for kind, records in groups.items():
        overrides = [o for o in results.get("overrides", []) if not o.startswith("experiment=")]
        row = {"run": " ".join(overrides) or "(defaults)", "kind": kind, "groups": len(records)}
        for column in COLUMNS:
            values = [r[column] for r in records if column in r]
            row[column] = round(sum(values) / len(values), 4) if len(values) == len(records) else None
        row["epochs"] = max(r["epochs"] for r in records)
        row["seconds"] = round(sum(r["seconds"] for r in records))
        rows.append(row)
    return rows


def render(folder: Path) -> str:
    rows = [row for path in sorted(folder.glob("*/results.json")) for row in dictionary_rows(json.loads(path.read_text()))]
    if not rows:
        raise SystemExit(f"no CSR results.json under {folder}")
    header = ["run", "kind", "groups", "k-means init", "epoch 10", "epoch 20", "kept", "epochs", "training s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["run"], row["kind"], row["groups"], *(row[c] for c in COLUMNS), row["epochs"], row["seconds"]]
        lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--summary", action="store_true", help="the sweep's summary.csv instead of the dictionary table")
    parser.add_argument("--columns", nargs="+", default=list(SUMMARY_COLUMNS))
    args = parser.parse_args()
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a directory")
    if args.summary:
        summary = args.folder / "summary.csv"
        if not summary.is_file():
            parser.error(f"{summary} is missing (the sweep has not finished, or this is not its folder)")
        with summary.open() as handle:
            known = next(csv.reader(handle), [])
        unknown = [c for c in args.columns if c not in known]
        if unknown:
            parser.error(str(unknown_choice("column", unknown[0], known)))
    table = summary_table(args.folder / "summary.csv", args.columns) if args.summary else render(args.folder)
    print(table)
    if args.out:
        write_text_atomic(args.out, table)


if __name__ == "__main__":
    main()
