"""The correctness gate of ``compare.py``: every parameter's gradient of a mode, gathered to the full tensor, against
the single-device run's, before the mode is timed."""

from __future__ import annotations

import torch
import torch.nn as nn


class GradientMismatch(AssertionError):
    """A mode's gradient differs from the single-device run's: the mode computes something else."""


def full_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient, by parameter name of the original model (collective in a distributed mode:
    DTensor gradients are gathered with ``full_tensor``, thunder_tp's shards through its transforms' reverse of the
    state dict, as ``ThunderModule.original_state_dict`` does)."""
    from torch.distributed.tensor import DTensor

    grads = {}
    for name, p in module.named_parameters():
        if p.grad is None:
            raise GradientMismatch(f"parameter {name!r} got no gradient")
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name.removeprefix("_orig_mod.")] = grad.detach()  # torch.compile's wrapper
    from thunder.core.module import ThunderModule

    if isinstance(module, ThunderModule):  # its transforms gather what they sharded
        import thunder

        for transform in reversed(thunder.list_transforms(module)):
            grads = transform.reverse_transform_state_dict_for_submodule(module, "", grads)
    return grads


def check_gradients(mode_name: str, grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                    rtol: float) -> float:
    """The largest gradient error relative to its reference's largest entry; GradientMismatch above ``rtol``."""
    if set(grads) != set(reference):
        raise GradientMismatch(f"{mode_name}: parameters {sorted(set(grads) ^ set(reference))} are not in both "
                               "this mode and the single-device model")
    worst = 0.0
    for name, ref in reference.items():
        if grads[name].shape != ref.shape:
            raise GradientMismatch(f"{mode_name}: gradient of {name!r} has shape {tuple(grads[name].shape)}, the "
                                   f"single-device run's {tuple(ref.shape)} (a shard not gathered?)")
        grad = grads[name].to(ref.device, torch.float64)
        error, largest = (grad - ref).abs().max().item(), ref.abs().max().item()
        bound = rtol * largest
        worst = max(worst, error / largest if largest else error)
        if not error <= bound:
            raise GradientMismatch(f"{mode_name}: gradient of {name!r} differs from the single-device run by "
                                   f"{error:.3e} (allowed {bound:.3e} = {rtol:g} x its largest entry); not timed")
    return worst
