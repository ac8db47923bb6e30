"""The one cost model's figures: the links collectives run on and the devices matmuls run on, each labelled with where
it was measured or given. Every price reads them from here: the automatic plan's (``collectives/reshard.py``,
``rewriting/communication.py``), the overlap decision's (``execution/overlap_cost.py``) and the projection's
(``benchmarks/lib/alpha_beta.py``). The formulas stay with their users; the ring collective's share of the bytes,
which the seconds-priced two share, is here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LinkFigures:
    """A link's alpha-beta figures: one call's latency and a large ring collective's bus bandwidth; ``concurrent``: the
    share of a transfer during which the rank computes on (1: the transport's own stream; 0: its threads need the
    rank's core); ``source``: where the figures were measured or given."""

    description: str
    latency_s: float
    bus_bytes_per_s: float
    concurrent: float
    source: str


@dataclass(frozen=True)
class DeviceFigures:
    """A device's dense matmul rates in full waves per dtype (``None``: any other dtype), one matmul call's fixed cost
    and, on a GPU, the output tile and the units (SMs) that run tiles at once (0: no wave quantization); ``source``:
    where they were measured or given."""

    description: str
    matmul_flops_per_s: dict[torch.dtype | None, float]
    matmul_call_s: float
    tile: int
    units: int
    source: str

    def matmul_rate(self, dtype: torch.dtype) -> float:
        """The matmul rate for ``dtype`` (the other-dtype rate where the table has none of its own)."""
        return self.matmul_flops_per_s.get(dtype, self.matmul_flops_per_s[None])


_NCCL_H100 = ("given NCCL figures (not measured here) for 8 x H100 NVLink: all_reduce of 16-64 KB about 21-23 µs "
              "eager, 17-20 µs under a CUDA graph; about 370 GB/s bus bandwidth for large ring collectives")

#: the links, by name: the projection's H100 NVLink figures and gloo on this project's CPU
LINKS: dict[str, LinkFigures] = {
    "h100_nvlink": LinkFigures("8 x H100 SXM, NVLink 4 / NVSwitch, NCCL, eager", 22e-6, 370e9, 1.0, _NCCL_H100),
    "h100_nvlink_graph": LinkFigures("8 x H100 SXM, NVLink 4 / NVSwitch, NCCL inside a CUDA graph", 18e-6, 370e9, 1.0,
                                     _NCCL_H100),
    "cpu_gloo": LinkFigures(
        "gloo between the ranks of this project's 2-core CPU", 1.0e-3, 0.8e9, 0.0,
        "this project's 2-core CPU bench, gloo (docs/results.md): a 2 MiB all_reduce after a matmul 3.8 ms, small "
        "ones 1.3-1.6 ms after a matmul (latency ~1 ms, ~0.8 GB/s); its threads run on the rank's core (a rank's "
        "step spends 34-36 ms of CPU in them; the decomposed benchmark Llama step measured 1.11-1.13x the whole one's)",
    ),
}

#: the devices, by name
DEVICES: dict[str, DeviceFigures] = {
    "h100_sxm": DeviceFigures(
        "H100 SXM", {torch.bfloat16: 700e12, torch.float16: 700e12, None: 50e12}, 2e-6, 128, 132,
        "H100-class figures assumed (not measured here): bf16 / fp16 700 TFLOP/s in full waves, fp32 without TF32 "
        "50 TFLOP/s; a call's fixed cost, the gap between kernels, 2 µs; output tiles of 128 x 128 over 132 SMs",
    ),
    "cpu_core": DeviceFigures(
        "one core of this project's CPU (AVX-512)", {torch.float32: 90e9, torch.float64: 45e9, None: 20e9}, 30e-6, 0,
        0, "this project's 2-core CPU bench (docs/results.md: the single device's 29 forward matmuls at 93 GFLOP/s in "
           "fp32); fp64 at half that, other dtypes and a call's dispatch (30 µs): assumed",
    ),
}

#: the link a backend's collectives are priced on, and the device a device type's matmuls are priced on
BACKEND_LINKS: dict[str, str] = {"nccl": "h100_nvlink", "gloo": "cpu_gloo"}
DEVICE_TYPE_DEVICES: dict[str, str] = {"cuda": "h100_sxm", "cpu": "cpu_core"}

#: the automatic plan's price is in bytes: one collective's latency as the bytes it would move meanwhile (alpha /
#: beta), a ranking constant chosen for the plan search, not measured
ALPHA_BYTES = 64 * 1024


def ring_factor(kind: str, size: int) -> float:
    """The share of a collective's full bytes on the bus, ring algorithm in NCCL's bus-bandwidth convention: 2 (n - 1)
    / n for all_reduce, (n - 1) / n for the others."""
    return (2 if kind == "all_reduce" else 1) * (size - 1) / size
