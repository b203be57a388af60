"""TensorFlow layer of hvd: Horovod's ``horovod.tensorflow`` API as TensorFlow ops over the numpy-level collectives.

Nothing is compiled against TensorFlow. In graph mode (``tf.compat.v1`` sessions, ``tf.function``) each collective is
a ``tf.numpy_function`` node that runs hvd's numpy API when the graph runs, named after the node (unique in its graph,
the same on every rank that builds the same graph); in eager mode it runs at once. Gradients are those Horovod
registers for its ops (``tf.custom_gradient``). What cannot work this way: XLA (``jit_compile=True``) cannot compile
a ``numpy_function``, and tensors are copied through host memory (hvd's collectives take CPU buffers).
"""

import os
import re

from hvd import _frameworks

tf = _frameworks.require("tensorflow", "hvd.tensorflow", "TensorFlow", "tensorflow")

import numpy as np

import hvd as _core
from hvd import _compression
from hvd import _tf_numpy as _tfnp

_core._reexport(globals(), tensor_ops=False)

# A collective node of a ``tf.compat.v1`` graph holds one of its session's inter-op threads until every rank has
# submitted it. With as many threads as cores (TensorFlow's default: 2 on a 2-core host), two ranks that start
# different collectives of one graph first would wait for each other forever; with 64 the ready collectives of any
# ordinary graph all start. Only sessions need them: eager ops run one at a time, and in a ``tf.function`` (Keras'
# steps) the collectives, stateful ops, run in program order (automatic control dependencies). So the sessions made
# after this import get 64 inter-op threads unless their config or ``TF_NUM_INTEROP_THREADS`` says otherwise, and
# eager execution keeps TensorFlow's default: 64 threads there made TF2 training on 2 cores a fifth slower
# (docs/horovod.md, Performance against Horovod 0.28.1).
# TensorFlow sizes the sessions' shared pool from the first session's config.
_INTEROP_THREADS = 64


def _session_interop_threads(base_init, context):
    def __init__(self, target="", graph=None, config=None):
        if "TF_NUM_INTEROP_THREADS" not in os.environ:
            if config is None:
                config = context.context().config
            if isinstance(config, tf.compat.v1.ConfigProto) and config.inter_op_parallelism_threads == 0:
                own = tf.compat.v1.ConfigProto()
                own.CopyFrom(config)
                own.inter_op_parallelism_threads = max(_INTEROP_THREADS, os.cpu_count() or 1)
                config = own
        base_init(self, target, graph, config)

    __init__.hvd_base_init = base_init
    return __init__


def _patch_sessions():
    try:
        from tensorflow.python.client import session
        from tensorflow.python.eager import context

        base_init = session.BaseSession.__init__
        context.context
    except (ImportError, AttributeError):
        # A TensorFlow without these modules: every pool gets the threads (eager execution too, slower on small hosts).
        os.environ.setdefault("TF_NUM_INTEROP_THREADS", str(max(_INTEROP_THREADS, os.cpu_count() or 1)))
        return
    if not hasattr(base_init, "hvd_base_init"):
        session.BaseSession.__init__ = _session_interop_threads(base_init, context)


_patch_sessions()


class _CastCompressor(_compression.CastCompressor):
    """Floating-point tensors travel as a subclass's ``dtype`` and come back in their own dtype."""

    is_floating = staticmethod(lambda dtype: dtype.is_floating)
    cast = staticmethod(tf.cast)


class _FP16Compressor(_CastCompressor):
    """Sends floating-point tensors as float16 and casts results back."""

    dtype = tf.float16


class Compression:
    """Gradient compression for the reductions: ``none`` or ``fp16``."""

    none = _compression.NoneCompressor
    fp16 = _FP16Compressor

# Not an hvd.h reduce op: hvd has no Adasum, so every collective refuses it with NotImplementedError (as Horovod's
# own refusals are). Any value unlike the five reduce ops would do.
Adasum = 101

_REDUCE_OPS = (_core.Sum, _core.Average, _core.Min, _core.Max, _core.Product)


# ---------------------------------------------------------------------------------------------------------------
# Helpers: modes, names, dtypes, errors


def _executing_eagerly():
    return tf.executing_eagerly()


def _normalize_name(name):
    return re.sub("[^a-zA-Z0-9_]", "_", name)


def _resolve_op(op, average, default=_core.Average):
    if op is not None and average is not None:
        raise ValueError("pass either op or average, not both")
    if op is None:
        op = default if average is None else (_core.Average if average else _core.Sum)
    if op == Adasum:
        raise NotImplementedError("hvd does not implement the Adasum reduction: use op=hvd.Average or op=hvd.Sum")
    if op not in _REDUCE_OPS:
        raise ValueError("unknown op {!r}: use hvd.Sum, hvd.Average, hvd.Min, hvd.Max or hvd.Product".format(op))
    return op


_ps = _tfnp._ps
_set_size = _tfnp.set_size
_set_rank = _tfnp.set_rank


def _tf_error(e):
    """The TensorFlow error a failed collective raises (Horovod's ops report a disagreement between the ranks as
    FailedPreconditionError)."""
    message = str(e)
    if isinstance(e, _core.MismatchError):
        return tf.errors.FailedPreconditionError(None, None, message)
    if isinstance(e, (_core.InvalidArgumentError, ValueError, TypeError)):
        return tf.errors.InvalidArgumentError(None, None, message)
    if isinstance(e, _core.NotInitializedError):
        return tf.errors.FailedPreconditionError(None, None, message)
    if isinstance(e, NotImplementedError):
        return tf.errors.UnimplementedError(None, None, message)
    return tf.errors.UnknownError(None, None, "{}: {}".format(type(e).__name__, message))


# ---------------------------------------------------------------------------------------------------------------
# The op wrapper


def _op_name(kind, tensors, name, ignore_name_scope=False):
    """The graph node's requested name (graph mode): Horovod's scheme, ``Horovod<Kind>_<input name>``."""
    if name is not None:
        return _normalize_name(name)
    first = getattr(tensors[0], "name", None) or "tensor"
    if len(tensors) > 1:
        last = getattr(tensors[-1], "name", None) or "tensor"
        return _normalize_name("Horovod{}_{}_{}".format(kind, first, last))
    return _normalize_name("Horovod{}_{}".format(kind, first))


def _run(kind, fn, tensors, touts, name, ignore_name_scope=False):
    """Runs ``fn(hvd_name, *numpy arrays) -> list of arrays`` as an op: at once in eager mode (hvd name: ``name``,
    None for unnamed), as a ``numpy_function`` node in a graph (hvd name: the node's unique name)."""
    if tf.executing_eagerly():
        arrays = [t.numpy() if hasattr(t, "numpy") else np.asarray(t) for t in tensors]
        try:
            outs = fn(name, *arrays)
        except tf.errors.OpError:
            raise
        except (_core.HvdError, ValueError, TypeError) as e:
            raise _tf_error(e) from e
        return [tf.convert_to_tensor(o, dtype=d) for o, d in zip(outs, touts)]
    cell = []
    node_name = _op_name(kind, tensors, name, ignore_name_scope)
    np_types = [tf.as_dtype(d).as_numpy_dtype for d in touts]

    def run(*arrays):
        # A numpy_function fails with the class TensorFlow maps the Python exception to (ValueError and TypeError,
        # so hvd's InvalidArgumentError: InvalidArgumentError; others: UnknownError), never FailedPreconditionError:
        # a disagreement between the ranks comes back as a message in the last output.
        try:
            return list(fn(cell[0], *arrays)) + [np.bytes_(b"")]
        except (_core.MismatchError, _core.NotInitializedError) as e:
            text = "{}: {}".format(type(e).__name__, e).replace("/", "|")
            message = "/hvd collective failed: {}".format(text).encode("utf-8", "replace")
            # Kept under PATH_MAX (4096), past which the write fails with ENAMETOOLONG (InvalidArgument) instead.
            if len(message) > _FAILURE_BYTES:
                message = message[:_FAILURE_BYTES].decode("utf-8", "ignore").encode("utf-8") + b"..."
            return [np.zeros(0, t) for t in np_types] + [np.bytes_(message)]

    outs = tf.numpy_function(run, list(tensors), list(touts) + [tf.string], name=node_name, stateful=True)
    outs, failure = list(outs[:-1]), outs[-1]
    cell.append(failure.op.name)
    # Raises the message as FailedPreconditionError, as Horovod's ops do: the node writes nothing to /dev/null when
    # the collective succeeded, else to a path below it, which fails with ENOTDIR, and TensorFlow reports that as
    # FailedPrecondition with the path (the message) in its text. A write, because only a stateful node keeps its
    # control edge (grappler drops those of a read); no tf.cond, because every cond adds two functions to the graph,
    # which each session run of a growing graph processes again.
    check = tf.io.write_file(tf.strings.join(["/dev/null", failure]), "")
    with tf.control_dependencies([check]):
        return [tf.identity(o) for o in outs]


# The most bytes of a failure's message a graph-mode collective raises (see `_run`).
_FAILURE_BYTES = 3000


def _check_set(process_set):
    """Refuses, when the op is made, a process set that is not one of the job's (never added, removed, or an id set
    by hand) with a ``ValueError``, as Horovod's ops do (its ``process_set.size()`` does)."""
    if process_set is None:
        return
    ps_id = getattr(process_set, "process_set_id", None)
    if ps_id == 0 or (ps_id is not None and ps_id in _core._SETS):
        return
    raise ValueError("{} is not a process set of this job (never added, removed, or its id set by hand): add it "
                     "with hvd.add_process_set or hvd.init(process_sets=...)".format(process_set))


def _tensor(x):
    if isinstance(x, tf.IndexedSlices):
        return x
    return tf.convert_to_tensor(x)


# ---------------------------------------------------------------------------------------------------------------
# Collectives with gradients (Horovod's registered gradients)


def _allreduce(tensor, name=None, op=_core.Sum, prescale_factor=1.0, postscale_factor=1.0, process_set=None,
               ignore_name_scope=False):
    return _grouped_allreduce([tensor], name, op, prescale_factor, postscale_factor, process_set,
                              ignore_name_scope, kind="Allreduce")[0]


def _grouped_allreduce(tensors, name=None, op=_core.Sum, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=None, ignore_name_scope=False, kind="GroupedAllreduce"):
    _check_set(process_set)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    dtypes = [t.dtype for t in tensors]

    @tf.custom_gradient
    def reduce(*xs):
        def fn(hvd_name, *arrays):
            return _tfnp.allreduce(list(arrays), hvd_name, op, prescale_factor, postscale_factor, process_set)

        ys = _run(kind, fn, xs, dtypes, name, ignore_name_scope)
        for x, y in zip(xs, ys):
            y.set_shape(x.shape)

        def grad(*dys):
            return _grouped_allreduce(list(dys), None, op, prescale_factor, postscale_factor, process_set,
                                      ignore_name_scope, kind)

        return ys, grad

    return list(reduce(*tensors))


def allgather(tensor, name=None, ignore_name_scope=False, process_set=None):
    """Concatenates every rank's ``tensor`` along dimension 0 (the ranks may differ in it); a ``tf.Tensor``."""
    return grouped_allgather([tensor], name, ignore_name_scope, process_set, kind="Allgather")[0]


def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=None, kind="GroupedAllgather"):
    """``allgather`` of each tensor, submitted together."""
    _check_set(process_set)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    dtypes = [t.dtype for t in tensors]

    @tf.custom_gradient
    def gather(*xs):
        def fn(hvd_name, *arrays):
            return _tfnp.allgather(list(arrays), hvd_name, process_set)

        ys = _run(kind, fn, xs, dtypes, name, ignore_name_scope)
        for x, y in zip(xs, ys):
            if x.shape.rank is not None:
                y.set_shape([None] + x.shape.as_list()[1:])

        def grad(*dys):
            reduced = _grouped_allreduce(list(dys), None, _core.Average, 1.0, 1.0, process_set, ignore_name_scope)
            out = []
            for x, g in zip(xs, reduced):
                rows = tf.reshape(tf.shape(x, out_type=tf.int64)[0], [1])
                sizes = allgather(rows, process_set=process_set, ignore_name_scope=ignore_name_scope)
                out.append(tf.split(g, tf.reshape(sizes, [_set_size(process_set)]), axis=0)[_set_rank(process_set)])
            return out

        return ys, grad

    return list(gather(*tensors))


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=None):
    """Rank ``root_rank``'s ``tensor`` on every rank; the gradient is averaged onto the root (zero elsewhere)."""
    return _grouped_broadcast([tensor], root_rank, name, ignore_name_scope, process_set, kind="Broadcast")[0]


def _grouped_broadcast(tensors, root_rank, name=None, ignore_name_scope=False, process_set=None,
                       kind="GroupedBroadcast"):
    _check_set(process_set)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    dtypes = [t.dtype for t in tensors]

    @tf.custom_gradient
    def bcast(*xs):
        def fn(hvd_name, *arrays):
            return _tfnp.broadcast(list(arrays), root_rank, hvd_name, process_set)

        ys = _run(kind, fn, xs, dtypes, name, ignore_name_scope)
        for x, y in zip(xs, ys):
            y.set_shape(x.shape)

        def grad(*dys):
            reduced = _grouped_allreduce(list(dys), None, _core.Average, 1.0, 1.0, process_set, ignore_name_scope)
            if _core.rank() != root_rank:
                return [g * 0 for g in reduced]
            return reduced

        return ys, grad

    return list(bcast(*tensors))


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=None):
    """Sends ``splits[j]`` rows of dimension 0 to rank j (default: equal parts). Returns the received tensor, and
    with ``splits`` given also the received splits (int32), as Horovod does."""
    _check_set(process_set)
    tensor = tf.convert_to_tensor(tensor)
    given = splits is not None
    splits_t = tf.convert_to_tensor(splits) if given else tf.constant([], dtype=tf.int32)
    if splits_t.dtype not in (tf.int32, tf.int64):
        raise ValueError("alltoall splits must be integers, not {}".format(splits_t.dtype))

    @tf.custom_gradient
    def exchange(x, s):
        def fn(hvd_name, array, split_array):
            return _tfnp.alltoall(array, split_array if given else None, hvd_name, process_set)

        out, received = _run("Alltoall", fn, [x, s], [x.dtype, tf.int32], name, ignore_name_scope)
        if x.shape.rank is not None:
            out.set_shape([None] + x.shape.as_list()[1:])
        received.set_shape([None])

        def grad(dy, _unused=None):
            back, _ = alltoall(dy, splits=received, ignore_name_scope=ignore_name_scope, process_set=process_set)
            return back, None

        return (out, received), grad

    out, received = exchange(tensor, splits_t)
    return (out, received) if given else out


def _reducescatter(tensor, name=None, op=_core.Sum, ignore_name_scope=False, process_set=None, prescale_factor=1.0,
                   postscale_factor=1.0):
    return _grouped_reducescatter([tensor], name, op, ignore_name_scope, process_set, prescale_factor,
                                  postscale_factor, kind="Reducescatter")[0]


def _grouped_reducescatter(tensors, name=None, op=_core.Sum, ignore_name_scope=False, process_set=None,
                           prescale_factor=1.0, postscale_factor=1.0, kind="GroupedReducescatter"):
    _check_set(process_set)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    dtypes = [t.dtype for t in tensors]

    @tf.custom_gradient
    def scatter(*xs):
        def fn(hvd_name, *arrays):
            return _tfnp.reducescatter(list(arrays), hvd_name, op, prescale_factor, postscale_factor, process_set)

        ys = _run(kind, fn, xs, dtypes, name, ignore_name_scope)
        for x, y in zip(xs, ys):
            if x.shape.rank is not None:
                shape = x.shape.as_list()
                if shape and shape[0] is not None:
                    n, r = _set_size(process_set), _set_rank(process_set)
                    shape[0] = shape[0] // n + (1 if r < shape[0] % n else 0)
                elif shape:
                    shape[0] = None
                y.set_shape(shape)

        def grad(*dys):
            out = []
            for g in dys:
                if op == _core.Sum:
                    g = g * tf.cast(_set_size(process_set), g.dtype)
                if prescale_factor != 1.0:
                    g = g * tf.cast(prescale_factor, g.dtype)
                if postscale_factor != 1.0:
                    g = g * tf.cast(postscale_factor, g.dtype)
                out.append(allgather(g, ignore_name_scope=ignore_name_scope, process_set=process_set))
            return out

        return ys, grad

    return list(scatter(*tensors))


# ---------------------------------------------------------------------------------------------------------------
# Horovod's public collectives


def _check_indexed_slices(op, prescale_factor, postscale_factor):
    if op == Adasum:
        raise NotImplementedError("The Adasum reduction does not support sparse tensors (hvd has no Adasum); pass "
                                  "sparse_as_dense=True or another op")
    if op not in (_core.Sum, _core.Average):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")


def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=None, ignore_name_scope=False):
    """Reduces ``tensor`` (a ``tf.Tensor``, ``tf.Variable`` or ``tf.IndexedSlices``) over the ranks (default: the
    average). An ``IndexedSlices`` is allgathered (values and indices), as Horovod does."""
    if op == Adasum and not isinstance(tensor, tf.IndexedSlices):
        raise NotImplementedError("hvd does not implement the Adasum reduction: use op=hvd.Average or op=hvd.Sum")
    if isinstance(tensor, tf.IndexedSlices):
        op = Adasum if op == Adasum else _resolve_op(op, average)
        _check_indexed_slices(op, prescale_factor, postscale_factor)
        values = allgather(tensor.values, process_set=process_set, ignore_name_scope=ignore_name_scope)
        indices = allgather(tensor.indices, process_set=process_set, ignore_name_scope=ignore_name_scope)
        if op == _core.Average:
            values = values / tf.cast(_set_size(process_set), values.dtype)
        return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)
    op = _resolve_op(op, average)
    tensor = tf.convert_to_tensor(tensor)
    compressed, ctx = compression.compress(tensor)
    reduced = _allreduce(compressed, name=name, op=op, prescale_factor=prescale_factor,
                         postscale_factor=postscale_factor, process_set=process_set,
                         ignore_name_scope=ignore_name_scope)
    return compression.decompress(reduced, ctx)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="", compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=None, ignore_name_scope=False,
                      name=None):
    """``allreduce`` of every tensor of the list, submitted together (the dense ones fuse)."""
    if not tensors:
        return tensors
    if op == Adasum:
        raise NotImplementedError("hvd does not implement the Adasum reduction: use op=hvd.Average or op=hvd.Sum")
    op = _resolve_op(op, average)
    tensors = [_tensor(t) for t in tensors]
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    out = [None] * len(tensors)
    if sparse:
        _check_indexed_slices(op, prescale_factor, postscale_factor)
        values = grouped_allgather([tensors[i].values for i in sparse], process_set=process_set,
                                   ignore_name_scope=ignore_name_scope)
        indices = grouped_allgather([tensors[i].indices for i in sparse], process_set=process_set,
                                    ignore_name_scope=ignore_name_scope)
        for i, v, ix in zip(sparse, values, indices):
            if op == _core.Average:
                v = v / tf.cast(_set_size(process_set), v.dtype)
            out[i] = tf.IndexedSlices(v, ix, dense_shape=tensors[i].dense_shape)
    if dense:
        compressed, ctxs = zip(*[compression.compress(tensors[i]) for i in dense])
        reduced = _grouped_allreduce(list(compressed), name, op, prescale_factor, postscale_factor, process_set,
                                     ignore_name_scope)
        for i, r, ctx in zip(dense, reduced, ctxs):
            out[i] = compression.decompress(r, ctx)
    return out


def reducescatter(tensor, device_dense="", compression=Compression.none, op=_core.Average, name=None,
                  process_set=None, ignore_name_scope=False, prescale_factor=1.0, postscale_factor=1.0):
    """Reduces over the ranks and leaves each its block of dimension 0 (the first ``dim0 % size`` ranks one row
    more)."""
    op = _resolve_op(op, None)
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    reduced = _reducescatter(compressed, name=name, op=op, ignore_name_scope=ignore_name_scope,
                             process_set=process_set, prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor)
    return compression.decompress(reduced, ctx)


def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=_core.Average, process_set=None,
                          prescale_factor=1.0, postscale_factor=1.0):
    """``reducescatter`` of every tensor of the list, submitted together."""
    if not tensors:
        return tensors
    op = _resolve_op(op, None)
    compressed, ctxs = zip(*[compression.compress(tf.convert_to_tensor(t)) for t in tensors])
    reduced = _grouped_reducescatter(list(compressed), None, op, False, process_set, prescale_factor,
                                     postscale_factor)
    return [compression.decompress(r, ctx) for r, ctx in zip(reduced, ctxs)]


def _scalar_op(value, name):
    """An int32 scalar computed when the graph runs (at once in eager mode)."""
    if tf.executing_eagerly():
        return tf.constant(value(), dtype=tf.int32)
    out = tf.numpy_function(lambda: np.int32(value()), [], tf.int32, name=name, stateful=True)
    out.set_shape([])
    return out


def _set_of(process_set_id):
    if process_set_id == 0:
        return _core.global_process_set
    ps = _core._SETS.get(process_set_id)
    if ps is None:
        raise ValueError("no process set with id {} has been added".format(process_set_id))
    return ps


def size_op(process_set_id=0, name=None):
    """The number of ranks (of the process set), as an op evaluated when the graph runs."""
    return _scalar_op(lambda: _core.size() if process_set_id == 0 else _set_of(process_set_id).size(),
                      name or "HorovodSize")


def process_set_included_op(process_set_id=0, name=None):
    """1 when this rank is a member of the process set, else 0, as an op."""
    return _scalar_op(lambda: int(bool(_set_of(process_set_id).included())), name or "HorovodProcessSetIncluded")


def local_size_op(name=None):
    return _scalar_op(_core.local_size, name or "HorovodLocalSize")


def rank_op(name=None):
    return _scalar_op(_core.rank, name or "HorovodRank")


def local_rank_op(name=None):
    return _scalar_op(_core.local_rank, name or "HorovodLocalRank")


def join():
    """Declares that this rank has no more data; returns (as an op) the rank that joined last."""
    return _scalar_op(_core.join, "HorovodJoin")


def broadcast_(variables, root_rank, name=None, process_set=None):
    """Assigns rank ``root_rank``'s values to ``variables`` (a list) and returns their new values."""
    values = _grouped_broadcast([v.read_value() if hasattr(v, "read_value") else v for v in variables], root_rank,
                                name, False, process_set)
    if tf.executing_eagerly():
        for v, b in zip(variables, values):
            v.assign(b)
        return [v.read_value() for v in variables]
    return [tf.identity(tf.compat.v1.assign(v, b)) for v, b in zip(variables, values)]


def broadcast_variables(variables, root_rank=0, process_set=None, inplace=False):
    """Assigns rank ``root_rank``'s values to every variable in ``variables``: at once in eager mode; in a graph,
    returns the op that does it."""
    variables = list(variables)
    if not variables:
        return tf.no_op() if not tf.executing_eagerly() else None
    values = _grouped_broadcast([tf.convert_to_tensor(v) for v in variables], root_rank, None, False, process_set)
    if tf.executing_eagerly():
        for v, b in zip(variables, values):
            v.assign(b)
        return None
    return tf.group(*[tf.compat.v1.assign(v, b) for v, b in zip(variables, values)])


broadcast_parameters = broadcast_variables


def broadcast_global_variables(root_rank):
    """Graph mode (tf.compat.v1): the op that assigns ``root_rank``'s values to every global variable."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. Please use "
                           "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=None):
    """A picklable object of rank ``root_rank`` on every rank (``session`` is accepted; nothing runs in it)."""
    return _core.broadcast_object(obj, root_rank, name=name, process_set=_ps(process_set))


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=None):
    """A function that broadcasts its argument from ``root_rank`` (Horovod's graph-mode helper)."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


def allgather_object(obj, session=None, name=None, process_set=None):
    """Every rank's picklable object, in rank order."""
    return _core.allgather_object(obj, name=name, process_set=_ps(process_set))


# ---------------------------------------------------------------------------------------------------------------
# Gradients: DistributedGradientTape, DistributedOptimizer


def _make_allreduce_grads(compression, sparse_as_dense, op, gradient_predivide_factor, groups, process_set):
    """The function that reduces a list of gradients (None entries stay None) for a tape or an optimizer."""
    if op == Adasum:
        raise NotImplementedError("hvd does not implement the Adasum reduction: use op=hvd.Average or op=hvd.Sum")
    if op == _core.Average:
        prescale, postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
    else:
        prescale = postscale = 1.0

    def reduce_group(grads):
        return grouped_allreduce(grads, compression=compression, op=op, prescale_factor=prescale,
                                 postscale_factor=postscale, process_set=process_set)

    def allreduce_grads(grads, variables=None):
        if sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        out = list(grads)
        ps = _ps(process_set)
        if ps is not None and (not ps.included() or ps.size() == 1):
            return out
        if ps is None and _core.size() == 1:
            return out
        present = [i for i, g in enumerate(grads) if g is not None]
        if isinstance(groups, list) and variables is not None:
            by_ref = {_ref(v): i for i, v in enumerate(variables) if grads[i] is not None}
            parts = []
            for group in groups:
                part = [by_ref.pop(_ref(v)) for v in group if _ref(v) in by_ref]
                if part:
                    parts.append(part)
            parts += [[i] for i in present if i in by_ref.values()]
        elif isinstance(groups, int) and groups > 0:
            parts = _tfnp.split(present, groups)
        else:
            parts = [present] if present else []
        for part in parts:
            for i, r in zip(part, reduce_group([grads[i] for i in part])):
                out[i] = r
        return out

    return allreduce_grads


def _ref(variable):
    """A hashable key of a variable: ``tf.Variable.ref()``; a Keras 3 variable (no ``ref``) by the TensorFlow
    variable it holds."""
    if hasattr(variable, "ref"):
        return variable.ref()
    inner = getattr(variable, "value", None)
    if inner is not None and hasattr(inner, "ref"):
        return inner.ref()
    return id(variable)


def _check_gradient_options(op, gradient_predivide_factor, num_groups, groups):
    if gradient_predivide_factor != 1.0 and op != _core.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups and groups is None:
        groups = num_groups
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise ValueError("groups should be a non-negative integer or a list of list of tf.Variable.")
    return groups


def _scale_local(grad, n):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / float(n), grad.indices, grad.dense_shape)
    return grad / tf.cast(n, grad.dtype)


class _DistributedGradientTape(tf.GradientTape):
    """A ``tf.GradientTape`` whose ``gradient()`` reduces the gradients over the ranks (those of registered local
    sources excepted: they are scaled by 1/size when ``scale_local_gradients``)."""

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False, **kwargs):
        single = not isinstance(sources, (list, tuple))
        source_list = [sources] if single else list(sources)
        grads = super().gradient(target, source_list, output_gradients, **kwargs)
        shared = [i for i, s in enumerate(source_list) if _ref(s) not in self._hvd_local]
        reduced = self._hvd_allreduce([grads[i] for i in shared], [source_list[i] for i in shared])
        grads = list(grads)
        for i, r in zip(shared, reduced):
            grads[i] = r
        if self._hvd_scale_local and self._hvd_local:
            n = _set_size(self._hvd_process_set)
            for i, s in enumerate(source_list):
                if _ref(s) in self._hvd_local and grads[i] is not None:
                    grads[i] = _scale_local(grads[i], n)
        return grads[0] if single else grads

    def register_local_source(self, source):
        """Gradients of ``source`` are not reduced (a rank-local variable)."""
        self._hvd_local.add(_ref(source))

    def get_local_and_global_gradients(self, target, sources, output_gradients=None, use_generic_names=False):
        grads = self.gradient(target, sources, output_gradients)
        local, shared = [], []
        for s, g in zip(sources, grads):
            (local if _ref(s) in self._hvd_local else shared).append((s, g))
        return local, shared


def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                            sparse_as_dense=False, op=_core.Average, gradient_predivide_factor=1.0, num_groups=0,
                            groups=None, process_set=None, scale_local_gradients=True):
    """Wraps a ``tf.GradientTape`` (also after its ``with`` block): ``gradient()`` returns the gradients reduced
    over the ranks (default: averaged)."""
    groups = _check_gradient_options(op, gradient_predivide_factor, num_groups, groups)
    cls = type(type(gradtape).__name__, (_DistributedGradientTape, type(gradtape)), {})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._hvd_allreduce = _make_allreduce_grads(compression, sparse_as_dense, op, gradient_predivide_factor, groups,
                                                process_set)
    tape._hvd_local = set()
    tape._hvd_scale_local = scale_local_gradients
    tape._hvd_process_set = process_set
    return tape


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                                   sparse_as_dense=False, op=_core.Average, gradient_predivide_factor=1.0,
                                   num_groups=0, groups=None, process_set=None, local_layers=None,
                                   scale_local_gradients=True):
    """``DistributedGradientTape`` whose ``local_layers`` (Keras layers) keep their gradients local."""
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, tf.keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, tf.keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape


def allreduce_gradients(grads, op=_core.Average, name="grad"):
    """Reduces (default: averages) a list of gradients over the ranks; None entries stay None."""
    return _make_allreduce_grads(Compression.none, False, op, 1.0, None, None)(list(grads))


class _DistributedOptimizer(tf.compat.v1.train.Optimizer):
    """A ``tf.compat.v1.train.Optimizer`` whose ``compute_gradients`` reduces the gradients over the ranks."""

    def __init__(self, optimizer, name=None, use_locking=False, compression=Compression.none,
                 sparse_as_dense=False, op=_core.Average, gradient_predivide_factor=1.0, groups=None,
                 process_set=None, scale_local_gradients=True, backward_passes_per_step=1,
                 average_aggregated_gradients=False):
        super().__init__(name=name or "Distributed{}".format(type(optimizer).__name__), use_locking=use_locking)
        self._optimizer = optimizer
        self._passes = backward_passes_per_step
        self._average_aggregated = average_aggregated_gradients
        self._counter = None
        self._allreduce_grads = _make_allreduce_grads(compression, sparse_as_dense, op, gradient_predivide_factor,
                                                      groups, process_set)
        self._local_vars = set()
        self._process_set = process_set
        self._scale_local = scale_local_gradients

    def register_local_var(self, var):
        """Gradients of ``var`` are not reduced."""
        self._local_vars.add(_ref(var))

    def compute_gradients(self, *args, **kwargs):
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        if self._passes > 1:
            return list(zip(self._aggregate(grads, variables), variables))
        return list(zip(self._reduce(grads, variables), variables))

    def _reduce(self, grads, variables):
        grads = list(grads)
        shared = [i for i, v in enumerate(variables) if _ref(v) not in self._local_vars]
        reduced = self._allreduce_grads([grads[i] for i in shared], [variables[i] for i in shared])
        for i, r in zip(shared, reduced):
            grads[i] = r
        if self._scale_local and self._local_vars:
            n = _set_size(self._process_set)
            for i, v in enumerate(variables):
                if _ref(v) in self._local_vars and grads[i] is not None:
                    grads[i] = _scale_local(grads[i], n)
        return grads

    def _aggregate(self, grads, variables):
        """``backward_passes_per_step`` (graph mode): each call adds the gradients to local sums; every
        ``backward_passes_per_step``-th call reduces the sums (divided by the passes with
        ``average_aggregated_gradients``) and ``apply_gradients`` applies them; the calls between apply nothing."""
        local = [tf.compat.v1.GraphKeys.LOCAL_VARIABLES]
        self._counter = tf.compat.v1.Variable(0, dtype=tf.int32, trainable=False, collections=local,
                                              name="aggregation_counter")
        dense = [None if g is None else tf.convert_to_tensor(g) for g in grads]
        sums = [None if g is None else tf.compat.v1.Variable(tf.zeros_like(g), trainable=False, collections=local,
                                                             name="aggregated_gradient")
                for g in dense]
        present = [(g, a) for g, a in zip(dense, sums) if g is not None]
        cleared = tf.cond(tf.equal(self._counter, 0),
                          lambda: tf.group(*[a.assign(tf.zeros_like(a)) for _, a in present]), tf.no_op)
        with tf.control_dependencies([cleared]):
            added = [a.assign_add(g) for g, a in present]
        with tf.control_dependencies(added):
            counted = self._counter.assign_add(1)

        def reduce_sums():
            values = [None if a is None else a.read_value() for a in sums]
            if self._average_aggregated:
                values = [None if v is None else v / tf.cast(self._passes, v.dtype) for v in values]
            reduced = self._reduce(values, variables)
            with tf.control_dependencies([r for r in reduced if r is not None]):
                reset = self._counter.assign(0)
            with tf.control_dependencies([reset]):
                return [tf.identity(r) for r in reduced if r is not None]

        def keep_sums():
            return [a.read_value() for a in sums if a is not None]

        with tf.control_dependencies([counted]):
            out = tf.cond(tf.equal(counted, self._passes), reduce_sums, keep_sums)
        out = iter(out if isinstance(out, (list, tuple)) else [out])
        return [None if g is None else next(out) for g in dense]

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        if self._counter is None:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)
        grads_and_vars = list(grads_and_vars)

        def apply():
            op = self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)
            with tf.control_dependencies([op]):
                return tf.constant(True)

        def skip():
            if global_step is None:
                return tf.constant(False)
            with tf.control_dependencies([global_step.assign_add(1)]):
                return tf.constant(False)

        # The counter is read once this step's gradients are made (the reduction resets it to 0).
        with tf.control_dependencies([g for g, _ in grads_and_vars if g is not None]):
            due = tf.equal(self._counter.read_value(), 0)
        return tf.cond(due, apply, skip).op

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


def _keras_module():
    import importlib

    for name in ("hvd.tensorflow.keras", "hvd.keras"):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
    raise NotImplementedError("DistributedOptimizer for a Keras optimizer needs hvd's Keras module, which this hvd "
                              "does not have")


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1,
                         op=_core.Average, gradient_predivide_factor=1.0, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=None, scale_local_gradients=True):
    """Wraps a ``tf.compat.v1.train.Optimizer`` (a Keras optimizer goes to hvd's Keras module) so that gradients
    are reduced over the ranks before they are applied."""
    if op == Adasum:
        raise NotImplementedError("hvd does not implement the Adasum reduction (DistributedOptimizer op=Adasum)")
    groups = _check_gradient_options(op, gradient_predivide_factor, num_groups, groups)
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if backward_passes_per_step > 1 and tf.executing_eagerly():
            raise ValueError("backward_passes_per_step > 1 is not yet supported for _LegacyOptimizer with eager "
                             "execution.")
        return _DistributedOptimizer(optimizer, name, use_locking, compression, sparse_as_dense, op,
                                     gradient_predivide_factor, groups, process_set, scale_local_gradients,
                                     backward_passes_per_step, average_aggregated_gradients)
    return _keras_module().DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse, compression=compression,
        sparse_as_dense=sparse_as_dense, gradient_predivide_factor=gradient_predivide_factor,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, process_set=process_set,
        scale_local_gradients=scale_local_gradients)


if hasattr(tf.compat.v1.train, "SessionRunHook"):

    class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
        """Broadcasts every global variable from ``root_rank`` once the session is created (tf.compat.v1)."""

        def __init__(self, root_rank, device=""):
            super().__init__()
            self.root_rank = root_rank
            self.bcast_op = None
            self.device = device

        def begin(self):
            if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
                self.bcast_op = broadcast_global_variables(self.root_rank)

        def after_create_session(self, session, coord):
            session.run(self.bcast_op)



def _sync_batch_normalization_class():
    global _KERAS_BN_FUSED
    base = tf.keras.layers.BatchNormalization
    # Keras 2's layer takes `fused`; Keras 3's has no fused kernel and refuses the argument.
    import inspect

    _KERAS_BN_FUSED = any("fused" in inspect.signature(cls.__init__).parameters
                          for cls in base.__mro__ if "__init__" in vars(cls))

    class SyncBatchNormalization(base):
        """Keras batch normalization whose batch statistics, in training, are those of every rank's batch together
        (the ranks' means and means of squares averaged; variance = E[x^2] - E[x]^2). ``fused`` is refused."""

        def __init__(self, fused=False, **kwargs):
            if fused in (True, None):
                raise ValueError("SyncBatchNormalization does not support fused=True.")
            kwargs.setdefault("name", None)
            if not kwargs["name"]:
                kwargs["name"] = "sync_batch_normalization"
            if _KERAS_BN_FUSED:
                kwargs["fused"] = fused
            super().__init__(**kwargs)

        def _moments(self, inputs, *args, **kwargs):
            mean, variance = super()._moments(inputs, *args, **kwargs)
            if _core.size() == 1:
                return mean, variance
            mean_of_square = variance + tf.math.square(mean)
            mean, mean_of_square = _grouped_allreduce([mean, mean_of_square], op=_core.Average)
            return mean, mean_of_square - tf.math.square(mean)

    return SyncBatchNormalization


_KERAS_BN_FUSED = False
if hasattr(tf, "keras") and hasattr(tf.keras.layers.BatchNormalization, "_moments"):
    SyncBatchNormalization = _sync_batch_normalization_class()

# Horovod's ``hvd.tensorflow.elastic`` (hvd.elastic plus TensorFlowState); imported last: it uses the names above.
# (Not `from hvd.tensorflow import elastic`: that would find the name hvd.elastic already has here.)
import importlib as _importlib  # noqa: E402

elastic = _importlib.import_module("hvd.tensorflow.elastic")
