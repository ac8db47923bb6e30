"""thunder_tp's public API (the names of ``thunder_tp.__all__``), loaded whole on the first use of one of them."""
# ruff: noqa: F401  (every import is a name this module provides)

from thunder_tp.thunder_internals import quiet  # noqa: I001  (first: filters the warning importing Thunder raises)
from thunder_tp import plans
from thunder_tp.collectives.annotate import annotate
from thunder_tp.tools.clipping import clip_grad_norm_
from thunder_tp.tools.debug import collectives_table, dump_traces
from thunder_tp.execution.executor import executors
from thunder_tp.runtimes.decode_step import DecodeStep
from thunder_tp.layouts import Partial, Replicate, Shard
from thunder_tp.data_parallel.mesh import Mesh, init_mesh, parallelize
from thunder_tp.tools.one_rank import one_rank
from thunder_tp.tools.simulate import per_rank, simulate
from thunder_tp.styles import ColwiseParallel, KVCacheParallel, RowwiseParallel, SequenceParallel
from thunder_tp.transform import TensorParallel
from thunder_tp.context_parallel import ContextParallel
from thunder_tp import models  # (model families register their lookasides and rules)
from thunder_tp.models.litgpt_sampling import set_sampling
from thunder_tp.ops.sampling import sample
