"""Shared fixtures: tiny random models of two families, and the embedded model when it is set up."""

import contextlib
import dataclasses
import os
from unittest import mock

os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels run on CPU tensors; must precede any triton import
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from kvcomp.cache import install  # noqa: E402
from kvcomp.codecs import ModelInfo  # noqa: E402

torch.set_num_threads(1)


def _patch_the_language_once_per_kernel() -> None:
    """Triton's interpreter patches the language modules a function sees (``triton.language``, or ``core`` for its
    own jitted helpers) for a kernel's run, then again at every device-function call inside it, though they are
    already patched (``inspect.getmembers`` over each: about 40 % of a kernel test's time). Here a call inside a
    running kernel patches only modules not yet patched in that run; the kernel's own patch and its restore, and
    any call outside a kernel, run as before. An interpreter without these functions (another Triton) runs
    unchanged."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    if not all(hasattr(interpreter, name) for name in ("_LangPatchScope", "_patch_lang", "GridExecutor")):
        return
    patch, run, running = interpreter._patch_lang, interpreter.GridExecutor.__call__, []  # per running kernel: ids of
    # the language modules patched in it

    def patch_once(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if running and langs <= running[-1]:
            return interpreter._LangPatchScope()
        if running:
            running[-1].update(langs)
        return patch(fn)

    def run_kernel(self, *args, **kwargs):
        running.append(set())
        try:
            return run(self, *args, **kwargs)
        finally:
            running.pop()

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = run_kernel


def _skip_the_discarded_overflow_checks() -> None:
    """Triton's interpreter runs with ``debug`` off, so its ``device_assert`` discards every check, yet with
    ``sanitize_overflow`` on (its default) every integer add, sub and mul is still redone in int64 and compared to
    the type's bounds only to build the discarded assert (about 40 % of a kernel test's time). Here the interpreter's
    builders start with ``sanitize_overflow`` off whenever ``debug`` is off: every value a kernel computes is the
    same. An interpreter without these names (another Triton) runs unchanged."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or "sanitize_overflow" not in getattr(interpreter.InterpreterOptions, "__dataclass_fields__", {}):
        return
    init = builder.__init__

    def skip_checks(b):
        if not b.options.debug:
            b.options = dataclasses.replace(b.options, sanitize_overflow=False)

    builder.__init__ = lambda self, *args, **kwargs: init(self, *args, **kwargs) or skip_checks(self)
    for existing in (v for v in vars(interpreter).values() if isinstance(v, builder)):  # the module's own builder
        skip_checks(existing)


_patch_the_language_once_per_kernel()
_skip_the_discarded_overflow_checks()

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _tiny(config_cls, model_cls, **extra):
    torch.manual_seed(0)
    model = model_cls(config_cls(**TINY, **extra)).eval()
    install(model)
    return model


FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),  # q/k/v biases
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}


@pytest.fixture
def session_cache(tmp_path_factory, monkeypatch):
    """``KVCOMP_CACHE`` in the session's temporary folder (one per xdist worker, shared by the modules that use it,
    ``pytestmark = pytest.mark.usefixtures("session_cache")``): calibration artifacts and K/V collections of tiny
    models are reused across those modules and never reach the user's cache. They are keyed by the model's name
    (tiny models have no fingerprint): a test that changes a model's weights gives it its own name."""
    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path_factory.getbasetemp() / "kvcomp-cache"))


@pytest.fixture(scope="session", params=list(FAMILIES))
def tiny_model(request):
    """A tiny random model (GQA 2:1, head_dim 16) of each family, kvcomp attention installed."""
    config_cls, model_cls, extra = FAMILIES[request.param]
    return _tiny(config_cls, model_cls, **extra)


@pytest.fixture(scope="session")
def tiny_llama():
    return _tiny(LlamaConfig, LlamaForCausalLM)


@contextlib.contextmanager
def reads_taken():
    """``(layer index, what update_in_step returned)`` of every compressed layer's forward in the block: ``tuple``
    (plain SDPA), ``Streaming``, ``FromSegments`` or ``FusedDecode`` (:mod:`kvcomp.cache.reads`); a layer whose
    rows are grouped by padding (:class:`~kvcomp.cache.rows.ByRows`) gives one entry per row group."""
    from kvcomp.cache.compressed_cache import CompressedLayer
    from kvcomp.cache.rows import ByRows

    taken, original = [], CompressedLayer.update_in_step

    def spy(self, key_states, value_states, step, query=None):
        read = original(self, key_states, value_states, step, query)
        parts = [r for _, r, _ in read.parts] if isinstance(read, ByRows) else [read]
        taken.extend((self.layer_idx, type(r).__name__) for r in parts)
        return read

    with mock.patch.object(CompressedLayer, "update_in_step", spy):
        yield taken


def encode_with_torch(monkeypatch) -> None:
    """Codebook encodes take the torch path under ``kernel_backend="triton"`` (the Triton interpreter would take
    minutes; ``test_decode_attention.py`` checks the kernel against it)."""
    import kvcomp.codecs.codebook as codebook

    original = codebook.encode_codebook
    monkeypatch.setattr(codebook, "encode_codebook", lambda quantizer, z, codebooks, backend="torch": original(quantizer, z, codebooks))


def load_script(name: str):
    """``scripts/{name}.py`` as a module (the scripts are not a package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def info_of(model) -> ModelInfo:
    return ModelInfo.from_hf_config(model.config)


@pytest.fixture(scope="session")
def embedded():
    """``(model, tokenizer)`` of the embedded SmolLM2-135M; skips when scripts/setup.sh has not fetched it."""
    from kvcomp.data.assets import embedded_assets_ready
    from kvcomp.models import load_model

    if not embedded_assets_ready():
        pytest.skip("embedded assets not fetched (run scripts/setup.sh)")
    model, tokenizer = load_model("embedded", dtype="float32", device="cpu")
    install(model)
    return model, tokenizer
