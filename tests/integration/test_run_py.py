"""``python run.py`` on the embedded SmolLM2-135M: perplexity runs end to end (calibration reused, sweeps with failing
members, a reference per model fingerprint) and the one-line error style."""

import csv
import io
import json

import pytest
import torch

from kvcomp.paths import cache_dir
from tests.run_py import THREADS, run_py

pytestmark = pytest.mark.integration


def test_temporalkv_end_to_end_calibrates_once(embedded, tmp_path):
    """`run.py codec=temporalkv` on a small calibration: sane perplexity, then the artifact is reused (by a run of
    one protocol: the calibration does not depend on the benchmark)."""
    args = ["codec=temporalkv", "codec.bits=2", "codec.kmeans_iters=2", "codec.hybrid=off",
            "calibration.num_samples=4", "calibration.seq_len=128", "benchmark.seq_len=128",
            "benchmark.num_windows=2", f"hardware.threads={THREADS}"]
    private = tmp_path / "cache"  # an empty artifact store that shares the fetched assets
    private.mkdir()
    for shared in ("models", "corpora", "tokens"):
        (private / shared).symlink_to(cache_dir() / shared)
    first = run_py(*args, f"hydra.run.dir={tmp_path / 'a'}", cwd=tmp_path, KVCOMP_CACHE=str(private))
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_py(*args, "benchmark.protocols=[streaming]", f"hydra.run.dir={tmp_path / 'b'}", cwd=tmp_path,
                    KVCOMP_CACHE=str(private))
    assert second.returncode == 0, second.stderr[-3000:]
    results = [json.loads((tmp_path / d / "results.json").read_text()) for d in "ab"]
    assert results[0]["calibration"]["reused"] is False and results[1]["calibration"]["reused"] is True
    assert results[1]["rows"][1]["ppl_streaming"] == results[0]["rows"][1]["ppl_streaming"]  # the same codebooks
    fp16, temporal = results[0]["rows"]
    assert temporal["paper_bits_per_value"] == 2.0 and temporal["bits_per_value"] == 2.0
    for protocol in ("streaming", "simulated"):
        assert fp16[f"ppl_{protocol}"] < temporal[f"ppl_{protocol}"] < 2 * fp16[f"ppl_{protocol}"]
        for row in (fp16, temporal):  # intervals over the 2 windows, in results.json only
            low, high = row[f"ppl_{protocol}_ci95"]
            assert low <= row[f"ppl_{protocol}"] <= high and len(row[f"nll_{protocol}"]) == 2
        low, high = temporal[f"ppl_{protocol}_vs_reference_ci95"]
        assert low <= temporal[f"ppl_{protocol}"] / fp16[f"ppl_{protocol}"] - 1 <= high
    assert temporal["cache_bytes_per_window"] == pytest.approx(temporal["cache_bytes_expected"])
    assert "ci95" not in first.stderr + first.stdout  # the printed table shows the point values


SMALL = ["benchmark.num_windows=2", "benchmark.seq_len=128", f"hardware.threads={THREADS}"]


def test_sweep_survives_a_bad_member_and_keeps_every_dtype(embedded, tmp_path):
    """`-m codec.bits=9,2 hardware.dtype=float32,bfloat16`: the invalid members are recorded as failed, the
    valid ones run, the summary holds a row per member (each dtype with its own reference), exit code 1."""
    sweep = tmp_path / "sweep"
    result = run_py("-m", "codec=kivi", "codec.bits=9,2", "hardware.dtype=float32,bfloat16", *SMALL,
                  f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "is invalid: kivi (keys): bits=9 is not supported" in result.stderr  # checked before any member ran
    assert "Traceback" not in result.stderr
    rows = list(csv.DictReader(io.StringIO((sweep / "summary.csv").read_text())))
    kept = sorted((r["codec"].split("(")[0], r["codec.bits"], r["hardware.dtype"], r["status"]) for r in rows)
    assert kept == [("fp16", "2", "bfloat16", "ok"), ("fp16", "2", "float32", "ok"),
                    ("kivi", "2", "bfloat16", "ok"), ("kivi", "2", "float32", "ok"),
                    ("kivi", "9", "bfloat16", "failed"), ("kivi", "9", "float32", "failed")]
    ppl = {(r["codec"][:4], r["hardware.dtype"]): float(r["ppl_streaming"]) for r in rows if r["status"] == "ok"}
    assert ppl[("fp16", "float32")] != ppl[("fp16", "bfloat16")]
    assert "bits=9 is not supported" in (sweep / "summary.md").read_text()
    assert str(tmp_path) not in (sweep / "summary.md").read_text()  # paths relative to the sweep folder


def test_a_perturbed_model_under_the_same_name_gets_its_own_reference(embedded, tmp_path):
    """SmolLM2 with 4 MLP layers zeroed, run as `model.source=<folder>` under the embedded model's name:
    its own fp16 perplexity (not the cached one of the real model) and its own fingerprint."""
    model, tokenizer = embedded
    folder = tmp_path / "perturbed"
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for layer in model.model.layers[10:14]:
            layer.mlp.down_proj.weight.zero_()
    try:
        model.save_pretrained(folder)
    finally:
        model.load_state_dict(state)
    tokenizer.save_pretrained(folder)
    runs = {}
    for name, source in (("real", "embedded"), ("perturbed", str(folder))):
        result = run_py("codec=kivi", f"model.source={source}", "model.name=smollm2_135m", *SMALL,
                        "benchmark.protocols=[streaming]", f"hydra.run.dir={tmp_path / name}", cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = json.loads((tmp_path / name / "results.json").read_text())
    assert runs["real"]["model"]["name"] == runs["perturbed"]["model"]["name"] == "smollm2_135m"
    assert runs["real"]["model"]["fingerprint"] != runs["perturbed"]["model"]["fingerprint"]
    real, perturbed = (runs[n]["rows"][0] for n in ("real", "perturbed"))
    assert real["codec"] == perturbed["codec"] == "fp16()" and real["reference_key"] != perturbed["reference_key"]
    assert perturbed["ppl_streaming"] > 1.5 * real["ppl_streaming"]


def test_user_errors_print_one_line_and_bugs_keep_tracebacks(tmp_path):
    result = run_py("benchmark.batch_size=0", f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "kvcomp error: benchmark.batch_size=0 is out of range; valid: an integer >= 1" in result.stderr
    full = run_py("benchmark.batch_size=0", f"hydra.run.dir={tmp_path}", cwd=tmp_path, HYDRA_FULL_ERROR="1")
    assert full.returncode != 0 and "Traceback" in full.stderr
