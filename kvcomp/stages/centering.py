"""Per-channel offsets subtracted before a per-token quantizer (kvcomp's option ``center``, not in the papers).

A codec that normalises each token by its norm (HIGGS, AQUA-KV's residuals) or rotates it codes the whole
vector. When a layer's keys sit on a constant offset much larger than their per-token deviation (Qwen2.5's
k_proj biases: 10-51x on some layers), the norm is the offset's and the deviation, which attention needs, is
lost in the quantization error. ``center`` subtracts one vector per layer and stream before coding and adds it
back after decoding (``x = c + Q(x - c)``):

- ``none``: nothing (the papers' and their code's behaviour, the default);
- ``calibration``: the per-channel mean of what the quantizer codes, over the calibration tokens;
- ``bias``: the model's k_proj / v_proj bias (pre-RoPE keys: the exact constant part of every key).

The vectors (``[kv_heads, head_dim]`` per layer and stream, float32) are part of the fitted state and counted
in the codec's overhead bits.
"""

from __future__ import annotations

import torch

from kvcomp.errors import ConfigError

CENTERS = ("none", "calibration", "bias")


def channel_mean(x: torch.Tensor) -> torch.Tensor:
    """The per-channel mean ``[H, D]`` of ``x [samples, H, tokens, D]`` (float32)."""
    return x.float().mean(dim=(0, 2))


def model_bias(biases: dict | None, layer: int, kind: str, owner: str) -> torch.Tensor:
    """Layer ``layer``'s k_proj (``kind="key"``) or v_proj bias ``[H, D]`` from the calibration's
    :attr:`~kvcomp.codecs.base.Activations.biases`; refused for a model without them."""
    if not biases or layer not in biases or kind not in biases[layer]:
        raise ConfigError(f"{owner}: center=bias needs the model's k_proj/v_proj biases, and this model has none "
                          "(e.g. Llama); use center=calibration or center=none")
    return biases[layer][kind].float()


def fit_offsets(activations, center: str, layers, kinds, owner: str) -> "Offsets":
    """The vector of every ``(layer, kind)`` of ``layers`` x ``kinds`` from a codec's calibration
    :class:`~kvcomp.codecs.base.Activations`: the calibration mean (``center="calibration"``) or the model's bias."""
    vectors = {}
    for layer in layers:
        fields = activations.layer(layer) if center == "calibration" else {}
        for kind in kinds:
            vectors[(layer, kind)] = (channel_mean(fields[kind]) if center == "calibration"
                                      else model_bias(activations.biases, layer, kind, owner))
    return Offsets(vectors)


class Offsets:
    """The centring vectors of a codec, by ``(layer, kind)``; :meth:`remove` and :meth:`restore` apply them to
    ``[B, H, T, D]`` blocks (vectors missing for a layer and kind: nothing is applied)."""

    def __init__(self, vectors: dict[tuple[int, str], torch.Tensor] | None = None):
        self.vectors = dict(vectors or {})
        self.on_device: dict = {}

    def on(self, layer: int, kind: str, device: torch.device) -> torch.Tensor | None:
        """The vector of ``(layer, kind)``, float32 ``[H, D]`` on ``device`` (copied there once), or None."""
        vector = self.vectors.get((layer, kind))
        if vector is None:
            return None
        key = (layer, kind, device)
        if key not in self.on_device:
            self.on_device[key] = vector.to(device, torch.float32).contiguous()
        return self.on_device[key]

    def remove(self, x: torch.Tensor, layer: int, kind: str) -> torch.Tensor:
        """``x - c`` (float32)."""
        c = self.on(layer, kind, x.device)
        return x.float() if c is None else x.float() - c[None, :, None, :]

    def restore(self, x: torch.Tensor, layer: int, kind: str) -> torch.Tensor:
        """``x + c`` (float32)."""
        c = self.on(layer, kind, x.device)
        return x.float() if c is None else x.float() + c[None, :, None, :]

    def tensors(self) -> dict[str, torch.Tensor]:
        """For a :class:`~kvcomp.codecs.base.CodecState`: ``layer{l}.{kind}.center``."""
        return {f"layer{layer}.{kind}.center": v for (layer, kind), v in self.vectors.items()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "Offsets":
        vectors = {}
        for name, t in tensors.items():
            parts = name.split(".")
            if len(parts) == 3 and parts[2] == "center" and parts[0].startswith("layer"):
                vectors[(int(parts[0].removeprefix("layer")), parts[1])] = t
        return cls(vectors)

    @property
    def bits(self) -> int:
        """Storage of the vectors (float32)."""
        return 32 * sum(v.numel() for v in self.vectors.values())
