"""Rate-distortion pictures: a metric against bits per value (or compression ratio), one line per codec.

Rows are the summary rows of a sweep (:func:`kvcomp.results.load_rows`) or of a committed
``summary.csv``. Each (model, benchmark) pair gets its own panel, since numbers from other models or
benchmark settings are not comparable (``panels_by`` splits further, e.g. by ``experiment`` when two
experiments ran one benchmark with other protocol settings). In a panel every codec family (the codec name before its
settings, e.g. ``kivi``) is one line through its points, and the uncompressed reference (``fp16``) is a
horizontal line. Perplexities are drawn on a log axis.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from pathlib import Path

from kvcomp.artifacts import atomic_path

X_AXES = {"bits": "bits per value (codes + scales)", "cr": "compression ratio vs 16-bit"}
DEFAULT_METRICS = ("ppl_streaming", "ppl_chunked", "ppl_simulated", "acc_avg", "score_avg")
REFERENCE = "fp16"


def family(codec: str) -> str:
    """``"kivi(bits=2, ...)"`` -> ``"kivi"``."""
    return str(codec).split("(", 1)[0]


def _number(value) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def x_value(row: dict, x: str) -> float | None:
    """The row's position on the ``x`` axis: ``bits`` per value, or ``cr``, the compression ratio
    against 16-bit values (the row's measured ``cr`` where the codec reports one, e.g. kvtc after
    DEFLATE, else 16 / bits)."""
    if x not in X_AXES:
        raise ValueError(f"x={x!r} is unknown; valid: {', '.join(X_AXES)}")
    bits = _number(row.get("bits_per_value"))
    if x == "bits":
        return bits
    measured = _number(row.get("cr"))
    return measured if measured is not None else (16.0 / bits if bits else None)


def metrics(rows: list[dict]) -> list[str]:
    """The metrics the rows can be drawn by: perplexities, accuracies and scores that some row holds."""
    present = {k for row in rows for k, v in row.items()
               if k.startswith(("ppl_", "acc_", "score_")) and _number(v) is not None}
    return [m for m in DEFAULT_METRICS if m in present] + sorted(present - set(DEFAULT_METRICS))


def pick_metric(rows: list[dict], y: str | None) -> str | None:
    """``y`` when some row holds it (else ValueError naming the valid choices); by default the first
    of :data:`DEFAULT_METRICS` present; ``None`` when the rows hold no metric."""
    available = metrics(rows)
    if y is None:
        return available[0] if available else None
    if y not in available:
        raise ValueError(f"metric {y!r} is in no row; valid: {', '.join(available) or '(none)'}")
    return y


def _panels(rows: list[dict], x: str, y: str, panels_by: tuple[str, ...] = ()) -> dict[tuple, dict[str, list]]:
    """``{(model, benchmark, *panels_by values): {family: sorted unique (x, y) points}}`` of the successful rows."""
    panels: dict = defaultdict(lambda: defaultdict(set))
    for row in rows:
        if row.get("status") == "failed":
            continue
        value, position = _number(row.get(y)), x_value(row, x)
        name = family(row.get("codec", ""))
        if value is None or (position is None and name != REFERENCE):
            continue
        key = tuple(str(row.get(column, "")) for column in ("model", "benchmark", *panels_by))
        panels[key][name].add((position, value))
    return {key: {name: sorted(points, key=lambda p: (p[0] or 0.0, p[1])) for name, points in lines.items()}
            for key, lines in sorted(panels.items())}


def rate_distortion(rows: list[dict], x: str = "bits", y: str | None = None, title: str | None = None,
                    panels_by: tuple[str, ...] = ()):
    """A matplotlib Figure (no pyplot state) of metric ``y`` against ``x`` (see the module docstring),
    or ``None`` when no row holds a metric."""
    from matplotlib.figure import Figure

    metric = pick_metric(rows, y)
    if metric is None:
        return None
    panels = _panels(rows, x, metric, panels_by)
    if not panels:
        return None
    columns = min(3, len(panels))
    lines_of = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(6.4 * columns, 4.6 * lines_of), layout="constrained")
    axes = figure.subplots(lines_of, columns, squeeze=False).ravel()
    for ax, ((model, benchmark, *split), lines) in zip(axes, panels.items()):
        reference = lines.pop(REFERENCE, [])
        for (_, value) in reference:
            ax.axhline(value, color="black", linestyle="--", linewidth=1, label=f"{REFERENCE} ({value:.3g})")
        for name, points in sorted(lines.items()):
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        if metric.startswith("ppl_"):
            ax.set_yscale("log")
        if x == "cr":
            ax.set_xscale("log", base=2)
        ax.set_xlabel(X_AXES[x])
        ax.set_ylabel(metric)
        ax.set_title(", ".join([f"{model}: {benchmark}", *split]), fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    if title:
        figure.suptitle(title)
    return figure


def write_rate_distortion(rows: list[dict], stem: str | Path, x: str = "bits", y: str | None = None,
                          title: str | None = None) -> list[Path]:
    """Draw :func:`rate_distortion` into ``<stem>.png`` and ``<stem>.svg`` (each written to a temporary
    file, then renamed); return the paths, or ``[]`` when there is nothing to draw."""
    figure = rate_distortion(rows, x, y, title)
    if figure is None:
        return []
    stem = Path(stem)
    paths = []
    for suffix in (".png", ".svg"):
        path = stem.with_suffix(suffix)
        with atomic_path(path, 0) as tmp:
            figure.savefig(tmp, dpi=150)
        paths.append(path)
    return paths


def read_rows(source: str | Path) -> list[dict]:
    """Summary rows from a sweep directory (its members' results, or its ``summary.csv``) or a CSV file."""
    from kvcomp.results import RESULTS_FILE, load_rows

    source = Path(source)
    if source.is_dir():
        if any(source.rglob(RESULTS_FILE)):
            return load_rows(source)[0]
        source = source / "summary.csv"
    if not source.is_file():
        raise FileNotFoundError(f"{source}: neither a sweep directory with results.json files nor a summary CSV")
    with open(source, newline="") as handle:
        return list(csv.DictReader(handle))


def spread_labels(ax, labelled: list[tuple[float, float, str]], gap: float = 7.0) -> None:
    """Annotate each ``(x, y, text)`` point to its right, moving a label up (by ``gap`` points at a time, joined to its
    point by a thin line) until it overprints no label placed before it: many rows share a bit count (every press
    at one ratio). Labels are placed from the lowest point of the leftmost column on; widths are estimated (6 pt
    type, about 3.3 points per character). Call it once the axes' limits and scales are final."""
    to_points = 72 / ax.figure.dpi
    placed: list[tuple[float, float, float]] = []  # (left, right, baseline) of each label, in points
    for x, y, text in sorted(labelled, key=lambda p: (p[0], p[1])):
        px, py = (v * to_points for v in ax.transData.transform((x, y)))
        left, right, base = px + 4, px + 4 + 3.3 * len(text), py + 1
        while any(left < r and l < right and abs(base - b) < gap for l, r, b in placed):
            base += gap
        placed.append((left, right, base))
        lift = base - py - 1
        ax.annotate(text, (x, y), fontsize=6, xytext=(4, 1 + lift), textcoords="offset points",
                    arrowprops=dict(arrowstyle="-", lw=0.3, color="grey") if lift > 1 else None)


def log_axis(ax, axis: str = "y") -> None:
    """A log scale on ``axis`` labelled in plain numbers (30, 40, 60, 100, ...), not powers of ten."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    getattr(ax, f"set_{axis}scale")("log")
    target = getattr(ax, f"{axis}axis")
    target.set_major_locator(LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 4.0, 6.0)))
    target.set_major_formatter(ScalarFormatter())
    target.set_minor_formatter(NullFormatter())
