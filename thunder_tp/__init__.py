"""thunder_tp: tensor parallelism for Lightning Thunder.

The public names load on first use (PEP 562): ``import thunder_tp`` imports neither torch nor Thunder, so that a
command line's ``--help`` (``python -m thunder_tp.generate --help``) answers at once. Reading any of them loads the
whole API (``thunder_tp.api``): Thunder's import-time warnings quieted first, the model families registered.
Importing it checks the installed Thunder and torch against the versions its patches of their internals were
written for (``thunder_tp.thunder_internals.versions``, from the packages' metadata).
"""

from thunder_tp.thunder_internals import quiet  # noqa: F401, I001  (first: filters the warning importing Thunder raises)
from thunder_tp.families import register_loader as _register_loader
from thunder_tp.thunder_internals import versions

versions.check()  # one UnsupportedThunderVersion (THUNDER_TP_STRICT_VERSIONS=1: ImportError) for another Thunder

__all__ = [
    "ColwiseParallel",
    "ContextParallel",
    "DecodeStep",
    "KVCacheParallel",
    "Mesh",
    "Partial",
    "Replicate",
    "RowwiseParallel",
    "SequenceParallel",
    "Shard",
    "TensorParallel",
    "annotate",
    "clip_grad_norm_",
    "collectives_table",
    "dump_traces",
    "executors",
    "init_mesh",
    "one_rank",
    "parallelize",
    "per_rank",
    "plans",
    "sample",
    "set_sampling",
    "simulate",
]


@_register_loader
def _load_families() -> None:
    """The model families (``thunder_tp.models``), loaded by the core's registry (``thunder_tp.families``) on its
    first use, wherever thunder_tp was entered from: the core and the registry name no family."""
    from thunder_tp import models  # noqa: F401


def __getattr__(name: str):
    """A public name, from the whole API, loaded once."""
    if name not in __all__:
        raise AttributeError(f"module 'thunder_tp' has no attribute {name!r}")
    from thunder_tp import api

    globals().update({public: getattr(api, public) for public in __all__})
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
