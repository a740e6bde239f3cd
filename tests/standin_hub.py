"""A stand-in Hugging Face cache: tiny files under real hub repository ids and file names, for offline tests.

:func:`build_standin_hub` writes, inside a given ``HF_HOME``, the layout that ``hf download`` leaves and
``huggingface_hub`` reads with ``HF_HUB_OFFLINE=1``: ``hub/{models,datasets}--ORG--NAME/refs/main`` (a
commit id) and ``snapshots/<commit>/<repository files>``.

* Corpora (:data:`CORPUS_FILES`): the files ``kvcomp.data.corpora`` reads, in their real formats
  (parquet with a ``text`` column, gzip JSON lines, JSON lines), filled with a few thousand words of
  generated English-like text per split: enough for a few 64-token calibration windows and a short
  perplexity benchmark.
* Models (:data:`MODELS`): 2-layer random models (bfloat16 safetensors, a few MB) whose configs keep the
  real ones' architecture fields (architectures, RoPE settings, biases, sliding windows), with the
  embedded SmolLM2 tokenizer (vocabulary 49,152) in place of the real one.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

# --- corpora ------------------------------------------------------------------------------------
REDPAJAMA_SOURCES = ("arxiv", "book", "c4", "cc_2019-30", "cc_2020-05", "cc_2021-04", "cc_2022-05", "cc_2023-06",
                     "github", "stackexchange", "wikipedia")
CORPUS_FILES: dict[str, tuple[str, dict[str, str]]] = {
    # corpus: (dataset repository, {repository file: format})
    "wikitext2": ("Salesforce/wikitext", {
        "wikitext-2-raw-v1/train-00000-of-00001.parquet": "wikitext",
        "wikitext-2-raw-v1/validation-00000-of-00001.parquet": "wikitext",
        "wikitext-2-raw-v1/test-00000-of-00001.parquet": "wikitext",
    }),
    "c4": ("allenai/c4", {
        "en/c4-train.00000-of-01024.json.gz": "c4",
        "en/c4-validation.00000-of-00008.json.gz": "c4",
    }),
    "redpajama": ("togethercomputer/RedPajama-Data-1T-Sample",
                  {f"{source}_sample.jsonl": "redpajama" for source in REDPAJAMA_SOURCES}),
    "fineweb": ("HuggingFaceFW/fineweb", {"sample/10BT/000_00000.parquet": "fineweb"}),
}
DOCUMENTS_PER_FILE = 24
WORDS_PER_DOCUMENT = 120

_WORDS = ("the river city council north harbour season music station history village early modern "
          "school bridge army church market island railway report winter garden museum painter language "
          "family road castle forest coast century people village library engine team river valley "
          "festival theatre science county mountain industry summer journal trade island record").split()


def _paragraph(rng: random.Random, words: int) -> str:
    """Sentences of random words, capitalised and full-stopped."""
    out = []
    while words > 0:
        n = min(words, rng.randint(6, 14))
        sentence = " ".join(rng.choice(_WORDS) for _ in range(n))
        out.append(sentence[0].upper() + sentence[1:] + ".")
        words -= n
    return " ".join(out)


def _documents(label: str) -> list[str]:
    """``DOCUMENTS_PER_FILE`` distinct documents, each starting with ``label`` and its number."""
    rng = random.Random(label)
    return [f"{label} document {i}. {_paragraph(rng, WORDS_PER_DOCUMENT)}" for i in range(DOCUMENTS_PER_FILE)]


def _wikitext_rows(label: str) -> list[str]:
    """WikiText-2 raw rows: `` = Title = `` lines, `` = = Section = = `` lines, paragraphs, empty rows."""
    rng = random.Random(label)
    rows = [""]
    for i in range(DOCUMENTS_PER_FILE // 4):
        rows += [f" = {label} article {i} = \n", "", f" {_paragraph(rng, WORDS_PER_DOCUMENT)} \n", "",
                 " = = Section = = \n", "", f" {_paragraph(rng, WORDS_PER_DOCUMENT)} \n", ""]
    return rows


def _write_corpus_file(path: Path, kind: str, label: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "wikitext":
        pq.write_table(pa.table({"text": _wikitext_rows(label)}), path)
    elif kind == "fineweb":
        docs = _documents(label)
        pq.write_table(pa.table({
            "text": docs,
            "id": [f"<urn:uuid:{i:08d}>" for i in range(len(docs))],
            "dump": ["CC-MAIN-2024-10"] * len(docs),
            "url": [f"https://example.org/{i}" for i in range(len(docs))],
            "language": ["en"] * len(docs),
            "token_count": [len(d.split()) for d in docs],
        }), path)
    else:
        if kind == "c4":
            rows = [{"text": d, "timestamp": "2019-04-25T12:57:54Z", "url": f"https://example.org/{i}"}
                    for i, d in enumerate(_documents(label))]
        else:  # redpajama
            rows = [{"text": d, "meta": {"source": label}} for d in _documents(label)]
        data = "".join(json.dumps(row) + "\n" for row in rows).encode()
        path.write_bytes(gzip.compress(data, mtime=0) if path.name.endswith(".gz") else data)


def snapshot_dir(hf_home: str | Path, repo_id: str, repo_type: str = "model") -> Path:
    """The snapshot folder of ``repo_id`` in the stand-in cache, with ``refs/main`` pointing at it."""
    kind = {"model": "models", "dataset": "datasets"}[repo_type]
    root = Path(hf_home) / "hub" / f"{kind}--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(f"standin:{repo_id}".encode()).hexdigest()
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    return snapshot


def stage_corpus(hf_home: str | Path, name: str, skip: tuple[str, ...] = ()) -> Path:
    """Write the files of corpus ``name`` (except the repository files in ``skip``); return the snapshot."""
    repo, files = CORPUS_FILES[name]
    snapshot = snapshot_dir(hf_home, repo, "dataset")
    for filename, kind in files.items():
        if filename not in skip:
            _write_corpus_file(snapshot / filename, kind, f"{name} {Path(filename).name}")
    return snapshot


# --- models ---------------------------------------------------------------------------------------
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# 2 layers, GQA 2:1 heads of 64 channels (codecs' group sizes divide it); the embedding is the bulk of the file.
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=64, vocab_size=49152,  # the SmolLM2 tokenizer's vocabulary
             bos_token_id=1, eos_token_id=2)  # and its special tokens
MISTRAL_WINDOW = 32  # tokens; shorter than the test windows, so the window binds


def _llama32_1b():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **_TINY, hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
        attention_bias=False, mlp_bias=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "high_freq_factor": 4.0,
                         "low_freq_factor": 1.0, "original_max_position_embeddings": 8192},
    )
    return LlamaForCausalLM(config)


def _qwen25_3b():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(  # Qwen2 attention has q/k/v biases; head_dim is set (the real one derives it)
        **_TINY, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False, sliding_window=32768, max_window_layers=2,
    )
    return Qwen2ForCausalLM(config)


def _mistral_7b_v03():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        **_TINY, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        # The real Mistral-7B-v0.3 has sliding_window null (v0.1: 4096): the stand-in sets a short window
        # on every layer so that the sliding-window path (and codec.compress_sliding) is exercised.
        sliding_window=MISTRAL_WINDOW,
    )
    return MistralForCausalLM(config)


def _gemma3_1b_pt():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **_TINY, pad_token_id=0,
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=512, attention_bias=False,
        layer_types=["sliding_attention", "full_attention"],  # the real one: 5 sliding layers, then 1 full
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    )
    return Gemma3ForCausalLM(config)


MODELS = {
    "meta-llama/Llama-3.2-1B": _llama32_1b,
    "Qwen/Qwen2.5-3B": _qwen25_3b,
    "mistralai/Mistral-7B-v0.3": _mistral_7b_v03,
    "google/gemma-3-1b-pt": _gemma3_1b_pt,
}


def stage_model(hf_home: str | Path, repo_id: str, tokenizer_dir: str | Path, seed: int = 0) -> Path:
    """A tiny random model of :data:`MODELS` under ``repo_id`` (bfloat16 safetensors) with the tokenizer
    files of ``tokenizer_dir``; return its snapshot folder.

    Mistral is saved in shards with ``model.safetensors.index.json`` and, as the real repository,
    carries a ``consolidated.safetensors`` (Mistral's own tensor names) that transformers never loads.
    """
    torch.manual_seed(seed)
    model = MODELS[repo_id]().to(torch.bfloat16).eval()
    snapshot = snapshot_dir(hf_home, repo_id)
    mistral = repo_id.startswith("mistralai/")
    model.save_pretrained(snapshot, max_shard_size="4MB" if mistral else "1GB")
    if mistral:
        from safetensors.torch import save_file

        consolidated = {f"layers.{i}.attention.{name}.weight": getattr(layer.self_attn, proj).weight.detach().clone()
                        for i, layer in enumerate(model.model.layers)
                        for name, proj in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"))}
        save_file(consolidated, str(snapshot / "consolidated.safetensors"))
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copyfile(Path(tokenizer_dir) / name, snapshot / name)
    return snapshot


def build_standin_hub(hf_home: str | Path, tokenizer_dir: str | Path | None = None, *,
                      corpora: tuple[str, ...] = tuple(CORPUS_FILES), models: tuple[str, ...] = tuple(MODELS)) -> Path:
    """Stage ``corpora`` and ``models`` (with the tokenizer of ``tokenizer_dir``, by default the embedded
    SmolLM2 folder) in ``hf_home``; return ``hf_home``."""
    hf_home = Path(hf_home)
    for name in corpora:
        stage_corpus(hf_home, name)
    if models:
        if tokenizer_dir is None:
            from kvcomp.data.assets import embedded_model_dir

            tokenizer_dir = embedded_model_dir()
        for repo_id in models:
            stage_model(hf_home, repo_id, tokenizer_dir)
    return hf_home


def use_hub(monkeypatch, hf_home: str | Path, offline: bool = True) -> None:
    """Point huggingface_hub and datasets at the cache ``hf_home``, offline or not: the environment, and the
    constants both libraries read from it at import."""
    import datasets.config
    from huggingface_hub import constants

    home = Path(hf_home)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
        if offline and var != "TRANSFORMERS_OFFLINE":
            monkeypatch.setenv(var, "1")
    for name, value in {"HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_HUB_OFFLINE": offline}.items():
        monkeypatch.setattr(constants, name, value)
    datasets_cache = home / "datasets"
    for name, value in {
        "HF_HUB_OFFLINE": offline, "HF_DATASETS_OFFLINE": offline, "HF_CACHE_HOME": str(home),
        "HF_DATASETS_CACHE": datasets_cache, "HF_MODULES_CACHE": home / "modules",
        "DOWNLOADED_DATASETS_PATH": datasets_cache / "downloads",
        "EXTRACTED_DATASETS_PATH": datasets_cache / "downloads" / "extracted",
    }.items():
        monkeypatch.setattr(datasets.config, name, value)

