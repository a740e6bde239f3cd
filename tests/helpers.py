"""Helpers the test modules share: tiny random models, spies on the cache's reads, stand-in tokenizers, Hydra
composition, and the held-bytes walk (fixtures live in ``conftest.py``; toy codecs in ``toy_codecs.py``)."""

import contextlib
import random
from pathlib import Path
from unittest import mock

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvcomp.cache import install
from kvcomp.cache.memory import held_nbytes
from kvcomp.codecs import Codec, ModelInfo

ROOT = Path(__file__).resolve().parents[1]  # the repository
CONF = ROOT / "conf"

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def build_tiny(config_cls, model_cls, **extra):
    """A tiny random model of ``TINY``'s shape, ``extra`` overriding it (seed 0), kvcomp attention installed."""
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY, **extra})).eval()
    install(model)
    return model


FAMILIES = {  # family: (config class, model class, config overrides)
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),  # q/k/v biases
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}


@contextlib.contextmanager
def reads_taken():
    """``(layer index, what update_in_context returned)`` of every compressed layer's forward in the block: ``tuple``
    (plain SDPA), ``Streaming``, ``FromSegments`` or ``FusedDecode`` (:mod:`kvcomp.cache.reads`); a layer whose
    rows are grouped by padding (:class:`~kvcomp.cache.rows.ByRows`) gives one entry per row group."""
    from kvcomp.cache.layer import CompressedLayer
    from kvcomp.cache.rows import ByRows

    taken, original = [], CompressedLayer.update_in_context

    def spy(self, key_states, value_states, step, query=None):
        read = original(self, key_states, value_states, step, query)
        parts = [r for _, r, _ in read.reads] if isinstance(read, ByRows) else [read]
        taken.extend((self.layer_idx, type(r).__name__) for r in parts)
        return read

    with mock.patch.object(CompressedLayer, "update_in_context", spy):
        yield taken


def encode_with_torch(monkeypatch) -> None:
    """Codebook encodes take the torch path under ``kernel_backend="triton"`` (the Triton interpreter would take
    minutes; ``test_decode_attention.py`` checks the kernel against it)."""
    import kvcomp.codecs.codebook as codebook

    original = codebook.encode_codebook
    monkeypatch.setattr(codebook, "encode_codebook", lambda quantizer, z, codebooks, backend="torch": original(quantizer, z, codebooks))


def load_script(path: str):
    """The script at ``path`` from the repository root (``scripts/*.py``, ``experiments/*/render.py``: not a package)
    as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def info_of(model) -> ModelInfo:
    return ModelInfo.from_hf_config(model.config)


def held_bytes(root, exclude: set[int]) -> int:
    """Bytes the cache holds, the codec (model-level state) left out."""
    return held_nbytes(root, exclude, skip=(Codec,))


def word_tokenizer():
    """A word-level tokenizer of the tiny vocabulary (``w0``..): fast, offline, saved with a model folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(TINY["vocab_size"] - 2)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")


class ByteTokenizer:
    """A tokenizer double: one token per UTF-8 byte (exactness must hold for any tokenizer)."""

    chat_template = None
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode())}

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode(errors="replace")


def haystack():
    """Five seeded essays of 200 sentences over ten words: a RULER haystack without the essay corpus."""
    rng = random.Random(0)
    words = "alpha beta gamma delta river stone cloud field light north".split()
    return [" ".join(" ".join(rng.choices(words, k=rng.randint(5, 15))).capitalize() + "." for _ in range(200))
            for _ in range(5)]


def compose_config(*overrides, hydra_config=False):
    """``conf/config.yaml`` composed with ``overrides`` (with Hydra's own node when ``hydra_config``)."""
    from hydra import compose, initialize_config_dir

    from kvcomp.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=hydra_config)
