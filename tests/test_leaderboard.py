"""The leaderboard page (scripts/leaderboard.py): rows from sweep folders into panels, bit classes by measured bits,
the Pareto front, Markdown / CSV / self-contained HTML with links to each row's results.json; and a two-codec slice
of ``experiment=leaderboard/quick`` through ``run.py -m`` on the embedded model, rendered."""

import csv
import io
import json
from pathlib import Path

import pytest

from tests.conftest import load_script
from tests.run_py import THREADS, run_py

ROOT = Path(__file__).resolve().parents[1]


def _module():
    return load_script("leaderboard")


def _member(sweep, codec, bits, measured, ppl, acc, tokens, model="m"):
    """One fake member per benchmark (perplexity and RULER), its fp16 reference row included as run.py writes it."""
    for bench, metric, value in (("perplexity", "ppl_chunked", ppl), ("ruler", "acc_avg", acc)):
        folder = sweep / f"benchmark={bench},codec={codec},model={model}"
        folder.mkdir()
        extra = {"output_tokens": tokens} if bench == "ruler" else {}
        reference = {"model": model, "codec": "fp16()", "bits_per_value": 16.0, "bits_per_value_measured": 32.0,
                     "benchmark": f"{bench}:x", metric: 20.0 if bench == "perplexity" else 50.0,
                     "reference_key": f"{bench}-{model}", **extra}
        row = {"model": model, "codec": f"{codec}(bits=2)", "bits_per_value": bits, "bits_per_value_measured": measured,
               "overhead_bits": 0, "benchmark": f"{bench}:x", metric: value, **extra}
        (folder / "results.json").write_text(json.dumps({"config": {"codec": {"name": codec}}, "rows": [reference, row],
                                                         "overrides": [f"benchmark={bench}", f"codec={codec}",
                                                                       f"model={model}"],
                                                         "timings": {"total_seconds": 600.0}}))


def test_panels_classes_front_and_files(tmp_path):
    module = _module()
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    _member(sweep, "kivi", 3.0, 4.8, 25.0, 40.0, 30.0)
    _member(sweep, "temporalkv", 2.0, 2.2, 24.0, 45.0, 28.0)
    _member(sweep, "higgs", 4.1, 7.6, 30.0, 20.0, 64.0)  # more bits, worse: off the front
    out = tmp_path / "page"
    module.main([str(sweep), "--out", str(out), "--headline", "m"])
    assert (out / "headline.png").read_bytes().startswith(b"\x89PNG")  # the model's perplexity panel
    with pytest.raises(SystemExit, match="no perplexity panel of that model; models: m"):
        module.main([str(sweep), "--out", str(tmp_path / "other"), "--headline", "nosuch"])
    text = (out / "leaderboard.md").read_text()
    assert text.count("### m: ") == 2 and "### m: perplexity:x / perplexity (chunked)" in text
    assert text.startswith("Computed in 1.00 hours of member time")  # 6 members of 10 minutes
    assert "| 2 | temporalkv | `temporalkv` | 2.200 | 2.000 | 0 | 24.000 | +20.0 % |  | * |" in text
    assert "| 8 | higgs | `higgs` | 7.600 | 4.100 | 0 | 30.000 | +50.0 % |  |  |" in text  # class by measured bits
    assert "| 2 | temporalkv | `temporalkv` | 2.200 | 2.000 | 0 | 45.000 | -5.0 pts | 28.000 | * |" in text
    assert "Leaders: 2 bits: `temporalkv` (+20.0 %); 4 bits: `kivi` (+25.0 %); 8 bits: `higgs` (+50.0 %)." in text
    rows = list(csv.DictReader(io.StringIO((out / "leaderboard.csv").read_text())))
    assert len(rows) == 8 and {r["reference"] for r in rows} == {"True", "False"}
    page = (out / "index.html").read_text()
    assert page.count("<svg") == 2 and "src=" not in page and "href='http" not in page  # nothing fetched
    assert "<dc:date>" not in page  # the same rows give the same page
    assert "href='../sweep/benchmark=ruler,codec=kivi,model=m/results.json'" in page
    (out / "runs" / "x" / "stale").mkdir(parents=True)  # copies replace what a sweep's folder held before
    (out / "runs" / tmp_path.name / "sweep" / "gone").mkdir(parents=True)
    module.main([str(sweep), "--out", str(out), "--copy-results"])  # a committed page: the results it shows beside it
    copied = sorted(p.relative_to(out).as_posix() for p in out.rglob("results.json"))
    assert len(copied) == 6 and copied[0] == f"runs/{tmp_path.name}/sweep/benchmark=perplexity,codec=higgs,model=m/results.json"
    assert not (out / "runs" / tmp_path.name / "sweep" / "gone").exists() and (out / "runs" / "x" / "stale").exists()
    assert f"href='runs/{tmp_path.name}/sweep/benchmark=ruler,codec=kivi,model=m/results.json'" in (out / "index.html").read_text()
    with pytest.raises(SystemExit, match="already a copy"):  # rendering the copies again would delete them
        module.main([str(out / "runs" / tmp_path.name / "sweep"), "--out", str(out), "--copy-results"])
    twin = tmp_path / "other" / tmp_path.name / "sweep"
    twin.mkdir(parents=True)
    with pytest.raises(SystemExit, match="two sweeps end in"):
        module.main([str(sweep), str(twin), "--out", str(out), "--copy-results"])


def test_panels_that_models_share_are_tabled_across_them(tmp_path):
    """One table per benchmark panel that both models have: each option's measured bits, change from its own model's
    reference and place in its bit class on each model, blank where a model lacks the option."""
    module = _module()
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    _member(sweep, "kivi", 3.0, 2.4, 25.0, 40.0, 30.0, model="a")
    _member(sweep, "temporalkv", 2.0, 2.2, 24.0, 45.0, 28.0, model="a")
    _member(sweep, "kivi", 3.0, 2.4, 22.0, 48.0, 30.0, model="b")  # the order in class 2 flips on model b
    _member(sweep, "temporalkv", 2.0, 2.2, 30.0, 30.0, 28.0, model="b")
    _member(sweep, "higgs", 4.1, 4.4, 21.0, 49.0, 30.0, model="b")  # on b only
    out = tmp_path / "page"
    module.main([str(sweep), "--out", str(out)])
    text = (out / "leaderboard.md").read_text()
    table = text[text.index("### Across models: perplexity:x"):text.index("### Across models: ruler:x")]
    assert "| temporalkv | `temporalkv` | 2.200 | +20.0 % | 2: 1 | 2.200 | +50.0 % | 2: 2 |" in table
    assert "| kivi | `kivi` | 2.400 | +25.0 % | 2: 2 | 2.400 | +10.0 % | 2: 1 |" in table
    assert "| higgs | `higgs` |  |  |  | 4.400 | +5.0 % | 4: 1 |" in table
    assert "fp16" not in table
    assert (out / "index.html").read_text().count("<h2>Across models: ") == 2


def test_a_row_names_the_press_settings_its_experiment_file_made(tmp_path):
    """A member's option names its swept overrides and the press settings an experiment file set without sweeping them
    (pressing while decoding, budgets per head), so that such rows are not taken for the plain press."""
    path = tmp_path / "results.json"
    press = {"name": "snapkv", "ratio": 0.5, "decoding_size": 0, "head_budgets": "adakv"}
    path.write_text(json.dumps({"config": {"press": press}, "overrides": ["codec=fp16", "press=snapkv", "press.ratio=0.5"]}))
    assert _module()._option(path, "fp16") == "fp16 press=snapkv press.ratio=0.5 press.head_budgets=adakv"
    path.write_text(json.dumps({"config": {"press": {**press, "decoding_size": 256, "head_budgets": "uniform"}},
                                "overrides": ["codec=fp16", "press=tova"]}))
    assert _module()._option(path, "fp16") == "fp16 press=tova press.decoding_size=256"


@pytest.mark.integration
def test_a_two_codec_slice_runs_and_renders(embedded, tmp_path):
    """``experiment=leaderboard/quick`` (its perplexity part) through run.py -m, then the page from it."""
    sweep = tmp_path / "sweep"
    result = run_py("-m", "experiment=leaderboard/quick", "benchmark=leaderboard_quick_perplexity",
                    f"hardware.threads={THREADS}", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _module().main([str(sweep), "--out", str(tmp_path / "page")])
    text = (tmp_path / "page" / "leaderboard.md").read_text()
    assert "`kivi`" in text and "`turboquant_4bit`" in text and "(reference)" in text
