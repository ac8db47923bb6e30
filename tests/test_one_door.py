"""One door to Thunder's internals (issue 77): outside ``thunder_tp/thunder_internals/`` no module imports an
underscore name of thunder, torch or transformers (nor from a private module of theirs), reads an underscore
attribute of one of their modules or objects, or assigns to an attribute of one (a patch: ``setattr``, ``del`` and
``x.__class__ = ...`` included). Reading a dunder (``__name__``) is fine. Read from the source with ast; a name counts
as theirs when an import of thunder, torch or transformers bound it in the module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "thunder_tp"
FOREIGN = {"thunder", "torch", "transformers"}
EXEMPT = PACKAGE / "thunder_internals"

# module (relative to thunder_tp/) -> why it reaches in outside thunder_internals; keep this empty or very short
EXCEPTIONS: dict[str, str] = {}


def is_private(name: str) -> bool:
    """An underscore name that is not a dunder."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def foreign_names(tree: ast.AST) -> set[str]:
    """The names that imports of thunder, torch or transformers bind anywhere in ``tree``."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] in FOREIGN}
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in FOREIGN:
            bound |= {a.asname or a.name for a in node.names}
    return bound


def root(node: ast.AST) -> str | None:
    """The name an attribute chain (``a.b.c``, ``a.b[0].c``, ``a().b``) starts from, if it starts from a name."""
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Call):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_imports(node: ast.Import | ast.ImportFrom) -> list[str]:
    """What an import takes from thunder, torch or transformers by an underscore name or from a private module."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] in FOREIGN and any(map(is_private,
                                                                                          a.name.split(".")))]
    module = node.module or ""
    if node.level or module.split(".")[0] not in FOREIGN:
        return []
    if any(map(is_private, module.split("."))):
        return [f"{module}.{a.name}" for a in node.names]
    return [f"{module}.{a.name}" for a in node.names if is_private(a.name)]


def store_targets(node: ast.AST) -> list[ast.AST]:
    """The targets an assignment or ``del`` statement writes (tuples unpacked)."""
    if isinstance(node, ast.Assign | ast.Delete):
        todo = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        todo = [node.target]
    else:
        return []
    found = []
    while todo:
        target = todo.pop()
        if isinstance(target, ast.Tuple | ast.List):
            todo.extend(target.elts)
        elif isinstance(target, ast.Starred):
            todo.append(target.value)
        else:
            found.append(target)
    return found


def violations(source: str, where: str = "<source>") -> list[str]:
    """Every reach into thunder's, torch's or transformers' internals in ``source``, as ``where:line: what``."""
    tree = ast.parse(source)
    theirs = foreign_names(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found += [(node.lineno, f"imports {name}") for name in private_imports(node)]
        elif isinstance(node, ast.Attribute) and is_private(node.attr) and root(node.value) in theirs:
            found.append((node.lineno, f"reads {ast.unparse(node)}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args
              and root(node.args[0]) in theirs):
            name = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else None
            if node.func.id in ("setattr", "delattr"):
                found.append((node.lineno, f"patches {ast.unparse(node)}"))
            elif node.func.id == "getattr" and isinstance(name, str) and is_private(name):
                found.append((node.lineno, f"reads {ast.unparse(node)}"))
        found += [(node.lineno, f"patches {ast.unparse(t)}") for t in store_targets(node)
                  if isinstance(t, ast.Attribute | ast.Subscript) and root(t) in theirs]
    return [f"{where}:{line}: {what}" for line, what in sorted(found)]


def package_violations() -> list[str]:
    """The violations of every thunder_tp module outside thunder_internals/ and the exceptions."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = str(path.relative_to(PACKAGE))
        if EXEMPT not in path.parents and relative not in EXCEPTIONS:
            found += violations(path.read_text(), relative)
    return found


def test_only_thunder_internals_reaches_in():
    found = package_violations()
    assert not found, "reaches into thunder/torch/transformers outside thunder_internals/:\n" + "\n".join(found)


def test_every_exception_is_still_needed():
    stale = [m for m in EXCEPTIONS if not violations((PACKAGE / m).read_text(), m)]
    assert not stale, f"exceptions that no longer reach in: {stale}"


@pytest.mark.parametrize("source, expected", [
    ("from torch._inductor import cpu_vec_isa", "imports torch._inductor.cpu_vec_isa"),
    ("import torch._dynamo", "imports torch._dynamo"),
    ("from thunder.torch import _torch_to_thunder_function_map as m", "imports thunder.torch._torch_to_thunder"),
    ("from transformers.modeling_utils import _init_weights", "imports transformers.modeling_utils._init_weights"),
    ("def f():\n    from thunder.core._x import y", "imports thunder.core._x.y"),
    ("import torch\nx = torch._C", "reads torch._C"),
    ("import thunder.core as c\nc._x.y()", "reads c._x"),
    ("from thunder.torch import linear\nlinear._sym", "reads linear._sym"),
    ("import torch\nf = getattr(torch.ops, '_c10d_functional')", "reads getattr(torch.ops, '_c10d_functional')"),
    ("import torch.distributed as dist\ndist.reduce_scatter_tensor = f", "patches dist.reduce_scatter_tensor"),
    ("import thunder\nthunder.core.x = 1", "patches thunder.core.x"),
    ("import torch\nsetattr(torch.distributed, 'x', 1)", "patches setattr(torch.distributed, 'x', 1)"),
    ("from torch.nn import Module\nModule.forward = f", "patches Module.forward"),
    ("from torch.nn import Module\nModule.forward += f", "patches Module.forward"),
    ("from torch.nn import Module\ndel Module.forward", "patches Module.forward"),
    ("from thunder.core.module import ThunderModule\nThunderModule.__class__ = C", "patches ThunderModule.__class__"),
    ("from thunder.torch import table\na, table[k] = 1, 2", "patches table[k]"),
    ("import transformers\nt = transformers.Model\nx, transformers.y = 1, 2", "patches transformers.y"),
])
def test_a_planted_violation_is_found(source, expected):
    found = violations(source)
    assert len(found) == 1 and found[0].split(": ", 1)[1].startswith(expected), found


@pytest.mark.parametrize("source", [
    "import torch\nx = torch.nn.Module.__name__",
    "import thunder\nfrom thunder_tp.thunder_internals import private\nprivate._x = 1",
    "import torch\nx = object()\nx._y = 1\nx.__class__ = int",
    "from __future__ import annotations",
    "from .models import _private",
    "import torch\ny = torch.zeros(1)\ny.data = y",
])
def test_allowed_code_is_not_flagged(source):
    assert violations(source) == []
