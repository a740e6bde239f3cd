"""Experiment configs (conf/experiment/**), the transcribed TemporalKV thesis tables and their renderer.

Fast: configs are composed with Hydra's compose API (no model is loaded) and the renderer reads fake
results.json files written in a temporary folder.
"""

import json
import re
from pathlib import Path

import pytest
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from kvcomp.codecs import codec_config
from kvcomp.config import BENCHMARKS, register_configs, typed
from kvcomp.experiments.temporalkv_paper import TABLES, thesis_bits, thesis_name
from tests.helpers import CONF, compose_config, load_script

EXPERIMENTS = sorted(p.relative_to(CONF / "experiment").with_suffix("").as_posix() for p in (CONF / "experiment").rglob("*.yaml"))
register_configs()


def _experiment_override(name: str) -> str:
    """``experiment=NAME`` when config.yaml lists an experiment slot, else ``experiment=NAME``."""
    listed = any("experiment" in str(entry) for entry in OmegaConf.load(CONF / "config.yaml").defaults)
    return f"{'' if listed else '+'}experiment={name}"


def _jobs(cfg, *extra) -> list[list[str]]:
    """The override lists Hydra's basic sweeper would launch (sweep params, then command-line ``extra``)."""
    params = [f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items()] + list(extra)
    return BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(params), None)[0]


def _covering(jobs: list[list[str]]) -> list[list[str]]:
    """Jobs (in sweep order) until every swept ``key=value`` has been composed once."""
    seen, chosen = set(), []
    for job in jobs:
        if not set(job) <= seen:
            chosen.append(job)
            seen |= set(job)
    return chosen


def test_experiments_exist():
    assert {"temporalkv/table6_7_embedded", "temporalkv/table6_c4", "temporalkv/table10_12_ruler"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_and_its_sweep_parses(name):
    override = _experiment_override(name)
    cfg = compose_config(override, hydra_config=True)
    HydraConfig.instance().cfg = None  # Hydra's basic sweeper reads the sweep folder before it sets its config
    assert cfg.hydra.sweep.dir == f"multirun/{name}"  # stated once, in config.yaml: no experiment file names it
    HydraConfig.instance().set_config(cfg)
    assert "sweep" not in OmegaConf.load(CONF / "experiment" / f"{name}.yaml").get("hydra", {})
    # the base config's exclusions hold for experiments too (none restates or narrows them)
    assert list(cfg.hydra.job.config.override_dirname.exclude_keys) == ["force", "experiment", "plot.x", "plot.y"]
    jobs = _jobs(cfg)
    assert len(jobs) >= 2
    for job in _covering(jobs):
        run = compose_config(override, *job, hydra_config=True)
        codec = codec_config(run.codec)  # validates against the codec's dataclass
        for item in job:  # every swept value reaches the composed config
            key, value = item.split("=", 1)
            if key == "model":
                assert run[key].name == value
            elif key == "codec":  # a codec or one of its presets (qjl_3bit, kivi_4bit, int8_token_head, ...)
                assert _codec_of(value) == run.codec.name
            elif key.startswith("codec."):
                got = getattr(codec, key.split(".", 1)[1])
                assert got == float(value) if isinstance(got, float) else str(got).lower() == value.lower()
        benchmark = typed("benchmark", run.benchmark, BENCHMARKS[run.benchmark.name].config_class)
        if run.benchmark.name != "perplexity":
            continue
        if name.startswith("kvtc/"):  # model scope: fed one compression event (16 tokens) per forward
            assert benchmark.protocols == ["chunked"] and benchmark.chunk_tokens == 16 == getattr(codec, "every", 16)
            continue
        if name.startswith("aquakv/") or name in ("qwen/centering", "qwen/aquakv_ablations"):
            # AQUA-KV's protocol: 32-token steps; the paper's tables: 256 x 8192 RedPajama, 8192 windows
            assert "chunked" in benchmark.protocols and benchmark.chunk_tokens == 32
            if run.model.source != "embedded":
                assert (run.calibration.name, run.calibration.num_samples, run.calibration.seq_len) == ("redpajama", 256, 8192)
                assert benchmark.seq_len == 8192 and benchmark.dataset == "wikitext2" and run.hardware.name == "h100"
            continue
        if name.startswith("baselines_2026/"):  # one protocol for every codec, kvtc included
            assert benchmark.protocols == ["chunked"] and benchmark.chunk_tokens == 16 and run.model.source == "embedded"
            continue
        if name.startswith("leaderboard/"):  # one protocol for every codec, kvtc included (its preset's settings)
            assert benchmark.protocols == ["chunked"] and benchmark.chunk_tokens == 16
            continue
        if name.startswith("eviction/"):  # one protocol for presses, codecs and their compositions
            assert benchmark.protocols == ["context"] and benchmark.context_tokens == 768 and run.model.source == "embedded"
            for item in job:
                if item.startswith("press"):
                    key, value = item.split("=", 1)
                    assert str(run.press[key.split(".")[1]] if "." in key else run.press.name) == value
            continue
        if name.startswith("csr/") and run.model.source != "embedded":  # NeuralDict tables: the spec's §5.1 calibration
            assert (run.calibration.name, run.calibration.num_samples, run.calibration.seq_len) == ("wikitext2", 256, 2048)
            assert run.hardware.name == "h100" and run.codec.merged_groups == "paper"
            continue
        assert set(benchmark.protocols) == {"simulated", "streaming"}
        if run.model.source == "embedded":  # the offline counterparts run with the defaults
            assert run.hardware.device == "cpu" and run.calibration.name == "enwiki"
            assert benchmark.dataset == ("ptb" if "ptb" in name else "enwiki")  # Tables 8-9: PTB, as the thesis
        else:  # the thesis' setup (spec §4): 64 x 2048 Wikitext-2 calibration, 2048-token windows, a GPU
            assert (run.calibration.name, run.calibration.num_samples, run.calibration.seq_len) == ("wikitext2", 64, 2048)
            assert benchmark.seq_len == 2048 and run.hardware.name == "h100"


def _codec_of(option: str) -> str:
    """The codec a ``conf/codec`` option composes: the one whose schema its base file names, or that of the preset
    it extends."""
    node = OmegaConf.load(CONF / "codec" / f"{option}.yaml")
    schema = [str(d).removeprefix("schema_") for d in node.defaults if str(d).startswith("schema_")]
    if schema:
        return schema[0]
    return _codec_of(next(d for d in node.defaults if d != "_self_"))


def test_thesis_sweeps_cover_the_thesis_tables():
    sizes = {"table6_c4": 27, "table7_c4_outliers": 27, "table8_ptb": 27, "table9_ptb_outliers": 27,
             "table2_fisher": 4, "table4_sinks": 6, "table10_12_ruler": 18, "table6_7_embedded": 18, "table2_embedded": 4, "table4_embedded": 2}
    for name, size in sizes.items():
        cfg = compose_config(_experiment_override(f"temporalkv/{name}"), hydra_config=True)
        assert len(_jobs(cfg)) == size, name
    # command-line values replace swept ones (the 1-bit, 8B-only RULER command relies on it)
    assert _jobs(compose_config(_experiment_override("temporalkv/table6_c4"), hydra_config=True), "model=llama31_8b", "codec.bits=1") == [
        ["model=llama31_8b", f"codec={c}", "codec.bits=1"] for c in ("kvquant", "channelkv", "temporalkv")]
    assert compose_config(_experiment_override("temporalkv/table7_c4_outliers"), hydra_config=True).codec.outliers == 0.01
    assert compose_config(_experiment_override("temporalkv/table9_ptb_outliers"), hydra_config=True).benchmark.dataset == "ptb"
    assert compose_config(_experiment_override("temporalkv/table2_fisher"), hydra_config=True).model.hub_id == "togethercomputer/LLaMA-2-7B-32K"


def test_ruler_experiment_has_the_thesis_settings():
    """Tables 10-12: lm-eval's RULER at 8192 tokens, 12 tasks, 1% outliers, simulated prefill, generated
    tokens uncompressed (the thesis' code)."""
    cfg = compose_config(_experiment_override("temporalkv/table10_12_ruler"), hydra_config=True)
    benchmark = typed("benchmark", cfg.benchmark, BENCHMARKS[cfg.benchmark.name].config_class)
    assert benchmark.name == "ruler_lmeval" and benchmark.metadata == {"max_seq_lengths": [8192]}
    assert len(benchmark.tasks) == 12 and "ruler_qa_squad" in benchmark.tasks and benchmark.limit is None
    assert (benchmark.protocol, benchmark.compress_generated, benchmark.data) == ("simulated", False, "hub")
    assert cfg.codec.outliers == 0.01 and cfg.hydra.sweeper.params["codec.bits"] == "4,2"


# ------------------------------------------------------------------------------------------------
# the transcribed thesis tables
# ------------------------------------------------------------------------------------------------
def test_thesis_names_and_bits():
    assert thesis_name("temporalkv", 2, 0.01) == "TempKV-4-2bit-1%"
    assert thesis_name("channelkv", 4) == "ChanKV-2-4bit"
    assert thesis_name("kvquant", 1) == "KVQuant-1bit"
    assert thesis_bits(4, 0.01) == 4.16 and thesis_bits(1) == 1


def test_thesis_tables_transcription():
    for number in (6, 7, 8, 9):
        table = TABLES[number]
        assert len(table.rows) == 9 and all(len(v) == 3 for v in table.rows.values())
        assert {k[2] for k in table.rows} == {0.01 if number in (7, 9) else 0.0}
    assert TABLES[6].rows[("temporalkv", 2, 0.0)]["llama31_8b"] == 10.82
    assert TABLES[7].rows[("temporalkv", 1, 0.01)]["llama32_1b"] == 25.39
    assert TABLES[9].rows[("kvquant", 4, 0.01)]["llama31_8b"] == TABLES[9].rows[("temporalkv", 4, 0.01)]["llama31_8b"]
    # Table 4 with the column labels corrected: fp16 sinks (sinks=8) is the Table 6 default run.
    assert TABLES[4].rows[("temporalkv", 2, 8)] == {m: TABLES[6].rows[("temporalkv", 2, 0.0)][m] for m in TABLES[4].models}
    assert TABLES[2].rows[("temporalkv", 1, True)] == {"llama2_7b_32k": 7.83}
    assert TABLES[2].label(("temporalkv", 1, False)) == "TempKV-8-1bit w/o Fisher"
    assert TABLES[10].rows[("temporalkv", 1, 0.01)] == {"llama31_8b": 16.07}


# ------------------------------------------------------------------------------------------------
# the renderer
# ------------------------------------------------------------------------------------------------
def _renderer():
    return load_script("experiments/temporalkv/render.py")


FP16_ROW = {"model": "smollm2_135m", "codec": "fp16()", "benchmark": "perplexity:enwiki/evaluation 32x512",
            "bits_per_value": 16.0, "paper_bits_per_value": 16.0, "ppl_streaming": 20.5, "ppl_simulated": 20.5}


def _fake_run(root: Path, name: str, bits: int, outliers: float, ppl: float, **codec) -> None:
    codec = {"name": name, "bits": bits, "outliers": outliers, "fisher": True, "sinks": 8, **codec}
    row = {**FP16_ROW, "codec": f"{name}(bits={bits})", "bits_per_value": bits + 0.5,
           "paper_bits_per_value": thesis_bits(bits, outliers), "ppl_streaming": ppl, "ppl_simulated": ppl + 1,
           "cache_bytes_per_window": 1000}
    folder = root / f"codec={name},codec.bits={bits},codec.outliers={outliers},{len(list(root.iterdir()))}"
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({"config": {"codec": codec}, "rows": [FP16_ROW, row]}))


def test_render_tables_6_and_7(tmp_path):
    sweep = tmp_path / "multirun"
    sweep.mkdir()
    for outliers, shift in ((0.0, 0.0), (0.01, -1.0)):
        _fake_run(sweep, "kvquant", 2, outliers, 40.0 + shift)
        _fake_run(sweep, "channelkv", 2, outliers, 30.0 + shift)
        _fake_run(sweep, "temporalkv", 2, outliers, 25.0 + shift)
        _fake_run(sweep, "temporalkv", 4, outliers, 21.0 + shift)
    _fake_run(sweep, "temporalkv", 2, 0.0, 99.0, fisher=False)  # a Table 2 run: not in Table 6
    out = tmp_path / "tables.md"
    text = _renderer().main([str(sweep), "--table", "6", "--table", "7", "--out", str(out)])
    assert out.read_text() == text
    table6, table7 = text.split("### Table 7:")
    assert "### Table 6: C4 PPL, no outlier removal" in table6 and "`smollm2_135m`" in table6
    assert "| float16 | 16 | 16.000 | 20.500 | 20.500 | 9.17 | 10.75 | 11.21 |" in table6
    assert "| TempKV-4-2bit | 2.00 | 2.500 | 26.000 | 25.000 | 10.82 | 13.42 | 15.71 |" in table6
    assert "| KVQuant-1bit | 1.00 |  |  |  | 33.24 | 51.47 | 197.14 |" in table6  # not measured: thesis only
    assert "99.000" not in text and "4 of the thesis' 9 configurations" in table6
    # 2 bits: ours TempKV < ChanKV < KVQuant; the thesis agrees on 8B and 1B, KVQuant wins 3B.
    assert ("| 2 | TempKV < ChanKV < KVQuant | TempKV < ChanKV < KVQuant | TempKV < KVQuant < ChanKV | "
            "KVQuant < TempKV < ChanKV | TempKV < ChanKV < KVQuant | 2/3 / 2/3 |") in table6
    assert "| TempKV-4-2bit-1% | 2.16 | 2.500 | 25.000 | 24.000 | 9.90 | 11.72 | 15.27 |" in table7
    assert "| 1 |  |  | TempKV < ChanKV < KVQuant |" in table7 and "| - / - |" in table7


def test_render_ablations_and_empty_tables(tmp_path):
    sweep = tmp_path / "multirun"
    sweep.mkdir()
    _fake_run(sweep, "temporalkv", 2, 0.0, 25.0, fisher=True)
    _fake_run(sweep, "temporalkv", 2, 0.0, 27.0, fisher=False)
    _fake_run(sweep, "temporalkv", 2, 0.0, 90.0, sinks=0)
    text = _renderer().render(sweep, [2, 4, 7])
    assert "| TempKV-4-2bit w/o Fisher | 2.00 | 2.500 | 28.000 | 27.000 | 6.77 |" in text
    assert "| 2 | w/ Fisher < w/o Fisher | w/ Fisher < w/o Fisher | w/ Fisher < w/o Fisher | 1/1 / 1/1 |" in text
    assert "| TempKV-4-2bit compressed sinks | 2.00 | 2.500 | 91.000 | 90.000 | 145.77 | 104.21 | 92.32 |" in text
    assert "| TempKV-4-2bit fp16 sinks | 2.00 | 2.500 | 26.000 | 25.000 | 10.82 |" in text
    assert "### Table 7: C4 PPL, 1 % outlier removal, 256 x 2048\n\n(no run below" in text


QJL_PRESETS = [  # preset, target bits per value, model shape (layers, kv heads, head_dim)
    ("qjl_3bit", 3.0, (32, 8, 128)), ("qjl_4.3bit", 4.3, (32, 8, 128)), ("qjl_5bit", 5.0, (32, 8, 128)),
    ("qjl_3bit_d64", 3.0, (30, 3, 64)), ("qjl_4.3bit_d64", 4.3, (30, 3, 64)), ("qjl_5bit_d64", 5.0, (30, 3, 64)),
    ("kivi_4bit", 5.0, (30, 3, 64)), ("kivi", 3.0, (30, 3, 64)),
]


@pytest.mark.parametrize("preset,bits,shape", QJL_PRESETS, ids=lambda p: str(p))
def test_bit_matched_presets_cost_the_bits_they_claim(preset, bits, shape):
    """QJL's paper settings (3 / 4.3 / 5 bits) and their KIVI partners, every stored bit counted."""
    from kvcomp.codecs import ModelInfo, build_codec

    codec = build_codec(compose_config(f"codec={preset}", hydra_config=True).codec, ModelInfo("m", *shape))
    assert codec.bits_per_value() == pytest.approx(bits, abs=0.015)


def test_csr_paper_configs_have_the_paper_settings():
    table1 = compose_config(_experiment_override("csr/table1_longbench"), hydra_config=True)
    assert table1.model.hub_id == "meta-llama/Llama-2-7b-chat-hf" and table1.benchmark.max_length == 4096
    assert len(table1.benchmark.tasks) == 11 and table1.codec.merged_groups == "paper"
    assert table1.benchmark.protocol == "exact_prefill"  # the prompt attended exactly, then coded (C11)
    table2 = compose_config(_experiment_override("csr/table2_longbench"), hydra_config=True)
    assert table2.model.hub_id == "meta-llama/Meta-Llama-3-8B-Instruct" and table2.benchmark.max_length == 7500
    online = compose_config(_experiment_override("csr/table7_online"), hydra_config=True)
    assert online.benchmark.tasks == table1.benchmark.tasks
    assert str(online.hydra.sweeper.params["codec.online_atoms"]).split(",") == ["0", "256", "512"]
    mse = compose_config(_experiment_override("csr/table3_4_dictionary_mse"), "codec.value_chunks=4", "codec.train_key_sparsity=4", hydra_config=True)
    typed_codec = codec_config(mse.codec)
    assert (typed_codec.key_chunks, typed_codec.train_value_sparsity) == (4, 4)  # keys and values at one (s, s_n)


def test_a_sweep_without_an_experiment_gets_a_dated_folder():
    cfg = compose_config("codec=kivi", hydra_config=True)
    HydraConfig.instance().cfg = None  # as when Hydra's basic sweeper reads it
    assert re.fullmatch(r"multirun/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d", cfg.hydra.sweep.dir)


def test_render_gives_each_outlier_rule_its_own_table(tmp_path):
    """Runs of codec.outlier_rule=reference are not rows of the token_topk table: each rule gets a table, named."""
    sweep = tmp_path / "multirun"
    sweep.mkdir()
    _fake_run(sweep, "temporalkv", 2, 0.01, 25.0)
    _fake_run(sweep, "temporalkv", 2, 0.01, 26.0, outlier_rule="reference")
    text = _renderer().render(sweep, [7])
    topk, reference = text.split("### Table 7: ")[1:]
    assert topk.startswith("C4 PPL, 1 % outlier removal, 256 x 2048 (outlier_rule=token_topk)")
    assert reference.startswith("C4 PPL, 1 % outlier removal, 256 x 2048 (outlier_rule=reference)")
    assert "| TempKV-4-2bit-1% | 2.16 | 2.500 | 26.000 | 25.000 |" in topk
    assert "| TempKV-4-2bit-1% | 2.16 | 2.500 | 27.000 | 26.000 |" in reference
    alone = tmp_path / "alone"
    alone.mkdir()
    _fake_run(alone, "temporalkv", 2, 0.01, 26.0, outlier_rule="reference")
    assert "### Table 7: C4 PPL, 1 % outlier removal, 256 x 2048 (outlier_rule=reference)" in _renderer().render(alone, [7])


def test_render_baselines_ranks_by_class_then_perplexity(tmp_path):
    module = load_script("experiments/baselines_2026/render.py")
    fp16 = {"model": "m", "codec": "fp16()", "ppl_chunked": 20.0}

    def member(option, bits, ppl, center=None):
        folder = tmp_path / f"{option}-{center}"
        folder.mkdir()
        row = {"model": "m", "codec": "x()", "bits_per_value": bits, "bits_per_value_measured": bits + 1,
               "encoded_share": 0.5, "ppl_chunked": ppl}
        overrides = [f"codec={option}", "model=m"] + ([f"codec.center={center}"] if center else [])
        (folder / "results.json").write_text(json.dumps({"config": {"codec": {"name": "x"}}, "overrides": overrides,
                                                         "rows": [fp16, row]}))

    member("kivi", 3.0, 25.0)
    member("turboquant", 3.25, 22.0, center="bias")
    member("fp8", 8.0, 20.2)
    member("oscar", 2.5, 30.0)
    lines = [line for line in module.render(tmp_path).splitlines() if line.startswith("| ") and "class" not in line]
    assert [line.split(" | ")[1] for line in lines] == ["`fp8`", "`turboquant center=bias`", "`kivi`", "`oscar`"]
    assert lines[1] == "| 3 | `turboquant center=bias` | 3.250 | 4.250 | 0.50 | 22.000 | +10.0 % |"
    assert module.bit_class(2.5) == 2 and module.bit_class(5.0) == 4 and module.bit_class(6.25) == 8


def test_render_eviction_puts_presses_codecs_and_compositions_on_one_byte_axis(tmp_path):
    module = load_script("experiments/eviction/render.py")
    fp16 = {"model": "m", "codec": "fp16()", "ppl_context": 20.0, "bits_per_value_measured": 32.0}

    def member(name, codec, press, ratio, seen, held, ppl, budgets="uniform"):
        folder = tmp_path / name
        folder.mkdir()
        share = 0.0 if codec == "fp16" else 0.9  # kivi: 90 % encoded at 2 bits, the rest in float32
        row = {"model": "m", "codec": f"{codec}()", "bits_per_value_measured": held, "ppl_context": ppl,
               "encoded_share": share, "code_bits_per_value": 2.0, "state_bits_per_value": 0.0}
        if press != "none":
            row |= {"press": f"{press}(ratio={ratio})", "press_ratio": ratio, "bits_per_value_seen": seen}
        overrides = [f"codec={codec}", "model=m"] + ([f"press={press}", f"press.ratio={ratio}"] if press != "none" else [])
        config = {"codec": {"name": codec}, "press": {"name": press, "head_budgets": budgets}}
        (folder / "results.json").write_text(json.dumps({"config": config, "overrides": overrides, "rows": [fp16, row]}))

    member("a", "fp16", "snapkv", 0.5, 20.0, 32.0, 24.0)
    member("b", "kivi", "none", 0.0, None, 5.0, 22.0)
    member("c", "kivi", "knorm", 0.5, 3.0, 5.0, 30.0)
    member("d", "fp16", "snapkv", 0.5, 20.0, 32.0, 23.0, budgets="adakv")
    lines = [line for line in module.render(tmp_path).splitlines() if line.startswith("| ") and "kind" not in line]
    assert [line.split(" | ")[0] for line in lines] == ["| composed", "| quantization", "| eviction", "| eviction"]
    assert lines[1] == "| quantization | - | 0.00 | `kivi` | 3.40 | 5.00 | 5.00 | 22.000 | +10.0 % |"  # 0.9 x 2 + 0.1 x 16
    assert lines[2] == "| eviction | `snapkv adakv` | 0.50 | `fp16` | 10.00 | 20.00 | 32.00 | 23.000 | +15.0 % |"
    assert lines[3] == "| eviction | `snapkv` | 0.50 | `fp16` | 10.00 | 20.00 | 32.00 | 24.000 | +20.0 % |"
    assert [p.name for p in module.plot(tmp_path, tmp_path)] == ["eviction_m.png"]


def test_render_baselines_ranks_ruler_rows_best_first_in_points(tmp_path):
    module = load_script("experiments/baselines_2026/render.py")
    fp16 = {"model": "m", "codec": "fp16()", "acc_avg": 40.0}
    for option, bits, acc in (("kivi", 3.0, 20.0), ("turboquant", 3.25, 30.0)):
        folder = tmp_path / option
        folder.mkdir()
        row = {"model": "m", "codec": "x()", "bits_per_value": bits, "acc_avg": acc}  # no measured bits recorded
        (folder / "results.json").write_text(json.dumps({"config": {"codec": {"name": option}}, "rows": [fp16, row],
                                                         "overrides": [f"codec={option}"]}))
    lines = [line for line in module.render(tmp_path).splitlines() if line.startswith("| 3")]
    assert lines == ["| 3 | `turboquant` | 3.250 |  |  | 30.000 | -10.0 pts |", "| 3 | `kivi` | 3.000 |  |  | 20.000 | -20.0 pts |"]
