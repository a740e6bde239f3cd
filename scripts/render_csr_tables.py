"""NeuralDict tables (CSR Tables 3-6's quantity) from a sweep's results: the held-out relative MSE of the trained
dictionaries, mean over layer groups, per run and kind, after the k-means initialisation, after epochs 10 and
20, and for the kept dictionaries, with epochs run and training time.

    python scripts/render_csr_tables.py multirun/csr/embedded_ldiv
    python scripts/render_csr_tables.py multirun/csr/embedded_ldiv --out experiments/csr/results/embedded_ldiv_mse.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvcomp.artifacts import write_text_atomic

COLUMNS = ("kmeans_relative_mse", "epoch10_relative_mse", "epoch20_relative_mse", "heldout_relative_mse")


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
    args = parser.parse_args()
    table = render(args.folder)
    print(table)
    if args.out:
        write_text_atomic(args.out, table)


if __name__ == "__main__":
    main()
