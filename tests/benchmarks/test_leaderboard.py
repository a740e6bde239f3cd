"""The leaderboard page (scripts/leaderboard.py): rows from sweep folders into panels, bit classes by measured bits,
the Pareto front, Markdown / CSV / self-contained HTML with links to each row's results.json; and a two-codec slice
of ``experiment=leaderboard/quick`` through ``run.py -m`` on the embedded model, rendered."""

import csv
import io
import json
import math
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.helpers import load_script
from tests.run_py import THREADS, run_py

ROOT = Path(__file__).resolve().parents[2]


def _module():
    return load_script("scripts/leaderboard.py")


def _refused(capsys, module, *argv) -> str:
    """The one stderr line of a run of the script that refuses ``argv`` with exit status 2."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        module.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and err.startswith("leaderboard.py: error: "), err
    return err


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


def test_panels_classes_front_and_files(tmp_path, capsys):
    module = _module()
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    _member(sweep, "kivi", 3.0, 4.8, 25.0, 40.0, 30.0)
    _member(sweep, "temporalkv", 2.0, 2.2, 24.0, 45.0, 28.0)
    _member(sweep, "higgs", 4.1, 7.6, 30.0, 20.0, 64.0)  # more bits, worse: off the front
    out = tmp_path / "page"
    module.main([str(sweep), "--out", str(out), "--headline", "m"])
    assert (out / "headline.png").read_bytes().startswith(b"\x89PNG")  # the model's perplexity panel
    refusal = _refused(capsys, module, sweep, "--out", tmp_path / "other", "--headline", "nosuch")
    assert "no perplexity panel of that model; models: m" in refusal
    text = (out / "leaderboard.md").read_text()
    assert text.count("### m: ") == 2 and "### m: perplexity:x / perplexity (chunked)" in text
    assert text.startswith("Computed in 1.00 hours of member time")  # 6 members of 10 minutes
    assert "| 2 | temporalkv | `temporalkv` | 2.200 | 2.000 | 0 | 24.000 | +20.0 % |  |  |  |  |  |  |  | * |" in text
    assert "| 8 | higgs | `higgs` | 7.600 | 4.100 | 0 | 30.000 | +50.0 % |  |  |  |  |  |  |  |  |" in text  # class by measured bits
    assert "| 2 | temporalkv | `temporalkv` | 2.200 | 2.000 | 0 | 45.000 | -5.0 pts | 28.000 |  |  |  |  |  |  | * |" in text
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
    # rendering the copies again would delete them
    copies = out / "runs" / tmp_path.name / "sweep"
    assert "already a copy" in _refused(capsys, module, copies, "--out", out, "--copy-results")
    twin = tmp_path / "other" / tmp_path.name / "sweep"
    twin.mkdir(parents=True)
    assert "two sweeps end in" in _refused(capsys, module, sweep, twin, "--out", out, "--copy-results")


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


def _results(folder: Path, rows: list[dict], overrides: list[str]) -> Path:
    """A member's ``results.json`` holding ``rows`` (its config names no press)."""
    folder.mkdir(parents=True)
    path = folder / "results.json"
    member = {"config": {}, "overrides": overrides, "rows": rows, "timings": {"total_seconds": 60.0}}
    path.write_text(json.dumps(member))
    return path


def _ppl(name: str, measured, ppl, model: str = "m", benchmark: str = "perplexity:x") -> list[dict]:
    """The reference and one codec row of a perplexity member."""
    reference = {"model": model, "codec": "fp16()", "bits_per_value": 16.0, "bits_per_value_measured": 32.0,
                 "benchmark": benchmark, "ppl_chunked": 20.0, "reference_key": f"perplexity-{model}"}
    return [reference, {"model": model, "codec": f"{name}(bits=2)", "bits_per_value": 2.0,
                        "bits_per_value_measured": measured, "benchmark": benchmark, "ppl_chunked": ppl}]


class _Tags(HTMLParser):
    """Every start tag of a page: ``(name, attributes)``."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


HOSTILE_CODEC = "x' onmouseover='alert(1)' y='("
HOSTILE_MODEL = 'm"><script>alert(2)</script>'
HOSTILE_BENCH = "ruler:<img src=x onerror=alert(3)>"
HOSTILE_OPTION = 'codec.center="><script>alert(4)</script>'


def test_hostile_rows_put_nothing_executable_on_the_page(tmp_path):
    """Codec, option, model, benchmark and folder names holding quotes, tags and handlers: the page gets no tag, handler
    or script they would add (counted against a plain render), attribute values keep them whole, the Markdown shows
    them as text, and the plot draws a ``$...$`` option as it is."""
    module = _module()
    pages = {}
    for kind, codec, model, bench, extra in (
            ("plain", "kivi", "m", "perplexity:x", "codec.center=mean"),
            ("hostile", HOSTILE_CODEC, HOSTILE_MODEL, HOSTILE_BENCH, HOSTILE_OPTION)):
        sweep = tmp_path / kind
        folder = sweep / ("member' onmouseover='alert(5)" if kind == "hostile" else "member")
        overrides = [f"codec={codec}", extra, r"press.ratio=$\nosuch$ | `x`"]  # not math: drawn as it is
        _results(folder, _ppl(codec, 2.2, 24.0, model, bench), overrides)
        module.main([str(sweep), "--out", str(tmp_path / f"{kind}-page")])
        pages[kind] = (tmp_path / f"{kind}-page" / "index.html").read_text()
    plain, hostile = (_Tags(pages[k]).tags for k in ("plain", "hostile"))
    assert not [(t, a) for t, a in hostile if any(name.startswith("on") for name in a)]
    assert sorted({t for t, _ in hostile}) == sorted({t for t, _ in plain})  # no <img>, no new element
    assert [t for t, _ in hostile].count("script") == [t for t, _ in plain].count("script") == 1
    page = pages["hostile"]
    assert "x&#x27; onmouseover=&#x27;alert(1)&#x27; y=&#x27;(" in page and "&lt;script&gt;alert(2)" in page
    assert "&lt;img src=x onerror=alert(3)&gt;" in page
    values = [a.get("data-v") for t, a in hostile if t == "td"]
    option = f'{HOSTILE_CODEC} {HOSTILE_OPTION} press.ratio=$\\nosuch$ | `x`'
    assert HOSTILE_CODEC.split("(")[0] in values and option in values  # each attribute holds its whole value
    link = "../hostile/member%27%20onmouseover=%27alert%285%29/results.json"  # reference and row
    assert [a["href"] for t, a in hostile if t == "a"] == [link] * 2
    text = (tmp_path / "hostile-page" / "leaderboard.md").read_text()
    assert "<img" not in text and "### m\"&gt;&lt;script&gt;alert(2)&lt;/script&gt;: ruler:&lt;img" in text
    assert "`` " + option.replace("|", "\\|") + " ``" in text  # a code span: its HTML stays text


def test_invalid_rows_are_listed_with_their_reason_and_never_ranked(tmp_path, capsys):
    """Six members, one with a NaN perplexity and one with a string: four are ranked, two listed as invalid with the
    reason and their results.json (page, Markdown, a warning each), none of them a leader or on the front."""
    module = _module()
    sweep = tmp_path / "sweep"
    for name, measured, ppl in (("a", 2.1, math.nan), ("b", 2.0, "x"), ("c", 2.2, 24.0), ("d", 2.3, 25.0),
                                ("e", 4.0, 22.0), ("f", 8.0, 21.0)):
        _results(sweep / name, _ppl(name, measured, ppl), [f"codec={name}"])
    out = tmp_path / "page"
    module.main([str(sweep), "--out", str(out)])
    captured = capsys.readouterr()
    assert json.loads(captured.out)["invalid"] == 2
    warnings = captured.err.splitlines()
    assert len(warnings) == 2 and all(w.startswith("leaderboard.py: warning: ") for w in warnings)
    assert str(sweep / "a" / "results.json") in warnings[0] and "metric ppl_chunked is nan" in warnings[0]
    assert str(sweep / "b" / "results.json") in warnings[1] and "metric ppl_chunked is a string 'x'" in warnings[1]
    ranked = list(csv.DictReader(io.StringIO((out / "leaderboard.csv").read_text())))
    assert sorted(r["codec"] for r in ranked if r["reference"] == "False") == ["c", "d", "e", "f"]
    text = (out / "leaderboard.md").read_text()
    invalid, panel = text.split("### m: ")
    lead = "| m | perplexity:x / perplexity (chunked) |"
    assert f"{lead} `a` | metric ppl_chunked is nan | [results.json](../sweep/a/results.json) |" in invalid
    assert f"{lead} `b` | metric ppl_chunked is a string 'x' | [results.json](../sweep/b/results.json) |" in invalid
    assert "Leaders: 2 bits: `c` (+20.0 %), `d` (+25.0 %); 4 bits: `e` (+10.0 %); 8 bits: `f` (+5.0 %)." in panel
    assert "`a`" not in panel and "`b`" not in panel and "nan" not in panel
    page = (out / "index.html").read_text()
    assert "<h2>Invalid rows</h2>" in page and "metric ppl_chunked is a string &#x27;x&#x27;" in page
    assert page.count("href='../sweep/b/results.json'") == 1  # listed once, in no panel


def test_a_failed_member_is_listed_with_its_error_not_dropped(tmp_path, capsys):
    from kvcomp.results import write_failure

    sweep = tmp_path / "sweep"
    _results(sweep / "c", _ppl("c", 2.2, 24.0), ["codec=c"])
    config = {"model": {"name": "m"}, "codec": {"name": "kivi"}, "benchmark": {"name": "perplexity"}}
    write_failure(sweep / "k", config, ["codec=kivi"], RuntimeError("out of memory\nmore"))
    out = tmp_path / "page"
    _module().main([str(sweep), "--out", str(out)])
    captured = capsys.readouterr()
    assert json.loads(captured.out)["invalid"] == 1 and "the member failed: RuntimeError: out of memory" in captured.err
    text = (out / "leaderboard.md").read_text()
    assert "| m | perplexity | `kivi` | the member failed: RuntimeError: out of memory | [error.json](../sweep/k/error.json) |" in text


@pytest.mark.parametrize("change, reason", [
    ({"ppl_chunked": math.inf}, "metric ppl_chunked is inf"),
    ({"ppl_chunked": True}, "metric ppl_chunked is a boolean True"),
    ({"ppl_chunked": 0.5}, "metric ppl_chunked is 0.5, below 1 (no perplexity is)"),
    ({"bits_per_value_measured": -math.inf}, "bits_per_value_measured is -inf"),
    ({"bits_per_value": [2]}, "bits_per_value is a list [2]"),
    ({"bits_per_value_seen": 10 ** 400}, "bits_per_value_seen is 1000000000000000000000000000000000000..."),
    ({"bits_per_value_measured": 1e308}, "bits_per_value_measured is 1e+308, outside (0, 1024] bits per value"),
    ({"bits_per_value": 0}, "bits_per_value is 0, outside (0, 1024] bits per value"),
    ({"ppl_chunked_ci95": [25.0, 26.0]}, "ppl_chunked_ci95 [25.0, 26.0] does not contain ppl_chunked 24.0"),
    ({"ppl_chunked_ci95": [20.0, math.inf]}, "ppl_chunked_ci95 is [20.0, inf], not [low, high] of finite numbers"),
    ({"ppl_chunked_ci95": [20.0]}, "ppl_chunked_ci95 is [20.0], not [low, high] of finite numbers"),
    ({"kld_mean_chunked": math.nan}, "kld_mean_chunked is nan"),
    ({"flag": ["collapsed"]}, "flag is ['collapsed'], not a string"),
])
def test_a_row_whose_metric_or_bits_are_no_finite_number_is_invalid(change, reason):
    row = {**_ppl("kivi", 2.2, 24.0)[1], **change}
    assert _module()._row_problem(row, "ppl_chunked") == reason


def test_an_infinite_bit_count_is_listed_invalid_not_plotted(tmp_path, capsys):
    module = _module()
    sweep = tmp_path / "sweep"
    _results(sweep / "a", _ppl("a", math.inf, 24.0), ["codec=a"])
    _results(sweep / "b", _ppl("b", 2.2, 24.0), ["codec=b"])
    module.main([str(sweep), "--out", str(tmp_path / "page"), "--headline", "m"])
    assert "bits_per_value_measured is inf" in capsys.readouterr().err
    assert "| `a` | bits_per_value_measured is inf |" in (tmp_path / "page" / "leaderboard.md").read_text()


@pytest.mark.parametrize("name, content, message", [
    ("results.json", json.dumps({"config": {}, "overrides": []}), "has no 'rows' list"),
    ("results.json", json.dumps({"rows": [{"model": "m", "ppl_chunked": 20.0}]}), "has a row 0 without 'codec'"),
    ("results.json", json.dumps({"rows": [{"model": "m", "codec": 3}]}), "has a row 0 whose 'codec' is not a string"),
    ("results.json", json.dumps([{"rows": []}]), "holds a list, not a JSON object"),
    ("results.json", '{"rows": [', "is unreadable (JSONDecodeError: "),
    ("results.json", json.dumps({"rows": [], "overrides": "codec=kivi"}), "has 'overrides' that are not a list"),
    ("error.json", "[]", "holds a list, not a JSON object"),
])
def test_a_member_file_it_cannot_read_is_refused_in_one_line(tmp_path, capsys, name, content, message):
    sweep = tmp_path / "sweep"
    _results(sweep / "good", _ppl("kivi", 2.2, 24.0), ["codec=kivi"])
    (sweep / "bad").mkdir()
    (sweep / "bad" / name).write_text(content)
    err = _refused(capsys, _module(), sweep, "--out", tmp_path / "page")
    assert f"member file {sweep / 'bad' / name} {message}" in err and "fix or delete it" in err
    assert not (tmp_path / "page").exists()  # refused before anything is written


def test_an_out_that_is_a_file_no_results_and_a_missing_reading_are_refused_in_one_line(tmp_path, capsys):
    module = _module()
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    assert f"no finished member with a metric (ppl_chunked, ppl_streaming, ppl_context, acc_avg) below {sweep}" in \
        _refused(capsys, module, sweep, "--out", tmp_path / "page")
    _results(sweep / "a", _ppl("a", 2.2, 24.0), ["codec=a"])
    (tmp_path / "file").write_text("x")
    refusal = _refused(capsys, module, sweep, "--out", tmp_path / "file")
    assert f"--out {tmp_path / 'file'} is a file; name a folder" in refusal
    assert f"--out {tmp_path / 'file' / 'page'} cannot be created (" in \
        _refused(capsys, module, sweep, "--out", tmp_path / "file" / "page")
    assert f"--reading {tmp_path / 'nosuch.html'} cannot be read (FileNotFoundError" in \
        _refused(capsys, module, sweep, "--out", tmp_path / "page", "--reading", tmp_path / "nosuch.html")


BASE_NLL = [200.0, 210.0, 190.0, 205.0, 195.0, 200.0, 202.0, 198.0]  # 8 windows of 100 scored tokens


def _windowed(name: str, measured: float, nll: list[float], reference: bool = False, **extra) -> dict:
    """A perplexity row that kept its per-window NLLs, its perplexity and interval computed from them."""
    from kvcomp.benchmarks.intervals import ppl_interval

    tokens = [100] * len(nll)
    row = {"model": "m", "codec": f"{name}()" if reference else f"{name}(bits=2)", "bits_per_value": 2.0,
           "bits_per_value_measured": measured, "benchmark": "perplexity:x",
           "ppl_chunked": math.exp(sum(nll) / sum(tokens)), "ppl_chunked_ci95": ppl_interval(nll, tokens),
           "nll_chunked": nll, "tokens_per_window": tokens, **extra}
    return {**row, "reference_key": "perplexity-m"} if reference else row


def _scored(name: str, scores: dict[str, list[float]], reference: bool = False) -> dict:
    """A RULER row that kept its per-sample scores, its accuracies and Wilson interval computed from them."""
    from kvcomp.benchmarks.intervals import wilson_interval

    accuracy = {f"acc_{task}": sum(s) / len(s) for task, s in scores.items()}
    average = sum(accuracy.values()) / len(accuracy)
    row = {"model": "m", "codec": f"{name}()" if reference else f"{name}(bits=2)", "bits_per_value": 2.0,
           "bits_per_value_measured": 16.0 if reference else 2.2, "benchmark": "ruler:x", **accuracy,
           "acc_avg": average, "acc_avg_ci95": wilson_interval(average, sum(map(len, scores.values()))),
           "scores": scores}
    return {**row, "reference_key": "ruler-m"} if reference else row


def _render(tmp_path: Path, members: dict[str, list[dict]]) -> tuple[str, str, list[dict]]:
    """The Markdown, the page and the CSV rows of one sweep whose members hold ``members`` (folder -> rows)."""
    sweep = tmp_path / "sweep"
    for name, rows in members.items():
        _results(sweep / name, rows, [f"codec={name}"])
    out = tmp_path / "page"
    _module().main([str(sweep), "--out", str(out)])
    return ((out / "leaderboard.md").read_text(), (out / "index.html").read_text(),
            list(csv.DictReader(io.StringIO((out / "leaderboard.csv").read_text()))))


def _cells(text: str, option: str) -> dict[str, str]:
    """The cells of ``option``'s row in the Markdown's panel table, by column."""
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| class |"))
    row = next(line for line in lines if line.startswith("| ") and f"| `{option}`" in line and "| class |" not in line)
    return dict(zip(header.strip("| ").split(" | "), row[2:-2].split(" | ")))


def test_the_new_columns_are_in_every_table(tmp_path):
    module = _module()
    text, page, rows = _render(tmp_path, {"a": _ppl("a", 2.2, 24.0)})
    new = ("ci95_low", "ci95_high", "tie_group", "kld_mean", "top1_agreement", "flag")
    assert set(new) <= set(module.COLUMNS) and set(new) <= set(rows[0])
    assert all(f"| {c} |" in text and f"<th>{c}</th>" in page for c in new)


def test_old_rows_without_per_window_data_render_with_empty_cells(tmp_path):
    """Rows from before the intervals (no lists, no intervals, no KL): the new cells are empty, the leaders line is
    as before, and the page says why."""
    text, page, rows = _render(tmp_path, {"a": _ppl("a", 2.2, 24.0), "b": _ppl("b", 2.3, 25.0)})
    cells = _cells(text, "a")
    assert [cells[c] for c in ("ci95_low", "ci95_high", "tie_group", "kld_mean", "top1_agreement", "flag")] == [""] * 6
    assert "Leaders: 2 bits: `a` (+20.0 %), `b` (+25.0 %)." in text
    note = "Rows without per-window data (runs that did not keep it) have no interval or tie group."
    assert note in text and note in page
    assert {r["tie_group"] for r in rows} == {""} and {r["ci95_low"] for r in rows} == {""}


def test_tie_groups_from_a_paired_bootstrap_over_the_windows(tmp_path):
    """In one bit class: ``a`` and ``b`` differ by +-1 nat per window (noise: group 1, the leaders tied), ``c`` is
    0.3 nats per token worse on every window (group 2), ``d`` kept no windows (no group); ``e`` alone in its class
    leads group 1 there. The interval, KL and top-1 agreement of the panel's protocol are shown."""
    noise = [1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, 0.5]
    reference = _windowed("fp16", 32.0, [n - 5 for n in BASE_NLL], reference=True)
    rows = {"a": [reference, _windowed("a", 2.2, BASE_NLL, kld_mean_chunked=0.0123, top1_agreement_chunked=0.9512,
                                       kld_mean_streaming=9.0)],
            "b": [reference, _windowed("b", 2.3, [n + d for n, d in zip(BASE_NLL, noise)])],
            "c": [reference, _windowed("c", 2.1, [n + 30 for n in BASE_NLL])],
            "d": [reference, _ppl("d", 2.2, 24.0)[1]],
            "e": [reference, _windowed("e", 4.0, [n + 50 for n in BASE_NLL])]}
    text, page, csv_rows = _render(tmp_path, rows)
    groups = {r["codec"]: r["tie_group"] for r in csv_rows}
    assert groups == {"fp16": "1", "a": "1", "b": "1", "c": "2", "d": "", "e": "1"}
    assert "Leaders: 2 bits: `a` (+5.1 %) = `b` (+5.3 %), not significant; 4 bits: `e` (+73.3 %)." in text
    a = _cells(text, "a")
    low, high = (float(a[c]) for c in ("ci95_low", "ci95_high"))
    assert low < float(a["metric"]) < high and a["kld_mean"] == "0.0123" and a["top1_agreement"] == "0.9512"
    assert _cells(text, "fp16")["kld_mean"] == ""  # the reference is what the others are measured against
    assert "tie_group: within a bit class" in text and "tie_group: within a bit class" in page


def test_tie_groups_of_ruler_rows_from_the_pooled_scores(tmp_path):
    """Per-sample scores of 4 tasks x 5 samples: ``b`` differs from ``a`` on three samples (group 1), ``c`` scores
    0 where ``a`` scores 100 (group 2), ``d``'s tasks have other sample counts (no test, no group)."""
    a = {task: [100.0, 100.0, 100.0, 0.0, 100.0] for task in ("t1", "t2", "t3", "t4")}
    b = {**a, "t1": [0.0, 100.0, 100.0, 100.0, 100.0], "t2": [100.0, 0.0, 100.0, 0.0, 100.0]}
    c = {task: [0.0] * 5 for task in a}
    d = {task: s[:4] for task, s in a.items()}
    reference = _scored("fp16", a, reference=True)
    _, _, rows = _render(tmp_path, {name: [reference, _scored(name, scores)]
                                    for name, scores in (("a", a), ("b", b), ("c", c), ("d", d))})
    groups = {r["codec"]: r["tie_group"] for r in rows if r["reference"] == "False"}
    assert groups == {"a": "1", "b": "1", "c": "2", "d": ""}


def test_a_flagged_row_is_marked_escaped_ranked_and_never_a_leader(tmp_path, capsys):
    """The best row of its class carries the gate's flag: its reason shows escaped (Markdown, page), it keeps its
    place and tie group, and the leaders are the next rows. A flag that is not a string makes the row invalid."""
    reason = "kld_mean_chunked 1.31 > 0.5 <b>|</b>"
    reference = _windowed("fp16", 32.0, BASE_NLL, reference=True)
    text, page, rows = _render(tmp_path, {
        "f": [reference, _windowed("f", 2.2, [n + 1 for n in BASE_NLL], flag=reason)],
        "g": [reference, _windowed("g", 2.3, [n + 30 for n in BASE_NLL], flag=None)],
        "h": [reference, _windowed("h", 2.4, [n + 60 for n in BASE_NLL])],
        "n": [reference, _windowed("n", 2.1, BASE_NLL, flag=3)]})
    assert "| ⚠ kld_mean_chunked 1.31 &gt; 0.5 &lt;b&gt;\\|&lt;/b&gt; |" in text and "<b>" not in text
    assert "⚠ kld_mean_chunked 1.31 &gt; 0.5 &lt;b&gt;|&lt;/b&gt;</td>" in page and "<b>" not in page
    assert "<tr class='front flagged'" in page and "⚠: the run&#x27;s degenerate-output gate flagged the row" in page
    assert "Leaders: 2 bits: `g` (+35.0 %), `h` (+82.2 %)." in text  # not `f`, though it is the best
    assert [r["codec"] for r in rows if r["reference"] == "False"] == ["f", "g", "h"]  # ranked, in order
    assert next(r for r in rows if r["codec"] == "f")["flag"] == reason
    assert "| m | perplexity:x / perplexity (chunked) | `n` | flag is 3, not a string |" in text
    assert "flag is 3, not a string" in capsys.readouterr().err


def test_an_interval_that_misses_its_value_makes_the_row_invalid(tmp_path):
    bad = {**_windowed("a", 2.2, BASE_NLL), "ppl_chunked_ci95": [1.0, 2.0]}
    reference = _windowed("fp16", 32.0, BASE_NLL, reference=True)
    text, _, rows = _render(tmp_path, {"a": [reference, bad], "b": [reference, _windowed("b", 2.2, BASE_NLL)]})
    assert f"| `a` | ppl_chunked_ci95 [1.0, 2.0] does not contain ppl_chunked {bad['ppl_chunked']} |" in text
    assert [r["codec"] for r in rows] == ["fp16", "b"]


def test_a_hybrid_models_rows_get_a_second_panel_by_their_full_attention_layers_bits(tmp_path):
    """Gemma-like rows: every layer's bits put both codecs near 28 (the sliding-window layers hold their window in
    the model's dtype); the second panel places them by the full-attention layers' bits, in their own classes. A
    model without sliding-window layers gets one panel."""
    module = _module()

    def hybrid(row: dict, full: float) -> dict:
        return {**row, "bits_per_value_full_attention": full, "bits_per_value_sliding_attention": 32.0}

    reference, a = _ppl("a", 27.8, 24.0, model="g")
    _, b = _ppl("b", 28.5, 23.0, model="g")
    members = {"a": [hybrid(reference, 32.0), hybrid(a, 2.2)], "b": [hybrid(reference, 32.0), hybrid(b, 7.9)],
               "plain": _ppl("plain", 2.2, 22.0)}
    _, _, rows = _render(tmp_path, members)
    panels = {(r["model"], r["panel"]) for r in rows}
    second = f"perplexity:x / perplexity (chunked) {module.FULL_ATTENTION_PANEL}"
    assert panels == {("g", "perplexity:x / perplexity (chunked)"), ("g", second),
                      ("m", "perplexity:x / perplexity (chunked)")}
    classes = {(r["codec"], r["panel"] == second): r["class"] for r in rows if r["model"] == "g"}
    assert classes == {("fp16", False): "16", ("a", False): "16", ("b", False): "16",
                       ("fp16", True): "16", ("a", True): "2", ("b", True): "8"}


def test_the_same_rows_give_the_same_page_and_a_panel_of_the_reference_alone_renders(tmp_path):
    """The page's SVG ids come from a fixed salt (two renderings of one sweep are byte-equal), and a panel whose only
    placed row is the reference (every codec invalid or failed) still draws."""
    module = _module()
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    _member(sweep, "kivi", 3.0, 4.8, 25.0, 40.0, 30.0)
    pages = []
    for out in (tmp_path / "a", tmp_path / "b"):
        module.main([str(sweep), "--out", str(out)])
        pages.append((out / "index.html").read_text())
    assert pages[0] == pages[1] and pages[0].count("<svg") == 2
    reference = {"metric_name": "ppl_chunked", "measured_bits": 32.0, "reference": True, "metric": 20.0,
                 "option": "fp16"}
    assert module.plot_svg([reference], "m: perplexity").startswith("<svg")
