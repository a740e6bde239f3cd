"""Two processes calibrating the same codec at once end with one valid artifact, fitted once."""

import multiprocessing
import time

import torch

from kvcomp.calibration import artifact_path, calibrate
from kvcomp.codecs import Calibrated, Codec, CodecConfig, CodecState, ModelInfo, StreamPolicy, StreamRequest
from kvcomp.config import CalibrationConfig


class SlowCodec(Codec, Calibrated):
    """Fits for half a second and records each fit in a file."""

    name = "slow"
    config_class = CodecConfig

    def policy(self, kind, layer_idx):
        return StreamPolicy()

    def encode(self, request: StreamRequest):
        raise NotImplementedError("only calibrated here")

    def decode(self, payload, request: StreamRequest):
        raise NotImplementedError("only calibrated here")

    def fit(self, activations):
        with open(activations, "a") as log:
            log.write("fit\n")
        time.sleep(0.5)
        return CodecState({"w": torch.arange(4.0)})

    def load_state(self, state):
        self.w = state.tensors["w"]


MODEL = ModelInfo("m", num_layers=1, num_kv_heads=1, head_dim=4)
CALIBRATION = CalibrationConfig(num_samples=1, seq_len=8)


def _member(cache: str, log: str, queue) -> None:
    import os

    os.environ["KVCOMP_CACHE"] = cache
    codec = SlowCodec(CodecConfig(name="slow"), MODEL)
    report = calibrate(codec, CALIBRATION, lambda: log)
    queue.put((report["reused"], codec.w.tolist()))


def test_two_processes_fit_once_and_share_one_artifact(tmp_path, monkeypatch):
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    log = tmp_path / "fits.log"
    members = [context.Process(target=_member, args=(str(tmp_path / "cache"), str(log), queue)) for _ in range(2)]
    for member in members:
        member.start()
    results = sorted(queue.get(timeout=60) for _ in members)
    for member in members:
        member.join(timeout=60)
        assert member.exitcode == 0
    assert results == [(False, [0.0, 1.0, 2.0, 3.0]), (True, [0.0, 1.0, 2.0, 3.0])]
    assert log.read_text() == "fit\n"  # the second waited for the first, then loaded its artifact
    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path / "cache"))
    path = artifact_path(SlowCodec(CodecConfig(name="slow"), MODEL), CALIBRATION)
    assert [p.name for p in path.parent.iterdir() if p.suffix == ".safetensors"] == [path.name]
