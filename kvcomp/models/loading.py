"""Loading causal language models (embedded, Hugging Face hub, or local folder) and describing them."""

from __future__ import annotations

from pathlib import Path

import torch

from kvcomp.data.corpora import HubUnavailableError
from kvcomp.artifacts import ArtifactError, safetensors_problem
from kvcomp.errors import ConfigError, first_line, unknown_choice

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def load_model(source: str, *, hub_id: str | None = None, embedded: str | None = None, dtype: str = "float32", device: str = "cpu",
               attn_implementation: str | None = None, device_map: str | None = None,
               gpu_memory: str | None = None, cpu_memory: str | None = None):
    """Load ``(model, tokenizer)`` in eval mode.

    ``source``: ``"embedded"`` (the embedded model ``embedded`` from the kvcomp cache, fetched and
    converted on first use: ``smollm2_135m``, ``qwen25_coder_05b`` or ``gemma3_270m``),
    ``"hub"`` (the Hugging Face model ``hub_id``), or a local model folder. ``dtype``: one of
    ``float32``, ``bfloat16``, ``float16``, ``auto``. ``device_map`` (``auto``, ``balanced``,
    ``balanced_low_0``, ``sequential``) spreads whole decoder layers over the visible GPUs
    (:func:`plan_device_map`) instead of putting the model on ``device``. The tokenizer pads on the
    left, with the eos token when it has no pad token.
    """
    if dtype not in DTYPES:
        raise unknown_choice("dtype", dtype, DTYPES)
    check_device(device)
    location = model_location(source, hub_id, embedded=embedded)

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kwargs = {"dtype": DTYPES[dtype]}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if device_map is None and torch.device(device).type != "cpu":
        kwargs["device_map"] = device  # load straight onto the accelerator
    try:
        if device_map is not None:
            config = AutoConfig.from_pretrained(location)
            kwargs["device_map"] = plan_device_map(config, DTYPES[dtype], device_map, gpu_memory, cpu_memory)
        model = AutoModelForCausalLM.from_pretrained(location, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(location)
    except Exception as err:
        damaged = damaged_checkpoint(location)
        if damaged is not None:
            raise damaged from err
        if source == "hub":
            raise _hub_error(hub_id, err) from err
        if source != "embedded" and isinstance(err, (OSError, ValueError, KeyError)):
            raise ConfigError(
                f"model.source={source!r}: transformers cannot load this folder ({first_line(err)})"
            ) from err
        raise
    if "device_map" not in kwargs:
        model.to(device)
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer


def plan_device_map(config, dtype, strategy: str = "auto", gpu_memory: str | int | None = None,
                    cpu_memory: str | int | None = None, gpus: int | None = None) -> dict[str, str | int]:
    """Where each module of a model with HF ``config`` goes: accelerate's placement (``strategy``) over
    ``gpus`` GPUs (default: the visible ones) holding ``gpu_memory`` each (default: what each has free)
    and ``cpu_memory`` of CPU offload (default: none), never splitting a decoder layer. Computed on meta
    weights, so it needs no memory and no GPU."""
    from accelerate import init_empty_weights, infer_auto_device_map
    from accelerate.utils import get_balanced_memory, get_max_memory
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=None if dtype == "auto" else dtype)
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    memory = None
    if gpu_memory is not None or cpu_memory is not None or gpus is not None:
        free = get_max_memory()
        count = torch.cuda.device_count() if gpus is None else gpus
        memory = {i: gpu_memory if gpu_memory is not None else free.get(i, 0) for i in range(count)}
        memory["cpu"] = cpu_memory if cpu_memory is not None else 0
    if strategy == "sequential":
        memory = get_max_memory(memory)
    else:
        memory = get_balanced_memory(model, max_memory=memory, no_split_module_classes=no_split,
                                     dtype=None if dtype == "auto" else dtype, low_zero=strategy == "balanced_low_0")
    placement = infer_auto_device_map(model, max_memory=memory, no_split_module_classes=no_split,
                                      dtype=None if dtype == "auto" else dtype)
    if "disk" in placement.values():
        raise ConfigError(
            f"hardware.device_map={strategy}: the model does not fit in {memory} (modules "
            f"{[k for k, v in placement.items() if v == 'disk']} would go to disk); use more GPUs, raise "
            "hardware.gpu_memory, or offload to the CPU with hardware.cpu_memory"
        )
    return placement


def layer_devices(model) -> dict[int, str]:
    """``{decoder layer index: device}`` of a model loaded with a device map (empty otherwise). A map may
    name each layer or only the module holding all of them (``model.layers``)."""
    placement = getattr(model, "hf_device_map", None) or {}
    if not placement:
        return {}
    prefix = next((name.rsplit(".", 1)[0] for name, _ in model.named_modules() if name.endswith("layers.0")), "model.layers")
    layers = model.config.get_text_config().num_hidden_layers
    devices = {}
    for i in range(layers):
        owner = max((k for k in placement if k == "" or f"{prefix}.{i}" == k or f"{prefix}.{i}".startswith(k + ".")),
                    key=len, default=None)
        if owner is not None:
            device = placement[owner]
            devices[i] = f"cuda:{device}" if isinstance(device, int) else str(device)
    return devices


def model_location(source: str, hub_id: str | None = None, fetch: bool = True, embedded: str | None = None) -> str:
    """Where ``from_pretrained`` reads the model: the embedded folder, the hub id, or a checked local folder.

    Raises :class:`ConfigError` for a missing folder or one without a ``config.json``. ``fetch=False``
    does not download the embedded model ``embedded`` (its folder may then not exist yet)."""
    if source == "embedded":
        from kvcomp.data.assets import DEFAULT_MODEL, embedded_model_dir, ensure_embedded_model

        key = embedded or DEFAULT_MODEL
        return str(ensure_embedded_model(key) if fetch else embedded_model_dir(key))
    if source == "hub":
        if not hub_id:
            raise ConfigError("model source 'hub' needs model.hub_id (e.g. 'HuggingFaceTB/SmolLM2-135M-Instruct')")
        return hub_id
    folder = Path(source).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"model.source={source!r} is neither 'embedded', 'hub' (with model.hub_id) nor an existing folder"
        )
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"model.source={source!r} is a folder without config.json, not a Hugging Face model folder "
            "(save one with model.save_pretrained(folder) and tokenizer.save_pretrained(folder))"
        )
    return str(folder)


def damaged_checkpoint(location: str) -> ArtifactError | None:
    """An error naming the first weight file of a model folder (or of a hub id's cached snapshot) whose
    safetensors header cannot be read (truncated or garbled), with the remedy; None when all read."""
    from kvcomp.models.fingerprint import checkpoint_files, model_folder

    folder = model_folder(location)
    for path in checkpoint_files(folder) if folder is not None else []:
        problem = safetensors_problem(path) if path.suffix == ".safetensors" else None
        if problem is not None:
            remedy = ("copy or save the model into the folder again (model.save_pretrained)" if Path(location).is_dir()
                      else f"download it again: hf download {location} --force-download")
            return ArtifactError(f"model weight file {path} is damaged ({problem}); {remedy}")
    return None


def check_device(device: str) -> None:
    """Raise :class:`ConfigError` when ``device`` is not usable on this machine (checked before loading)."""
    kind = torch.device(device).type
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device {device!r} needs CUDA, but torch.cuda.is_available() is False on this machine "
            f"(torch {torch.__version__}); use hardware=cpu, or install a CUDA build of torch on a GPU machine"
        )
    if kind == "cuda" and torch.device(device).index is not None and torch.device(device).index >= torch.cuda.device_count():
        raise ConfigError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {device!r} needs Apple MPS, which this machine lacks; use hardware=cpu")


def _hub_error(hub_id: str, err: Exception) -> HubUnavailableError:
    """A readable error for a hub model that could not be fetched."""
    text = f"{type(err).__name__}: {err}"
    if "gated" in text.lower() or "401" in text or "403" in text:
        hint = ("the model is gated or private: accept its license on huggingface.co and set HF_TOKEN "
                "(or run `hf auth login`)")
    else:
        hint = ("the Hugging Face hub is unreachable or the model id is wrong; for gated models set HF_TOKEN; "
                "offline, use model source 'embedded' or a local folder")
    return HubUnavailableError(f"could not load hub model {hub_id!r}: {hint}. ({text})")


def model_summary(model) -> dict:
    """Architecture facts read from the model's (text) config, plus the parameter count."""
    from kvcomp.codecs.base import ModelInfo

    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    info = ModelInfo.from_hf_config(config)
    return {
        "model_type": text.model_type,
        "n_layers": info.num_layers,
        "n_heads": text.num_attention_heads,
        "n_kv_heads": info.num_kv_heads,
        "head_dim": info.head_dim,
        "hidden_size": text.hidden_size,
        "vocab_size": getattr(text, "vocab_size", None),
        "max_position_embeddings": getattr(text, "max_position_embeddings", None),
        "rope": info.has_rope,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
