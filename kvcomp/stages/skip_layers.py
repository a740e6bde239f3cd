"""Layers a codec leaves in the model's dtype: vLLM's ``--kv-cache-dtype-skip-layers`` and the boundary layers
of its TurboQuant presets (the first and last ``boundary`` layers of a dense model stay in bf16).

A codec returns ``StreamPolicy(block_size=None)`` for these layers (never encoded) and counts them at
:data:`SKIPPED_BITS` per value in its nominal bits, as vLLM stores them.
"""

from __future__ import annotations

from kvcomp.errors import ConfigError

SKIPPED_BITS = 16  # bf16, as vLLM keeps skipped layers


def skipped_layers(layers: list[int], boundary: int, num_layers: int, owner: str) -> frozenset[int]:
    """``layers`` (indices; negative ones count from the end) plus the first and last ``boundary`` layers of a
    model with ``num_layers`` codec layers."""
    if boundary < 0 or 2 * boundary >= num_layers:
        raise ConfigError(f"{owner}: boundary_layers={boundary} must be >= 0 and leave a layer to compress "
                          f"(the model has {num_layers} layers)")
    bad = [i for i in layers if not -num_layers <= i < num_layers]
    if bad:
        raise ConfigError(f"{owner}: skip_layers {bad} are not layers of this model (valid: 0..{num_layers - 1}, or "
                          f"-{num_layers}..-1 from the end)")
    ends = list(range(boundary)) + list(range(num_layers - boundary, num_layers))
    return frozenset(i % num_layers for i in [*layers, *ends])
