"""Shared fixtures: tiny random models of three families, and the embedded model when it is set up."""

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels run on CPU tensors; must precede any triton import
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvcomp.cache import install  # noqa: E402
from tests.helpers import FAMILIES, build_tiny  # noqa: E402

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
    return build_tiny(config_cls, model_cls, **extra)


@pytest.fixture(scope="session")
def tiny_llama():
    return build_tiny(LlamaConfig, LlamaForCausalLM)


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
