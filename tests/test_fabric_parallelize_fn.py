"""Lightning's tensor-parallel example for ModelParallelStrategy, with only its strategy line changed to
ThunderTPStrategy (real gloo ranks, float64): the losses equal one-device Fabric's; a parallelize_fn's FSDP2
`fully_shard` becomes Thunder's FSDP over the data-parallel ranks; what cannot be read is refused, naming it."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tests.dist import run_ranks

RTOL = 1e-7  # float64 through Inductor: ~1e-9 apart
TIMEOUT_S = 600


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def parallelize_feedforward(model, device_mesh):
    tp_mesh = device_mesh["tensor_parallel"]
    plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel(), "w3": ColwiseParallel()}
    parallelize_module(model, tp_mesh, plan)
    return model


def parallelize_2d(model, device_mesh):
    """TP over the tensor-parallel dim, then FSDP2 over the data-parallel one, as Lightning's 2-D example does."""
    from torch.distributed.fsdp import fully_shard

    parallelize_feedforward(model, device_mesh)
    fully_shard(model, mesh=device_mesh["data_parallel"])
    return model


def distribute_by_hand(model, device_mesh):
    from torch.distributed.tensor import distribute_module

    distribute_module(model, device_mesh["tensor_parallel"])
    return model


def lightning_example(strategy: str, parallelize_fn: str = "parallelize_feedforward", steps: int = 3,
                      **sizes: int) -> dict:
    """Lightning's example loop: a FeedForward built on the meta device, fabric.setup, AdamW, output.sum() as the
    loss. `strategy`: "one device" (plain Fabric, the model built normally) or "thunder_tp" (`sizes`: the mesh's).
    Returns the losses and the data parallelism the strategy chose."""
    import lightning as L
    import torch.distributed as dist

    from thunder_tp.fabric import ThunderTPStrategy

    if strategy == "one device":
        fabric = L.Fabric(accelerator="cpu", devices=1, precision="64-true")
    else:
        os.environ["LOCAL_RANK"] = str(dist.get_rank())  # the pool's processes are launched as by torchrun
        strategy = ThunderTPStrategy(parallelize_fn=globals()[parallelize_fn], **sizes)  # the one line changed
        fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, precision="64-true")
    fabric.launch()
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=strategy != "one device"):
        model = FeedForward(32, 64)
    model = fabric.setup(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    optimizer = fabric.setup_optimizers(optimizer)
    losses = []
    for _ in range(steps):
        inputs = torch.randn(8, 32, device=fabric.device)
        output = model(inputs)
        loss = output.sum()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    options = getattr(fabric.strategy, "options", None)
    return {"losses": losses, "data_parallel": options and options.data_parallel}


def _setup_error(parallelize_fn: str) -> str:
    try:
        lightning_example("thunder_tp", parallelize_fn, steps=1)
    except (TypeError, ValueError) as e:
        return str(e)
    return "no error"


def _assert_one_devices_losses(results: list[dict]) -> None:
    expected = lightning_example("one device")["losses"]
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(expected), rtol=RTOL, atol=0)


def test_lightning_tp_example_with_the_strategy_line_changed_equals_one_device():
    _assert_one_devices_losses(run_ranks(lightning_example, 2, "thunder_tp", timeout=TIMEOUT_S))


@pytest.mark.slow  # reason: four ranks; the TP=2 test reads the same parallelize_module calls
def test_lightning_2d_example_maps_fully_shard_to_thunders_fsdp():
    """A parallelize_fn with FSDP2's fully_shard over the data-parallel dim (data_parallel_size=2,
    tensor_parallel_size=2): Thunder's FSDP over it, the losses one device's."""
    results = run_ranks(lightning_example, 4, "thunder_tp", "parallelize_2d", data_parallel_size=2,
                        tensor_parallel_size=2, timeout=TIMEOUT_S)
    assert {r["data_parallel"] for r in results} == {"fsdp"}
    _assert_one_devices_losses(results)


def test_a_parallelize_fn_thunder_tp_cannot_read_is_refused_naming_the_call():
    for message in run_ranks(_setup_error, 2, "distribute_by_hand", timeout=TIMEOUT_S):
        assert "calls torch.distributed.tensor.distribute_module" in message, message
        assert "parallelize_module(module, mesh, plan)" in message, message
