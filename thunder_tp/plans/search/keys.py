"""The automatic plan's keys: module names, or one glob per decision where it matches exactly its modules."""

from __future__ import annotations

from collections.abc import Iterator

import torch.nn as nn

from thunder_tp.plans.search.decisions import Decision
from thunder_tp.styles import Style
from thunder_tp.styles.matching import plan_key_matches


def plan_of(module: nn.Module, decisions: list[Decision], choice: tuple[int, ...]) -> dict[str, Style]:
    """Module names -> styles, a glob per decision where it matches exactly its modules."""
    names = [n for n, _ in module.named_modules() if n]
    plan: dict[str, Style] = {}
    for d, i in zip(decisions, choice, strict=True):
        styled = {m: s for m, s in zip(d.modules, d.choices[i], strict=True) if s is not None}
        for style in dict.fromkeys(styled.values()):
            members = [m for m, s in styled.items() if s == style]
            plan.update(_keys(members, style, names))
    return plan


def _keys(members: list[str], style: Style, names: list[str]) -> Iterator[tuple[str, Style]]:
    """One glob for modules that differ only in block indices, when it matches nothing else; else their names."""
    parts = [m.split(".") for m in members]
    if len(members) > 1 and len({len(p) for p in parts}) == 1:
        pattern = ".".join(p[0] if len(set(p)) == 1 else "*" for p in zip(*parts, strict=True))
        if sorted(plan_key_matches(pattern, names)) == sorted(members):
            yield pattern, style
            return
    yield from ((m, style) for m in members)
