"""Our measured runs beside the TemporalKV thesis' Tables 2, 4, 6, 7, 8 and 9, as Markdown.

    python scripts/render_tables.py temporalkv multirun/temporalkv/table6_7_embedded --table 6 --table 7 [--out FILE]

Reads every ``results.json`` below the directory. A run enters a thesis table when its codec config has
the table's fixed values (Tables 6-9: fisher=true, sinks=8) and its key, e.g. (name, bits, outliers),
is a row of the table (``kvcomp.experiments.temporalkv_paper``). One Markdown table per thesis table,
per (our model, benchmark) and per outlier rule (``codec.outlier_rule``, named in the title unless all runs
use the default): the thesis' config name, bits as the thesis counts them and as we
store them exactly, our PPL under both protocols, and the thesis' values for its models. Below it, per
bit width, the variants ranked best first, ours against the thesis', so that agreement or disagreement
of the ordering shows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvcomp.experiments.temporalkv_paper import MODEL_LABELS, TABLES, ThesisTable
from kvcomp.stages.outliers import TOKEN_TOPK

PROTOCOLS = ("simulated", "streaming")
RENDERABLE = (2, 4, 6, 7, 8, 9)  # Tables 10-12 (RULER) wait for benchmark=ruler


def load_runs(directory: str | Path) -> list[tuple[dict | None, dict]]:
    """(codec config, row) for every row of every results.json below ``directory``; the codec config
    is None for the uncompressed reference row (codec ``fp16()``)."""
    runs = []
    for path in sorted(Path(directory).rglob("results.json")):
        data = json.loads(path.read_text())
        for row in data["rows"]:
            runs.append((None if row["codec"].startswith("fp16") else data["config"]["codec"], row))
    return runs


def _fmt(value, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def ranking(values: dict[str, float], lower_is_better: bool = True) -> str:
    """``{"TempKV": 9.3, "KVQuant": 9.4, "ChanKV": 9.4}`` -> ``"TempKV < ChanKV = KVQuant"`` (best first)."""
    ranked = sorted(values, key=lambda k: (values[k] if lower_is_better else -values[k], k))
    text = ranked[0] if ranked else ""
    for prev, name in zip(ranked, ranked[1:]):
        text += (" = " if values[name] == values[prev] else " < " if lower_is_better else " > ") + name
    return text


def _best(values: dict[str, float], lower_is_better: bool) -> set[str]:
    target = (min if lower_is_better else max)(values.values())
    return {k for k, v in values.items() if v == target}


def _metric(row: dict | None, protocol: str):
    return None if row is None else row.get(f"ppl_{protocol}")


def render_section(table: ThesisTable, model: str, benchmark: str, ours: dict[tuple, dict], reference: dict | None,
                   rule: str | None = None) -> str:
    """One thesis table beside our rows ``ours[key]`` for one model and benchmark (``rule``: their outlier rule,
    named in the title when it is not the default)."""
    thesis_cols = [f"thesis {MODEL_LABELS.get(m, m)}" for m in table.models]
    header = ["Config", "thesis bits", "our bits", *(f"PPL {p}" for p in PROTOCOLS), *thesis_cols]
    lines = [
        f"### Table {table.number}: {table.title}" + (f" (outlier_rule={rule})" if rule else ""),
        "",
        f"Ours: `{model}`, {benchmark} ({len(ours)} of the thesis' {len(table.rows)} configurations).",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    if table.reference:
        cells = ["float16", "16", _fmt(reference and reference.get("bits_per_value"), 3),
                 *(_fmt(_metric(reference, p), 3) for p in PROTOCOLS), *(_fmt(table.reference.get(m)) for m in table.models)]
        lines.append("| " + " | ".join(cells) + " |")
    for key, thesis in table.rows.items():
        row = ours.get(key)
        paper_bits = row.get("paper_bits_per_value", table.paper_bits(key)) if row else table.paper_bits(key)
        cells = [table.label(key), _fmt(paper_bits), _fmt(row and row.get("bits_per_value"), 3),
                 *(_fmt(_metric(row, p), 3) for p in PROTOCOLS), *(_fmt(thesis.get(m)) for m in table.models)]
        lines.append("| " + " | ".join(cells) + " |")

    header = ["bits", *(f"ours, {p}" for p in PROTOCOLS), *thesis_cols, "same best as thesis (sim / stream)"]
    lines += ["", "Best first, per bit width:", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for bits in dict.fromkeys(dict(zip(table.key, key))["bits"] for key in table.rows):
        keys = [k for k in table.rows if dict(zip(table.key, k))["bits"] == bits]
        mine = {p: {table.variant_label(k): _metric(ours.get(k), p) for k in keys} for p in PROTOCOLS}
        mine = {p: {k: v for k, v in values.items() if v is not None} for p, values in mine.items()}
        theirs = [{table.variant_label(k): table.rows[k][m] for k in keys if m in table.rows[k]} for m in table.models]
        agree = []
        for p in PROTOCOLS:
            if len(mine[p]) < 2:
                agree.append("-")
                continue
            our_best = _best(mine[p], table.lower_is_better)
            scored = [t for t in theirs if len(t) >= 2]
            agree.append(f"{sum(bool(our_best & _best(t, table.lower_is_better)) for t in scored)}/{len(scored)}")
        cells = [str(bits), *(ranking(mine[p], table.lower_is_better) for p in PROTOCOLS),
                 *(ranking(t, table.lower_is_better) for t in theirs), " / ".join(agree)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render(directory: str | Path, numbers: list[int]) -> str:
    """Markdown for the thesis tables ``numbers`` against every run below ``directory``."""
    runs = load_runs(directory)
    groups: dict[tuple[str, str], list] = {}
    for codec, row in runs:
        groups.setdefault((row["model"], row.get("benchmark", "")), []).append((codec, row))
    out = []
    for number in numbers:
        table, sections = TABLES[number], []
        for (model, benchmark), members in groups.items():
            reference = next((row for codec, row in members if codec is None), None)
            by_rule: dict[str, dict] = {}
            for codec, row in members:
                if codec is None or any(codec.get(k) != v for k, v in table.fixed.items()):
                    continue
                key = tuple(codec.get(k) for k in table.key)
                if key in table.rows:
                    by_rule.setdefault(codec.get("outlier_rule", TOKEN_TOPK), {})[key] = row
            for rule, ours in sorted(by_rule.items(), key=lambda item: (item[0] != TOKEN_TOPK, item[0])):
                named = rule if rule != TOKEN_TOPK or len(by_rule) > 1 else None
                sections.append(render_section(table, model, benchmark, ours, reference, named))
        out += sections or [f"### Table {number}: {table.title}\n\n(no run below {directory} matches this table)"]
    return "\n\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="a sweep directory, e.g. multirun/temporalkv/table6_7_embedded")
    parser.add_argument("--table", type=int, action="append", choices=RENDERABLE, required=True,
                        help="thesis table number (repeatable)")
    parser.add_argument("--out", help="write the Markdown here instead of printing it")
    args = parser.parse_args(argv)
    if not Path(args.directory).is_dir():
        parser.error(f"{args.directory} is not a directory")
    text = render(args.directory, args.table)
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return text


if __name__ == "__main__":
    main()
