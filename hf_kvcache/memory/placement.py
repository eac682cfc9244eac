"""Where a model's KV lives when one device is not enough (``integration.seams.placement_of`` reads a model's plan
and map; nothing here imports transformers):

- **Tensor parallel** (``tp_plan="auto"`` under ``torchrun``): every rank runs every layer on its share of the heads,
  and its pool is cut for that many. The ranks agree on every page allocation (``AgreedPages``) and every sharing of
  identical rows (``agree``), so that they take the same cache decisions.
- **Split models** (``device_map`` over several devices): each layer runs on one device (``layer_devices``), and each
  device gets one pool, cut for its layers only.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_kvcache.errors import IncompatibleModelError, PoolExhaustedError

KEY_PROJECTIONS = ("k_proj", "qkv_proj", "query_key_value")
"""Modules whose output holds a layer's keys (plain or fused): a plain ``colwise`` rule on one shards the heads."""

OFFLOADED = ("cpu", "disk")
"""``device_map`` values whose layers accelerate streams to the main device (when there is one) and runs there."""


def normalize_device(device: str | torch.device) -> torch.device:
    """``device`` the way tensors on it report theirs: an accelerator with its index (the current one when none is
    given: ``"cuda"`` is ``cuda:0`` on the default device), the CPU without one (``"cpu:0"`` is ``cpu``)."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.index is None:
        current = getattr(getattr(torch, device.type, None), "current_device", None)
        if current is not None:
            return torch.device(device.type, current())
    return device


@dataclass(frozen=True)
class Placement:
    """How one model's KV is laid out over devices and processes, as seen from this process.

    Attributes:
        num_kv_heads: KV heads this process's layers hold per layer (tensor parallel); ``None``: the config's.
        layer_devices: the device each model layer writes on (a split model); ``None``: one device, or learnt at the
            first write (a pool per device, each cut for all layers).
        process_group: the ranks that run each request together (tensor parallel); ``None``: one process.
    """

    num_kv_heads: int | None = None
    layer_devices: tuple[torch.device, ...] | None = None
    process_group: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.num_kv_heads is not None and self.num_kv_heads < 1:
            raise ValueError(f"Placement.num_kv_heads must be >= 1, got {self.num_kv_heads}.")
        if self.layer_devices is not None:
            object.__setattr__(self, "layer_devices", tuple(map(normalize_device, self.layer_devices)))

    @property
    def devices(self) -> list[torch.device]:
        """The distinct devices of ``layer_devices``, in layer order (empty when not given)."""
        return list(dict.fromkeys(self.layer_devices or ()))

    def devices_for(self, model_device: str | torch.device) -> list[torch.device]:
        """The devices the layers run on: ``devices`` where given, else ``model_device``; none before the first
        write where that is "meta" (accelerate streams offloaded parameters to where the layers run)."""
        if self.devices:
            return self.devices
        device = normalize_device(model_device)
        return [] if device.type == "meta" else [device]


def kv_heads_per_rank(num_kv_heads: int, tp_plan: Mapping[str, str] | None, tp_size: int) -> int:
    """KV heads each rank holds under a tensor-parallel plan, by transformers' rule (``get_kv_heads_per_rank``; a
    test pins the two equal): a plain ``colwise`` rule on the key projection splits the heads evenly (else
    ``IncompatibleModelError``); any other rule leaves every rank all of them."""
    sharded = any(
        name.rsplit(".", 1)[-1] in KEY_PROJECTIONS and style == "colwise" for name, style in (tp_plan or {}).items()
    )
    if tp_size <= 1 or not sharded:
        return num_kv_heads
    if num_kv_heads % tp_size:
        raise IncompatibleModelError(
            f"The model's {num_kv_heads} KV heads do not split evenly over tp_size={tp_size} ranks; hf_kvcache "
            f"caches need an even split. Run with a tp_size that divides {num_kv_heads}."
        )
    return num_kv_heads // tp_size


def layer_devices_from_map(
    device_map: Mapping[str, int | str | torch.device], layer_modules: list[str], model: Any = None
) -> tuple[torch.device, ...]:
    """The device each layer runs on, from a model's ``hf_device_map`` (accelerate's module -> device map).

    With ``model``, the accelerate hook on the layer's module or its nearest hooked parent names it
    (``execution_device``). Otherwise the longest map key covering the module does, as ``accelerate.dispatch_model``
    places it: keys mapped to ``"cpu"`` or ``"disk"`` are offloaded and run on the main device (the map's first other
    device, in dispatch_model's order), or on the CPU where there is none.

    ``layer_modules``: each layer's attention module, e.g. ``"model.layers.3.self_attn"``. Raises ``ValueError`` for a
    module the map does not cover.
    """
    others = set(device_map.values()) - set(OFFLOADED)  # as accelerate.dispatch_model picks its main device
    main_device = list(others)[0] if others else "cpu"
    devices = []
    for name in layer_modules:
        keys = [key for key in device_map if key == "" or name == key or name.startswith(key + ".")]
        if not keys:
            raise ValueError(f"hf_device_map places no module above {name!r}; its keys are {sorted(device_map)}.")
        value = device_map[max(keys, key=len)]
        hooked = _hooked_device(model, name)
        devices.append(_as_device(hooked if hooked is not None else main_device if value in OFFLOADED else value))
    return tuple(devices)


def _hooked_device(model: Any, name: str) -> int | str | torch.device | None:
    """The ``execution_device`` of the accelerate hook on module ``name`` or its nearest hooked parent, or ``None``."""
    if model is None:
        return None
    parts = name.split(".")
    for end in range(len(parts), -1, -1):
        try:
            module = model.get_submodule(".".join(parts[:end]))
        except AttributeError:
            continue
        hook = getattr(module, "_hf_hook", None)
        for each in getattr(hook, "hooks", (hook,)):  # a SequentialHook holds several
            device = getattr(each, "execution_device", None)
            if device is not None:
                return device
    return None


def _as_device(value: int | str | torch.device) -> torch.device:
    """A ``device_map`` value as a device: an int is an index of the machine's accelerator (CUDA if none)."""
    if isinstance(value, int):
        accelerator = torch.accelerator.current_accelerator()
        return torch.device(accelerator.type if accelerator is not None else "cuda", value)
    return normalize_device(value)


def agree(values: list[int], process_group: Any, device: torch.device, op: str = "min") -> list[int]:
    """The elementwise ``op`` (``"min"`` or ``"max"``) of ``values`` over the ranks of ``process_group``.

    A collective: every rank calls it, in the same order relative to the model's own collectives. ``device``: where
    the reduction runs (a pool's: the CPU for gloo, the GPU for NCCL). ``process_group=None`` returns ``values``.
    """
    if process_group is None:
        return list(values)
    reduce_op = {"min": torch.distributed.ReduceOp.MIN, "max": torch.distributed.ReduceOp.MAX}[op]
    tensor = torch.tensor(values, dtype=torch.long, device=device)  # [len(values)]
    torch.distributed.all_reduce(tensor, op=reduce_op, group=process_group)
    return tensor.tolist()


class AgreedPages:
    """A pool's pages as the ``Allocator`` of a page table whose allocations the ranks of a process group make together.

    The ranks' tables ask for as many pages at the same steps. ``ensure_free``, called before any page is taken, is
    one small collective: if any rank cannot make room, every rank raises ``PoolExhaustedError`` with nothing taken,
    so that no rank goes on alone into the model's next collective (and hangs there until the timeout). The prefix
    index is not agreed (ranks could find prefixes of different lengths): prompt reuse is refused under tensor
    parallelism.
    """

    def __init__(self, pool: Any, process_group: Any) -> None:
        self.pool = pool
        self.process_group = process_group

    def ensure_free(self, num: int) -> None:
        """Makes sure ``num`` pages are free on every rank."""
        if not num:  # every rank asks for as many pages: no need to agree on none
            return
        pool = self.pool
        available = pool.num_available_pages
        try:
            pool.ensure_free(num)
            ready = True
        except PoolExhaustedError:
            ready = False
        everyone, fewest = agree([int(ready), available], self.process_group, pool.device)
        if everyone:
            return
        raise PoolExhaustedError(
            num,
            fewest,
            pool.capacity_pages,
            f"Pages hold {pool.format.page_size} tokens; the free pages are the fewest of any tensor-parallel rank, "
            "and every rank stops here alike. Give the pools more room (cache_config max_tokens), or lower the batch "
            "size or max_new_tokens.",
        )

    def allocate(self, num: int) -> list[int]:  # after ensure_free: cannot fail
        return self.pool.allocate(num)

    def extend(self, anchor: int | None, num: int) -> list[int]:  # after ensure_free: cannot fail
        return self.pool.extend(anchor, num)

    def share(self, pages: list[int]) -> None:
        self.pool.share(pages)

    def free(self, pages: list[int]) -> list[int]:
        return self.pool.free(pages)

    def refcount(self, page: int) -> int:
        return self.pool.refcount(page)
