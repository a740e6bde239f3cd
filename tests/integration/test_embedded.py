"""Integration tests on the embedded SmolLM2-135M (fetched by scripts/setup.sh)."""

import csv
import io
import json

import pytest
import torch

from kvcomp.cache import CompressedCache
from kvcomp.codecs import ModelInfo, build_codec
from kvcomp.paths import cache_dir
from tests.run_py import THREADS, run_py

pytestmark = pytest.mark.integration


def _long_prompts(tokenizer):
    from kvcomp.data import load_corpus

    article = load_corpus("enwiki", "evaluation")[3]
    ids = tokenizer(article)["input_ids"]
    texts = [tokenizer.decode(ids[:300]), tokenizer.decode(ids[400:640])]
    return tokenizer(texts, return_tensors="pt", padding=True)


@torch.no_grad()
def test_generate_through_compressed_cache(embedded):
    model, tokenizer = embedded
    batch = _long_prompts(tokenizer)
    assert (batch["attention_mask"][1] == 0).any()  # the second prompt is left padded
    kwargs = dict(**batch, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    info = ModelInfo.from_hf_config(model.config)
    plain = model.generate(**kwargs)
    assert torch.equal(model.generate(**kwargs, past_key_values=CompressedCache(build_codec({"name": "fp16"}, info))), plain)

    cache = CompressedCache(build_codec({"name": "kivi", "bits": 4}, info))
    kivi = model.generate(**kwargs, past_key_values=cache)
    assert cache.layers[0].key_stream.num_encoded >= 256 and cache.nbytes < 0.5 * 2 * 30 * 3 * 64 * 4 * kivi.shape[1] * 2
    # fluent: the plain model finds the KIVI-4 continuation about as likely as its own greedy one
    prompt_len = batch["input_ids"].shape[1]
    def continuation_nll(sequences):
        logits = model(sequences, attention_mask=torch.ones_like(sequences)).logits[:, prompt_len - 1 : -1]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), sequences[:, prompt_len:].flatten()).item()
    assert continuation_nll(kivi) < continuation_nll(plain) + 1.0
    assert (kivi[:, prompt_len : prompt_len + 4] == plain[:, prompt_len : prompt_len + 4]).float().mean() >= 0.5


def test_temporalkv_end_to_end_calibrates_once(embedded, tmp_path):
    """`run.py codec=temporalkv` on a small calibration: sane perplexity, then the artifact is reused."""
    args = ["codec=temporalkv", "codec.bits=2", "codec.kmeans_iters=5", "codec.hybrid=off",
            "calibration.num_samples=4", "calibration.seq_len=256", "benchmark.seq_len=256",
            "benchmark.num_windows=2", f"hardware.threads={THREADS}"]
    private = tmp_path / "cache"  # an empty artifact store that shares the fetched assets
    private.mkdir()
    for shared in ("models", "corpora", "tokens"):
        (private / shared).symlink_to(cache_dir() / shared)
    first = run_py(*args, f"hydra.run.dir={tmp_path / 'a'}", cwd=tmp_path, KVCOMP_CACHE=str(private))
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_py(*args, f"hydra.run.dir={tmp_path / 'b'}", cwd=tmp_path, KVCOMP_CACHE=str(private))
    assert second.returncode == 0, second.stderr[-3000:]
    results = [json.loads((tmp_path / d / "results.json").read_text()) for d in "ab"]
    assert results[0]["calibration"]["reused"] is False and results[1]["calibration"]["reused"] is True
    fp16, temporal = results[1]["rows"]
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


def test_run_py_ruler_rows_per_length(embedded, tmp_path):
    result = run_py("benchmark=ruler", "benchmark.tasks=[niah_single_1,vt]", "benchmark.lengths=[512,768]",
                  "benchmark.num_samples=1", "benchmark.max_new_tokens=16", f"hardware.threads={THREADS}",
                  f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["codec"].split("(")[0], r["length"]) for r in rows] == [("fp16", 512), ("fp16", 768), ("kivi", 512), ("kivi", 768)]
    assert all({"acc_niah_single_1", "acc_vt", "acc_avg"} <= set(r) and len(r["predictions"]["vt"]) == 1 for r in rows)
    assert "acc_niah_single_1" in result.stdout


@pytest.mark.parametrize("preset, tasks", [("longbench", "[longbench_hotpotqa,longbench_passage_count]"), ("aime", "[aime24]")])
def test_run_py_lm_eval_presets_on_fixtures(embedded, tmp_path, preset, tasks):
    """The presets run offline on the fixtures through lm-eval, with the compressed cache."""
    result = run_py(f"benchmark={preset}", f"benchmark.tasks={tasks}", "benchmark.limit=1", "benchmark.max_gen_toks=8",
                  "benchmark.data=fixtures", f"hardware.threads={THREADS}", f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) == 2 and all(r["benchmark"].startswith(f"{preset}:fixtures") for r in rows)
    task_names = tasks.strip("[]").split(",")
    assert all({f"score_{t}" for t in task_names} | {"score_avg"} <= set(r) for r in rows)


@torch.no_grad()
def test_qjl_presets_on_smollm2(embedded):
    """QJL at the paper's 3 and 5 bits on the real model (streaming protocol): more bits, lower perplexity,
    both within a sane distance of the uncompressed model, and the cache holds what the codec counts."""
    from kvcomp.codecs import expected_cache_bits
    from kvcomp.data import load_corpus
    from tests.helpers import compose_config

    model, tokenizer = embedded
    ids = tokenizer(" ".join(load_corpus("enwiki", "evaluation")[:2]), return_tensors="pt").input_ids[:, :384]
    info = ModelInfo.from_hf_config(model.config)

    def perplexity(codec):
        cache = CompressedCache(codec, "streaming")
        loss = model(ids, past_key_values=cache, labels=ids).loss
        assert 8 * cache.nbytes == expected_cache_bits(codec, ids.shape[1], 1, 32)
        return loss.exp().item()

    plain = perplexity(build_codec({"name": "fp16"}, info))
    three, five = (perplexity(build_codec(compose_config(f"codec=qjl_{b}bit_d64", hydra_config=True).codec, info)) for b in (3, 5))
    assert plain < five < three < 3 * plain


@torch.no_grad()
def test_fused_decode_attention_on_smollm2(embedded):
    """KIVI-2 decode steps read by the fused Triton kernel (interpreter) on the real model (GQA 3:1,
    head_dim 64, 30 layers): the same logits as the torch path, and no payload block is ever decoded."""
    from kvcomp.cache import install
    from kvcomp.data import load_corpus

    model, tokenizer = embedded
    ids = tokenizer(load_corpus("enwiki", "evaluation")[0], return_tensors="pt").input_ids[:, :200]
    codec = build_codec({"name": "kivi", "bits": 2}, ModelInfo.from_hf_config(model.config))

    def generate(backend):
        install(model, kernel_backend=backend)
        try:
            cache = CompressedCache(codec, "exact_prefill")
            out = model.generate(ids, max_new_tokens=2, do_sample=False, past_key_values=cache,
                                 output_logits=True, return_dict_in_generate=True)
        finally:
            install(model, kernel_backend="torch")
        return torch.stack(out.logits, dim=1), cache

    reference, _ = generate("torch")
    fused, cache = generate("triton")
    torch.testing.assert_close(fused, reference, rtol=1e-3, atol=1e-3)
    assert all(layer.key_stream.decoded.length == 0 and layer.value_stream.decoded.length == 0 for layer in cache.layers)
    assert cache.layers[0].key_stream.num_encoded == 128


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
                      f"hydra.run.dir={tmp_path / name}", cwd=tmp_path)
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


@pytest.mark.integration
def test_prefill_memo_benchmark_runs_and_agrees(embedded):
    from importlib import import_module

    body = import_module("benchmarks.bench_prefill_memo").main(["--tokens", "48", "--new", "3", "--codecs", "fp16", "kivi"])
    assert body.count("| yes |") == 2 and "| NO |" not in body
