"""What every parallel style implements.

A style says how a module's own tensors (parameters, and a cache's buffers) are split (`tensor_layouts`) and
which layouts the input and output of the op that consumes its weight are constrained to (`input_layout`,
`output_layout`), as DTensor's styles do at module boundaries.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch.nn as nn

from thunder_tp.layouts import Layout


class Style(ABC):
    """What every parallel style implements (a frozen dataclass each, so that plans compare and hash).

    A new style fills in `tensor_layouts`, raising a ValueError or TypeError where it cannot split a module (the
    error gets the module's name), and where it needs them `input_layout` and `output_layout`: the layouts the input
    and the output of the op that consumes the module's weight are turned into (None leaves them to propagation).
    """

    input_layout: Layout | None = None
    output_layout: Layout | None = None

    @abstractmethod
    def tensor_layouts(self, module: nn.Module, size: int = 1) -> dict[str, Layout]:
        """Layout of each of the module's own tensors that the style splits, on `size` ranks (their divisibility
        `matching.planned_tensors` checks)."""
