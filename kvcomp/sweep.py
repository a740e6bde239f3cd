"""Runs and sweeps from ``run.py``: user errors without tracebacks, sweeps that survive a bad member.

:func:`one_line_errors` wraps ``run.py``'s Hydra entry point: a command line Hydra cannot compose (an
unknown group option or field, a mistyped value, a malformed override), also in one member of a sweep,
ends like every user error, with one line ``kvcomp error: ...`` and exit status 2. :func:`run_job` runs
one Hydra job. A user error (:class:`~kvcomp.errors.KVCompError`) of a single run prints one message and
exits with status 2, a bug prints its traceback and exits with status 1; in a sweep any failure is
recorded in the member's ``error.json`` and the next member runs. ``HYDRA_FULL_ERROR=1`` shows every
traceback. Under the
local parallel launcher a member first takes its GPU or its share of the cores (:mod:`kvcomp.parallel`).

:class:`AggregateSweep` (a Hydra callback) checks every member of a basic sweep before the first one
starts, and after the last one (in the launching process, also when members ran as SLURM jobs) runs
:func:`aggregate`: ``summary.md`` / ``summary.csv`` (failed members included), the rate-distortion
plot, W&B, and exit status 1 when any member failed. ``scripts/aggregate_sweep.py DIR`` runs
:func:`aggregate` by hand.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from kvcomp.errors import ConfigError, KVCompError, unknown_choice
from kvcomp.parallel import PARALLEL_LAUNCHER, lease_gpu, member_threads, register_resolver
from kvcomp.results import failed_members, load_rows, log_to_wandb, write_failure, write_summary

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
log = logging.getLogger(__name__)
register_resolver()  # launcher configs read ${kvcomp_parallel_jobs:}, also in worker processes


FULL_ERROR = "HYDRA_FULL_ERROR"
USER_FULL_ERROR = "KVCOMP_FULL_ERROR"  # the user's HYDRA_FULL_ERROR while one_line_errors sets it for Hydra


def _full_error() -> bool:
    """Whether the user asked for every traceback (``HYDRA_FULL_ERROR=1``), also in a member's own process."""
    return os.environ.get(USER_FULL_ERROR, os.environ.get(FULL_ERROR)) == "1"


@contextmanager
def one_line_errors(conf_dir: Path):
    """Around ``run.py``'s Hydra entry point (``conf_dir``: its config folder): bad input that reaches it (a
    command line Hydra cannot compose, an invalid sweep member, a :class:`KVCompError`) ends with one line
    ``kvcomp error: ...`` and exit status 2; anything else keeps its traceback.

    Hydra is run with ``HYDRA_FULL_ERROR=1`` so that it re-raises its errors to here instead of printing
    them over several lines; the user's own setting is kept in ``KVCOMP_FULL_ERROR`` (for the members'
    processes too), and with it set every traceback is shown."""
    os.environ[USER_FULL_ERROR] = "1" if _full_error() else "0"
    os.environ[FULL_ERROR] = "1"
    try:
        yield
    except Exception as error:
        problem = None if _full_error() else user_problem(error, conf_dir)
        if problem is None:
            raise
        refuse(problem)


def refuse(problem: str) -> None:
    """End the process for bad input: one line on stderr, exit status 2."""
    print(f"kvcomp error: {problem}", file=sys.stderr)
    sys.exit(2)


def user_problem(error: BaseException, conf_dir: Path) -> str | None:
    """``error`` on one line when it is bad input: a :class:`KVCompError`, an error Hydra reports without a
    traceback (a composition or override-parsing error) or a ``ValueError`` Hydra's own checks raise (e.g.
    ``codec=3``, a group given no name); None for anything else (a bug)."""
    from hydra.errors import CompactHydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    if isinstance(error, KVCompError):
        return str(error)
    if isinstance(error, MissingConfigException):
        return _unknown_option(error, conf_dir)
    if isinstance(error, OverrideParseException):
        return f"malformed override {error.override!r}; the grammar: {OVERRIDE_GRAMMAR}"
    if isinstance(error, OSError) and _raised_by_hydra(error, anywhere=True):  # the run folder Hydra sets up
        return (f"cannot write the run folder {error.filename or ''} ({error.strerror or error}); set hydra.run.dir "
                "(a sweep: hydra.sweep.dir) to a folder kvcomp can create and write")
    if not isinstance(error, CompactHydraException) and not (isinstance(error, ValueError) and _raised_by_hydra(error)):
        return None
    cause = error.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.parent_node is not None:  # codec.bogus=1
        group, _, key = str(cause.full_key).rpartition(".")
        return str(unknown_choice(f"{group} field" if group else "field", key, cause.parent_node.keys()))
    message = str(error).strip().splitlines()[0]
    return f"{message}: {str(cause).strip().splitlines()[0]}" if cause is not None and str(cause).strip() else message


OVERRIDE_GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"


def _unknown_option(error, conf_dir: Path) -> str:
    """``codec=nosuch`` / ``experiment=nosuch``: the unknown option and the group's options (Hydra's list less
    the schemas kvcomp registers; for nested groups such as ``experiment``, the files below the group)."""
    missing = error.missing_cfg_file or ""
    options = [o for o in error.options or [] if not o.startswith("schema")]
    if options:
        group, _, name = missing.rpartition("/")
    else:
        group, _, name = missing.partition("/") if "/" in missing else ("", "", missing)
        folder = conf_dir / group
        files = folder.glob("**/*.yaml" if group else "*.yaml")
        options = sorted(str(p.relative_to(folder).with_suffix("")) for p in files)
    return str(unknown_choice(f"{group} option" if group else "config", name, options))


def _raised_by_hydra(error: BaseException, anywhere: bool = False) -> bool:
    """Whether ``error`` was raised by Hydra's own code (its checks of the command line), or (``anywhere``) in a
    call Hydra made before the job ran: kvcomp's jobs (:func:`run_job`) end every error of their own."""
    import hydra

    frames = traceback.extract_tb(error.__traceback__)
    inside = [Path(f.filename).is_relative_to(Path(hydra.__file__).parent) for f in frames]
    return bool(frames) and (any(inside) if anywhere else inside[-1])


@contextmanager
def member_placement(cfg: DictConfig, n_jobs: int):
    """A local parallel member's share of the machine: one leased GPU (the current CUDA device while
    the member runs), or ``cores // n_jobs`` CPU threads unless ``hardware.threads`` is set. A member
    placed over several GPUs (``hardware.device_map``) takes every visible GPU: run those one at a time
    (``hydra.launcher.n_jobs=1``) or with the SLURM launcher."""
    if cfg.hardware.get("device_map"):
        yield
        return
    if str(cfg.hardware.device).startswith("cuda"):
        import torch

        with lease_gpu() as index:
            torch.cuda.set_device(index)
            yield
        return
    if not cfg.hardware.threads:
        os.environ["OMP_NUM_THREADS"] = str(member_threads(n_jobs))
    yield


def run_job(cfg: DictConfig, output_dir: Path, overrides: list[str], in_sweep: bool,
            launcher: DictConfig | None = None) -> None:
    """Run one job (see the module docstring for how failures end). ``launcher``: Hydra's launcher
    config (``hydra.launcher``) of the job."""
    from kvcomp.runner import run

    overrides = [o for o in overrides if not o.lstrip("+~").startswith("plot.")]  # how the sweep draws, not the run
    parallel = in_sweep and launcher is not None and str(launcher.get("_target_", "")).endswith(PARALLEL_LAUNCHER)
    try:
        if parallel:
            with member_placement(cfg, int(launcher.n_jobs)):
                run(cfg, output_dir, overrides)
        else:
            run(cfg, output_dir, overrides)
    except Exception as error:
        user_error = isinstance(error, KVCompError)
        _to_log_files(f"kvcomp error: {error}" if user_error else "".join(traceback.format_exception(error)))
        if not in_sweep:
            if _full_error():
                raise
            if user_error:
                refuse(str(error))
            traceback.print_exception(error)
            sys.exit(1)
        config = OmegaConf.to_container(cfg, resolve=False)
        config.pop("hydra", None)
        write_failure(output_dir, config, overrides, error)
        if user_error and not _full_error():
            print(f"kvcomp error in sweep member {' '.join(overrides)}: {error}", file=sys.stderr)
        else:
            traceback.print_exception(error)
        print("[kvcomp] member recorded as failed; the sweep goes on", file=sys.stderr)


def _to_log_files(text: str) -> None:
    """Write ``text``, how a failed job ends, into its log files (``run.log``), and not again on the console."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, text, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def sweep_members(config: DictConfig) -> list[list[str]] | None:
    """The override lists of every member of a basic sweep (``None`` for other sweepers)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if config.hydra.sweeper.get("_target_") != BASIC_SWEEPER:
        return None
    params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    parsed = OverridesParser.create().parse_overrides(params + list(config.hydra.overrides.task))
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def check_members(config: DictConfig, conf_dir: Path) -> list[tuple[list[str], str]]:
    """``(overrides, problem)`` of every member whose config fails kvcomp's checks. A member Hydra cannot
    compose (``-m codec=kivi,nosuch``) is a :class:`ConfigError` naming it, which stops the sweep before
    any member runs (``conf_dir``: the config folder, for the valid options)."""
    from hydra import compose

    from kvcomp.runner import check_codec_for_model, check_config

    problems = []
    for overrides in sweep_members(config) or []:
        try:
            member = compose(config_name=config.hydra.job.config_name, overrides=overrides)
        except Exception as error:
            problem = user_problem(error, conf_dir)
            if problem is None:
                raise
            raise ConfigError(f"sweep member {' '.join(overrides)}: {problem}") from error
        try:
            check_codec_for_model(check_config(member, overrides))
        except KVCompError as error:
            problems.append((overrides, str(error)))
    return problems


def aggregate(sweep_dir: str | Path, logger: DictConfig | None = None, x: str = "bits", y: str | None = None) -> int:
    """Summarise every member below ``sweep_dir``: ``summary.md`` / ``summary.csv``, the rate-distortion
    plot (``rate_distortion.png`` / ``.svg``, see :mod:`kvcomp.plots`), the W&B table and plot when
    ``logger`` is W&B. Return the number of failed members (each named on stderr)."""
    from kvcomp.plots import write_rate_distortion

    sweep_dir = Path(sweep_dir)
    table = write_summary(sweep_dir)
    if table:
        log.info("sweep summary (%s):\n%s", sweep_dir / "summary.md", table)
        rows, _ = load_rows(sweep_dir)
        try:
            plots = write_rate_distortion(rows, sweep_dir / "rate_distortion", x=x, y=y)
        except ValueError as error:  # e.g. plot.y names no metric of these rows: the summary stands
            log.error("no rate-distortion plot: %s", error)
            plots = []
        if plots:
            log.info("rate-distortion plot: %s", plots[0])
        if logger is not None and logger.name == "wandb":
            log_to_wandb(logger, f"sweep-{sweep_dir.name}", {"sweep_dir": sweep_dir.name}, rows,
                         group="sweeps", directory=sweep_dir, images=[p for p in plots if p.suffix == ".png"])
    failed = failed_members(sweep_dir)
    if failed:
        names = ", ".join(str(p.relative_to(sweep_dir)) for p in failed)
        print(f"kvcomp: {len(failed)} sweep member(s) failed: {names} (see their error.json)", file=sys.stderr)
    return len(failed)


class AggregateSweep(Callback):
    """Hydra callback: check the members before a multirun, name each member as it starts, aggregate
    them after the multirun."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self.members = len(sweep_members(config) or [])  # known for basic sweeps; shown as members start
        (main,) = [s for s in config.hydra.runtime.config_sources if s.provider == "main"]  # run.py's conf/
        try:
            problems = check_members(config, Path(main.path))
        except ConfigError as error:  # a member Hydra cannot compose (Hydra turns a callback's errors into warnings)
            if _full_error():
                raise
            refuse(str(error))
        for overrides, problem in problems:
            print(f"kvcomp: sweep member {' '.join(overrides)} is invalid: {problem}", file=sys.stderr)
        if problems:
            print(f"kvcomp: {len(problems)} invalid member(s) will be recorded as failed; the others run",
                  file=sys.stderr)

    def on_job_start(self, config: DictConfig, **kwargs) -> None:
        job = config.hydra.job
        if job.get("num") is not None and config.hydra.mode == RunMode.MULTIRUN:
            of = f"/{self.members}" if getattr(self, "members", 0) else ""  # this process launched the sweep
            log.info("sweep member %d%s: %s", job.num + 1, of, " ".join(config.hydra.overrides.task) or "(no overrides)")

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        try:
            failed = aggregate(config.hydra.sweep.dir, config.logger, config.plot.x, config.plot.y)
        except Exception as error:  # Hydra would turn it into a warning and exit 0 with a stale summary
            if _full_error() or not isinstance(error, KVCompError):
                traceback.print_exception(error)
            else:
                print(f"kvcomp error: the sweep summary: {error}", file=sys.stderr)
            sys.exit(1)
        if failed:
            sys.exit(1)
