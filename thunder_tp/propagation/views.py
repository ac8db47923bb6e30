"""Rules for view-like ops: one generic propagation over how each output dim maps to input dims.

A view op is described by a `DimMap`: for each output dim, the input dim it is (`int`), or None
for a new dim. Reshapes group dims whose products match; a shard survives a reshape when it is on
the outermost dim of its group and lands on that group's outermost output dim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import thunder.core.prims as prims
import thunder.torch as ltorch
from thunder.core.proxies import NumberProxy, TensorProxy
from thunder.core.utils import extract_shape_from_varargs

from thunder_tp.layouts import PARTIAL, Partial, Shard, Split, canonical, held_chunks, local_blocks, local_size
from thunder_tp.layouts import local_shape as local_shape_of
from thunder_tp.propagation.engine import LocalFn, Op, Strategy, register_rule

DimMap = list[int | None]


def _through(op: Op, dim_map: DimMap, local=None) -> list[Strategy]:
    """Carry the input's shard (or Partial) to every output along `dim_map`; Replicate otherwise."""
    layout = op.layouts[0]
    strategies = [op.replicated()]
    n_out = len(op.outputs)
    if isinstance(layout, Partial):
        strategies.insert(0, Strategy((PARTIAL,), (PARTIAL,) * n_out))
    elif isinstance(layout, Shard) and layout.dim in dim_map:
        out_layout = layout.moved(dim_map.index(layout.dim))
        strategies.insert(0, Strategy((layout,), (out_layout,) * n_out, local))
    return strategies


def view_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of input and output dims with equal products."""
    groups, i, j = [], 0, 0
    while i < len(in_shape) and j < len(out_shape):
        gi, gj, pi, pj = [i], [j], in_shape[i], out_shape[j]
        while pi != pj:
            if pi < pj and i + 1 < len(in_shape):
                i += 1
                gi.append(i)
                pi *= in_shape[i]
            elif j + 1 < len(out_shape):
                j += 1
                gj.append(j)
                pj *= out_shape[j]
            else:
                break
        groups.append((gi, gj))
        i, j = i + 1, j + 1
    if groups:  # trailing size-1 dims join the last group
        groups[-1][0].extend(range(i, len(in_shape)))
        groups[-1][1].extend(range(j, len(out_shape)))
    return groups


@register_rule(ltorch.reshape, ltorch.view, prims.reshape, ltorch.flatten, ltorch.view_as)
def reshape(op: Op) -> list[Strategy]:
    """Shard on the outermost dim of a group moves to the group's outermost output dim."""
    x, out = op.tensors[0], op.outputs[0]
    layout = op.layouts[0]
    if not isinstance(layout, Shard):
        return _through(op, [])
    for gi, gj in view_groups(x.shape, out.shape):
        if layout.dim not in gi:
            continue
        # a replicated head may be 1 of 1
        def kept(shape, d):
            return shape[d] != 1 or layout.is_replicated
        outer_in = [d for d in gi if kept(x.shape, d)]
        outer_out = [d for d in gj if kept(out.shape, d)]
        if outer_in and outer_in[0] != layout.dim and len(outer_out) == 1:  # (B, T) -> (B * T): T's pieces, B times
            merged = _merged(layout, [x.shape[d] for d in outer_in], outer_in.index(layout.dim), outer_out[0])
            return [Strategy((layout,), (merged,), _local_reshape(op, merged)), op.replicated()]
        if not outer_in or outer_in[0] != layout.dim or not outer_out:
            break
        target = outer_out[0]
        if layout.blocks is not None and (len(outer_in) != 1 or len(outer_out) != 1):
            break
        out_layout = _reshaped(layout, x.shape[layout.dim], out.shape[target], target, op.tp.size)
        if out_layout is None:
            break
        return [Strategy((layout,), (out_layout,), _local_reshape(op, out_layout)), op.replicated()]
    return [op.replicated()]


def _merged(layout: Shard, sizes: list[int], at: int, dim: int) -> Shard:
    """The split of one output dim that merges input dims of `sizes` (`at`: the sharded one's place among them):
    every entry of the dims before it holds its blocks again, each as long as the dims after it make an entry."""
    outer, inner = math.prod(sizes[:at]), math.prod(sizes[at + 1:])
    blocks = tuple(b * inner for b in layout.blocks or (sizes[at],)) * outer
    splits = None if layout.splits is None else layout.splits * outer
    return Shard(dim, blocks, splits)


def _reshaped(layout: Shard, n_in: int, n_out: int, dim: int, size: int) -> Shard | None:
    """The split of output dim `dim` (length `n_out`) that a reshape makes of `layout`'s dim (length `n_in`, the
    outermost of the same run of entries): every rank's piece scaled by n_out / n_in, where that keeps it whole
    (e.g. whole heads of a head-split feature dim); None where no layout splits the output so."""
    if layout.blocks is not None:
        return layout.moved(dim) if n_in == n_out else None
    pieces = [held_chunks(layout, n_in, rank, size)[0] for rank in range(size)]
    if any((start * n_out) % n_in or (length * n_out) % n_in for start, length in pieces):
        return None
    wanted = [[(start * n_out // n_in, length * n_out // n_in)] for start, length in pieces]
    (split,) = layout.block_splits()
    for candidate in (Shard(dim), Shard(dim, splits=(split or Split(n_in),))):
        split_out = candidate.block_splits()[0]
        if split_out is not None and n_out % split_out.units:
            continue
        candidate = canonical(candidate, n_out, size)
        if [held_chunks(candidate, n_out, rank, size) for rank in range(size)] == wanted:
            return candidate
    return None


def _local_reshape(op: Op, out_layout: Shard) -> LocalFn:
    """The reshape of one rank's piece: to the shape the op asks for (its own arguments, with local values of
    numbers, so that shapes of symbolic values stay symbolic), the sharded dim divided (a -1 there stays); where
    it asks for none (flatten, view_as, a dtype view), to the local output shape."""
    tp = op.tp
    if not _asks_for_shape(op):
        local_shape = local_shape_of(op.outputs[0].shape, out_layout, tp.size, tp.rank)
        return lambda a, *_, **__: ltorch.reshape(a, local_shape)

    def local(a: TensorProxy, *shape: int | NumberProxy) -> TensorProxy:
        shape = list(extract_shape_from_varargs(shape))
        if shape[out_layout.dim] != -1:
            shape[out_layout.dim] = local_size(shape[out_layout.dim], out_layout, tp.size, tp.rank)
        return ltorch.reshape(a, shape)

    return local


def _asks_for_shape(op: Op) -> bool:
    """Whether the op is a reshape or view called with the shape of its output (sizes, maybe one -1)."""
    if op.bsym.sym.id not in (ltorch.reshape.id, ltorch.view.id, prims.reshape.id):
        return False
    shape = extract_shape_from_varargs(op.bsym.args[1:])
    return len(shape) == op.outputs[0].ndim and all(isinstance(s, (int, NumberProxy)) for s in shape)


def _permutation(op: Op) -> DimMap:
    ndim = op.tensors[0].ndim
    sym = op.bsym.sym.name
    if op.bsym.sym.id == prims.transpose.id:  # prims.transpose(a, permutation): named like torch's, not alike
        return [d % ndim for d in op.bsym.args[1]]
    if sym in ("transpose", "t"):
        d0, d1 = (op.arg("dim0", 0), op.arg("dim1", 1)) if sym == "transpose" else (0, 1)
        perm = list(range(ndim))
        d0, d1 = d0 % ndim, d1 % ndim
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return perm
    if sym == "movedim":
        src, dst = op.arg("source") % ndim, op.arg("destination") % ndim
        perm = [d for d in range(ndim) if d != src]
        perm.insert(dst, src)
        return perm
    dims = op.bsym.args[1:] if sym == "permute" and not isinstance(op.bsym.args[1], Sequence) else op.bsym.args[1]
    return [d % ndim for d in dims]


@register_rule(ltorch.transpose, ltorch.permute, ltorch.movedim, ltorch.t, prims.transpose)
def permute(op: Op) -> list[Strategy]:
    """Dims move with the permutation."""
    return _through(op, _permutation(op))


@register_rule(ltorch.unsqueeze)
def unsqueeze(op: Op) -> list[Strategy]:
    """A new size-1 dim shifts the dims after it."""
    out = op.outputs[0]
    new = op.arg("dim") % out.ndim
    return _through(op, [None if d == new else d - (d > new) for d in range(out.ndim)])


@register_rule(ltorch.squeeze)
def squeeze(op: Op) -> list[Strategy]:
    """Removed size-1 dims shift the dims after them."""
    x, out = op.tensors[0], op.outputs[0]
    return _through(op, _match_dims(x.shape, out.shape))


def _match_dims(in_shape: Sequence[int], out_shape: Sequence[int]) -> DimMap:
    """Map each output dim to the input dim it keeps, skipping input size-1 dims that disappeared."""
    dim_map, i = [], 0
    for size in out_shape:
        while i < len(in_shape) and in_shape[i] != size and in_shape[i] == 1:
            i += 1
        dim_map.append(i if i < len(in_shape) else None)
        i += 1
    return dim_map


def _broadcast_map(in_shape: Sequence[int], out_shape: Sequence[int], dims: Sequence[int]) -> DimMap:
    dim_map: DimMap = [None] * len(out_shape)
    for i, o in enumerate(dims):
        if in_shape[i] == out_shape[o]:
            dim_map[o] = i
    return dim_map


@register_rule(ltorch.expand, ltorch.expand_as)
def expand(op: Op) -> list[Strategy]:
    """Expanded (size-1) dims are new; the others keep their shard; the local target shrinks."""
    x, out = op.tensors[0], op.outputs[0]
    offset = out.ndim - x.ndim
    dim_map = _broadcast_map(x.shape, out.shape, [i + offset for i in range(x.ndim)])
    return _through(op, dim_map, _local_target(op, dim_map, lambda a, shape: ltorch.expand(a, shape)))


@register_rule(prims.broadcast_in_dim)
def broadcast_in_dim(op: Op) -> list[Strategy]:
    """Like expand, with explicit broadcast dims."""
    x, out = op.tensors[0], op.outputs[0]
    dims = op.bsym.args[2]
    dim_map = _broadcast_map(x.shape, out.shape, dims)
    return _through(op, dim_map, _local_target(op, dim_map, lambda a, shape: prims.broadcast_in_dim(a, shape, dims)))


def _local_target(op: Op, dim_map: DimMap, call):
    layout = op.layouts[0]
    if not isinstance(layout, Shard) or layout.dim not in dim_map:
        return None
    shape = local_shape_of(op.outputs[0].shape, layout.moved(dim_map.index(layout.dim)), op.tp.size, op.tp.rank)
    return lambda a, *_, **__: call(a, shape)


def _getitem_map(shape: Sequence[int], key) -> DimMap | None:
    """Output->input dims of basic indexing; dims that are sliced map to None (not shard-preserving), dims taken
    whole (`:`, or e.g. HF's `0:` of logits_to_keep=0) to themselves."""
    ndim = len(shape)
    key = key if isinstance(key, tuple) else (key,)
    consumed = sum(1 for k in key if k is not None and k is not Ellipsis)
    dim_map: DimMap = []
    i = 0
    for k in key:
        if k is Ellipsis:
            dim_map.extend(range(i, i + ndim - consumed))
            i += ndim - consumed
        elif k is None:
            dim_map.append(None)
        elif isinstance(k, slice):
            dim_map.append(i if k.indices(shape[i]) == (0, shape[i], 1) else None)
            i += 1
        elif isinstance(k, int):
            i += 1
        else:
            return None  # advanced indexing
    dim_map.extend(range(i, ndim))
    return dim_map


@register_rule(ltorch.getitem)
def getitem(op: Op) -> list[Strategy]:
    """Basic indexing keeps a shard on a dim it takes whole."""
    dim_map = _getitem_map(op.tensors[0].shape, op.bsym.args[1])
    if dim_map is None or len(op.tensors) != 1:
        return [op.replicated()]
    return _through(op, dim_map)


@register_rule(ltorch.split, ltorch.chunk, ltorch.tensor_split)
def split(op: Op) -> list[Strategy]:
    """Splitting another dim keeps the shard; splitting a blocked dim at its blocks shards each piece."""
    x, layout = op.tensors[0], op.layouts[0]
    dim = op.arg("dim", 0) % x.ndim
    if not isinstance(layout, Shard) or layout.dim != dim:
        return _through(op, list(range(x.ndim)))
    sizes = tuple(o.shape[dim] for o in op.outputs)
    if layout.blocks != sizes:
        return [op.replicated()]
    local = local_blocks(sizes, layout.splits, op.tp.size, op.tp.rank)
    outputs = tuple(canonical(Shard(dim, splits=(split,)), size, op.tp.size)
                    for size, split in zip(sizes, layout.block_splits(), strict=True))
    return [
        Strategy((layout,), outputs, lambda a, *_, **__: ltorch.split(a, local, dim)),
        op.replicated(),
    ]


@register_rule(ltorch.cat, ltorch.stack)
def concatenate(op: Op) -> list[Strategy]:
    """Concatenating along another dim keeps a common shard; Partials concatenate to a Partial."""
    out = op.outputs[0]
    dim = op.arg("dim", 0) % out.ndim
    stack = op.bsym.sym.name == "stack"
    strategies = [op.replicated()]
    if all(isinstance(x, Partial) for x in op.layouts):
        strategies.insert(0, Strategy((PARTIAL,) * len(op.tensors), (PARTIAL,)))
    for layout in {x for x in op.layouts if isinstance(x, Shard) and (x.dim != dim or stack)}:
        out_dim = layout.dim + (stack and layout.dim >= dim)
        strategies.insert(0, Strategy((layout,) * len(op.tensors), (layout.moved(out_dim),)))
    return strategies


@register_rule(ltorch.repeat_interleave)
def repeat_interleave(op: Op) -> list[Strategy]:
    """Repeating whole entries of the sharded dim keeps the shard (each rank repeats its own entries)."""
    x, layout = op.tensors[0], op.layouts[0]
    dim, repeats = op.arg("dim"), op.arg("repeats")
    if len(op.tensors) != 1 or dim is None or op.arg("output_size") is not None or not isinstance(repeats, int):
        return [op.replicated()]
    dim %= x.ndim
    if not isinstance(layout, Shard) or layout.dim != dim or layout.blocks is not None:
        return _through(op, list(range(x.ndim)))
    (split,) = layout.block_splits()
    n = x.shape[dim]
    if layout.is_replicated:
        return [*_replicated_heads_repeated(op, split, n, repeats, dim), op.replicated()]
    repeated = canonical(Shard(dim, splits=(split or Split(n),)), n * repeats, op.tp.size)
    return [Strategy((layout,), (repeated,)), op.replicated()]


def _replicated_heads_repeated(op: Op, split: Split, n: int, repeats: int, dim: int) -> list[Strategy]:
    """Heads each held whole by several ranks (K/V heads shared by the query heads of those ranks), repeated
    `repeats` times: the copies of a head are split over its ranks, as the query heads that use them are."""
    if split.units != n:
        return []
    out = canonical(Shard(dim, splits=(Split(n * repeats, n),)), n * repeats, op.tp.size)
    copies = local_size(n * repeats, out, op.tp.size, op.tp.rank)

    def local(a, *_, **__):
        return ltorch.repeat_interleave(a, copies, dim)

    return [Strategy((Shard(dim, splits=(split,)),), (out,), local)]


@register_rule("torch.view_as_complex")
def view_as_complex(op: Op) -> list[Strategy]:
    """The trailing (real, imaginary) pair becomes one complex number: every other dim keeps its shard."""
    return _through(op, list(range(op.outputs[0].ndim)))


@register_rule("torch.view_as_real")
def view_as_real(op: Op) -> list[Strategy]:
    """Each complex number becomes a trailing (real, imaginary) pair: the dims keep their shards."""
    return _through(op, [*range(op.tensors[0].ndim), None])


@register_rule(prims.update_aliases)
def update_aliases(op: Op) -> list[Strategy]:
    """Thunder's marker that in-place writes reached these aliases: each keeps its layout."""
    return [Strategy(tuple(op.layouts), tuple(op.layouts))]
