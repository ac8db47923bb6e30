"""What thunder_tp asks of torch.compile's front end, Dynamo (``torch._dynamo``), which torch 2.10 answers only
privately: whether an error is the program's (raised while Dynamo traced it) and whether a call came through a
torch.compile'd module. Imported when asked, as torch loads ``torch._dynamo`` lazily.
"""

from __future__ import annotations

import torch

__all__ = ["in_torch_compile", "is_program_error"]


def is_program_error(error: BaseException) -> bool:
    """Whether `error` is the traced program's own error, which Dynamo re-raises as a ``TorchRuntimeError``."""
    return isinstance(error, torch._dynamo.exc.TorchRuntimeError)


def in_torch_compile() -> bool:
    """Whether this call came through a torch.compile'd module (``_is_in_optimized_module``)."""
    from torch._dynamo.eval_frame import _is_in_optimized_module

    return _is_in_optimized_module()
