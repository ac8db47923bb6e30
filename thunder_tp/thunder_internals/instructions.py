"""Thunder 0.2.6's interpreter decodes each code object's bytecode once, makes each raise's frame once, and finds
its caller without a whole stack.

The interpreter's ``_run_frame`` runs ``tuple(dis.get_instructions(frame.code))`` for every Python call it
interprets: about 23,000 calls for a 2-layer litgpt training step, 1.2 s of its 15 s on this project's machine. A code
object's instructions never change, so the interpreter module's ``dis`` becomes a copy of ``dis`` whose
``get_instructions`` answers a code object from a cache (0.2.6 has no hook for it; nothing else of ``dis`` changes).

Each exception leaving an interpreted frame (a ``hasattr`` that finds nothing, a loop's ``StopIteration``) gets a
Python frame for its traceback: ``get_or_make_python_frame`` compiles a ``raise`` at the line, runs it on a new
thread (so that no frame of the interpreter is its caller) and waits for it by spinning, which holds the GIL until
the interpreter's switch interval (5 ms) hands it over: 5.6 ms a frame, 84 CPU seconds of this project's test suite.
The frame depends on the file, the function's names and lines only, and a finished frame can sit in any number of
tracebacks, so each is made once, on a thread that is joined.

Each interpretation records its call site as ``inspect.stack()[2]``, which reads the source of every frame of the
whole stack (a test runner's too): 0.35 s for the first, 31 CPU seconds of the test suite. The interpreter module's
``inspect`` becomes a copy whose ``stack`` gives the first three frames only, as ``inspect.stack`` gives them.

Declared to ``patches`` (installed on thunder_tp's first use): the speed-up in thunder_tp's compiles, Thunder's code
in any other jit.
"""

from __future__ import annotations

import dis
import functools
import inspect
import sys
import threading
import types

import thunder.core.interpreter as interpreter

from thunder_tp.thunder_internals import patches

__all__ = ["instructions", "python_frame"]


@functools.lru_cache(maxsize=16384)
def instructions(code: types.CodeType) -> tuple[dis.Instruction, ...]:
    """`code`'s instructions, as ``dis.get_instructions`` gives them, decoded once."""
    return tuple(dis.get_instructions(code))


def _get_instructions(x, **options):
    """``dis.get_instructions``, from the cache for a code object."""
    return instructions(x) if isinstance(x, types.CodeType) and not options else dis.get_instructions(x, **options)


@functools.lru_cache(maxsize=4096)
def python_frame(filename: str, firstlineno: int, lineno: int, name: str, qualname: str) -> types.FrameType:
    """The finished frame of a ``raise`` at `lineno` of function `qualname` (first line `firstlineno`) in
    `filename`, run on a thread of its own, made once."""
    code = compile("\n" * (lineno - firstlineno) + "raise ValueError()", filename, "exec")
    names = {"co_filename": filename, "co_firstlineno": firstlineno, "co_name": name}
    if hasattr(code, "co_qualname"):
        names["co_qualname"] = qualname
    raising = types.FunctionType(code.replace(**names), {"ValueError": ValueError})
    frames: list[types.FrameType] = []

    def run() -> None:
        try:
            raising()
        except ValueError as error:
            traceback = error.__traceback__
            while traceback.tb_next is not None:
                traceback = traceback.tb_next
            frames.append(traceback.tb_frame)

    thread = threading.Thread(target=run, name="thunder_tp frame of a raise")
    thread.start()
    thread.join()
    return frames[0]


def _get_or_make_python_frame(frame: interpreter.InterpreterFrame) -> types.FrameType:
    """``InterpreterFrame.get_or_make_python_frame``: the frame for `frame`'s line, made once."""
    assert frame.positions is not None
    code = frame.code
    lineno = code.co_firstlineno if frame.positions.lineno is None else frame.positions.lineno
    return python_frame(code.co_filename, code.co_firstlineno, lineno, code.co_name, frame.qualname)


def _stack_head(frame: types.FrameType, context: int = 1) -> list[inspect.FrameInfo]:
    """The first three entries of ``inspect.getouterframes(frame, context)``."""
    head = []
    while frame is not None and len(head) < 3:
        info = inspect.getframeinfo(frame, context)
        positions = {"positions": info.positions} if hasattr(info, "positions") else {}
        head.append(inspect.FrameInfo(frame, *info, **positions))
        frame = frame.f_back
    return head


def _stack(context: int = 1) -> list[inspect.FrameInfo]:
    """``inspect.stack(context)``, called where this is called: its first three entries in thunder_tp's compiles."""
    frame = sys._getframe(1)
    return _stack_head(frame, context) if patches.active() else inspect.getouterframes(frame, context)


def _module_copy(module: types.ModuleType, **replacements) -> types.ModuleType:
    """A module of `module`'s names, `replacements` in place of some."""
    copy = types.ModuleType(module.__name__, module.__doc__)
    copy.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")}, **replacements)
    return copy


patches.declare(interpreter, "dis", _module_copy(
    dis, get_instructions=patches.dispatching(_get_instructions, dis.get_instructions)))
patches.declare(interpreter, "inspect", _module_copy(inspect, stack=_stack))
patches.declare(interpreter.InterpreterFrame, "get_or_make_python_frame", patches.dispatching(
    _get_or_make_python_frame, interpreter.InterpreterFrame.get_or_make_python_frame))
