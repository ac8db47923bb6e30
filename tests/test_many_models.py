"""Many models jitted with TP, one after another in the same pair of processes, stay exact and in lock-step.

Guards the divergence seen in long sweeps (one rank far behind its peer at a model that passes alone): every
model is checked against the single device, both ranks must have run the same collectives, and a failure on
one rank is turned into an error on every rank before the next model starts.
"""

import torch.nn as nn

from tests.dist import run_ranks

WIDTHS = [(32, 64), (48, 96), (64, 256)]  # (hidden, ffn): distinct kernels per model
SEQ, BATCH = 8, 2


class _MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.fc2(nn.functional.gelu(self.fc1(x)))


def _every_rank_ok(error: str | None, what: str) -> None:
    """Raise on every rank if any rank failed ``what``."""
    import torch.distributed as dist

    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = {r: e for r, e in enumerate(errors) if e is not None}
    if failed:
        raise RuntimeError(f"{what} failed on rank(s) {sorted(failed)}: " + "\n".join(failed.values()))


def _many_models() -> list[dict]:
    import functools
    import traceback

    import torch
    import torch.distributed as dist

    import thunder_tp
    from tests.tp_checks import compare_with_single_device

    plan = {"fc1": thunder_tp.ColwiseParallel(), "fc2": thunder_tp.RowwiseParallel()}
    seen = []
    for hidden, ffn in WIDTHS:
        info, error = None, None
        try:
            def make_inputs(h=hidden):
                return (torch.randn(SEQ, BATCH, h, requires_grad=True),)
            info = compare_with_single_device(functools.partial(_MLP, hidden, ffn), make_inputs,
                                              thunder_tp.TensorParallel(plan), executors=thunder_tp.executors())
        except Exception:
            error = traceback.format_exc()
        _every_rank_ok(error, f"model ({hidden}, {ffn})")
        tables = [None] * dist.get_world_size()
        dist.all_gather_object(tables, info)
        assert all(t == tables[0] for t in tables), tables  # same collectives on every rank
        seen.append(info)
    return seen


def test_many_models_in_one_process_pair():
    for infos in run_ranks(_many_models, 2, timeout=600):
        assert infos == [{"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}] * len(WIDTHS), infos
