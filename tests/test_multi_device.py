"""Multi-device models: tensor parallel under ``torchrun`` (the real engine, 2 CPU ranks over gloo), and where a
tensor-parallel rank's or a split model's KV lives (``hf_kvcache.memory.placement``).

The tensor-parallel tests share one ``torchrun`` launch that runs every case (``torchrun_worker.py``) and check,
per model and registered cache, that both ranks generate the unsharded model's tokens (and DynamicCache's where the
cache keeps every token), that each rank's pool holds its half of the heads and took the pages the unsharded pool
took, and that a request that does not fit raises ``PoolExhaustedError`` on both ranks at the same step.
"""

import copy
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import exact_config, example_config
from torchrun_worker import RANK1_MEMORY_FRACTION, TP_MODELS, cases, run_case
from transformers import AutoModelForCausalLM

import hf_kvcache
from hf_kvcache import KVPool, PagedCache, PoolExhaustedError
from hf_kvcache.caches.base import PoolCache
from hf_kvcache.errors import IncompatibleModelError
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.integration.seams import attention_modules, placement_of
from hf_kvcache.memory.placement import Placement, agree, kv_heads_per_rank, layer_devices_from_map
from hf_kvcache.memory.pools import DEFAULT_MAX_MEMORY_FRACTION

REPO = Path(__file__).parents[1]
TORCHRUN_TIMEOUT_S = 300
"""A rank stuck in a collective would otherwise wait out the process group's timeout (transformers sets 2 hours)."""


def free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def tensor_parallel_run(tmp_path_factory) -> tuple[dict, list[dict]]:
    """Saves the tiny models, runs every case on them unsharded here and on 2 ranks under torchrun; returns both.

    The ranks talk over loopback only (gloo on ``lo``, the rendezvous at 127.0.0.1). torchrun's own rendezvous
    store still listens on every interface while the run lasts: torch has no option to bind it to one.
    """
    root = tmp_path_factory.mktemp("tp")
    models = {model_name: build() for model_name, build in TP_MODELS.items()}
    for model_name, model in models.items():
        model.save_pretrained(root / model_name)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),  # this checkout
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }
    rendezvous = ["--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(free_loopback_port())]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", *rendezvous]
    command += ["--local-addr", "127.0.0.1", str(REPO / "tests" / "torchrun_worker.py"), str(root)]
    log = root / "torchrun.log"
    with log.open("w") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        unsharded = {  # while the ranks start
            f"{model_name}/{case}": run_case(model, name, cache_config)
            for model_name, model in models.items()
            for case, (name, cache_config) in cases().items()
        }
        process.wait(timeout=TORCHRUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun did not finish in {TORCHRUN_TIMEOUT_S} s (a rank hung?):\n{log.read_text()[-4000:]}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # torchrun and both ranks
            process.wait()
    assert process.returncode == 0, log.read_text()[-4000:]
    return unsharded, [json.loads((root / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def cases_of(name: str) -> list[str]:
    return [case for case in cases() if case.split("/")[0] == name]


@pytest.mark.torchrun
@pytest.mark.parametrize("model_name", list(TP_MODELS))
def test_tensor_parallel_tokens_equal_the_unsharded_model_and_dynamic_cache(
    tensor_parallel_run, model_name, cache_name
):
    unsharded, ranks = tensor_parallel_run
    for rank in ranks:
        assert rank["hf_kvcache"] == hf_kvcache.__file__  # the ranks ran this checkout
        assert rank[f"{model_name}/tp"] == {"tp_size": 2, "process_group_size": 2}  # read from the device mesh
        dynamic = rank[f"{model_name}/dynamic"]["tokens"]
        assert dynamic == unsharded[f"{model_name}/dynamic"]["tokens"]
        for case in cases_of(cache_name):
            key = f"{model_name}/{case}"
            assert rank[key]["tokens"] == unsharded[key]["tokens"], key
        assert rank[f"{model_name}/{cache_name}/exact"]["tokens"] == dynamic


@pytest.mark.torchrun
@pytest.mark.parametrize("model_name", list(TP_MODELS))
def test_tensor_parallel_pools_hold_each_rank_its_heads(tensor_parallel_run, model_name, cache_name):
    """Each rank's pool holds 2 of the 4 KV heads (half the bytes a page of the unsharded pool has) and took the
    pages the unsharded pool took, the identical rows' shared pages included; the ranks' default pools have one
    cap, the smaller rank's."""
    unsharded, ranks = tensor_parallel_run
    for case in cases_of(cache_name):
        key = f"{model_name}/{case}"
        (whole,) = unsharded[key]["pools"].values()
        shards = [rank[key]["pools"]["cpu"] for rank in ranks]
        for rank, shard in zip(ranks, shards):
            assert rank[key]["num_kv_heads"] == 2
            assert shard["page_bytes"] * 2 == whole["page_bytes"]
            assert (shard["pages_used"], shard["tokens_held"]) == (whole["pages_used"], whole["tokens_held"])
        assert shards[0]["max_pages"] == shards[1]["max_pages"]


@pytest.mark.torchrun
def test_tensor_parallel_default_pools_agree_on_the_smallest_budget(tensor_parallel_run):
    _, ranks = tensor_parallel_run
    budgets = [rank["budget"] for rank in ranks]
    assert budgets[1]["own"] == pytest.approx(budgets[0]["own"] * RANK1_MEMORY_FRACTION / DEFAULT_MAX_MEMORY_FRACTION)
    assert budgets[0]["agreed"] == budgets[1]["agreed"] == budgets[1]["own"]


@pytest.mark.torchrun
@pytest.mark.parametrize("model_name", list(TP_MODELS))
def test_tensor_parallel_exhaustion_fails_on_every_rank_at_the_same_step(tensor_parallel_run, model_name):
    """A pool too small for the request (each registered cache, admission off), the admission check, and pools of
    different sizes on the two ranks (rank 1's runs out first): both ranks raise PoolExhaustedError at the same step."""
    _, ranks = tensor_parallel_run
    for how in [*(f"exhausted/{name}" for name in REGISTRY), "refused", "uneven"]:
        outcomes = [rank[f"{model_name}/{how}"] for rank in ranks]
        assert [outcome["error"] for outcome in outcomes] == ["PoolExhaustedError"] * 2, (how, outcomes)
        for field in ("new_tokens_before", "requested_pages", "free_pages"):  # free: the fewest of any rank
            assert outcomes[0][field] == outcomes[1][field], (how, field, outcomes)
    uneven = [rank[f"{model_name}/uneven"] for rank in ranks]
    assert uneven[0]["total_pages"] > uneven[1]["total_pages"]  # rank 0 had room, and stopped with rank 1
    assert [outcome["pages_used_after"] for outcome in uneven] == [0, 0]  # the failed request's pages went back


def test_a_shard_written_into_a_pool_cut_for_the_whole_model_is_named(tiny_llama_model):
    """A cache built by hand for a tensor-parallel rank without its placement fails clearly, not with an IndexError."""
    cache = PagedCache(tiny_llama_model.config, {"max_tokens": 16}, dtype=torch.float32, device="cpu")
    with pytest.raises(IncompatibleModelError, match="writes 1 KV heads of size 16, but the pool on cpu holds 2"):
        cache.update(torch.zeros(1, 1, 3, 16), torch.zeros(1, 1, 3, 16), 0)
    sharded = PagedCache(tiny_llama_model.config, dtype=torch.float32, device="cpu", placement=Placement(1))
    keys, _ = sharded.update(torch.ones(1, 1, 3, 16), torch.ones(1, 1, 3, 16), 0)
    assert torch.equal(keys, torch.ones(1, 1, 3, 16))
    assert sharded.pool.format.num_kv_heads == 1


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


def test_layers_run_where_accelerates_hooks_execute_them(tiny_llama_model):
    """``dispatch_model(..., main_device="cpu")`` runs layers mapped to "cpu" on the CPU, not on the map's GPU: the
    hook accelerate puts on a mapped module names its execution device, and the placement reads it there (it
    placed such a layer on the GPU, and generate raised IncompatibleModelError: the GPU check's split test)."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    model = copy.deepcopy(tiny_llama_model)
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": 0, "lm_head": 0, "": 0}
    layers = attention_modules(model, 2)
    gpu = torch.device("cuda", 0)
    assert layer_devices_from_map(device_map, layers, model) == (gpu, gpu)  # no hooks: accelerate's default rule
    add_hook_to_module(model.model.layers[0], AlignDevicesHook(execution_device="cpu"))
    add_hook_to_module(model.model.layers[1], AlignDevicesHook(execution_device=0))
    assert layer_devices_from_map(device_map, layers, model) == (torch.device("cpu"), gpu)


def test_placement_normalizes_its_devices():
    placement = Placement(layer_devices=("cpu:0", torch.device("cpu"), "meta", "meta"))
    assert placement.layer_devices == (torch.device("cpu"),) * 2 + (torch.device("meta"),) * 2
    assert placement.devices == [torch.device("cpu"), torch.device("meta")]
    assert Placement().devices == []
    assert Placement(2, process_group="a group") == Placement(2)  # the process group takes no part in comparisons
    with pytest.raises(ValueError, match="num_kv_heads must be >= 1"):
        Placement(0)


def test_agree_without_a_group_keeps_the_values():
    assert agree([3, 1], None, torch.device("cpu")) == [3, 1]


SPLIT = (torch.device("cpu"),) * 2 + (torch.device("meta"),) * 2
"""Layers 0-1 on the CPU, 2-3 on the meta device: a second device a CPU-only run has (it holds shapes, no data)."""


def split_cache(model, cache_name: str, **cache_config) -> PoolCache:
    settings = {**example_config(cache_name), "page_size": 4, "max_tokens": 32, **cache_config}
    return REGISTRY[cache_name].cache_class(model.config, settings, placement=Placement(layer_devices=SPLIT))


def test_a_split_model_gets_one_pool_per_device_holding_its_layers(tiny_gemma3_model, cache_name):
    """Gemma 3 (sliding, sliding, sliding, full): the CPU pool holds the 2 sliding layers placed there, the meta
    pool 1 sliding layer and the full one, a layer group each; statistics come per device."""
    cache = split_cache(tiny_gemma3_model, cache_name)
    torch.manual_seed(0)
    states = [torch.randn(1, 2, 6, 16) for _ in SPLIT]  # [batch, heads, tokens, head_dim]
    for layer_idx, device in enumerate(SPLIT):
        keys, _ = cache.update(states[layer_idx].to(device), states[layer_idx].to(device), layer_idx)
        if device.type == "cpu":  # what the CPU layers get back is what they wrote
            encoded = 4 if cache_name == "quantized_kv" else 0  # keys of the full page (4 tokens) through int4
            torch.testing.assert_close(keys[:, :, :encoded], states[layer_idx][:, :, :encoded], rtol=0, atol=0.3)
            torch.testing.assert_close(keys[:, :, encoded:], states[layer_idx][:, :, encoded:])
    pools = cache.pools
    assert list(pools) == [torch.device("cpu"), torch.device("meta")]
    cpu, meta = pools[torch.device("cpu")].format, pools[torch.device("meta")].format
    assert (cpu.num_layers, cpu.num_layer_groups) == (2, 1)
    assert (meta.num_layers, meta.num_layer_groups) == (1, 2)
    stats = {str(device): pool.stats() for device, pool in pools.items()}
    assert stats["cpu"]["pages_used"] == 2  # 6 tokens in pages of 4, one layer group
    assert stats["meta"]["pages_used"] == 2 * 2  # ... in each of its two layer groups
    assert stats["cpu"]["page_bytes"] == 2 * stats["meta"]["page_bytes"]  # a page spans 2 layers vs 1
    assert cache.memory_stats()["pages_held"] == stats["cpu"]["pages_used"] + stats["meta"]["pages_used"]


def test_a_split_model_layer_writing_on_another_device_is_named(tiny_gemma3_model):
    cache = split_cache(tiny_gemma3_model, "paged_pool")
    with pytest.raises(IncompatibleModelError, match=r"placed on meta .* write their states on cpu"):
        cache.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), 3)


def test_a_split_model_admission_check_covers_every_device(tiny_gemma3_model):
    cache = split_cache(tiny_gemma3_model, "paged_pool", max_tokens=8, admission_check=True)
    cache.check_admission(1, 8, "cpu", torch.float32)  # 2 pages per layer group fit on both devices
    assert cache.worst_case_pages(1, 8, 4, "cpu") == 2 and cache.worst_case_pages(1, 8, 4, "meta") == 4
    with pytest.raises(PoolExhaustedError, match="in 1 layer group\\(s\\) on cpu"):
        cache.check_admission(2, 8, "cpu", torch.float32)
    with pytest.raises(IncompatibleModelError, match="placement"):
        split_cache(
            tiny_gemma3_model, "paged_pool", max_tokens=None, pool=KVPool.for_model(tiny_gemma3_model, max_tokens=8)
        ).update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), 0)


def test_offloaded_layers_of_a_real_device_map_write_on_the_main_device(tmp_path, tiny_gemma3_model, cache_name):
    """A CPU-only split from ``from_pretrained(device_map=...)``: layers mapped to "disk" run on the CPU (the only
    device), so one CPU pool holds every layer, and tokens equal DynamicCache's."""
    tiny_gemma3_model.save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    device_map |= {f"model.layers.{idx}": "disk" if idx % 2 else "cpu" for idx in range(4)}
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", device_map=device_map, offload_folder=tmp_path / "offload"
    )
    assert len(set(model.hf_device_map.values())) == 2
    assert placement_of(model).layer_devices == (torch.device("cpu"),) * 4
    ids = torch.tensor([[5, 9, 17, 33, 4, 8, 21, 70, 11, 3, 99, 42]])
    reference = model.generate(ids, max_new_tokens=10, do_sample=False)
    out = model.generate(
        ids,
        max_new_tokens=10,
        do_sample=False,
        cache_implementation=cache_name,
        cache_config=exact_config(cache_name, 22),
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, reference)
    (pool,) = out.past_key_values.pools.values()
    assert (pool.format.num_layers, pool.format.num_layer_groups) == (1, 4)


def test_prefix_caching_is_refused_under_tensor_parallelism_and_on_split_models(tiny_llama_model, tiny_gemma3_model):
    """Each rank's (device's) pool would keep its own prefix index, whose lookups the ranks do not agree on: a clear
    error rather than ranks feeding prompts of different lengths into the model's collectives."""
    with pytest.raises(ValueError, match="not supported under tensor parallelism"):
        PagedCache(
            tiny_llama_model.config,
            {"max_tokens": 16, "prefix_caching": True},
            dtype=torch.float32,
            device="cpu",
            placement=Placement(1, process_group="a group"),
        )
    cache = split_cache(tiny_gemma3_model, "paged_pool", prefix_caching=True)
    with pytest.raises(ValueError, match="split over several devices"):
        cache.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), 0)
