"""Keras on TensorFlow (``tf.keras``): Horovod's ``DistributedOptimizer``, callbacks, elastic state and collectives
of Keras values, over hvd's runtime; nothing is compiled against TensorFlow.

    import hvd.keras as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.001 * hvd.size()))
    model.compile(loss=..., optimizer=opt)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

The gradients of a step travel as one TensorFlow op (``tf.numpy_function`` over hvd's grouped allreduce and
allgathers), in eager mode and inside ``tf.function`` (``model.fit``) alike: one op per step keeps every rank's
collectives in the same order whatever order TensorFlow runs a graph's ops in. XLA cannot compile that op
(``jit_compile=True`` fails on it), as it cannot compile any Python callback. docs/horovod.md, "Keras".
"""

import hvd.tensorflow  # noqa: F401 - first: without TensorFlow, its ImportError says what to install

import tensorflow as tf

import hvd as _core
from hvd.keras import _ops
from hvd.keras._ops import Compression

_core._reexport(globals(), tensor_ops=False)
broadcast_variables = _ops.broadcast_variables
Adasum = _ops.Adasum

__all__ = [name for name in _core._SHARED_API if name != "elastic"] + [
    "Adasum", "Compression", "DistributedOptimizer", "PartialDistributedOptimizer", "allgather", "allreduce",
    "alltoall", "broadcast", "broadcast_global_variables", "broadcast_variables", "callbacks", "elastic",
    "load_model", "reducescatter",
]


def _check_options(op, groups, gradient_predivide_factor, backward_passes_per_step):
    if op is Adasum or op == Adasum:
        raise ValueError("op=Adasum: hvd has no Adasum; DistributedOptimizer supports op=Average and op=Sum")
    if op not in (_core.Average, _core.Sum):
        raise ValueError("DistributedOptimizer supports op=Average and op=Sum, not {!r}".format(op))
    if groups is not None and not isinstance(groups, (list, tuple)):
        if isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0:
            raise ValueError("groups should be a positive integer or a list of lists of tf.Variable, not "
                             "{!r}".format(groups))
    if gradient_predivide_factor <= 0:
        raise ValueError("gradient_predivide_factor must be > 0, not {!r}".format(gradient_predivide_factor))
    if op != _core.Average and gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor splits an average: it needs op=Average")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be a positive integer, not {!r}".format(
            backward_passes_per_step))


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=_core.Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=None, scale_local_gradients=True):
    """Wraps a Keras optimizer so that its gradients are reduced over the ranks (averaged by default) before they
    are applied; the result is an instance of a subclass of the optimizer's class with the same name (so a saved
    model loads without hvd), made from the optimizer's config. ``backward_passes_per_step`` > 1 sums that many
    steps' gradients locally and reduces and applies them once (divided by the count with
    ``average_aggregated_gradients``); ``sparse_as_dense`` turns ``tf.IndexedSlices`` into dense tensors, which
    are otherwise gathered (indices and values). ``device_dense``/``device_sparse`` are accepted and unused: hvd
    reduces CPU memory. ``groups``/``num_groups`` only ever fused gradients: here every gradient of a step is one
    fused group anyway."""
    if num_groups and groups is None:
        groups = num_groups
    _check_options(op, groups, gradient_predivide_factor, backward_passes_per_step)
    settings = _ops.Settings(name=name, compression=compression, sparse_as_dense=sparse_as_dense,
                             gradient_predivide_factor=gradient_predivide_factor, op=op,
                             backward_passes_per_step=backward_passes_per_step,
                             average_aggregated_gradients=average_aggregated_gradients, process_set=process_set,
                             scale_local_gradients=scale_local_gradients)
    return _ops.wrap_optimizer(optimizer, settings)


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0,
                                op=_core.Average, backward_passes_per_step=1, average_aggregated_gradients=False,
                                groups=None, process_set=None, local_layers=None, scale_local_gradients=True):
    """``DistributedOptimizer`` whose ``local_layers`` (a Keras layer or a list of them) keep their gradients on
    each rank: not reduced, divided by the number of ranks when ``scale_local_gradients``."""
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, tf.keras.layers.Layer):
        local_layers = [local_layers]
    else:
        local_layers = list(local_layers)
        if not all(isinstance(layer, tf.keras.layers.Layer) for layer in local_layers):
            raise ValueError("local_layers must be Keras layers (tf.keras.layers.Layer)")
    opt = DistributedOptimizer(optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
                               gradient_predivide_factor=gradient_predivide_factor, op=op,
                               backward_passes_per_step=backward_passes_per_step,
                               average_aggregated_gradients=average_aggregated_gradients, groups=groups,
                               process_set=process_set, scale_local_gradients=scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            opt.register_local_var(var)
    return opt


def broadcast_global_variables(root_rank):
    """Broadcasts every global variable of the TF1-style default graph from ``root_rank`` and returns the op; in
    eager mode (TensorFlow 2's default) there is no such collection: ``RuntimeError`` saying to broadcast the
    model's and optimizer's variables (``broadcast_variables``, or ``callbacks.BroadcastGlobalVariablesCallback``)."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "broadcast_global_variables() does not support eager execution (there are no global variables): use "
            "hvd.broadcast_variables(model.variables + optimizer.variables, root_rank) or the "
            "BroadcastGlobalVariablesCallback")
    variables = tf.compat.v1.global_variables()
    return _ops.broadcast_variables_op(variables, root_rank, "broadcast_global_variables")


def _value(value, name):
    return value if tf.is_tensor(value) else tf.constant(value, name=name)


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none, process_set=None):
    """Reduces a tensor-compatible value over the ranks (average by default); returns a ``tf.Tensor``."""
    op = _core._resolve_op(average, op)
    if op == Adasum:
        raise ValueError("op=Adasum: hvd has no Adasum")
    t, ctx = compression.compress(_value(value, name))
    out = _ops.allreduce_tensor(t, op, name, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


def allgather(value, name=None, process_set=None):
    """Concatenates every rank's value along dimension 0 (which may differ between ranks)."""
    return _ops.allgather_tensor(_value(value, name), name, process_set)


def broadcast(value, root_rank, name=None, process_set=None):
    """``root_rank``'s value on every rank."""
    return _ops.broadcast_tensor(_value(value, name), root_rank, name, process_set)


def reducescatter(value, name=None, op=_core.Average, process_set=None):
    """Reduces over the ranks and leaves each rank its block of dimension 0."""
    if op == Adasum:
        raise ValueError("op=Adasum: hvd has no Adasum")
    return _ops.reducescatter_tensor(_value(value, name), name, op, process_set)


def alltoall(value, splits=None, name=None, process_set=None):
    """Sends rows ``splits[j]`` of dimension 0 to rank j (equal parts by default); returns the received rows."""
    return _ops.alltoall_tensor(_value(value, name), splits, name, process_set)


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none,
               legacy_opts=False):
    """``tf.keras.models.load_model`` with the saved optimizer wrapped in ``DistributedOptimizer`` (every Keras
    optimizer class by name, plus ``custom_optimizers``; ``custom_objects`` as Keras takes them)."""
    settings = _ops.Settings(name=None, compression=compression, sparse_as_dense=False, gradient_predivide_factor=1.0,
                             op=_core.Average, backward_passes_per_step=1, average_aggregated_gradients=False,
                             process_set=None, scale_local_gradients=True)
    return _ops.load_model(filepath, settings, custom_optimizers, custom_objects, legacy_opts)


# hvd's shared API brought ``elastic`` (hvd.elastic): this module's own comes instead (it builds on that one).
del elastic  # noqa: F821
from hvd.keras import callbacks, elastic  # noqa: E402 - they use the names above
