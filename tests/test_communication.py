"""What communication.py prices is what the rewrite issues: a hand plan priced on a trace (no ranks) comes to the
collectives tests/test_litgpt.py counts in the traces that ran (Megatron's minimum, `expected_counts`), in every mode,
sequence parallel's gathers into the TP region (forward all_gather, backward reduce_scatter) included."""

from __future__ import annotations

import pytest
import torch

import thunder_tp
from tests.litgpt_models import MODES, GPTWithLoss, batch, expected_counts, make_config
from thunder_tp.layouts import TPGroup
from thunder_tp.plans.search.pricing import Pricing
from thunder_tp.plans.search.tracing import traced

#: the default run: every mode once, neox's parallel residual in TP; the others price the same rules (slow)
DEFAULT = {("llama", "tp_sp"), ("llama", "tp_lp"), ("neox", "tp")}


@pytest.mark.parametrize("name,mode", [(n, m) if (n, m) in DEFAULT else pytest.param(n, m, marks=pytest.mark.slow)
                                       for n in ("llama", "neox") for m in MODES], ids=lambda v: v)
def test_priced_collectives_are_megatrons_minimum(name, mode):
    config = make_config(name)
    with torch.device("meta"):
        model = GPTWithLoss(config)
    pricing = Pricing(model, traced(model, batch(0), {}), TPGroup(None, 2, 0), training=True)
    comm, _ = pricing.price_plan(thunder_tp.plans.litgpt(model, **MODES[mode]))
    assert (dict(comm.forward), dict(comm.backward)) == expected_counts(config, mode, 2), str(comm)
