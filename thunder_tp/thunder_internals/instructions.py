"""Thunder 0.2.6's interpreter decodes each code object's bytecode once, and compiles each raise's frame once.

The interpreter's ``_run_frame`` runs ``tuple(dis.get_instructions(frame.code))`` for every Python call it
interprets: about 23,000 calls for a 2-layer litgpt training step, 1.2 s of its 15 s on this project's machine. A code
object's instructions never change, so the interpreter module's ``dis`` becomes a copy of ``dis`` whose
``get_instructions`` answers a code object from a cache (0.2.6 has no hook for it; nothing else of ``dis`` changes).

Each exception raised in interpreted code (a ``hasattr`` that finds nothing, a loop's ``StopIteration``) gets a
Python frame for its traceback, made by ``compile``-ing a ``raise`` at the line's offset: 64 times in a 2-layer
litgpt step, about 5 ms each. The source depends on the line, file and name only, and code objects are immutable, so
the interpreter module's ``compile`` answers a string source it compiled before from a cache.
"""

from __future__ import annotations

import dis
import functools
import types

import thunder.core.interpreter as interpreter

__all__ = ["compiled", "instructions"]


@functools.lru_cache(maxsize=16384)
def instructions(code: types.CodeType) -> tuple[dis.Instruction, ...]:
    """`code`'s instructions, as ``dis.get_instructions`` gives them, decoded once."""
    return tuple(dis.get_instructions(code))


@functools.lru_cache(maxsize=4096)
def compiled(source: str, filename: str, mode: str) -> types.CodeType:
    """``compile(source, filename, mode)``, compiled once."""
    return compile(source, filename, mode)


def _compile(source, filename, mode, *args, **kwargs):
    """The builtin ``compile``, from the cache for a string source without flags."""
    if isinstance(source, str) and not args and not kwargs:
        return compiled(source, filename, mode)
    return compile(source, filename, mode, *args, **kwargs)


def _get_instructions(x, **options):
    """``dis.get_instructions``, from the cache for a code object."""
    return instructions(x) if isinstance(x, types.CodeType) and not options else dis.get_instructions(x, **options)


if interpreter.dis is dis:
    _dis = types.ModuleType("dis", dis.__doc__)
    _dis.__dict__.update({k: v for k, v in vars(dis).items() if not k.startswith("__")})
    _dis.get_instructions = _get_instructions
    interpreter.dis = _dis
if "compile" not in vars(interpreter):  # the module's own global, ahead of the builtin
    interpreter.compile = _compile
