"""The 2026-baselines comparison as Markdown: one table per model, rows by bit class then perplexity (or RULER's
average accuracy, best first).

    python scripts/render_tables.py baselines_2026 multirun/baselines_2026/perplexity [--out FILE]

Reads every ``results.json`` below the sweep folder (finished members only; a sweep still running renders the
rows it has, and says how many). Each row is named by the codec option the member swept (``codec=...``, e.g.
``turboquant_4bit_nc``), with its ``center`` when it was swept too. Columns: the nominal bits per value (codes
and their parameters, boundary layers at 16 bits), the measured bits of the cache (full-precision sinks, windows
and boundary layers at the model's dtype included), the share of tokens encoded, the perplexity of the sweep's
protocol and its change from the model's fp16 row. Bit classes are the nominal bits rounded to 2 / 3 / 4 / 8.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvcomp.errors import existing_directory
from kvcomp.results import emit, parse_overrides

CLASSES = (2, 3, 4, 8)


def bit_class(bits: float) -> int:
    """The class of ``bits`` per value: the nearest of :data:`CLASSES` (ties to the lower)."""
    return min(CLASSES, key=lambda c: (abs(bits - c), c))


def load_members(directory: str | Path) -> list[dict]:
    """One dict per finished member: ``model``, ``option`` (the swept codec option and center), its codec row and
    the fp16 row of the same run."""
    members = []
    for path in sorted(Path(directory).rglob("results.json")):
        data = json.loads(path.read_text())
        swept = parse_overrides(data.get("overrides", []))
        option = swept.get("codec", data["config"]["codec"]["name"])
        if swept.get("codec.center", "none") != "none":
            option += f" center={swept['codec.center']}"
        rows = data["rows"]
        fp16 = next(r for r in rows if r["codec"].startswith("fp16"))
        members += [{"model": r["model"], "option": option, "row": r, "fp16": fp16}
                    for r in rows if not r["codec"].startswith("fp16")]
    return members


def _metric(row: dict) -> tuple[str, float]:
    """The row's perplexity, or RULER's average accuracy."""
    name = next(k for k in row if k.startswith("ppl_") or k == "acc_avg")
    return name, row[name]


def _cell(row: dict, key: str, digits: int) -> str:
    """A number of the row, empty where the row has none (RULER rows written before it was recorded)."""
    value = row.get(key)
    return "" if value is None else f"{value:.{digits}f}"


def render(directory: str | Path) -> str:
    members = load_members(directory)
    out = []
    for model in sorted({m["model"] for m in members}):
        mine = [m for m in members if m["model"] == model]
        metric, fp16 = _metric(mine[0]["fp16"])
        out += [f"### {model}", "", f"{len(mine)} rows; fp16 {metric} {fp16:.3f}.", "",
                f"| class | codec | bits/value | measured bits/value | encoded share | {metric} | vs fp16 |",
                "|---|---|---|---|---|---|---|"]
        accuracy = metric == "acc_avg"  # higher is better; compared in points
        ranked = sorted(mine, key=lambda m: (-bit_class(m["row"]["bits_per_value"]),
                                             -_metric(m["row"])[1] if accuracy else _metric(m["row"])[1]))
        for m in ranked:
            row, value = m["row"], _metric(m["row"])[1]
            change = f"{value - fp16:+.1f} pts" if accuracy else f"{100 * (value / fp16 - 1):+.1f} %"
            out.append(f"| {bit_class(row['bits_per_value'])} | `{m['option']}` | {row['bits_per_value']:.3f} | "
                       f"{_cell(row, 'bits_per_value_measured', 3)} | {_cell(row, 'encoded_share', 2)} | {value:.3f} | "
                       f"{change} |")
        out.append("")
    return "\n".join(out) if out else f"(no finished run below {directory})\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=existing_directory, help="the sweep folder, e.g. multirun/baselines_2026/perplexity")
    parser.add_argument("--out", type=Path, help="write the Markdown here (atomically) instead of printing it")
    args = parser.parse_args(argv)
    return emit(render(args.directory), args.out)


if __name__ == "__main__":
    main()
