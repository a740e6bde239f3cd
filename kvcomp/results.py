"""Results: ``results.json`` per run (written atomically), Markdown/CSV tables, sweep aggregation, W&B.

A run's ``results.json`` holds the resolved config, its command-line overrides, the model's
fingerprint, one row per evaluated codec (the codec of the run and, by default, the uncompressed
reference), bit accounting, measured cache bytes, timings and library versions. A member of a sweep
that fails writes ``error.json`` instead (its config, overrides and error). A Hydra multirun ends with
:class:`AggregateSweep` writing ``summary.md`` and ``summary.csv``: one row per member, its overrides
as columns, failed members marked with their error, and each shared reference row once. What these files
and W&B get holds no install paths (:func:`portable`).
"""

from __future__ import annotations

import csv
import io
import os
import platform
import re
import sys
import traceback
from pathlib import Path

from kvcomp.artifacts import ArtifactError, read_json, write_json_atomic, write_text_atomic
from kvcomp.errors import KVCompError
from kvcomp.paths import cache_dir

RESULTS_FILE = "results.json"
ERROR_FILE = "error.json"
TABLE_COLUMNS = [
    ("model", "model"),
    ("codec", "codec"),
    ("press", "press"),
    ("bits_per_value", "bits/value"),
    ("paper_bits_per_value", "paper bits/value"),
    ("length", "length"),
    ("bits_per_value_measured", "measured bits/value"),
    ("bits_per_value_seen", "bits per value seen"),
    ("bits_per_value_full_attention", "bits/value full-attention layers"),
    ("bits_per_value_sliding_attention", "bits/value sliding-window layers"),
    ("cache_bytes_per_window", "cache bytes/window"),
    ("cr_before_deflate", "CR before DEFLATE"),
    ("cr", "CR"),
    ("cr_min", "CR min"),
    ("cr_max", "CR max"),
    ("cr_with_window", "CR with window"),
    ("ppl_streaming", "PPL streaming"),
    ("ppl_simulated", "PPL simulated"),
    ("ppl_chunked", "PPL chunked"),
    ("kld_mean_streaming", "KLD streaming"),
    ("kld_mean_simulated", "KLD simulated"),
    ("kld_mean_chunked", "KLD chunked"),
    ("flag", "flag"),
    ("note", "note"),
]


def portable(value):
    """``value`` (a string, or lists and dicts of them) with every absolute path below a known folder written
    from that folder, so that written files carry no install paths: ``$KVCOMP_CACHE/...`` (the kvcomp
    cache), a module's path (``kvcomp/runner.py``, ``transformers/utils.py``: below the checkout or a
    folder Python imports from, such as site-packages or the standard library), ``~/...`` (the home
    folder). Paths elsewhere (e.g. ``/data/models/x``) stay as they are. Keys are kept."""
    roots = [(re.compile(re.escape(root) + r"(/|(?=[\s'\":,)\]]|$))"), label) for root, label in _path_roots()]
    return _relative(value, roots)


def _relative(value, roots: list[tuple[re.Pattern, str]]):
    if isinstance(value, dict):
        return {key: _relative(item, roots) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_relative(item, roots) for item in value]
    if not isinstance(value, str) or "/" not in value:
        return value
    for pattern, label in roots:  # "<root>/x" -> "<label>/x" (or "x"); "<root>" alone -> "<label>" (or ".")
        value = pattern.sub(lambda m: label + m.group(1) if label else ("" if m.group(1) else "."), value)
    return value


def _path_roots() -> list[tuple[str, str]]:
    """``(folder, label)``, longest folder first (a folder inside another is matched first), each folder
    as given and resolved. Label ``""``: paths below the folder become relative."""
    import kvcomp

    named = [(cache_dir(), "$KVCOMP_CACHE"), (Path(kvcomp.__file__).parents[1], "")]
    named += [(Path(entry), "") for entry in sys.path if os.path.isabs(entry)]
    named.append((Path.home(), "~"))
    roots = {}
    for folder, label in named:
        for form in (os.path.abspath(folder), str(Path(folder).resolve())):
            if form != "/":
                roots.setdefault(form, label)
    return sorted(roots.items(), key=lambda item: -len(item[0]))


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


def table_columns(rows: list[dict], leading: list[str] = ()) -> list[tuple[str, str]]:
    """Model and codec, then ``leading`` columns (a sweep's overrides), the other standard columns (``paper
    bits/value`` only where it differs from ``bits/value``), any other metric the rows carry, and ``status`` /
    ``error`` when some member failed."""
    standard = [(k, h) for k, h in TABLE_COLUMNS if any(k in row for row in rows) and not _repeats(k, rows)]
    known = {key for key, _ in TABLE_COLUMNS}
    overrides = [(k, k) for k in leading if k not in known]
    extra = sorted({
        k for row in rows for k, v in row.items()
        if k not in known | set(leading) and k.startswith(("ppl_", "kld_mean_", "acc_", "score_")) and not isinstance(v, (list, dict))
    })  # intervals and per-window values stay in results.json
    failed = [("status", "status"), ("error", "error")] if any(row.get("status") == "failed" for row in rows) else []
    return standard[:2] + overrides + standard[2:] + [(k, k) for k in extra] + failed


def _repeats(key: str, rows: list[dict]) -> bool:
    """``paper bits/value`` adds nothing where it equals ``bits/value`` in every row (it stays in results.json)."""
    return key == "paper_bits_per_value" and all(row.get(key) == row.get("bits_per_value") for row in rows)


def markdown_table(rows: list[dict], leading: list[str] = ()) -> str:
    columns = table_columns(rows, leading)
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_format(row.get(k)).replace("|", "/") for k, _ in columns) + " |" for row in rows]
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


def parse_overrides(overrides: list[str]) -> dict[str, str]:
    """``["codec=kivi", "codec.bits=2", "+x=1"]`` -> ``{"codec": "kivi", "codec.bits": "2", "x": "1"}``."""
    parsed = {}
    for item in overrides:
        key, _, value = item.partition("=")
        parsed[key.lstrip("+~")] = value
    return parsed


def _member_files(directory: Path) -> list[Path]:
    """The file that says where each member below ``directory`` stands: its ``error.json`` (its latest attempt
    failed: a finished member's is removed, :func:`clear_failure`), else its ``results.json``."""
    found: dict[Path, Path] = {}
    for path in [*directory.rglob(RESULTS_FILE), *directory.rglob(ERROR_FILE)]:
        if path.name == ERROR_FILE or path.parent not in found:
            found[path.parent] = path
    return [found[folder] for folder in sorted(found, key=str)]


def _read_member(path: Path) -> dict:
    """A member's file, refused (:class:`ArtifactError`) when it cannot be read or is not what kvcomp writes."""
    member = read_json(path, "sweep member file", "delete it (the member then runs again)")
    if not isinstance(member, dict) or not isinstance(member.get("overrides", []), list) or (
            path.name == RESULTS_FILE and not (isinstance(member.get("rows"), list)
                                               and all(isinstance(row, dict) for row in member["rows"]))):
        raise ArtifactError(f"sweep member file {path} is not a kvcomp {path.name} (an object with its overrides"
                            f"{' and rows' if path.name == RESULTS_FILE else ''}); delete it (the member then runs again)")
    return member


def load_rows(directory: str | Path) -> tuple[list[dict], list[str]]:
    """Every member below ``directory``: ``(rows, override columns)``.

    A row per evaluated codec of each member with that member's overrides as columns (``run_dir``
    relative to ``directory``); a row per failed member (``status: failed`` and its error), also one whose file is
    damaged (its rows are not shown); each reference row once per reference it was computed for, with the overrides
    its members share. Paths in the rows are :func:`portable` (also those of files written before it)."""
    directory = Path(directory)
    rows, references, columns = [], {}, {}
    for path in _member_files(directory):
        where = {"run_dir": str(path.parent.relative_to(directory))}
        try:
            member = _read_member(path)
        except ArtifactError as error:
            rows.append({**where, "status": "failed", "error": str(error)})
            continue
        overrides = parse_overrides(member.get("overrides", []))
        columns.update(dict.fromkeys(overrides))
        if path.name == ERROR_FILE:
            config = member.get("config", {})
            rows.append({
                **overrides, **where, "model": config.get("model", {}).get("name"),
                "codec": config.get("codec", {}).get("name"), "benchmark": config.get("benchmark", {}).get("name"),
                "status": "failed", "error": member.get("error"),
            })
            continue
        for row in member["rows"]:
            key = row.get("reference_key")
            if key is None:
                rows.append({**overrides, **row, **where, "status": "ok"})
            elif key in references:  # keep only the overrides every member of this reference shares
                shared = references[key]
                for name in [k for k in shared["overrides"] if overrides.get(k) != shared["overrides"][k]]:
                    del shared["overrides"][name]
            else:
                references[key] = {"row": {**row, **where, "status": "ok"}, "overrides": dict(overrides)}
                rows.append(key)
    resolved = [
        {**references[r]["overrides"], **references[r]["row"]} if isinstance(r, str) else r for r in rows
    ]
    return portable(resolved), list(columns)


def write_summary(directory: str | Path) -> str:
    """Write ``summary.md`` and ``summary.csv`` for all members below ``directory``; return the Markdown."""
    directory = Path(directory)
    rows, overrides = load_rows(directory)
    if not rows:
        return ""
    table = markdown_table(rows, overrides)
    write_text_atomic(directory / "summary.md", table + "\n")
    write_text_atomic(directory / "summary.csv", csv_table(rows))
    return table


def write_failure(output_dir: str | Path, config: dict, overrides: list[str], error: BaseException) -> None:
    """Record a failed member (``error.json``): its config, overrides, error and, for bugs, the traceback
    (paths as :func:`portable` writes them: ``File "kvcomp/runner.py", line 12``)."""
    record = {"config": config, "overrides": list(overrides), "error": f"{type(error).__name__}: {error}"}
    if not isinstance(error, KVCompError):
        record["traceback"] = "".join(traceback.format_exception(error))
    write_json_atomic(Path(output_dir) / ERROR_FILE, portable(record))


def clear_failure(output_dir: str | Path) -> None:
    """Forget an earlier failure of this member (it has results now)."""
    (Path(output_dir) / ERROR_FILE).unlink(missing_ok=True)


def failed_members(directory: str | Path) -> list[Path]:
    """The folders of the members below ``directory`` that failed or whose file is damaged (:func:`load_rows`)."""
    rows, _ = load_rows(directory)
    return sorted({Path(directory) / r["run_dir"] for r in rows if r["status"] == "failed"})


def log_to_wandb(logger_cfg, run_name: str, config: dict, rows: list[dict], group: str | None = None,
                 directory: str | Path | None = None, images: list[Path] = ()) -> None:
    """Log the rows as a W&B table (offline by default, ``wandb sync`` later), and ``images`` (e.g. a
    sweep's rate-distortion plot) under their file names. Its files go under ``directory``/wandb (the
    run's output folder) unless ``$WANDB_DIR`` says otherwise. Config and rows go as :func:`portable` writes
    them."""
    import wandb

    config, rows = portable(config), portable(rows)
    run = wandb.init(
        dir=None if os.environ.get("WANDB_DIR") or directory is None else str(directory),
        project=logger_cfg.project,
        entity=logger_cfg.entity,
        mode=logger_cfg.mode,
        name=run_name,
        group=group,
        config=config,
        reinit="finish_previous",
        # no machine metadata (program and interpreter paths, host), system metrics, code, git state,
        # requirements or console capture: the run holds the config, table, summary and images only
        settings=wandb.Settings(x_disable_meta=True, x_disable_stats=True, disable_code=True, disable_git=True,
                                x_save_requirements=False, console="off"),
    )
    columns = scalar_columns(rows)
    run.log({
        "results": wandb.Table(columns=columns, data=[[_format(row.get(c)) for c in columns] for row in rows]),
        **{Path(image).stem: wandb.Image(str(image)) for image in images},
    })
    for row in rows:
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                run.summary["/".join(filter(None, (row.get("run_dir"), row["codec"], key)))] = value
    run.finish()


def emit(text: str, out: Path | None = None) -> str:
    """A script's Markdown: written to ``out`` (atomically) or printed; returned."""
    if out:
        write_text_atomic(out, text)
    else:
        sys.stdout.write(text)
    return text
