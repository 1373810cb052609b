"""A sharded adapter is refused by the snapshot with a typed error that says how to gather it
(relax_glue/snapshot.py): only the main process snapshots, so a gather (a collective of every
rank) cannot start there. Real sharded models on CPU: a small PEFT LoRA model wrapped by torch's
FSDP2 (``fully_shard``) and FSDP1 in a single-process gloo group (world size 1 still shards into
DTensors and flat parameters), and a ZeRO-3 partitioned parameter as DeepSpeed leaves it
(``ds_id``, ``ds_status``, empty data; deepspeed is not installed here). Gathered with each
framework's own API, the same model snapshots to the very digest of the unsharded one."""

from __future__ import annotations

import copy
import enum
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from lora_contract.errors import ErrorCode, LoraVersionError
from relax_glue.snapshot import Snapshot


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(16, 16)
        self.v_proj = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.v_proj(self.q_proj(x))


def peft_model() -> Any:
    torch.manual_seed(0)
    model = get_peft_model(Tiny(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # lora_B starts at zero: give it values, so a wrong copy shows
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def gloo() -> Iterator[None]:
    """A single-process gloo group (what ``torchrun --nproc-per-node 1`` gives a trainer)."""
    assert not dist.is_initialized()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def refused(model: Any, kind: str) -> LoraVersionError:
    with pytest.raises(LoraVersionError) as err:
        Snapshot.from_peft_model(model)
    assert err.value.code is ErrorCode.INVALID_REQUEST
    assert any(kind in k for k in err.value.details["sharding"]), err.value.details
    assert err.value.details["tensors"], "it names the sharded tensors"
    assert "gather the adapter on every rank first" in err.value.message  # and what to do
    return err.value


@pytest.fixture()
def unsharded() -> Snapshot:
    return Snapshot.from_peft_model(peft_model())


def test_an_fsdp2_sharded_adapter_is_refused_and_snapshots_exactly_once_gathered(
    gloo: None, unsharded: Snapshot
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = peft_model()
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    assert any(type(p).__name__ == "DTensor" for p in model.parameters())  # really sharded
    err = refused(model, "DTensor")
    assert "full_tensor()" in err.message
    # FSDP2's own gather (every rank calls full_tensor), then the main process snapshots
    gathered = {k: v.full_tensor() for k, v in get_peft_model_state_dict(model).items()}
    assert Snapshot.from_peft_model(model, gathered=gathered).digest == unsharded.digest


def test_dtensors_handed_to_from_tensors_are_refused(gloo: None, unsharded: Snapshot) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = peft_model()
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    tensors = get_peft_model_state_dict(model)
    with pytest.raises(LoraVersionError) as err:
        Snapshot.from_tensors(dict(unsharded.config), tensors)
    assert err.value.code is ErrorCode.INVALID_REQUEST and err.value.details["sharding"] == ["DTensor"]


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_an_fsdp1_wrapped_adapter_is_refused_and_snapshots_exactly_inside_summon_full_params(
    gloo: None, unsharded: Snapshot, use_orig_params: bool
) -> None:
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    inner = peft_model()
    wrapped = FSDP(
        inner,
        device_id=torch.device("cpu"),
        use_orig_params=use_orig_params,
        # PEFT's own policy: the LoRA layers in units of their own (uniform requires_grad)
        auto_wrap_policy=fsdp_auto_wrap_policy(inner),
    )
    if not use_orig_params:
        refused(wrapped.module, "FSDP1 flat parameter")
    refused(wrapped, "FSDP1")
    with FSDP.summon_full_params(wrapped):  # FSDP1's own gather
        assert Snapshot.from_peft_model(wrapped.module).digest == unsharded.digest


class ZeroParamStatus(enum.Enum):
    """deepspeed.runtime.zero.partition_parameters.ZeroParamStatus (names as DeepSpeed's)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


def zero3(model: Any, status: ZeroParamStatus) -> dict[str, torch.Tensor]:
    """Partition every parameter as ZeRO-3 does on one rank: the full value moves to
    ``ds_tensor`` (this rank's partition), ``data`` becomes empty unless gathered (AVAILABLE).
    Returns the full values."""
    full = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        full[name] = p.detach().clone()
        p.ds_id, p.ds_status, p.ds_shape, p.ds_numel = i, status, p.shape, p.numel()
        p.ds_tensor = full[name].flatten()
        if status is not ZeroParamStatus.AVAILABLE:
            p.data = torch.empty(0, dtype=p.dtype)
    return full


@pytest.mark.parametrize("status", [ZeroParamStatus.NOT_AVAILABLE, ZeroParamStatus.INFLIGHT])
def test_a_zero3_partitioned_adapter_is_refused(status: ZeroParamStatus) -> None:
    model = peft_model()
    zero3(model, status)
    err = refused(model, "ZeRO-3")
    assert status.name in err.message and "GatheredParameters" in err.message


def test_a_zero3_adapter_gathered_snapshots_exactly(unsharded: Snapshot) -> None:
    model = peft_model()
    zero3(model, ZeroParamStatus.AVAILABLE)  # inside deepspeed.zero.GatheredParameters
    assert Snapshot.from_peft_model(model).digest == unsharded.digest


def test_a_plain_model_and_a_deep_copy_are_not_sharded(unsharded: Snapshot) -> None:
    model = peft_model()
    assert Snapshot.from_peft_model(copy.deepcopy(model)).digest == unsharded.digest
