"""The calibration artifact cache: fit once, reuse, refuse an artifact fitted for something else."""


import pytest
import torch

from kvcomp.calibration import artifact_path, calibrate, fitted_for
from kvcomp.codecs import ModelInfo
from kvcomp.codecs.uniform import UniformCodec, UniformConfig
from kvcomp.config import CalibrationConfig
from kvcomp.errors import CalibrationMismatchError
from tests.toy_codecs import MODEL, OffsetCodec, OffsetConfig


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path))
    return tmp_path


def test_fit_once_then_reuse(cache_home):
    calibration = CalibrationConfig(num_samples=2, seq_len=4)
    windows = torch.arange(8).view(2, 4)
    first = OffsetCodec(OffsetConfig(), MODEL)
    report = calibrate(first, calibration, lambda: windows)
    assert report["reused"] is False and first.fit_calls == 1 and torch.allclose(first.offset, torch.full((16,), 3.5))
    assert artifact_path(first, calibration).is_relative_to(cache_home)

    second = OffsetCodec(OffsetConfig(), MODEL)
    report = calibrate(second, calibration, lambda: pytest.fail("must not fit again"))
    assert report["reused"] is True and torch.equal(second.offset, first.offset)


def test_same_name_other_weights_never_share_an_artifact(cache_home):
    other = ModelInfo(name="tiny", num_layers=2, num_kv_heads=2, head_dim=16, fingerprint="bbbb")
    calibration = CalibrationConfig(num_samples=2, seq_len=4)
    first = OffsetCodec(OffsetConfig(), MODEL)
    calibrate(first, calibration, lambda: torch.zeros(2, 4))
    second = OffsetCodec(OffsetConfig(), other)
    report = calibrate(second, calibration, lambda: torch.ones(2, 4))
    assert report["reused"] is False and second.offset[0] == 1 and first.offset[0] == 0
    assert report["artifact"].startswith("$KVCOMP_CACHE/calibration/")  # no machine path in results


def test_another_config_gets_its_own_artifact(cache_home):
    a = OffsetCodec(OffsetConfig(bits=2), MODEL)
    b = OffsetCodec(OffsetConfig(bits=4), MODEL)
    assert artifact_path(a, CalibrationConfig()) != artifact_path(b, CalibrationConfig())
    assert artifact_path(a, CalibrationConfig()) != artifact_path(a, CalibrationConfig(name="lee"))


def test_artifact_for_another_model_is_refused(cache_home):
    calibration = CalibrationConfig()
    codec = OffsetCodec(OffsetConfig(), MODEL)
    path = cache_home / "given.safetensors"
    calibrate(codec, calibration, lambda: torch.ones(1, 4), path=path)
    other_model = ModelInfo(name="tiny", num_layers=2, num_kv_heads=2, head_dim=16, fingerprint="bbbb")
    with pytest.raises(CalibrationMismatchError, match="model: artifact has 'fingerprint:aaaa', run wants 'fingerprint:bbbb'"):
        calibrate(OffsetCodec(OffsetConfig(), other_model), calibration, lambda: None, path=path)
    with pytest.raises(CalibrationMismatchError, match="calibration"):
        calibrate(codec, CalibrationConfig(num_samples=99), lambda: None, path=path)
    assert fitted_for(codec, calibration)["codec"]["name"] == "test_offset"


def test_codecs_without_calibration_skip_it():
    codec = UniformCodec(UniformConfig(group_size=16), MODEL)
    assert calibrate(codec, CalibrationConfig(), lambda: pytest.fail("no data needed")) == {}
