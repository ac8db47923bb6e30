"""Code that Thunder's interpreter runs natively instead of tracing into.

torch.compile (Inductor, as the fusion executor uses it) patches `nn.Module.__init__` to tag every new module
in a registry of weak references (`torch._dynamo.mutation_guard.GenerationTracker`). A module built inside a
jitted forward (litgpt builds an `nn.Identity()` in `GPT.forward`) makes Thunder 0.2.6's interpreter trace
that tag, and its `in` on the registry iterates over every module ever tagged in the process: slower with each
model jitted, and when the garbage collector frees a tagged module during that loop, its weakref callback
changes the registry's size and tracing fails with "dictionary changed size during iteration" on that rank
only, while the others wait in their first collective. Tagging natively is what eager code does. The lookaside is
declared to ``patches`` (installed on thunder_tp's first use): in thunder_tp's compiles only.
"""

from __future__ import annotations

from thunder.core.interpreter import interpreter_needs_wrap
from torch._dynamo.mutation_guard import GenerationTracker

from thunder_tp.thunder_internals import patches


@interpreter_needs_wrap
def _tag_natively(tracker: type, module) -> None:
    """dynamo's module tag, run outside the interpreter."""
    GenerationTracker.tag.__func__(tracker, module)


patches.declare_lookaside(GenerationTracker.tag.__func__, _tag_natively)
