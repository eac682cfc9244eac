"""Multi-device models: where a tensor-parallel rank's or a split model's KV lives (``hf_kvcache.placement``)."""

import pytest
import torch

from hf_kvcache.errors import IncompatibleModelError
from hf_kvcache.placement import Placement, agree, kv_heads_per_rank, layer_devices_from_map


def test_kv_heads_per_rank_follows_the_key_projection_rule():
    plan = {"model.layers.*.self_attn.k_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}
    assert kv_heads_per_rank(4, plan, 2) == 2
    assert kv_heads_per_rank(4, plan, 1) == 4
    assert kv_heads_per_rank(4, {"model.layers.*.self_attn.qkv_proj": "colwise"}, 4) == 1  # fused projections
    assert kv_heads_per_rank(4, {"model.layers.*.self_attn.k_proj": "colwise_gather_output"}, 2) == 4  # Olmo 3
    assert kv_heads_per_rank(4, None, 2) == 4
    with pytest.raises(IncompatibleModelError, match="tp_size that divides 3"):
        kv_heads_per_rank(3, plan, 2)


LAYERS = [f"model.layers.{idx}.self_attn" for idx in range(4)]


def test_layer_devices_follow_the_device_map_and_offloaded_layers_run_on_the_main_device():
    gpu = (torch.device("cuda", 0), torch.device("cuda", 1))
    split = {"model.embed_tokens": "cuda:0", "model.layers.0": "cuda:0", "model.layers.1": "cuda:1", "": "cuda:1"}
    devices = layer_devices_from_map({**split, "model.layers.2": "cpu"}, LAYERS)
    assert devices[:2] == gpu
    assert devices[2] in gpu  # accelerate streams a "cpu" layer to a GPU and runs it there
    assert devices[3] == gpu[1]  # the "" key covers what nothing else does
    cpu_only = {"model": "cpu", "model.layers.3": "disk"}
    assert layer_devices_from_map(cpu_only, LAYERS) == (torch.device("cpu"),) * 4  # no GPU: disk runs on the CPU
    with pytest.raises(ValueError, match="places no module above"):
        layer_devices_from_map({"model.layers.0": 0}, LAYERS[1:2])


def test_layer_devices_follow_where_accelerate_runs_a_key_when_known():
    """A model dispatched with main_device="cpu": its "cpu" layers really run on the CPU, next to a GPU."""
    device_map = {"model.layers.0": "cpu", "model.layers.1": "cpu", "model.layers.2": 0, "model.layers.3": 0}
    run_on = {"model.layers.0": "cpu", "model.layers.1": torch.device("cpu"), "model.layers.2": 0}
    devices = layer_devices_from_map(device_map, LAYERS, run_on)
    assert devices[:2] == (torch.device("cpu"),) * 2
    assert devices[2].index == devices[3].index == 0 and devices[2].type == devices[3].type != "cpu"


def test_placement_normalizes_its_devices():
    placement = Placement(layer_devices=("cpu:0", torch.device("cpu"), "meta", "meta"))
    assert placement.layer_devices == (torch.device("cpu"),) * 2 + (torch.device("meta"),) * 2
    assert placement.devices == [torch.device("cpu"), torch.device("meta")]
    assert Placement().devices == []
    assert Placement(2, group="a group") == Placement(2)  # the process group takes no part in comparisons
    with pytest.raises(ValueError, match="num_kv_heads must be >= 1"):
        Placement(0)


def test_agree_without_a_group_keeps_the_values():
    assert agree([3, 1], None, torch.device("cpu")) == [3, 1]
