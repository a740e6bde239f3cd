"""Results: ``results.json`` per run (written atomically), Markdown/CSV tables, sweep aggregation, W&B.

A run's ``results.json`` holds the resolved config, one row per evaluated codec (the codec of the run
and, by default, the uncompressed reference), bit accounting, measured cache bytes, timings and
library versions. A Hydra multirun ends with :class:`AggregateSweep` writing ``summary.md`` and
``summary.csv`` over every member of the sweep directory.
"""

from __future__ import annotations

import csv
import io
import json
import os
import platform
from pathlib import Path

from hydra.experimental.callback import Callback

RESULTS_FILE = "results.json"
TABLE_COLUMNS = [
    ("model", "model"),
    ("codec", "codec"),
    ("bits_per_value", "bits/value"),
    ("paper_bits_per_value", "paper bits/value"),
    ("length", "length"),
    ("bits_per_value_measured", "measured bits/value"),
    ("cache_bytes_per_window", "cache bytes/window"),
    ("ppl_streaming", "PPL streaming"),
    ("ppl_simulated", "PPL simulated"),
]


def write_json_atomic(path: str | Path, obj) -> None:
    """Write JSON to a temporary file beside ``path`` and rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str))
    tmp.replace(path)


def versions() -> dict:
    import torch
    import transformers

    import kvcomp

    return {
        "kvcomp": kvcomp.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
    return "" if value is None else str(value)


def table_columns(rows: list[dict]) -> list[tuple[str, str]]:
    """The standard columns, plus any other metric the rows carry."""
    known = {key for key, _ in TABLE_COLUMNS}
    extra = sorted({k for row in rows for k in row if k not in known and k.startswith(("ppl_", "acc_", "score_"))})
    return [(k, h) for k, h in TABLE_COLUMNS if any(k in row for row in rows)] + [(k, k) for k in extra]


def markdown_table(rows: list[dict]) -> str:
    columns = table_columns(rows)
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_format(row.get(k)) for k, _ in columns) + " |" for row in rows]
    return "\n".join(lines)


def scalar_columns(rows: list[dict]) -> list[str]:
    """Every key of the rows except nested values (e.g. RULER's predictions, kept in results.json)."""
    nested = {k for row in rows for k, v in row.items() if isinstance(v, (dict, list))}
    return [k for k in dict.fromkeys(k for row in rows for k in row) if k not in nested]


def csv_table(rows: list[dict]) -> str:
    keys = scalar_columns(rows)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=keys, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def load_rows(directory: str | Path) -> list[dict]:
    """Rows of every ``results.json`` below ``directory`` (reference rows once), sorted by path."""
    rows, seen = [], set()
    for path in sorted(Path(directory).rglob(RESULTS_FILE)):
        for row in json.loads(path.read_text())["rows"]:
            key = json.dumps({k: row.get(k) for k in ("model", "codec", "benchmark")}, sort_keys=True)
            if key not in seen:
                seen.add(key)
                rows.append({**row, "run_dir": str(path.parent)})
    return rows


def write_summary(directory: str | Path) -> str:
    """Write ``summary.md`` and ``summary.csv`` for all runs below ``directory``; return the Markdown."""
    directory = Path(directory)
    rows = load_rows(directory)
    if not rows:
        return ""
    table = markdown_table(rows)
    for name, text in (("summary.md", table + "\n"), ("summary.csv", csv_table(rows))):
        tmp = directory / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(directory / name)
    return table


def log_to_wandb(logger_cfg, run_name: str, config: dict, rows: list[dict], group: str | None = None) -> None:
    """Log the rows as a W&B table (offline by default: files under ./wandb, ``wandb sync`` later)."""
    import wandb

    run = wandb.init(
        project=logger_cfg.project,
        entity=logger_cfg.entity,
        mode=logger_cfg.mode,
        name=run_name,
        group=group,
        config=config,
        reinit="finish_previous",
    )
    columns = scalar_columns(rows)
    run.log({"results": wandb.Table(columns=columns, data=[[_format(row.get(c)) for c in columns] for row in rows])})
    for row in rows:
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                run.summary[f"{row['codec']}/{key}"] = value
    run.finish()


class AggregateSweep(Callback):
    """Hydra callback: after a multirun, aggregate every member's results into one table."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        table = write_summary(sweep_dir)
        if not table:
            return
        print(f"\nSweep summary ({sweep_dir / 'summary.md'}):\n{table}")
        if config.logger.name == "wandb":
            log_to_wandb(config.logger, f"sweep-{sweep_dir.name}", {"sweep_dir": str(sweep_dir)}, load_rows(sweep_dir), group="sweeps")
