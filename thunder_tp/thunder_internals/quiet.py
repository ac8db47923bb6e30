"""Quiet the messages that using thunder_tp causes and that tell its user nothing; imported first by thunder_tp.

Each filter matches one message from one place, so a user's own warnings and logs are left as they are:

* ``transformer_engine module not found!``: a UserWarning that importing Thunder raises where NVIDIA's
  Transformer Engine is not installed (thunder_tp does not use it). Filtered only if thunder_tp is imported before
  Thunder itself (``python -m thunder_tp.generate`` and the benchmarks do; the warning is issued once, at import).
* ``No CUDA runtime is found, using CUDA_HOME=...``: torch's C++-extension module logs it when Inductor, thunder_tp's
  fusion executor on CPU, first compiles on a machine with a CUDA directory and no GPU.

While thunder_tp.checkpoint saves (``quiet_checkpoint_save``), three UserWarnings of torch.distributed.checkpoint
about how it writes, none about the user's checkpoint:

* ``TypedStorage is deprecated``: DCP's file writer calls ``Tensor.storage()`` itself (torch 2.10).
* ``Detected an existing checkpoint in ..., overwriting``: saving over a checkpoint directory, which fabric.save
  (as Lightning's strategies) does on purpose; DCP warns even when told to overwrite.
* ``torch.distributed is disabled, unavailable or uninitialized``: a save in a process without a process group,
  which thunder_tp.checkpoint supports on purpose.

What is printed by C++ and cannot be filtered here is listed in docs/run_output.md.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator

TRANSFORMER_ENGINE_WARNING = "transformer_engine module not found!"
NO_CUDA_RUNTIME_LOG = "No CUDA runtime is found"
CHECKPOINT_SAVE_WARNINGS = (
    "TypedStorage is deprecated",
    "Detected an existing checkpoint in",
    "torch.distributed is disabled, unavailable or uninitialized",
)


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


@contextlib.contextmanager
def quiet_checkpoint_save() -> Iterator[None]:
    """Meanwhile, drop torch.distributed.checkpoint's CHECKPOINT_SAVE_WARNINGS (issued from its own modules)."""
    with warnings.catch_warnings():
        for message in CHECKPOINT_SAVE_WARNINGS:
            warnings.filterwarnings("ignore", message=re.escape(message), category=UserWarning,
                                    module=r"torch\.distributed\.checkpoint\.")
        yield


install()
