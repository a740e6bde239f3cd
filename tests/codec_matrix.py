"""The codec test matrix: one entry per registered codec, read by every test that runs all codecs.

A new codec joins with one entry here (``tests/codecs/test_codec_matrix.py`` fails until it does); it is then
checked for the round trip through the cache, formula vs measured bytes, state save/load and the
mismatch error, batch maps and beam search (``test_codec_matrix.py``), generation with left padding on
tiny Llama / Qwen2 / Mistral (``test_left_padding.py``), the memory walk on the torch, fused and
decode-per-step paths (``test_memory.py``), and the fused decode path against the torch path where the
codec has one (``test_decode_attention.py``, ``test_qjl_kernel.py``).
"""

from dataclasses import dataclass, field

import torch

from kvcomp.calibration import CalibrationData, calibrate
from kvcomp.codecs import build_codec
from kvcomp.config import CalibrationConfig
from tests.helpers import info_of

QJL_TINY = {
    "name": "qjl", "sketch_dim": 32, "outlier_sketch_dim": 16, "initial_layers": 1, "initial_sketch_dim": 48,
    "initial_outlier_sketch_dim": 8, "outlier_channels": 2, "group_size": 4, "key_buffer": 8,
    "value_group_size": 8, "value_window": 6,
}
# power-of-two sketches and 16-token groups: the fused decode-attention kernel reads the sign bits
QJL_FUSED = {**QJL_TINY, "initial_sketch_dim": 64, "group_size": 16, "key_buffer": 16}
CALIBRATION = CalibrationConfig(num_samples=8, seq_len=72)


@dataclass(frozen=True)
class Entry:
    """``config``: the codec on tiny models (small blocks, so that 40 tokens encode several);
    ``fitted``: calibrated on the tiny model first; ``error``: bound on the relative RMS error of cached
    keys and values after a round trip through the cache."""

    config: dict = field(default_factory=dict)
    fitted: bool = False
    error: float = 0.0


MATRIX = {
    "fp16": Entry({"name": "fp16"}),
    "uniform": Entry({"name": "uniform", "bits": 2, "group_size": 8, "window": 4, "sinks": 2}, error=0.3),
    "kivi": Entry({"name": "kivi", "group_size": 8, "residual_length": 16}, error=0.3),
    "qjl": Entry(QJL_TINY, error=0.5),
    "temporalkv": Entry({"name": "temporalkv", "sinks": 4, "kmeans_iters": 10}, fitted=True, error=0.3),
    "channelkv": Entry({"name": "channelkv", "sinks": 4, "kmeans_iters": 10}, fitted=True, error=0.3),
    "kvquant": Entry({"name": "kvquant", "sinks": 4, "kmeans_iters": 10}, fitted=True, error=0.4),
    "higgs": Entry({"name": "higgs", "bits": 2, "sinks": 2, "buffer": 8}, error=0.4),
    "aquakv": Entry({"name": "aquakv", "bits": 2, "sinks": 2, "buffer": 8}, fitted=True, error=0.4),
    "kvtc": Entry({"name": "kvtc", "cr": 4, "rank": 64, "group_sizes": [1, 16], "sinks": 2, "window": 4,
                   "every": 4, "calibration_drop_first": 2}, fitted=True, error=0.5),
    "csr": Entry({"name": "csr", "sparsity": 4, "atoms": 32, "online_atoms": 8, "guard_fraction": 0.5, "epochs": 2,
                  "batch_size": 256, "kmeans_iters": 5, "merged_groups": "auto"}, fitted=True, error=0.5),
    "fp8": Entry({"name": "fp8", "tensor_scale": "calibrated"}, fitted=True, error=0.1),
    "int_token_head": Entry({"name": "int_token_head", "bits": 4}, error=0.3),
    "nvfp4": Entry({"name": "nvfp4", "global_scale": "calibrated"}, fitted=True, error=0.3),
    "kvarn": Entry({"name": "kvarn", "tile": 8, "sinks": 4}, error=0.4),
    "turboquant": Entry({"name": "turboquant", "variant": "prod", "key_bits": 3, "value_bits": 3}, error=0.6),
    "eden": Entry({"name": "eden", "key_bits": 2, "value_bits": 2, "scale": "unbiased"}, error=0.5),
    "oscar": Entry({"name": "oscar", "sinks": 2, "window": 4, "flush_block": 4}, fitted=True, error=0.5),
}


def calibration_windows(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 96, (8, 72), generator=torch.Generator().manual_seed(seed))


def make_codec(model, name: str, path=None, **overrides):
    """The matrix entry's codec for ``model`` (calibrated on it when the entry says so)."""
    entry = MATRIX[name]
    codec = build_codec({**entry.config, **overrides}, info_of(model))
    if entry.fitted:
        torch.manual_seed(0)  # fits that draw from the global generator (k-means inits) give one artifact, whoever fits first
        windows = calibration_windows()
        calibrate(codec, CALIBRATION, lambda: CalibrationData(model, None, windows, None).activations(codec), path)
    return codec


def fitted(model, name, **overrides):
    """Codebook codec ``name`` (KVQuant, ChannelKV, TemporalKV) calibrated on ``model``, 10 k-means iterations."""
    codec = build_codec({"name": name, "kmeans_iters": 10, **overrides}, info_of(model))
    windows = calibration_windows()
    calibrate(codec, CALIBRATION, lambda: CalibrationData(model, None, windows, None).activations(codec))
    return codec
