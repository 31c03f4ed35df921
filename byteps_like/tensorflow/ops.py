"""TensorFlow tensors through the core: push_pull, broadcast and gradient groups, in eager mode
and inside ``tf.function``.

TF cannot lend its memory to another library, so a tensor travels as a numpy copy
(``tensor.numpy()``), is summed in place by the core, and comes back with
``tf.convert_to_tensor``. Inside a graph the same eager code runs in one ``tf.py_function`` per
operation (one for a whole gradient list, so the gradients' order on the wire is the one the
synchroniser chooses, not TF's scheduling). Names are fixed when the graph is traced.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from ..compression import Compression, Compressor, resolve
from ..worker.runtime import default_runtime
from ..worker.sync import GradBuffer, GradientSynchronizer, dtype_layout, model_signature_check

WIRE_DTYPE = {tf.float32: "float32", tf.float64: "float64", tf.float16: "float16",
              tf.bfloat16: "bfloat16", tf.int32: "int32", tf.int64: "int64"}


def wire_dtype(dtype: Any, what: str = "tensor") -> str:
    try:
        return WIRE_DTYPE[tf.as_dtype(dtype)]
    except KeyError:
        raise TypeError(f"{what} has dtype {tf.as_dtype(dtype).name}; push_pull sums "
                        f"{', '.join(d.name for d in WIRE_DTYPE)}") from None


def _to_numpy(t: tf.Tensor) -> tuple[np.ndarray, str]:
    """A writable C-contiguous numpy copy of eager tensor ``t`` and its wire dtype."""
    dtype = wire_dtype(t.dtype)
    arr = np.array(t.numpy(), copy=True, order="C")
    if dtype == "bfloat16":
        arr = arr.view(np.uint16)
    return arr, dtype


def _from_numpy(arr: np.ndarray, dtype: tf.DType) -> tf.Tensor:
    if dtype == tf.bfloat16:
        return tf.bitcast(tf.convert_to_tensor(arr.view(np.uint16)), tf.bfloat16)
    return tf.convert_to_tensor(arr)


ArraysFn = Callable[[list, list], None]   # (numpy arrays, wire dtypes) -> results in place


def run_on_arrays(tensors: Sequence[tf.Tensor], fn: ArraysFn) -> list[tf.Tensor]:
    """Apply ``fn`` to numpy copies of ``tensors``: directly when eager, as one
    ``tf.py_function`` inside a graph. Returns new tensors of the same dtypes and shapes."""
    tensors = list(tensors)
    if not tensors:
        return []

    def eager(*ts):
        pairs = [_to_numpy(t) for t in ts]
        arrays = [a for a, _ in pairs]
        fn(arrays, [d for _, d in pairs])
        return [_from_numpy(a, t.dtype) for a, t in zip(arrays, ts)]

    if tf.executing_eagerly():
        return eager(*tensors)
    outs = tf.py_function(eager, inp=tensors, Tout=[t.dtype for t in tensors])
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    for o, t in zip(outs, tensors):
        o.set_shape(t.shape)
    return outs


def push_pull_arrays(arrays: list, dtypes: list, names: list, average: bool,
                     compression: Compressor, priorities: list) -> None:
    """Start every push_pull, then wait for all: the sums land in ``arrays``."""
    rt = default_runtime()
    pending, errors = [], []
    # in place; a codec, or a cast compressor (fp16), runs in the runtime's pipeline
    for arr, dt, name, pr in zip(arrays, dtypes, names, priorities):
        pending.append(rt.push_pull_async(arr, name=name, average=average, priority=pr,
                                          out=arr, dtype=dt, compression=compression))
    for h in pending:
        try:
            h.wait()
        except Exception as exc:  # noqa: BLE001 - the first is raised after all finished
            errors.append(exc)
    if errors:
        raise errors[0]


def _name_of(tensor: Any, scope: str, name: str | None, what: str) -> str:
    rt = default_runtime()
    if name:
        return f"{what}.{scope}{name}"
    if not tf.executing_eagerly() and getattr(tensor, "name", None):
        # traced once: the graph's tensor name is the same on every worker running this code
        return f"{what}.{scope}{tensor.name.replace(':', '_')}"
    # eager: BytePS's sequence of unnamed tensors (pass name= for a push_pull in a loop)
    return f"{scope}{rt.auto_name()}"


def densify(grad: Any, what: str) -> Any:
    if isinstance(grad, tf.IndexedSlices):
        shape = grad.dense_shape
        warnings.warn(
            f"{what} is a tf.IndexedSlices (a sparse gradient, e.g. of an embedding lookup); "
            "byteps_like converts it to a dense tensor of the whole variable "
            f"(dense shape {shape.numpy().tolist() if tf.executing_eagerly() else shape}) "
            "before push_pull, which may need far more memory and bandwidth than the slices",
            UserWarning, stacklevel=3)
        return tf.convert_to_tensor(grad)
    return grad


def push_pull(tensor: Any, scope: str = "", average: bool | None = None,
              device_dense: str = "", device_sparse: str = "",
              compression: Compressor = Compression.none, op: Any = None,
              enable_async: bool = False, name: str | None = None,
              priority: int = 0) -> tf.Tensor:
    """Sum (``average=True``, the default: average) ``tensor`` over all workers.

    Eager and in ``tf.function``; differentiable (the gradient of the result is push_pulled
    back). ``device_*``, ``op`` and ``enable_async`` are accepted for BytePS compatibility.
    In eager mode an unnamed call takes the next name of BytePS's noname sequence, a new key
    per call: pass ``name=`` for a push_pull repeated in a loop."""
    average = True if average is None else bool(average)
    rt = default_runtime()
    rt.check()
    tensor = densify(tensor, "push_pull's tensor")
    tensor = tf.convert_to_tensor(tensor)
    wire_dtype(tensor.dtype, f"push_pull of {name or 'a tensor'}")
    full = _name_of(tensor, scope, name, "PushPull")

    def run(t, n):
        return run_on_arrays([t], lambda a, d: push_pull_arrays(
            a, d, [n], average, compression, [priority]))[0]

    if not tensor.dtype.is_floating:
        return run(tensor, full)

    @tf.custom_gradient
    def _op(x):
        def grad(dy):
            return run(tf.convert_to_tensor(dy), full + ".grad")
        return run(x, full), grad

    return _op(tensor)




def _broadcast_arrays(arrays: list, dtypes: list, names: list, root_rank: int) -> None:
    rt = default_runtime()
    from ..worker.broadcast import _check_root
    _check_root(rt, root_rank)
    if rt.rank() != root_rank:
        for a in arrays:
            a[...] = 0
    push_pull_arrays(arrays, dtypes, names, False, Compression.none, [0] * len(arrays))


def _summable(t: tf.Tensor) -> tuple[tf.Tensor, tf.DType]:
    """(t in a dtype the servers can sum exactly, t's dtype): bool and small ints as int64."""
    if tf.as_dtype(t.dtype) in WIRE_DTYPE:
        return t, t.dtype
    if t.dtype.is_floating or t.dtype.is_complex:
        raise TypeError(f"broadcast of a {t.dtype.name} tensor is not supported")
    return tf.cast(t, tf.int64), t.dtype


def broadcast_tensors(tensors: Sequence[Any], root_rank: int, names: Sequence[str]) -> list:
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    pairs = [_summable(t) for t in tensors]
    outs = run_on_arrays([p for p, _ in pairs],
                         lambda a, d: _broadcast_arrays(a, d, list(names), root_rank))
    return [o if o.dtype == dt else tf.cast(o, dt) for o, (_, dt) in zip(outs, pairs)]


def broadcast(tensor: Any, root_rank: int, scope: str = "", name: str | None = None,
              is_variable: bool = True) -> tf.Tensor:
    """The root rank's value of ``tensor`` on every rank (eager and in ``tf.function``)."""
    rt = default_runtime()
    rt.check()
    tensor = tf.convert_to_tensor(tensor)
    full = _name_of(tensor, scope, name, "Broadcast")
    return broadcast_tensors([tensor], root_rank, [full])[0]


def allgather(tensor: Any, name: str | None = None) -> tf.Tensor:
    """Horovod's ``allgather``: every rank's ``tensor`` concatenated along the first axis in rank
    order; the first dimension may differ between ranks (eager and in ``tf.function``; not
    differentiable)."""
    return _allgather(tensor, name)


def _allgather(tensor: Any, name: str | None, max_rows: int | None = None,
               bound: str = "") -> tf.Tensor:
    from ..worker.broadcast import allgather_array
    tensor = tf.convert_to_tensor(tensor)
    rt = default_runtime()

    def eager(t):
        arr, dtype = _to_numpy(t)
        return _from_numpy(allgather_array(rt, arr, name, dtype, max_rows=max_rows,
                                           bound=bound), t.dtype)

    if tf.executing_eagerly():
        return eager(tensor)
    out = tf.py_function(eager, inp=[tensor], Tout=tensor.dtype)
    out.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
    return out


def var_name(v: Any, index: int) -> str:
    n = getattr(v, "path", None) or getattr(v, "name", None) or "tensor"
    return f"{index}.{str(n).replace(':', '_')}"


def broadcast_variables(variables: Sequence[Any], root_rank: int, scope: str = "",
                        prefix: str = "BroadcastVariables.") -> None:
    """Assign the root rank's values to ``variables`` (tf.Variable or Keras variables), all
    in flight at once. Eager and in ``tf.function``."""
    rt = default_runtime()
    rt.check()
    variables = list(variables)
    names = [f"{prefix}{scope}{var_name(v, i)}" for i, v in enumerate(variables)]
    values = broadcast_tensors([tf.convert_to_tensor(v) for v in variables], root_rank, names)
    for v, val in zip(variables, values):
        v.assign(val)


# -- gradient lists: the core's GradientSynchronizer ------------------------------------------
class GradientGroup:
    """One GradientSynchronizer per list of gradient names: every gradient of a step starts at
    once, first variable first (highest priority), and the step waits for all of them."""

    def __init__(self, names: Sequence[str], prefix: str, compression: Compressor,
                 average: bool, layout: Sequence[tuple[int, Any, int]] | None = None):
        self._arrays: list = []
        self._dtypes: list = []
        self.sync = GradientSynchronizer(default_runtime(), names, self._buffer,
                                         compression=compression, average=average,
                                         prefix=prefix, layout=layout)

    def _buffer(self, index: int) -> GradBuffer:
        return GradBuffer(self._arrays[index], self._dtypes[index])

    def run(self, arrays: list, dtypes: list) -> None:
        self._arrays, self._dtypes = arrays, dtypes
        try:
            self.sync.synchronize()  # one training step (a tape's gradient, a Keras apply)
        finally:
            self._arrays, self._dtypes = [], []


_groups: dict = {}


def push_pull_rows(grad: tf.IndexedSlices, name: str, average: bool = True,
                   max_rows: int | None = None) -> tf.IndexedSlices:
    """A sparse gradient (of an embedding lookup) averaged as rows, never made dense: each
    worker sums its rows per unique index, pads them to a power of two (at least 64; so a
    server keeps a few sizes, not one per step), and every worker gathers every worker's rows
    (:func:`allgather`, through the servers); the values are divided by the number of workers.
    The result's indices may repeat (rows several workers touched): optimizers add them up.
    Eager and in ``tf.function``. Bounded: a worker's unique rows (padded) may be at most
    ``max_rows`` (default BYTEPS_SPARSE_MAX_IDS); over it every worker raises (a ValueError,
    in ``tf.function`` wrapped by TensorFlow) naming the ranks, before the gather is made."""
    rt = default_runtime()
    if max_rows is None:
        max_rows, bound = rt.config.server.sparse_max_ids, "BYTEPS_SPARSE_MAX_IDS"
    else:
        bound = "max_rows"
    uniq, pos = tf.unique(tf.cast(grad.indices, tf.int64))
    n = tf.shape(uniq)[0]
    values = tf.math.unsorted_segment_sum(grad.values, pos, n)
    padded = tf.maximum(64, tf.cast(2.0 ** tf.math.ceil(
        tf.math.log(tf.cast(tf.maximum(n, 1), tf.float64)) / np.log(2.0)), tf.int32))
    extra = padded - n
    ids = tf.concat([uniq, -tf.ones([extra], tf.int64)], 0)
    rows = tf.pad(values, tf.concat([[[0, extra]], tf.zeros([tf.rank(values) - 1, 2],
                                                            tf.int32)], 0))
    all_ids = _allgather(ids, f"{name}.ids", max_rows, bound)
    all_rows = _allgather(rows, f"{name}.rows", max_rows, bound)
    keep = all_ids >= 0
    all_rows = tf.boolean_mask(all_rows, keep)
    if average:
        all_rows = all_rows / tf.cast(rt.size(), all_rows.dtype)
    return tf.IndexedSlices(all_rows, tf.boolean_mask(all_ids, keep), grad.dense_shape)


def push_pull_gradients(grads: Sequence[Any], variables: Sequence[Any] | None,
                        compression: Compressor = Compression.none, average: bool = True,
                        prefix: str = "Gradient.", sparse_as_dense: bool = True) -> list:
    """Average a list of gradients (None stays None). IndexedSlices become dense, with a
    warning; with ``sparse_as_dense=False`` they travel as rows (:func:`push_pull_rows`).
    Names come from the variables (index and path), so they match across workers."""
    rt = default_runtime()
    rt.check()
    compression = resolve(compression, rt.cfg)  # BYTEPS_COMPRESSOR* when left at the default
    if compression is not Compression.none:  # the wire dtype is part of a key's declaration
        prefix = f"{prefix}{compression.name}."
    grads = list(grads)
    variables = list(variables) if variables is not None else [None] * len(grads)
    names = [var_name(v, i) for i, v in enumerate(variables)]
    idx = [i for i, g in enumerate(grads) if g is not None]
    rows = [] if sparse_as_dense else [i for i in idx if isinstance(grads[i], tf.IndexedSlices)]
    idx = [i for i in idx if i not in rows]
    result: list = list(grads)
    for i in rows:
        result[i] = push_pull_rows(grads[i], f"{prefix}{names[i]}", average)
    if not idx:
        return result
    dense = [tf.convert_to_tensor(densify(grads[i], f"the gradient of {names[i]!r}"))
             for i in idx]
    for i, g in zip(idx, dense):
        wire_dtype(g.dtype, f"the gradient of {names[i]!r}")
    key = (id(rt), tuple(names[i] for i in idx), prefix, compression, average)
    group = _groups.get(key)
    if group is None:
        if rt.size() > 1:  # before declaring: the workers' declarations must match
            model_signature_check(rt, [(names[i], tuple(g.shape.as_list()), g.dtype.name)
                                       for i, g in zip(idx, dense)], "model")
        # tensor fusion: each gradient's bytes, and its dtype (only one dtype shares a bucket)
        layout = dtype_layout([(g.shape.num_elements() * g.dtype.size, g.dtype.name)
                               for g in dense], compression, rt.cfg)
        group = _groups[key] = GradientGroup(key[1], prefix, compression, average, layout)
    outs = run_on_arrays(dense, group.run)
    for i, o in zip(idx, outs):
        result[i] = o
    return result
