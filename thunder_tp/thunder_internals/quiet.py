"""Quiet the messages that using thunder_tp causes and that tell its user nothing; imported first by thunder_tp.

Each filter matches one message from one place, so a user's own warnings and logs are left as they are:

* ``transformer_engine module not found!``: a UserWarning that importing Thunder raises where NVIDIA's
  Transformer Engine is not installed (thunder_tp does not use it). Filtered only if thunder_tp is imported before
  Thunder itself (``python -m thunder_tp.generate`` and the benchmarks do; the warning is issued once, at import).
* ``No CUDA runtime is found, using CUDA_HOME=...``: torch's C++-extension module logs it when Inductor, thunder_tp's
  fusion executor on CPU, first compiles on a machine with a CUDA directory and no GPU.

What is printed by C++ and cannot be filtered here is listed in docs/run_output.md.
"""

from __future__ import annotations

import logging
import re
import warnings

TRANSFORMER_ENGINE_WARNING = "transformer_engine module not found!"
NO_CUDA_RUNTIME_LOG = "No CUDA runtime is found"


class _DropMessage(logging.Filter):
    """Drops the log records whose unformatted message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def install() -> None:
    """Add the two filters (idempotent: a filter already there is not added twice)."""
    warnings.filterwarnings("ignore", message=re.escape(TRANSFORMER_ENGINE_WARNING) + "$", category=UserWarning,
                            module=r"thunder\.executors\.transformer_engineex$")
    logger = logging.getLogger("torch.utils.cpp_extension")
    if not any(isinstance(f, _DropMessage) and f.prefix == NO_CUDA_RUNTIME_LOG for f in logger.filters):
        logger.addFilter(_DropMessage(NO_CUDA_RUNTIME_LOG))


install()
