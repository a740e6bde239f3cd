"""Runs and sweeps from ``run.py``: user errors without tracebacks, sweeps that survive a bad member.

:func:`run_job` runs one Hydra job. A user error (:class:`~kvcomp.errors.KVCompError`) of a single run
prints one message and exits with status 2; in a sweep any failure is recorded in the member's
``error.json`` and the next member runs. ``HYDRA_FULL_ERROR=1`` shows every traceback.

:class:`AggregateSweep` (a Hydra callback) checks every member of a basic sweep before the first one
starts, and after the last one writes ``summary.md`` / ``summary.csv`` (failed members included) and
exits with status 1 when any member failed.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from kvcomp.errors import KVCompError
from kvcomp.results import failed_members, load_rows, log_to_wandb, write_failure, write_summary

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def _full_error() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def run_job(cfg: DictConfig, output_dir: Path, overrides: list[str], in_sweep: bool) -> None:
    """Run one job (see the module docstring for how failures end)."""
    from kvcomp.runner import run

    try:
        run(cfg, output_dir, overrides)
    except Exception as error:
        user_error = isinstance(error, KVCompError)
        if not in_sweep:
            if user_error and not _full_error():
                print(f"kvcomp error: {error}", file=sys.stderr)
                sys.exit(2)
            raise
        config = OmegaConf.to_container(cfg, resolve=False)
        config.pop("hydra", None)
        write_failure(output_dir, config, overrides, error)
        if user_error and not _full_error():
            print(f"kvcomp error in sweep member {' '.join(overrides)}: {error}", file=sys.stderr)
        else:
            traceback.print_exception(error)
        print("[kvcomp] member recorded as failed; the sweep goes on", file=sys.stderr)


def sweep_members(config: DictConfig) -> list[list[str]] | None:
    """The override lists of every member of a basic sweep (``None`` for other sweepers)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if config.hydra.sweeper.get("_target_") != BASIC_SWEEPER:
        return None
    params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    parsed = OverridesParser.create().parse_overrides(params + list(config.hydra.overrides.task))
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def check_members(config: DictConfig) -> list[tuple[list[str], str]]:
    """``(overrides, problem)`` of every member whose config fails kvcomp's checks (composition errors
    are left to Hydra, which reports them before launching)."""
    from hydra import compose

    from kvcomp.runner import check_codec_for_model, check_config

    problems = []
    for overrides in sweep_members(config) or []:
        try:
            member = compose(config_name=config.hydra.job.config_name, overrides=overrides)
        except Exception:
            continue
        try:
            check_codec_for_model(check_config(member))
        except KVCompError as error:
            problems.append((overrides, str(error)))
    return problems


class AggregateSweep(Callback):
    """Hydra callback: check the members before a multirun, aggregate them after it."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        problems = check_members(config)
        for overrides, problem in problems:
            print(f"kvcomp: sweep member {' '.join(overrides)} is invalid: {problem}", file=sys.stderr)
        if problems:
            print(f"kvcomp: {len(problems)} invalid member(s) will be recorded as failed; the others run",
                  file=sys.stderr)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        table = write_summary(sweep_dir)
        if table:
            print(f"\nSweep summary ({sweep_dir / 'summary.md'}):\n{table}")
            if config.logger.name == "wandb":
                rows, _ = load_rows(sweep_dir)
                log_to_wandb(config.logger, f"sweep-{sweep_dir.name}", {"sweep_dir": sweep_dir.name}, rows,
                             group="sweeps", directory=sweep_dir)
        failed = failed_members(sweep_dir)
        if failed:
            names = ", ".join(str(p.relative_to(sweep_dir)) for p in failed)
            print(f"kvcomp: {len(failed)} sweep member(s) failed: {names} (see their error.json)", file=sys.stderr)
            sys.exit(1)
