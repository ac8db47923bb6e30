"""Thunder 0.2.6's interpreter answers ``bool``, ``len``, ``[]``, ``in``, ``*``, ``**`` of builtin containers directly.

For a list, tuple, dict or OrderedDict, Thunder's interpreter registers wrapper methods (``MutMappingWrapperMethods``,
``MutSequenceWrapperMethods``) that keep the items' provenance: ``len(d)`` ends in the wrapper's ``__len__``, ``d[k]``
in its ``__getitem__``. But it reaches them by interpreting helpers of its own: ``bool(d)`` interprets an ``impl``
that looks up ``__bool__``, then ``__len__``, then calls ``len(d) != 0``, itself an interpreted ``impl``; ``d[k]``,
``k in d``, ``f(*args)``, ``f(**kw)`` and every argument of a ``*args`` / ``**kwargs`` call interpret a function that
looks the method up; a ``functools.partial`` (a proxy's method: ``x.view``) interprets the merge of its arguments.
torch's ``Module._call_impl`` tests eight hook dicts per module call, ``Module.__getattr__`` asks ``name in
self._parameters``: 43,000 of the 59,000 instructions interpreted for a 2-layer litgpt step were these helpers'
(``bool`` of an OrderedDict: 17 ms each on this project's machine).

Here those calls go to the same wrapper method directly (`_wrapper_method`: the one Thunder's interpreter would look
aside to for the container's method), so the items are tracked as before and ``len``, ``[]`` and ``in`` return the
very wrapped value Thunder's path returns; ``bool`` returns ``len != 0`` of it (``None``, ``int`` and ``float``:
their ``__bool__``), as a value of an opaque call; a partial without keywords calls its function on the same wrapped
arguments. Arithmetic of two ints or floats (``n // 2``: Thunder interprets an ``impl`` calling ``int.__floordiv__``,
about 16 ms) is computed; a Python method bound to an object (``self.forward``) is called as its function on the
object, without the ``_impl`` Thunder interprets to make that call. Anything else (a proxy, a module, a subclass, a
user's class) takes Thunder's path. The traces are those Thunder's path gives (``tests/test_builtin_containers.py``).

Declared to ``patches`` (installed on thunder_tp's first use): the speed-up in thunder_tp's compiles, Thunder's code
in any other jit.
"""

from __future__ import annotations

import collections
import functools
import operator
import types
from collections.abc import Callable
from typing import Any

import thunder.core.interpreter as interpreter
from thunder.core.interpreter import (
    INTERPRETER_SIGNALS,
    ProvenanceRecord,
    PseudoInst,
    WrappedValue,
    do_raise,
    get_interpretercompilectx,
    wrap,
    wrap_const,
)

from thunder_tp.thunder_internals import patches

__all__ = [
    "binary_op_handler", "binary_subscr_handler", "bool_lookaside", "call_dispatch", "contains_handler",
    "dict_merge_handler", "len_lookaside", "list_extend_handler", "partial_call_lookaside", "wrap_args_from_list",
    "wrap_kwargs_from_dict",
]

_CONTAINERS = (list, tuple, dict, collections.OrderedDict)
_MAPPINGS = (dict, collections.OrderedDict)
_NUMBERS = (type(None), int, float)
_KEYS = (str, int)
#: BINARY_OP's operators by its argument (the in-place ones, 13 on, are the same: int and float have no ``__iadd__``)
_OPERATORS = (operator.add, operator.and_, operator.floordiv, operator.lshift, None, operator.mul, operator.mod,
              operator.or_, operator.pow, operator.rshift, operator.sub, operator.truediv, operator.xor)

#: Thunder's own: lookasides (by the function looked aside), opcode handlers (by opcode), interpreter functions
_thunder_lookasides = {fn: interpreter._default_lookaside_map[fn] for fn in (bool, len, functools.partial.__call__)}
_thunder_handlers = {name: interpreter._default_opcode_handler_map[name]
                     for name in ("BINARY_OP", "BINARY_SUBSCR", "CONTAINS_OP", "DICT_MERGE", "LIST_EXTEND")}
_thunder_functions = {name: getattr(interpreter, name)
                      for name in ("_call_dispatch", "wrap_args_from_list", "wrap_kwargs_from_dict")}


def _wrapper_method(x: Any, name: str, types: tuple[type, ...] = _CONTAINERS) -> Callable | None:
    """The wrapper method Thunder's interpreter calls for `x`'s method `name` (`x` a wrapped builtin container, under
    provenance tracking, and the interpreter's lookaside for the method that wrapper method), else None."""
    ctx = get_interpretercompilectx()
    if not (isinstance(x, WrappedValue) and type(x.value) in types and ctx._with_provenance_tracking):
        return None
    method = getattr(type(x.value), name)
    wrapper_method = interpreter._default_provenance_tracking_lookaside_map.get(method)
    return wrapper_method if wrapper_method is not None and ctx.lookaside(method, x) is wrapper_method else None


def _opaque_result(value: Any, *inputs: WrappedValue) -> WrappedValue:
    return wrap(value, provenance=ProvenanceRecord(PseudoInst.OPAQUE, inputs=[i.provenance for i in inputs]))


def len_lookaside(obj: Any) -> Any:
    """``len(obj)``: a builtin container's wrapper ``__len__``, else Thunder's lookaside."""
    method = _wrapper_method(obj, "__len__")
    return _thunder_lookasides[len](obj) if method is None else method(obj)


def bool_lookaside(x: Any) -> Any:
    """``bool(x)``: a builtin container's length against 0, None's or a number's ``__bool__``, else Thunder's."""
    method = _wrapper_method(x, "__len__")
    if method is not None:
        length = method(x)
        return _opaque_result(length.value != 0, length)
    if isinstance(x, WrappedValue) and type(x.value) in _NUMBERS:
        return _opaque_result(type(x.value).__bool__(x.value), x)
    return _thunder_lookasides[bool](x)


def binary_op_handler(inst, /, stack, **kwargs) -> None | INTERPRETER_SIGNALS:
    """BINARY_OP of two ints or floats: computed, as Thunder's interpreted impl computes it through their methods;
    else Thunder's handler."""
    a, b = stack.getitem_wrapped(-2), stack.getitem_wrapped(-1)
    op = _OPERATORS[inst.arg % len(_OPERATORS)]
    if op is None or not all(isinstance(x, WrappedValue) and type(x.value) in (int, float) for x in (a, b)):
        return _thunder_handlers["BINARY_OP"](inst, stack=stack, **kwargs)
    stack.pop_wrapped(), stack.pop_wrapped()
    try:
        result = op(a.value, b.value)
    except Exception as e:
        return do_raise(e)
    stack.append(result)
    return None


def binary_subscr_handler(inst, /, stack, **kwargs) -> None | INTERPRETER_SIGNALS:
    """BINARY_SUBSCR (``c[i]``) of a builtin container: the wrapper's ``__getitem__``, else Thunder's handler."""
    container = stack.getitem_wrapped(-2)
    getitem = _wrapper_method(container, "__getitem__")
    if getitem is None:
        return _thunder_handlers["BINARY_SUBSCR"](inst, stack=stack, **kwargs)
    index = stack.pop_wrapped()
    stack.pop_wrapped()
    return interpreter.check_and_append(stack, getitem(container, index))


def wrap_args_from_list(items: Any) -> list:
    """The wrapped items of a call's ``*args``: a builtin sequence's through its ``__getitem__``, else Thunder's."""
    getitem = _wrapper_method(items, "__getitem__", (list, tuple))
    if getitem is None:
        return _thunder_functions["wrap_args_from_list"](items)
    return [getitem(items, wrap_const(i)) for i in range(len(items.value))]


def wrap_kwargs_from_dict(mapping: Any) -> dict:
    """The wrapped items of a call's ``**kwargs``: a dict's through its ``__getitem__``, else Thunder's."""
    getitem = _wrapper_method(mapping, "__getitem__", _MAPPINGS)
    if getitem is None:
        return _thunder_functions["wrap_kwargs_from_dict"](mapping)
    return {key: getitem(mapping, wrap_const(key)) for key in mapping.value}


def partial_call_lookaside(partial_object: Any, *args, **kwargs) -> Any:
    """A ``functools.partial`` without keywords (a proxy's method, ``x.view``) called: its function on its arguments
    and `args`, as Thunder's lookaside calls it without interpreting the merge of the arguments; else Thunder's."""
    if not (isinstance(partial_object, WrappedValue) and type(partial_object.value) is functools.partial
            and not partial_object.value.keywords):
        return _thunder_lookasides[functools.partial.__call__](partial_object, *args, **kwargs)
    func, bound = (interpreter._interpret_call(getattr, partial_object, wrap_const(name)) for name in ("func", "args"))
    if func is INTERPRETER_SIGNALS.EXCEPTION_RAISED or _wrapper_method(bound, "__getitem__", (tuple,)) is None:
        return _thunder_lookasides[functools.partial.__call__](partial_object, *args, **kwargs)
    return interpreter._interpret_call(func, *wrap_args_from_list(bound), *args, **kwargs)


def call_dispatch(compilectx, runtimectx, fn: Any, /, *args, **kwargs) -> Any:
    """A call of a Python method bound to an object: its function on the object and the arguments (Thunder
    interprets a function making that call); any other call Thunder's dispatch."""
    if not (isinstance(fn, WrappedValue) and type(fn.value) is types.MethodType
            and compilectx._with_provenance_tracking and not hasattr(fn.value, "__thunder_interpreter_orig_fn")):
        return _thunder_functions["_call_dispatch"](compilectx, runtimectx, fn, *args, **kwargs)
    function = interpreter._interpret_call(getattr, fn, wrap_const("__func__"))
    if function is INTERPRETER_SIGNALS.EXCEPTION_RAISED:
        return function
    bound_to = interpreter._interpret_call(getattr, fn, wrap_const("__self__"))
    if bound_to is INTERPRETER_SIGNALS.EXCEPTION_RAISED:
        return bound_to
    return interpreter._interpret_call(function, bound_to, *args, **kwargs)


def contains_handler(inst, /, stack, **kwargs) -> None | INTERPRETER_SIGNALS:
    """CONTAINS_OP: a str or int key in a dict through the wrapper's ``__contains__``, else Thunder's handler."""
    container, key = stack.getitem_wrapped(-1), stack.getitem_wrapped(-2)
    method = _wrapper_method(container, "__contains__", _MAPPINGS)
    if method is None or not isinstance(key, WrappedValue) or type(key.value) not in _KEYS:
        return _thunder_handlers["CONTAINS_OP"](inst, stack=stack, **kwargs)
    stack.pop_wrapped(), stack.pop_wrapped()
    result = method(container, key)
    if inst.arg == 1:
        result = interpreter._interpret_call(lambda result: not result, result)
        if result is INTERPRETER_SIGNALS.EXCEPTION_RAISED:
            return result
    stack.append(result)
    return None


def dict_merge_handler(inst, /, stack, co, **kwargs) -> None | INTERPRETER_SIGNALS:
    """DICT_MERGE (``f(**kw)``) of two dicts: the wrapper's ``update``, else Thunder's handler."""
    mapping, target = stack.getitem_wrapped(-1), stack.getitem_wrapped(-2)
    update = _wrapper_method(target, "update", _MAPPINGS)
    if update is None or _wrapper_method(mapping, "keys", _MAPPINGS) is None:
        return _thunder_handlers["DICT_MERGE"](inst, stack=stack, co=co, **kwargs)
    stack.pop_wrapped()
    if overlap := target.value.keys() & mapping.value:
        return do_raise(KeyError(f"{co.co_name} got multiple values for keyword argument {next(iter(overlap))}"))
    result = update(target, mapping)
    return result if result is INTERPRETER_SIGNALS.EXCEPTION_RAISED else None


def list_extend_handler(inst, /, stack, **kwargs) -> None | INTERPRETER_SIGNALS:
    """LIST_EXTEND (``[*a]``, ``f(*a)``) of a list: the wrapper's ``extend``, else Thunder's handler."""
    items, target = stack.getitem_wrapped(-1), stack.getitem_wrapped(-1 - inst.arg)
    extend = _wrapper_method(target, "extend", (list,))
    if extend is None or not isinstance(items, WrappedValue):
        return _thunder_handlers["LIST_EXTEND"](inst, stack=stack, **kwargs)
    stack.pop_wrapped()
    result = extend(target, items)
    return result if result is INTERPRETER_SIGNALS.EXCEPTION_RAISED else None


for _fn, _fast in ((bool, bool_lookaside), (len, len_lookaside), (functools.partial.__call__, partial_call_lookaside)):
    patches.declare(interpreter._default_lookaside_map, _fn, patches.dispatching(_fast, _thunder_lookasides[_fn]))
for _name, _fast in (("BINARY_OP", binary_op_handler), ("BINARY_SUBSCR", binary_subscr_handler),
                     ("CONTAINS_OP", contains_handler), ("DICT_MERGE", dict_merge_handler),
                     ("LIST_EXTEND", list_extend_handler)):
    patches.declare(interpreter._default_opcode_handler_map, _name,
                    patches.dispatching(_fast, _thunder_handlers[_name]))
for _name, _fast in (("_call_dispatch", call_dispatch), ("wrap_args_from_list", wrap_args_from_list),
                     ("wrap_kwargs_from_dict", wrap_kwargs_from_dict)):
    patches.declare(interpreter, _name, patches.dispatching(_fast, _thunder_functions[_name]))
