"""thunder_tp: tensor parallelism for Lightning Thunder.

The public names load on first use (PEP 562): ``import thunder_tp`` imports neither torch nor Thunder, so that a
command line's ``--help`` (``python -m thunder_tp.generate --help``) answers at once. Reading any of them loads the
whole API (``_public_names``): Thunder's import-time warnings quieted first, the model families registered.
Importing it checks the installed Thunder and torch against the versions its patches of their internals were
written for (``thunder_tp.thunder_internals.versions``, from the packages' metadata).
"""
# ruff: noqa: F401  (_public_names imports the names it returns)

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


def _public_names() -> dict[str, object]:
    """The names of ``__all__``, from the modules that define them."""
    import thunder_tp.models  # (the families register their lookasides and rules)
    import thunder_tp.plans as plans  # (not `from thunder_tp import`: that would ask this module's __getattr__)
    from thunder_tp.collectives.annotate import annotate
    from thunder_tp.context_parallel import ContextParallel
    from thunder_tp.data_parallel.mesh import Mesh, init_mesh, parallelize
    from thunder_tp.execution.executor import executors
    from thunder_tp.layouts import Partial, Replicate, Shard
    from thunder_tp.models.litgpt_sampling import set_sampling
    from thunder_tp.ops.sampling import sample
    from thunder_tp.runtimes.decode_step import DecodeStep
    from thunder_tp.styles import ColwiseParallel, KVCacheParallel, RowwiseParallel, SequenceParallel
    from thunder_tp.tools.clipping import clip_grad_norm_
    from thunder_tp.tools.debug import collectives_table, dump_traces
    from thunder_tp.tools.one_rank import one_rank
    from thunder_tp.tools.simulate import per_rank, simulate
    from thunder_tp.transform import TensorParallel

    found = locals()
    return {name: found[name] for name in __all__}


def __getattr__(name: str):
    """A public name, from the whole API, loaded once."""
    if name not in __all__:
        raise AttributeError(f"module 'thunder_tp' has no attribute {name!r}")
    globals().update(_public_names())
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
