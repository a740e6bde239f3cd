"""The leaderboard: every codec of one or more sweeps at matched bits, per model and benchmark, as a static
HTML page (sortable tables, a rate-distortion plot per panel with its Pareto front), Markdown and CSV.

    python scripts/leaderboard.py multirun/leaderboard/embedded [MORE_SWEEPS...] --out leaderboard

A panel is one model on one benchmark and its data (perplexity's or RULER's metric); its rows are the codecs of every finished
member, each with the bits per value the cache measured (codes, scales, windows, sinks, boundary layers, per-sequence
state: the rank axis), the codec's code bits, its model-level overhead apart, the metric, its change from the
uncompressed reference of the same data, and (RULER) the mean output length. A row with a press (token eviction)
is placed by the bits per value of every token seen, evicted ones included. A model with sliding-window layers (Gemma 3)
gets each panel twice: placed by the bits of every layer (its sliding-window layers hold their window in the model's
dtype), and by the bits of its full-attention layers (``· bits of the full-attention layers``), the layers a codec
compresses by default. Rows fall into the bit class nearest
their measured bits (1, 2, 3, 4, 8, 16), not their name. The Pareto front of a panel: the rows no other row beats on
both bits and metric. Every row links to its member's ``results.json``; the page needs no network. Panels that several
models share open the page in one table across the models (each option's bits, change and place in its bit class per
model), which is where a conclusion that holds on one model and not another shows.

Where the rows carry them (runs that keep per-window NLLs and per-sample scores), a row also shows the metric's 95 %
interval, its KL divergence from the reference and top-1 agreement on the panel's protocol, and its tie group: within
a bit class, the rows whose paired-bootstrap difference from the group's first row is not significant
(:func:`tie_groups`). A row the run's degenerate-output gate flagged (its ``flag``) is marked with the reason, stays
ranked and is never named a leader.

Everything a row carries is escaped where the page and the Markdown show it. A row whose metric or bits are not a
finite number (NaN, inf, a string) or out of range (a perplexity below 1, bits per value outside (0, 1024]), whose
interval is not finite or does not contain its metric, or whose ``flag`` is not a string is never ranked: it is
listed under "Invalid rows" with its reason and a warning on stderr (the CSV holds the ranked rows only). A member
file the page cannot read (garbled JSON, not an object, no ``rows``, a row without ``model`` or ``codec``), an
``--out`` that is a file and sweeps without a finished member stop the script with one line naming the file or folder
(exit status 2).
"""

from __future__ import annotations

import argparse
import csv
import html
import io
import json
import os
import re
import shutil
import sys
from pathlib import Path
from urllib.parse import quote

from kvcomp.artifacts import read_json, write_text_atomic
from kvcomp.benchmarks.intervals import (
    paired_change_interval,
    paired_mean_change_interval,
)
from kvcomp.errors import KVCompError, existing_directory, first_line
from kvcomp.plots import log_axis, spread_labels
from kvcomp.results import ERROR_FILE, RESULTS_FILE, load_rows, parse_overrides

PROG = "leaderboard.py"

CLASSES = (1, 2, 3, 4, 8, 16)
METRICS = {"ppl_chunked": "perplexity (chunked)", "ppl_streaming": "perplexity (streaming)",
           "ppl_context": "perplexity after the context", "acc_avg": "RULER accuracy"}
LOWER_IS_BETTER = {"ppl_chunked", "ppl_streaming", "ppl_context"}
COLUMNS = ("class", "codec", "option", "measured_bits", "code_bits", "overhead_bits", "metric", "vs_reference",
           "output_tokens", "ci95_low", "ci95_high", "tie_group", "kld_mean", "top1_agreement", "flag")
AGAINST_REFERENCE = ("kld_mean", "top1_agreement")  # a compressed row's ``<name>_<protocol>``, measured against the reference
BITS = ("bits_per_value_seen", "bits_per_value_measured", "bits_per_value")
NUMBERS = (*BITS, "overhead_bits", "output_tokens")
FULL_ATTENTION_BITS, SLIDING_BITS = "bits_per_value_full_attention", "bits_per_value_sliding_attention"
FULL_ATTENTION_PANEL = "· bits of the full-attention layers"  # a hybrid model's second reading (_full_attention_reading)
MOST_BITS = 1024  # bits per value no cache needs; beyond it a row's bits are garbage (and overflow the plot's axis)
INTERVAL_SLACK = 1e-9  # relative: an interval's bounds and its row's value may differ by rounding (a single window)
FLAG_MARK = "\u26a0"  # the warning sign before a flagged row's reason
INVALID_COLUMNS = ("model", "panel", "option", "reason")
JSON_KINDS = {str: "a string", bool: "a boolean", list: "a list", dict: "an object", type(None): "null"}
REMEDY = "fix or delete it (a resumed sweep runs a deleted member again), or leave its sweep out"


class LeaderboardError(KVCompError):
    """Input the leaderboard cannot render: a malformed member file, an ``--out`` that is a file, no results."""


def bit_class(bits: float) -> int:
    """The class nearest ``bits`` (ties to the lower)."""
    return min(CLASSES, key=lambda c: (abs(bits - c), c))


def _metric(row: dict) -> str | None:
    """The first leaderboard metric the row has a value for (whether it is a number is checked apart)."""
    return next((m for m in METRICS if row.get(m) is not None), None)


def _protocol(metric: str) -> str | None:
    """The perplexity protocol of ``metric`` (``ppl_chunked`` -> ``chunked``); None for an accuracy."""
    return metric.removeprefix("ppl_") if metric in LOWER_IS_BETTER else None


def _against_reference(metric: str) -> dict[str, str]:
    """The row keys of the values measured against the reference on ``metric``'s protocol, by column
    (``kld_mean`` -> ``kld_mean_chunked``); none for an accuracy."""
    protocol = _protocol(metric)
    return {name: f"{name}_{protocol}" for name in AGAINST_REFERENCE} if protocol else {}


def _short(value) -> str:
    """``repr(value)``, cut at 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _number_problem(value) -> str | None:
    """How ``value`` fails to be a finite number (``is nan``, ``is a string 'x'``); None where it is one or absent."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"is {JSON_KINDS.get(type(value), type(value).__name__)} {_short(value)}"
    return None if abs(value) <= sys.float_info.max else f"is {_short(value)}"  # nan, inf, an int beyond a float


def _finite(values) -> bool:
    """Whether ``values`` is a list of finite numbers."""
    return isinstance(values, list) and all(v is not None and _number_problem(v) is None for v in values)


def _row_problem(row: dict, metric: str) -> str | None:
    """Why a row cannot be ranked (``metric ppl_chunked is nan``, ``bits_per_value is inf``, a perplexity below 1,
    bits per value not above 0 or beyond :data:`MOST_BITS`, an interval that is not finite or misses the metric, a
    ``flag`` that is not a string), or None."""
    for key in (metric, *NUMBERS, *_against_reference(metric).values()):
        problem = _number_problem(row.get(key))
        if problem:
            return f"{'metric ' if key == metric else ''}{key} {problem}"
    if metric in LOWER_IS_BETTER and row[metric] < 1:
        return f"metric {metric} is {row[metric]}, below 1 (no perplexity is)"
    wrong = next((key for key in BITS if row.get(key) is not None and not 0 < row[key] <= MOST_BITS), None)
    if wrong:
        return f"{wrong} is {row[wrong]}, outside (0, {MOST_BITS}] bits per value"
    if row.get("flag") is not None and not isinstance(row["flag"], str):
        return f"flag is {_short(row['flag'])}, not a string"
    return _interval_problem(row, metric)


def _interval_problem(row: dict, metric: str) -> str | None:
    """How the row's ``<metric>_ci95`` fails to be a finite ``[low, high]`` containing the metric, or None."""
    key, interval = f"{metric}_ci95", row.get(f"{metric}_ci95")
    if interval is None:
        return None
    if not _finite(interval) or len(interval) != 2:
        return f"{key} is {_short(interval)}, not [low, high] of finite numbers"
    slack = INTERVAL_SLACK * max(1.0, abs(row[metric]))
    if not interval[0] - slack <= row[metric] <= interval[1] + slack:
        return f"{key} {_short(interval)} does not contain {metric} {row[metric]}"
    return None


def _paired_data(row: dict, metric: str) -> tuple[tuple, list[float]] | None:
    """What a paired test of ``metric`` needs: ``(shape, values)``, two rows being comparable where their shapes are
    equal: each window's scored tokens and its summed NLL (perplexity), or each task with its sample count, in order,
    and the per-sample scores pooled over the tasks (RULER). None where the row lacks them."""
    protocol = _protocol(metric)
    if protocol:
        nll, tokens = row.get(f"nll_{protocol}"), row.get("tokens_per_window")
        usable = _finite(nll) and _finite(tokens) and len(nll) == len(tokens) > 0 and min(tokens) > 0
        return (tuple(tokens), nll) if usable else None
    scores = row.get("scores")
    if not isinstance(scores, dict) or not scores or not all(_finite(s) and s for s in scores.values()):
        return None
    return tuple((task, len(s)) for task, s in scores.items()), [x for s in scores.values() for x in s]


def _member_problem(data, results: bool) -> str | None:
    """What keeps the leaderboard from reading a member file (``results.json`` when ``results``, else
    ``error.json``), or None."""
    if not isinstance(data, dict):
        return f"holds {JSON_KINDS.get(type(data), 'a JSON ' + type(data).__name__)}, not a JSON object"
    config = data.get("config", {})
    if not isinstance(config, dict) or not all(isinstance(config.get(k) or {}, dict)
                                               for k in ("model", "codec", "benchmark", "press")):
        return "has a 'config' that is not an object of objects (model, codec, benchmark, press)"
    overrides = data.get("overrides", [])
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        return "has 'overrides' that are not a list of strings"
    if not results:
        return None
    timings = data.get("timings", {})
    if not isinstance(timings, dict) or _number_problem(timings.get("total_seconds")):
        return "has 'timings' without a finite number 'total_seconds'"
    if not isinstance(data.get("rows"), list):
        return "has no 'rows' list (one row per evaluated codec)"
    return next(filter(None, (_shape_problem(i, row) for i, row in enumerate(data["rows"]))), None)


def _shape_problem(i: int, row) -> str | None:
    """What keeps row ``i`` of a ``results.json`` from being read: not an object, no ``model`` or ``codec`` string."""
    if not isinstance(row, dict):
        return f"has a row {i} that is not an object"
    for key in ("model", "codec"):
        if key not in row:
            return f"has a row {i} without {key!r}"
        if not isinstance(row[key], str):
            return f"has a row {i} whose {key!r} is not a string"
    if not isinstance(row.get("reference_key", ""), str):
        return f"has a row {i} whose 'reference_key' is not a string"
    return None


def check_members(directory: Path) -> None:
    """Refuse, naming the file, a member file below ``directory`` that the leaderboard cannot read."""
    for path in sorted([*Path(directory).rglob(RESULTS_FILE), *Path(directory).rglob(ERROR_FILE)]):
        problem = _member_problem(read_json(path, "member file", REMEDY), path.name == RESULTS_FILE)
        if problem:
            raise LeaderboardError(f"member file {path} {problem}; {REMEDY}")


def _bench(row: dict) -> str:
    """The benchmark and its data (``ruler:essays 4096 tokens x1``): rows of the same task on other samples, windows or
    lengths (e.g. a sweep's RULER with two samples per task) form their own panel, with their own reference."""
    return str(row.get("benchmark", "")).strip()


def _option(results: Path, family: str) -> str:
    """The member's codec option and the codec and press settings it overrode (``turboquant codec.center=calibration``;
    ``kivi press=snapkv press.ratio=0.5``), read from its ``results.json``."""
    data = json.loads(results.read_text())
    swept = parse_overrides(data.get("overrides", []))
    press = data.get("config", {}).get("press") or {}  # settings an experiment file makes, not swept
    if press.get("decoding_size") and "press.decoding_size" not in swept:
        swept["press.decoding_size"] = str(press["decoding_size"])
    if press.get("head_budgets", "uniform") != "uniform" and "press.head_budgets" not in swept:
        swept["press.head_budgets"] = press["head_budgets"]
    extra = " ".join(f"{k}={v}" for k, v in swept.items() if k.startswith(("codec.", "press")))
    return " ".join(part for part in (swept.get("codec", family), extra) if part)


def _entry(directory: Path, row: dict, metric: str) -> dict:
    """A loaded row as the leaderboard shows it (its class and change from the reference apart)."""
    results = Path(directory) / row["run_dir"] / RESULTS_FILE if row.get("run_dir") else None
    family = str(row["codec"]).split("(", 1)[0]
    flag = row.get("flag")
    interval = row.get(f"{metric}_ci95")
    low, high = interval if isinstance(interval, list) and len(interval) == 2 else (None, None)
    return {
        "model": row["model"], "panel": f"{_bench(row)} / {METRICS[metric]}", "metric_name": metric,
        "codec": family, "option": family if "reference_key" in row or results is None else _option(results, family),
        "describe": row["codec"] + (f" + {row['press']}" if row.get("press") else ""),
        "reference": "reference_key" in row,
        # a press's rows: the bits of every token seen (evicted ones included), the one axis with codecs
        "measured_bits": row.get("bits_per_value_seen", row.get("bits_per_value_measured")),
        "code_bits": row.get("bits_per_value"),
        "overhead_bits": row.get("overhead_bits"), "metric": row[metric],
        "output_tokens": row.get("output_tokens"), "results": str(results) if results else None,
        "ci95_low": low, "ci95_high": high,
        **dict.fromkeys(AGAINST_REFERENCE), **{name: row.get(key) for name, key in _against_reference(metric).items()},
        "flag": (" ".join(flag.split()) or None) if isinstance(flag, str) else None,  # one line, None when empty
        "paired": _paired_data(row, metric),
    }


def _full_attention_reading(row: dict, entry: dict) -> list[dict]:
    """A hybrid model's row (sliding-window layers beside full-attention ones, each kind's bits measured) once more,
    in a panel of its own placed by the full-attention layers' bits: the sliding-window layers hold their last window
    in the model's dtype whatever the codec (unless it compresses them, ``codec.compress_sliding=true``), which puts
    every row of the every-layer reading near the same bits. No second reading for a press's row (its axis counts
    every token seen)."""
    bits = row.get(FULL_ATTENTION_BITS)
    if not isinstance(row.get(SLIDING_BITS), (int, float)) or not isinstance(bits, (int, float)) \
            or "bits_per_value_seen" in row:
        return []
    return [{**entry, "panel": f"{entry['panel']} {FULL_ATTENTION_PANEL}", "measured_bits": bits}]


def _failed(directory: Path, row: dict) -> dict:
    """A failed member as an invalid row: its error is the reason, its folder's ``error.json`` the link."""
    error = Path(directory) / row["run_dir"] / ERROR_FILE
    codec = str(row.get("codec") or "?")
    return {"model": str(row.get("model") or "?"), "panel": str(row.get("benchmark") or "?"), "option": codec,
            "describe": f"{codec} in {row['run_dir']}", "reference": False,
            "reason": f"the member failed: {(str(row.get('error') or '').strip().splitlines() or ['?'])[0]}",
            "results": str(error) if error.exists() else None}


def _once(rows: list[dict]) -> list[dict]:
    """Each row once: a reference computed for several members appears once."""
    unique = {}
    for row in rows:
        unique.setdefault((row["model"], row["panel"], row["describe"], row["reference"]), row)
    return list(unique.values())


def leaderboard_rows(directories: list[Path]) -> tuple[list[dict], list[dict]]:
    """``(rows, invalid)``: one dict per evaluated codec row of every finished member (references included,
    ``reference: True``): model, panel (benchmark and metric), codec family and swept option, the bits, the metric,
    and the member's results file. Rows whose metric or bits are not a finite number in range are ``invalid``, each
    with its ``reason`` (:func:`_row_problem`): they get no class, change from the reference or place, and are no
    reference to others."""
    out, invalid = [], []
    for directory in directories:
        rows, _ = load_rows(directory)
        for row in rows:
            metric = _metric(row)
            if row.get("status") == "failed":
                invalid.append(_failed(directory, row))
                continue
            if metric is None:
                continue
            entry, reason = _entry(directory, row, metric), _row_problem(row, metric)
            if reason:
                invalid.append({**entry, "reason": reason})
            else:
                out += [entry, *_full_attention_reading(row, entry)]
    for row in out:
        bits = row["measured_bits"] if row["measured_bits"] is not None else row["code_bits"]
        row["class"] = bit_class(bits) if bits is not None else None
        reference = next((r for r in out if r["reference"] and r["model"] == row["model"] and r["panel"] == row["panel"]), None)
        row["vs_reference"] = (row["metric"] / reference["metric"] - 1) if reference and row["metric_name"] in LOWER_IS_BETTER \
            else (row["metric"] - reference["metric"]) if reference else None
    out = _once(out)
    for mine in panels(out).values():
        groups = tie_groups(mine)
        for row in mine:
            row["tie_group"] = groups.get(id(row))
    return out, _once(invalid)


def _tied(row: dict, leader: dict) -> bool:
    """Whether the paired bootstrap interval of ``row``'s change from ``leader`` (comparable rows) contains 0."""
    (shape, values), (_, leading) = row["paired"], leader["paired"]
    low, high = paired_change_interval(values, leading, list(shape)) if row["metric_name"] in LOWER_IS_BETTER \
        else paired_mean_change_interval(values, leading)
    return low <= 0 <= high


def tie_groups(mine: list[dict]) -> dict[int, int]:
    """Each row's tie group within its bit class in one panel (its rows as :func:`panels` sorts them), by ``id``: the
    best row leads group 1 and every row not significantly different from it (:func:`_tied`) joins it; the best row
    left leads group 2, and so on. The reference takes part; a row without per-window data, or on other windows or
    samples than its class's best row with them, gets none."""
    groups = {}
    for klass in dict.fromkeys(r["class"] for r in mine):
        ranked = [r for r in mine if r["class"] == klass and r["paired"] is not None]
        left = [r for r in ranked if r["paired"][0] == ranked[0]["paired"][0]]
        number = 0
        while left:
            number += 1
            leader, *others = left
            groups[id(leader)] = number
            for r in others:
                if _tied(r, leader):
                    groups[id(r)] = number
            left = [r for r in others if id(r) not in groups]
    return groups


def pareto(rows: list[dict]) -> list[dict]:
    """The rows of one panel that no other row beats on both measured bits (fewer) and metric (better)."""
    def better(a, b):
        lower = a["metric_name"] in LOWER_IS_BETTER
        at_most = a["measured_bits"] <= b["measured_bits"] and (a["metric"] <= b["metric"] if lower else a["metric"] >= b["metric"])
        strictly = a["measured_bits"] < b["measured_bits"] or a["metric"] != b["metric"]
        return at_most and strictly

    placed = [r for r in rows if r["measured_bits"] is not None]
    return sorted((r for r in placed if not any(better(o, r) for o in placed if o is not r)), key=lambda r: r["measured_bits"])


def panels(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """Rows by (model, panel), each sorted by bit class, then metric (best first)."""
    grouped: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        grouped.setdefault((row["model"], row["panel"]), []).append(row)
    for key, mine in grouped.items():
        lower = mine[0]["metric_name"] in LOWER_IS_BETTER
        mine.sort(key=lambda r: (-(r["class"] or 0), r["metric"] if lower else -r["metric"]))
    return dict(sorted(grouped.items()))


def _fmt(value, name: str = "", metric: str = "") -> str:
    """A cell: ``vs_reference`` as a relative change (perplexity) or a difference in points (accuracy)."""
    if value is None:
        return ""
    if name == "vs_reference":
        return f"{100 * value:+.1f} %" if metric in LOWER_IS_BETTER else f"{value:+.1f} pts"
    if name == "kld_mean":
        return f"{value:.3g}"
    if name == "top1_agreement":
        return f"{value:.4f}"
    if name == "flag":
        return f"{FLAG_MARK} {value}"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _esc(value) -> str:
    """``value`` as HTML text or a quoted attribute value."""
    return html.escape(str(value), quote=True)


def _md(value) -> str:
    """``value`` as Markdown text in a table cell or heading: its HTML shown as text, ``|`` kept from splitting the
    cell."""
    return html.escape(str(value), quote=False).replace("|", "\\|")


def _md_code(value) -> str:
    """``value`` as a Markdown code span (HTML in it stays text), fenced by more backticks than any run it holds."""
    text = str(value).replace("|", "\\|")
    fence = "`" * (1 + max((len(run) for run in re.findall("`+", text)), default=0))
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _href(results: str, out: Path) -> str:
    """The link from a page in ``out`` to a member's ``results.json``: relative, percent-encoded, no URL scheme."""
    return quote(os.path.relpath(results, out), safe="/=,+")


def leaders(mine: list[dict]) -> str:
    """``Leaders: 2 bits: `a` (+3.1 %), `b` (+4.0 %); 4 bits: `c` (+1.0 %) = `d` (+1.2 %), not significant; ...``:
    the best two rows of each bit class of one panel (its rows as :func:`panels` sorts them), the reference and
    flagged rows left out; ``=`` where the two share a tie group."""
    by_class: dict[int, list[dict]] = {}
    for r in mine:
        if not r["reference"] and not r["flag"] and r["class"] is not None:
            by_class.setdefault(r["class"], []).append(r)
    def named(r):
        return f"{_md_code(r['option'])} ({_fmt(r['vs_reference'], 'vs_reference', r['metric_name'])})"
    def pair(best):
        tied = len(best) == 2 and best[0]["tie_group"] is not None and best[0]["tie_group"] == best[1]["tie_group"]
        return " = ".join(map(named, best)) + ", not significant" if tied else ", ".join(map(named, best))
    parts = [f"{c} bits: " + pair(best[:2]) for c, best in sorted(by_class.items())]
    return "Leaders: " + "; ".join(parts) + "." if parts else ""


def notes(rows: list[dict]) -> list[str]:
    """What the page says of its intervals, tie groups and flags, where its rows need it."""
    out = []
    if any(r["tie_group"] is not None for r in rows):
        out.append("tie_group: within a bit class, the rows whose paired-bootstrap difference from the group's first "
                   "row is not significant (95 %).")
    if any(r["paired"] is None for r in rows):
        out.append("Rows without per-window data (runs that did not keep it) have no interval or tie group.")
    if any(r["flag"] for r in rows):
        out.append(f"{FLAG_MARK}: the run's degenerate-output gate flagged the row (the reason follows); it stays "
                   "ranked and is never named a leader.")
    return out


def class_ranks(mine: list[dict]) -> dict[int, int]:
    """Each row's place within its bit class in one panel (1: the best of its class), by ``id``; the reference has
    none."""
    ranks, seen = {}, {}
    for r in mine:  # as panels() sorts them: by class, best first
        if not r["reference"] and r["class"] is not None:
            seen[r["class"]] = seen.get(r["class"], 0) + 1
            ranks[id(r)] = seen[r["class"]]
    return ranks


def across_models(rows: list[dict]) -> list[tuple[str, list[str], list[dict]]]:
    """Per benchmark panel that more than one model has: ``(panel, models, rows)`` with one row per option (presses
    included, references left out) and per model its measured bits, change from that model's reference and place in
    its bit class (``None`` where the model has no such row), sorted by the first model's class, then place: where
    a conclusion holds on one model and not the other."""
    grouped = panels(rows)
    out = []
    for panel in sorted({p for _, p in grouped}):
        models = sorted(m for m, p in grouped if p == panel)
        if len(models) < 2:
            continue
        table: dict[str, dict] = {}
        for model in models:
            mine = grouped[(model, panel)]
            ranks = class_ranks(mine)
            for r in mine:
                if not r["reference"]:
                    entry = table.setdefault(r["option"], {"codec": r["codec"], "option": r["option"]})
                    entry[model] = (r["measured_bits"], r["vs_reference"], r["class"], ranks.get(id(r)),
                                    r["metric_name"], r["flag"])

        def order(entry):
            first = next(entry[m] for m in models if m in entry)
            return -(first[2] or 0), first[3] or 0, entry["option"]
        out.append((panel, models, sorted(table.values(), key=order)))
    return out


def _across_cells(entry: dict, model: str) -> list[str]:
    """``measured bits``, ``change`` and ``class: place`` (marked where the row is flagged) of one model's row, empty
    where it has none."""
    if model not in entry:
        return ["", "", ""]
    bits, change, klass, place, metric, flag = entry[model]
    marked = f"{klass}: {place}" + (f" {FLAG_MARK}" if flag else "") if place else ""
    return [_fmt(bits), _fmt(change, "vs_reference", metric), marked]


def member_hours(directories: list[Path]) -> float:
    """Hours the finished members took, summed (each member's ``timings.total_seconds``; members that ran side by
    side, e.g. one per core, count each): what the leaderboard costs to compute."""
    seconds = 0.0
    for directory in directories:
        for path in Path(directory).rglob("results.json"):
            seconds += json.loads(path.read_text()).get("timings", {}).get("total_seconds", 0.0)
    return seconds / 3600


def _invalid_markdown(invalid: list[dict], out: Path) -> list[str]:
    """The invalid rows' table (:func:`leaderboard_rows`), with the link to each one's ``results.json``."""
    if not invalid:
        return []
    lines = ["### Invalid rows (not ranked)", "", "| " + " | ".join(INVALID_COLUMNS) + " | results |",
             "|" + "---|" * (len(INVALID_COLUMNS) + 1)]
    for r in invalid:
        link = f"[{Path(r['results']).name}]({_href(r['results'], out)})" if r["results"] else ""
        lines.append(f"| {_md(r['model'])} | {_md(r['panel'])} | {_md_code(r['option'])} | {_md(r['reason'])} "
                     f"| {link} |")
    return lines + [""]


def markdown(rows: list[dict], hours: float | None = None, invalid: list[dict] = (), out: Path = Path(".")) -> str:
    """The leaderboard as Markdown: member time, :func:`notes`, invalid rows, the across-model tables, then each
    panel's table."""
    lines = [f"Computed in {hours:.2f} hours of member time (the members' total_seconds summed).", ""] if hours else []
    said = notes(rows)
    lines += [" ".join(_md(n) for n in said), ""] if said else []
    lines += _invalid_markdown(invalid, out)
    for panel, models, entries in across_models(rows):
        lines += [f"### Across models: {_md(panel)}", "",
                  "| codec | option | " + " | ".join(f"{_md(m)} bits | {_md(m)} vs reference | {_md(m)} class: place"
                                                     for m in models) + " |",
                  "|" + "---|" * (2 + 3 * len(models))]
        for e in entries:
            lines.append(f"| {_md(e['codec'])} | {_md_code(e['option'])} | "
                         + " | ".join(c for m in models for c in _across_cells(e, m)) + " |")
        lines.append("")
    for (model, panel), mine in panels(rows).items():
        front = {id(r) for r in pareto(mine)}
        lines += [f"### {_md(model)}: {_md(panel)}", "", "| " + " | ".join(COLUMNS) + " | Pareto |",
                  "|" + "---|" * (len(COLUMNS) + 1)]
        for r in mine:
            cells = [_md(_fmt(r[c], c, r["metric_name"])) for c in COLUMNS]
            cells[2] = _md_code(r["option"]) + (" (reference)" if r["reference"] else "")
            lines.append("| " + " | ".join(cells) + " | " + ("*" if id(r) in front else "") + " |")
        lines += ["", leaders(mine), ""] if leaders(mine) else [""]
    return "\n".join(lines)


def csv_text(rows: list[dict]) -> str:
    out = io.StringIO()
    fields = ["model", "panel", *COLUMNS, "metric_name", "describe", "reference", "results"]
    writer = csv.DictWriter(out, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def plot_svg(mine: list[dict], title: str) -> str:
    """The panel's rate-distortion plot (:func:`plot`) as inline SVG."""
    fig = plot(mine, title)
    import matplotlib.pyplot as plt

    buffer = io.StringIO()
    with plt.rc_context({"svg.hashsalt": "kvcomp"}):  # ids from a fixed salt, no timestamp: the same rows, the same page
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    plt.close(fig)
    svg = buffer.getvalue()
    return svg[svg.index("<svg"):]


def headline_png(rows: list[dict], model: str, path: Path) -> Path:
    """``model``'s first perplexity panel (:func:`plot`) as a PNG: the picture the README shows."""
    found = [(panel, mine) for (m, panel), mine in panels(rows).items() if m == model and panel.startswith("perplexity")]
    if not found:
        models = sorted({m for m, _ in panels(rows)})
        raise LeaderboardError(f"--headline {model}: no perplexity panel of that model; models: {', '.join(models)}")
    panel, mine = found[0]
    fig = plot(mine, f"{model}: {panel}")
    import matplotlib.pyplot as plt

    fig.savefig(path, format="png", dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


def plot(mine: list[dict], title: str):
    """The panel's rate-distortion figure: every row, the reference dashed, the Pareto front joined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.0, 5.5))
    lower = mine[0]["metric_name"] in LOWER_IS_BETTER
    placed = [r for r in mine if r["measured_bits"] is not None and not r["reference"]]
    reference = next((r["metric"] for r in mine if r["reference"]), None)
    # perplexity: rows beyond twice the reference's are drawn at the top edge (collapsed codecs would flatten the rest)
    top = 2 * reference if lower and reference else None
    shown = [min(r["metric"], top) if top else r["metric"] for r in placed]
    beyond = [top is not None and r["metric"] > top for r in placed]
    for flag, marker in ((False, "o"), (True, "^")):
        points = [(r["measured_bits"], y) for r, y, b in zip(placed, shown, beyond) if b == flag]
        if points:
            ax.scatter(*zip(*points), s=14, marker=marker, label="beyond 2x the reference" if flag else None)
    front = [r for r in pareto(mine) if not r["reference"]]
    ax.plot([r["measured_bits"] for r in front], [r["metric"] for r in front], color="tab:red", label="Pareto front")
    for r in mine:
        if r["reference"]:
            ax.axhline(r["metric"], color="grey", linestyle="--", label="uncompressed")
    ax.set_xscale("log", base=2)
    bits = [r["measured_bits"] for r in placed] or [r["measured_bits"] or 16.0 for r in mine if r["reference"]]
    if bits:  # a panel of the reference alone is placed around the reference's bits
        ax.set_xlim(min(bits) / 1.15, max(bits) * 1.9)  # room for the labels of the last column
    if lower:
        log_axis(ax)
    if any(beyond):  # headroom for the labels stacked above the top edge's rows
        ax.set_ylim(top=top * 1.25)
    ax.set_xlabel("bits per value the cache holds (measured)")
    ax.set_ylabel(METRICS[mine[0]["metric_name"]])
    ax.set_title(_literal(title), fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    spread_labels(ax, [(r["measured_bits"], y, _literal(r["option"])) for r, y in zip(placed, shown)])
    return fig


def _literal(text: str) -> str:
    """``text`` for a matplotlib label: its ``$`` drawn, not read as the start of math."""
    return text.replace("$", r"\$")


STYLE = """body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;font-size:13px;margin:.5em 0 2em}
th,td{border:1px solid #ccc;padding:3px 6px;text-align:right}th{background:#eee;cursor:pointer}td.l{text-align:left}
tr.ref{color:#666;font-style:italic}tr.front td:first-child{border-left:4px solid #d62728}svg{max-width:900px;height:auto}
tr.flagged td{background:#fff1d6}"""
SORT = """document.querySelectorAll('th').forEach(th=>th.addEventListener('click',()=>{const t=th.closest('table');
const i=[...th.parentNode.children].indexOf(th);const rows=[...t.tBodies[0].rows];const up=th.dataset.up!=='1';
th.dataset.up=up?'1':'0';const v=r=>{const s=r.cells[i].dataset.v??r.cells[i].innerText;const n=parseFloat(s);
return isNaN(n)?s:n};rows.sort((a,b)=>{const x=v(a),y=v(b);return (x>y?1:x<y?-1:0)*(up?1:-1)});
rows.forEach(r=>t.tBodies[0].appendChild(r))}));"""


def _link(row: dict, out: Path) -> str:
    """The ``results.json`` link of a row, empty where it has none."""
    return f"<a href='{_esc(_href(row['results'], out))}'>{Path(row['results']).name}</a>" if row["results"] else ""


def _invalid_html(invalid: list[dict], out: Path) -> list[str]:
    """The invalid rows' table (:func:`leaderboard_rows`), none where there are none."""
    if not invalid:
        return []
    head = "".join(f"<th>{c}</th>" for c in (*INVALID_COLUMNS, "results"))
    body = "".join("<tr>" + "".join(f"<td class='l'>{_esc(r[c])}</td>" for c in INVALID_COLUMNS)
                   + f"<td class='l'>{_link(r, out)}</td></tr>" for r in invalid)
    note = ("Their metric, bits or interval are not finite numbers in range, or their flag is not a string: not "
            "ranked, not leaders, not on a Pareto front.")
    return [f"<h2>Invalid rows</h2><p>{note}</p><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"]


def page(rows: list[dict], out: Path, reading: str = "", invalid: list[dict] = ()) -> str:
    """The self-contained HTML page: a reading, the invalid rows, then per panel its plot and sortable table (rows
    link to their ``results.json`` relative to ``out``). Everything from the rows is escaped."""
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>kvcomp leaderboard</title>",
             f"<style>{STYLE}</style></head><body><h1>kvcomp leaderboard</h1>", reading,
             *[f"<p>{_esc(n)}</p>" for n in notes(rows)], *_invalid_html(invalid, out)]
    for panel, models, entries in across_models(rows):
        parts.append(f"<h2>Across models: {_esc(panel)}</h2><table><thead><tr><th>codec</th><th>option</th>"
                     + "".join(f"<th>{_esc(m)} {c}</th>" for m in models
                               for c in ("bits", "vs reference", "class: place")) + "</tr></thead><tbody>")
        for e in entries:
            cells = "".join(f"<td>{_esc(c)}</td>" for m in models for c in _across_cells(e, m))
            parts.append(f"<tr><td class='l'>{_esc(e['codec'])}</td><td class='l'>{_esc(e['option'])}</td>{cells}</tr>")
        parts.append("</tbody></table>")
    for (model, panel), mine in panels(rows).items():
        front = {id(r) for r in pareto(mine)}
        parts.append(f"<h2>{_esc(model)}: {_esc(panel)}</h2>{plot_svg(mine, f'{model}: {panel}')}")
        parts.append("<table><thead><tr>" + "".join(f"<th>{c}</th>" for c in COLUMNS) + "<th>results</th></tr></thead><tbody>")
        for r in mine:
            kind = " ".join(k for k, on in (("ref", r["reference"]), ("front", id(r) in front), ("flagged", r["flag"]))
                            if on)
            cells = "".join(f"<td class='{'l' if c in ('codec', 'option', 'flag') else ''}' "
                            f"data-v='{_esc('' if r[c] is None else r[c])}'>"
                            f"{_esc(_fmt(r[c], c, r['metric_name']))}</td>" for c in COLUMNS)
            parts.append(f"<tr class='{kind}' title='{_esc(r['describe'])}'>{cells}"
                         f"<td class='l'>{_link(r, out)}</td></tr>")
        parts.append("</tbody></table>")
    parts.append(f"<script>{SORT}</script></body></html>")
    return "\n".join(parts)


def copy_results(directories: list[Path], runs: Path) -> list[Path]:
    """Each sweep's finished members' ``results.json`` copied to ``runs/<sweep path>/<member>/`` (failed members
    left out); what was there before is replaced, so the copies are exactly the sweeps' members. Returns the copies'
    sweep folders, in order."""
    copies = []
    for directory in directories:
        source = Path(directory).resolve()
        target = runs / source.relative_to(source.parents[1])  # e.g. leaderboard/embedded
        if source == runs.resolve() or runs.resolve() in source.parents:
            raise LeaderboardError(f"--copy-results: {directory} is already a copy below {runs}; "
                                   "render it without --copy-results")
        if target in copies:
            raise LeaderboardError(f"--copy-results: two sweeps end in {target.relative_to(runs)}; rename one folder")
        if target.is_dir():
            shutil.rmtree(target)
        for path in sorted(Path(directory).rglob("results.json")):
            destination = target / path.parent.relative_to(directory) / path.name
            destination.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(destination, path.read_text())
        copies.append(target)
    return copies


def _read_reading(path: Path | None) -> str:
    """The text of ``--reading``, empty without one."""
    try:
        return path.read_text() if path else ""
    except (OSError, UnicodeDecodeError) as err:
        raise LeaderboardError(f"--reading {path} cannot be read ({first_line(err)})") from err


def _check_out(out: Path) -> None:
    """Refuse an ``--out`` that is a file."""
    if out.exists() and not out.is_dir():
        raise LeaderboardError(f"--out {out} is a file; name a folder (it is created if missing)")


def _make_out(out: Path) -> None:
    """Create the ``--out`` folder, naming it where it cannot be."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise LeaderboardError(f"--out {out} cannot be created ({first_line(err)})") from err


def _warn(invalid: list[dict]) -> None:
    """A line on stderr per invalid row."""
    for r in invalid:
        print(f"{PROG}: warning: {r['results'] or r['model']}: row {r['describe']!r} ({r['model']}, {r['panel']}) "
              f"is invalid: {r['reason']}; listed under 'Invalid rows', not ranked", file=sys.stderr)


def render(args: argparse.Namespace) -> list[Path]:
    """Check the sweeps and ``--out``, then write the page, the Markdown, the CSV (and the headline); returns the
    files written."""
    _check_out(args.out)
    reading = _read_reading(args.reading)
    for directory in args.directories:
        check_members(directory)
    rows, invalid = leaderboard_rows(args.directories)
    if not rows and not invalid:
        raise LeaderboardError(f"no finished member with a metric ({', '.join(METRICS)}) below "
                               f"{', '.join(map(str, args.directories))}")
    _make_out(args.out)
    directories = args.directories
    if args.copy_results:
        directories = copy_results(args.directories, args.out / "runs")
        rows, invalid = leaderboard_rows(directories)  # linked to the copies
    _warn(invalid)
    written = [args.out / "index.html", args.out / "leaderboard.md", args.out / "leaderboard.csv"]
    hours = member_hours(directories)
    texts = (page(rows, args.out, reading, invalid), markdown(rows, hours, invalid, args.out), csv_text(rows))
    for path, text in zip(written, texts):
        write_text_atomic(path, text)
    if args.headline:
        written.append(headline_png(rows, args.headline, args.out / "headline.png"))
    print(json.dumps({"rows": len(rows), "invalid": len(invalid), "panels": len(panels(rows)),
                      "member_hours": round(hours, 2), "written": [str(p) for p in written]}))
    return written


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("directories", type=existing_directory, nargs="+", help="sweep folders, e.g. multirun/leaderboard/embedded")
    parser.add_argument("--out", type=Path, required=True, help="folder for index.html, leaderboard.md and leaderboard.csv")
    parser.add_argument("--reading", type=Path, help="a Markdown or HTML file whose text opens the page (the written reading)")
    parser.add_argument("--copy-results", action="store_true",
                        help="copy every finished member's results.json under OUT/runs/<sweep>/ and link the copies, so "
                             "that OUT holds every number it shows (a committed leaderboard)")
    parser.add_argument("--headline", metavar="MODEL",
                        help="also write OUT/headline.png, MODEL's first perplexity panel (the README's picture)")
    args = parser.parse_args(argv)
    try:
        return render(args)
    except KVCompError as err:  # bad input: one line, no traceback
        parser.exit(2, f"{PROG}: error: {err}\n")


if __name__ == "__main__":
    main()
