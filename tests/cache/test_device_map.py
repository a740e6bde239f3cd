"""Models across GPUs: whole decoder layers placed over devices, and every per-layer tensor of the cache,
its codec state and its kernels on its own layer's device. No second device exists here: placement is
planned on meta weights for two GPUs, and "another device" is the meta device."""

import logging

import pytest
import torch
from transformers import LlamaConfig

from kvcomp.config import HardwareConfig
from kvcomp.errors import ConfigError
from kvcomp.models.loading import layer_devices, plan_device_map
from kvcomp.runner import _spans
from kvcomp.stages.ridge import LinearPredictor
from tests.helpers import TINY

CONFIG = LlamaConfig(**{**TINY, "num_hidden_layers": 8, "hidden_size": 256, "intermediate_size": 512,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000})


@pytest.fixture(autouse=True)
def _quiet(caplog):
    logging.getLogger("accelerate").setLevel(logging.ERROR)  # "Device 0 is not available" on a CPU machine


@pytest.mark.parametrize("strategy", ["auto", "sequential", "balanced_low_0"])
def test_three_gpu_placement_keeps_layers_whole_and_in_order(strategy):
    placement = plan_device_map(CONFIG, torch.float32, strategy, "12MiB", gpus=3)  # ~21 MB of weights
    assert not [k for k in placement if k.startswith("model.layers.0.")] and "disk" not in placement.values()
    devices = [int(d.removeprefix("cuda:")) for d in layer_devices(_Placed(placement)).values()]
    assert len(devices) == 8 and devices == sorted(devices) and len(set(devices)) >= 2  # contiguous runs of layers
    assert (0 in devices) == (strategy != "balanced_low_0")  # low_0 keeps GPU 0 free for generation


def test_a_model_that_does_not_fit_is_a_clear_error_unless_it_may_offload():
    with pytest.raises(ConfigError, match="does not fit in .*would go to disk.*hardware.cpu_memory"):
        plan_device_map(CONFIG, torch.float32, "auto", "4MiB", gpus=2)
    offloaded = plan_device_map(CONFIG, torch.float32, "auto", "4MiB", "1GiB", gpus=2)
    assert "cpu" in offloaded.values() and "disk" not in offloaded.values()


class _Placed(torch.nn.Module):
    """A meta-weight model of CONFIG carrying a device map, as ``from_pretrained(device_map=...)`` leaves it."""

    def __init__(self, placement, layers=8):
        from accelerate import init_empty_weights
        from transformers import LlamaForCausalLM

        super().__init__()
        with init_empty_weights():
            self.model = LlamaForCausalLM(LlamaConfig(**{**CONFIG.to_dict(), "num_hidden_layers": layers})).model
        self.config, self.hf_device_map = self.model.config, placement


def test_layer_devices_and_their_report():
    placement = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0, "model.layers.2": 1,
                 "model.layers.3": "cpu", "lm_head": 1}
    devices = layer_devices(_Placed(placement, layers=4))
    assert devices == {0: "cuda:0", 1: "cuda:0", 2: "cuda:1", 3: "cpu"}
    assert _spans(devices) == "layers 0-1 on cuda:0, 2 on cuda:1, 3 on cpu"
    assert layer_devices(_Placed({"model.layers": 1, "": 0}, layers=2)) == {0: "cuda:1", 1: "cuda:1"}
    assert layer_devices(torch.nn.Linear(1, 1)) == {}


def test_device_map_needs_the_cuda_device_and_memory_caps_need_a_map():
    HardwareConfig(device="cuda", device_map="auto", gpu_memory="70GiB", cpu_memory="200GiB")
    with pytest.raises(ConfigError, match="device_map='auto' places layers over the visible GPUs; it needs device=cuda"):
        HardwareConfig(device="cpu", device_map="auto")
    with pytest.raises(ConfigError, match="device_map='everywhere' is unknown; valid choices: auto, balanced"):
        HardwareConfig(device="cuda", device_map="everywhere")
    with pytest.raises(ConfigError, match="gpu_memory / cpu_memory are used only with device_map"):
        HardwareConfig(gpu_memory="1GiB")


def test_a_predictor_computes_on_its_inputs_device():
    predictor = LinearPredictor(torch.randn(6, 4, dtype=torch.bfloat16), torch.randn(4, dtype=torch.bfloat16))
    x = torch.randn(3, 6)
    on_cpu = predictor(x)
    torch.testing.assert_close(on_cpu, x @ predictor.weight.float() + predictor.bias.float())
    on_meta = predictor(x.to("meta"))
    assert on_meta.device.type == "meta" and on_meta.shape == (3, 4)
    assert {d.type for d in predictor.on_device} == {"cpu", "meta"}


def test_layer_scope_handoff_lands_on_the_receiving_layers_device(tiny_llama):
    """AQUA-KV hands layer l-1's reconstruction to layer l, which may sit on another GPU."""
    from kvcomp.cache.scopes import LayerScope
    from kvcomp.codecs import ModelInfo, build_codec

    codec = build_codec({"name": "fp16"}, ModelInfo.from_hf_config(tiny_llama.config))
    scope = LayerScope(codec)
    first, second = scope.schedule(0, None), scope.schedule(1, None)
    second.key_stream.append(torch.zeros(1, 2, 1, 4, device="meta"))
    first.encode_handoff[0] = (torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
    handed = second._handed("encode", 0)
    assert [t.device.type for t in handed] == ["meta", "meta"]


def test_the_higgs_grid_is_copied_to_a_device_once():
    from kvcomp.stages.higgs import HiggsQuantizer

    quantizer = HiggsQuantizer(torch.randn(16, 2), 64)
    assert quantizer.grid_on(torch.device("meta")) is quantizer.grid_on(torch.device("meta"))
    assert quantizer.grid_on(torch.device("meta")).device.type == "meta"
