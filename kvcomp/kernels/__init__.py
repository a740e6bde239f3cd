"""Kernels, each beside its torch reference. Triton modules are imported only when a kernel is used
(triton is an optional dependency); the references run everywhere and are what the kernels are tested
against (under ``TRITON_INTERPRET=1`` on a CPU).

- ``formats``: the payload formats, one module each (its reader, torch decoding and kernel arguments) beside its
  Triton device functions; the readers are imported by the references and the Triton launchers, importing neither;
- ``decode_attention`` (reference, dispatch) / ``decode_attention_triton``: decode-step attention
  reading packed uniform/KIVI, codebook, QJL-sketch, float8 / int8 and NVFP4 payloads, split-K + merge;
- ``decode_plan``: a decode step's launches planned once and run by every layer, in a workspace kept across steps
  (with each launch's token bounds on the device); ``decode_graphs``: those launches captured in CUDA graphs;
  ``valid_tokens``: a step's mask and each sequence's span of valid tokens, which the kernels read instead;
- ``codebook_encode`` (dispatch) / ``codebook_encode_triton``: nearest-centroid coding fused with
  packing (reference: :meth:`kvcomp.stages.codebook.CodebookQuantizer.encode`);
- ``qjl_scores`` / ``qjl_scores_triton``: QJL attention logits from packed sign bits.

Outside the package, above it: the GPU benchmarks and their shared timing in ``benchmarks/``; a launch's registers,
spills, shared memory and occupancy compiled for sm_90 without a GPU (``tools.resources``) and a decode step's time
on an H100 predicted from the compiled code (``tools.static_model``) in ``tools/``.
"""

import contextlib
import os
from dataclasses import dataclass

import torch

from kvcomp.errors import ConfigError

KERNEL_BACKENDS = ("torch", "triton")  # "torch": the references; "triton": the fused kernels where they exist


@dataclass
class Launch:
    """One Triton kernel launch, built but not run: the jitted function, its grid and its arguments by name
    (run it with ``launch()``; :mod:`tools.resources` compiles it for a GPU that need not be here)."""

    kernel: object  # a triton.JITFunction
    grid: tuple
    args: dict

    def __call__(self) -> None:
        self.kernel[self.grid](**self.args)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the launch passes, within tuples too (a format's arguments are named tuples)."""
        found, pending = [], list(self.args.values())
        while pending:
            value = pending.pop()
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, tuple):
                pending.extend(value)
        return found


def launch_device(device: torch.device):
    """A context in which kernels launch on ``device``'s GPU (a model's layers may sit on several GPUs);
    none on the CPU (the Triton interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def sdpa_without_cudnn():
    """A context in which SDPA picks among its flash, memory-efficient and math kernels only. On an H200
    with torch 2.11, SDPA dispatches bf16 decode steps to cuDNN, which builds a plan for every new sequence
    length: 37 ms per decode step of a 4-layer Llama-3.1-8B-shaped model at batch 8 x 16K, against 3.4 ms
    with flash (``benchmarks/profile_decode_step.py``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def loads_float8() -> bool:
    """Whether the fused kernels may load float8 values (fp8 caches, NVFP4 block scales, TurboQuant's k8 keys):
    Triton converts them from sm_89 (Ada, Hopper) on, and under its CPU interpreter."""
    return not torch.cuda.is_available() or torch.cuda.get_device_capability() >= (8, 9)


def check_kernel_backend(backend: str, device: str) -> None:
    """Raise :class:`ConfigError` when ``backend`` cannot run on ``device`` (Triton needs CUDA, or its
    CPU interpreter switched on with ``TRITON_INTERPRET=1``)."""
    if backend != "triton":
        return
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise ConfigError("kernel_backend=triton needs the triton package: pip install 'kvcomp[triton]'") from exc
    if not str(device).startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(
            f"kernel_backend=triton runs on a CUDA device, but the device is {device!r} "
            "(use hardware=cpu, or TRITON_INTERPRET=1 to run the kernels slowly on the CPU)"
        )
