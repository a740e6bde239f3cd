"""Layers left in the model's dtype (vLLM's skip layers and TurboQuant presets' boundary layers)."""

import pytest

from kvcomp.errors import ConfigError
from kvcomp.stages.skip_layers import skipped_layers


def test_boundary_and_listed_layers():
    assert skipped_layers([], 2, 10, "c") == {0, 1, 8, 9}
    assert skipped_layers([5, -1], 0, 10, "c") == {5, 9}
    assert skipped_layers([], 0, 3, "c") == frozenset()


@pytest.mark.parametrize("layers, boundary, message", [
    ([10], 0, r"skip_layers \[10\] are not layers of this model \(valid: 0..9"),
    ([], 5, "boundary_layers=5 must be >= 0 and leave a layer"),
    ([], -1, "boundary_layers=-1"),
])
def test_bad_layers_are_refused(layers, boundary, message):
    with pytest.raises(ConfigError, match=message):
        skipped_layers(layers, boundary, 10, "c")
