"""One error style: bad command lines end with one line ``kvcomp error: ...`` and exit status 2, bugs keep
their traceback, ``HYDRA_FULL_ERROR=1`` shows every traceback."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from kvcomp.config import LoggerConfig, register_configs
from kvcomp.results import log_to_wandb, portable, write_failure
from kvcomp.sweep import user_problem
from tests.run_py import ROOT, run_py

CONF = ROOT / "conf"


def _problem(*overrides) -> str:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        with pytest.raises(Exception) as raised:
            compose(config_name="config", overrides=list(overrides))
    return user_problem(raised.value, CONF)


@pytest.mark.parametrize("override, expected", [
    ("codec.bogus=1", "unknown codec field 'bogus'; valid choices: bits, compress_sliding, group_size, name,"),
    ("bogus=1", "unknown field 'bogus'; valid choices: benchmark, calibration, codec, force,"),
    ("benchmark.batch_size=abc", "benchmark.batch_size=abc: Value 'abc' of type 'str' could not be converted to Integer"),
    ("codec.bits=", "codec.bits=: Value '' of type 'str' could not be converted to Integer"),
    ("codec=nosuch", "unknown codec option 'nosuch'; valid choices: aquakv, aquakv_3bit,"),
    ("hardware=nosuch", "unknown hardware option 'nosuch'; valid choices: a100, cpu, h100, h100_8x, h200"),
    ("experiment=qjl/nosuch", "unknown experiment option 'qjl/nosuch'; valid choices: aquakv/embedded_ablations,"),
    ("codec..x=1", "malformed override 'codec..x=1'; the grammar: https://hydra.cc/"),
    ("=3", "Config group override must be a string or a list. Got int"),
    ("codec=3", "Config group override must be a string or a list. Got int"),
    ("~codec.bits", "~codec.bits: KIVIConfig (DictConfig) does not support deletion"),
])
def test_composition_errors_read_as_one_line(override, expected):
    problem = _problem(override)
    assert expected in problem and "\n" not in problem
    assert "schema" not in problem  # kvcomp's registered schemas are not options


def test_bugs_are_not_user_problems():
    assert user_problem(ZeroDivisionError("boom"), CONF) is None
    assert user_problem(ValueError("raised by kvcomp, not by Hydra's checks"), CONF) is None


@pytest.mark.parametrize("args", [["codec.bogus=1"], ["benchmark.batch_size=abc"], ["-m", "codec=kivi,nosuch"]])
def test_run_py_refuses_bad_command_lines_with_one_line(tmp_path, args):
    result = run_py(*args, f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith("kvcomp error: ") and "HYDRA_FULL_ERROR" not in result.stderr
    if args[0] == "-m":
        assert line.startswith("kvcomp error: sweep member codec=nosuch: unknown codec option 'nosuch'")
        assert not list((tmp_path / "sweep").rglob("results.json"))


def test_hydra_full_error_shows_the_traceback(tmp_path):
    result = run_py("codec.bogus=1", f"hydra.run.dir={tmp_path}", cwd=tmp_path, HYDRA_FULL_ERROR="1")
    assert result.returncode == 1 and "Traceback" in result.stderr and "ConfigCompositionException" in result.stderr
    assert "kvcomp error" not in result.stderr


def test_a_bug_in_the_job_keeps_its_traceback(tmp_path):
    """A non-kvcomp exception raised inside the job: its traceback and exit status 1, not a one-line error."""
    script = ("import runpy, kvcomp.runner\n"
              "def run(*args, **kwargs):\n    raise ZeroDivisionError('a bug')\n"
              "kvcomp.runner.run = run\n"
              f"runpy.run_path({str(ROOT / 'run.py')!r}, run_name='__main__')\n")
    result = subprocess.run([sys.executable, "-c", script, f"hydra.run.dir={tmp_path}"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "Traceback" in result.stderr
    assert "ZeroDivisionError: a bug" in result.stderr and "kvcomp error" not in result.stderr


def test_cfg_job_still_prints_the_config(tmp_path):
    result = run_py("--cfg", "job", "codec.bits=4", cwd=tmp_path)
    assert result.returncode == 0 and "bits: 4" in result.stdout


def _install_paths() -> list[str]:
    """Folders no written file may name: the checkout, the interpreter's prefix (site-packages), the home."""
    import sysconfig

    return [str(ROOT), sys.prefix, sys.executable, sysconfig.get_paths()["purelib"], str(Path.home())]


def _yaml_bug():
    import yaml

    yaml.safe_load("a: [")  # raises inside site-packages


def test_error_json_holds_no_install_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path / "cache"))
    home = Path.home()
    config = {"model": {"name": "m", "source": str(home / "models" / "m")},
              "calibration": {"artifact": str(tmp_path / "cache" / "calibration" / "a.safetensors")}}
    try:
        _yaml_bug()
    except Exception as error:
        write_failure(tmp_path / "member", config, [f"model.source={home / 'models' / 'm'}"], error)
    text = (tmp_path / "member" / "error.json").read_text()
    assert not [p for p in _install_paths() if p in text], text
    record = json.loads(text)
    assert record["config"]["model"]["source"] == "~/models/m" and record["overrides"] == ["model.source=~/models/m"]
    assert record["config"]["calibration"]["artifact"] == "$KVCOMP_CACHE/calibration/a.safetensors"
    assert 'File "tests/usage/test_error_style.py", line' in record["traceback"] and 'File "yaml/' in record["traceback"]
    assert portable("/data/models/m") == "/data/models/m" and portable(str(ROOT)) == "."


def test_wandb_files_hold_no_install_paths(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    rows = [{"model": "m", "codec": "kivi()", "ppl": 1.5, "note": f"read {ROOT / 'kvcomp' / 'x.py'}"}]
    log_to_wandb(LoggerConfig(name="wandb", mode="offline"), "r", {"model": {"source": str(Path.home() / "m")}},
                 rows, directory=tmp_path)
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    files = [p for p in run.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files) and any(p.name.endswith(".table.json") for p in files)
    for path in files:
        text = path.read_bytes().decode("utf-8", "replace")
        if path.suffix == ".wandb":  # W&B's own log names its staging folder (under the home) for the table
            text = text.replace(str(Path.home() / ".local" / "share" / "wandb"), "")
        assert not [p for p in _install_paths() if p in text], (path, [p for p in _install_paths() if p in text])
    assert "kvcomp/x.py" in next(p for p in files if p.name.endswith(".table.json")).read_text()


@pytest.mark.parametrize("script, args, expected", [
    ("scripts/key_offsets.py", ["--model", "nosuch"], "argument --model: invalid choice: 'nosuch'"),
    ("scripts/key_offsets.py", ["--tokens", "0"], "argument --tokens: must be at least 1, got 0"),
    ("scripts/ppl_spread.py", ["--codec", "nosuch"], "argument --codec: invalid choice: 'nosuch'"),
    ("scripts/ppl_spread.py", ["--copies", "0"], "argument --copies: must be at least 1, got 0"),
    ("experiments/qjl/distortion.py", ["--ratios", "4", "-1"], "argument --ratios: must be at least 1, got -1"),
    ("benchmarks.bench_calibration", ["--codecs", "kvtc,nosuch"], "unknown codec family 'nosuch'; valid choices: aquakv,"),
    ("benchmarks.bench_calibration", ["--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
    ("benchmarks.bench_cache_memory", ["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    ("tools.kernel_resources", ["--context", "-5"], "argument --context: must be at least 1, got -5"),
    ("benchmarks.bench_qjl_decode", ["--reps", "0"], "argument --reps: must be at least 1, got 0"),
    ("benchmarks.bench_decode_e2e", ["--layers", "0"], "argument --layers: must be at least 1, got 0"),
    ("benchmarks.bench_decode_attention", ["--warmup", "-1"], "argument --warmup: must be at least 0, got -1"),
    ("benchmarks.bench_decode_overhead", ["--threads", "0"], "argument --threads: must be at least 1, got 0"),
    ("benchmarks.bench_decode_overhead", ["--repeats", "x"], "argument --repeats: invalid int value: 'x'"),
    ("scripts/render_tables.py", ["nosuch"], "argument experiment: invalid choice: 'nosuch' (choose from 'baselines_2026', 'csr',"),
    ("scripts/render_tables.py", ["csr", "{missing}"], "is not a directory"),
    ("scripts/render_tables.py", ["csr", "{tmp}", "--summary"], "summary.csv is missing"),
])
def test_scripts_refuse_bad_arguments_before_any_work(script, args, expected, tmp_path, monkeypatch, capsys):
    """argparse's usage error (exit status 2), not a traceback from inside the work. ``script``: a file of
    the repository (run as ``python scripts/<script>``, ``python experiments/<name>/<script>``) or a module of
    ``benchmarks``/``tools`` (run from the repository root as ``python -m <module>``)."""
    import runpy

    args = [a.format(missing=tmp_path / "missing", tmp=tmp_path) for a in args]
    monkeypatch.setattr(sys, "argv", [script, *args])
    with pytest.raises(SystemExit) as exit_:
        if script.endswith(".py"):
            path = ROOT / script
            monkeypatch.setattr(sys, "path", [str(path.parent), *sys.path])  # as `python <script>` runs
            runpy.run_path(str(path), run_name="__main__")
        else:
            monkeypatch.delitem(sys.modules, script, raising=False)  # imported by another test: run it afresh
            runpy.run_module(script, run_name="__main__", alter_sys=True)
    assert exit_.value.code == 2 and expected in capsys.readouterr().err


def test_render_csr_tables_names_the_valid_columns(tmp_path, monkeypatch, capsys):
    import runpy

    (tmp_path / "summary.csv").write_text("codec,bits_per_value,ppl_streaming\nkivi,3,10\n")
    monkeypatch.setattr(sys, "argv", ["render_tables.py", "csr", str(tmp_path), "--summary", "--columns", "ppl_nope"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / "scripts" / "render_tables.py"), run_name="__main__")
    assert exit_.value.code == 2
    assert "unknown column 'ppl_nope'; valid choices: bits_per_value, codec, ppl_streaming" in capsys.readouterr().err


def _last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


@pytest.mark.parametrize("args, expected", [
    (["press=snapkv", "press.window_size=1000", "press.ratio=0.5", "benchmark.context_tokens=128"],
     "press=snapkv needs prompts of at least 1001 tokens (its observation window of window_size=1000 tokens and one "
     "before it), but the context (benchmark.context_tokens) is 128"),
])
def test_errors_after_composition_are_one_line_and_end_the_run_log(tmp_path, args, expected):
    """Bad settings found once the run has started: one line, exit status 2, the same line ending ``run.log``; a
    press's are found before the model loads (RULER lengths too short for every task: ``tests/benchmarks/test_ruler.py``)."""
    result = run_py(*args, f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert _last_line(result.stderr).startswith(f"kvcomp error: {expected}") and "Traceback" not in result.stderr
    log = (tmp_path / "run.log").read_text()
    assert f"kvcomp error: {expected}" in _last_line(log)
    assert "loading model" not in log


@pytest.mark.parametrize("where", ["file", "file/below"])
def test_a_run_folder_hydra_cannot_create_is_one_line(tmp_path, where):
    (tmp_path / "file").write_text("not a folder")
    result = run_py(f"hydra.run.dir={tmp_path / where}", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith(f"kvcomp error: cannot write the run folder {tmp_path / where} (")
    assert "set hydra.run.dir" in line
