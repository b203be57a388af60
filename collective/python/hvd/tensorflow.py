"""TensorFlow (eager) helpers over the pure-Python core (CPU tensors through DLPack)."""

try:
    import tensorflow as tf
except ImportError as e:
    raise ImportError(
        "hvd.tensorflow needs TensorFlow, which is not installed in this environment; add tensorflow to the "
        "environment's packages"
    ) from e

import hvd as _core
from hvd import (  # noqa: F401 - re-exported API
    ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, is_homogeneous, mpi_built, mpi_enabled,
    mpi_threads_supported, nccl_built, rocm_built,
    Average, HorovodInternalError, HvdError, Max, Min, Product, Sum, allgather, allgather_async, allgather_object,
    allreduce, allreduce_async, alltoall, barrier, broadcast, broadcast_async, broadcast_object, cross_rank,
    cross_size, grouped_allreduce, init, is_initialized, join, local_rank, local_size, poll, rank, reducescatter,
    shutdown, size, start_timeline, stop_timeline, synchronize,
)


def broadcast_variables(variables, root_rank=0):
    """Assigns root's values to every `tf.Variable` in `variables`."""
    for i, v in enumerate(variables):
        v.assign(_core.broadcast(v.value(), root_rank, name="broadcast_variables.{}".format(i)))


broadcast_parameters = broadcast_variables


def allreduce_gradients(grads, op=Average, name="grad"):
    """Averages (by default) a list of gradients over ranks (None entries stay None)."""
    present = [g for g in grads if g is not None]
    out = iter(_core.grouped_allreduce(present, op=op, name=name))
    return [None if g is None else next(out) for g in grads]


class DistributedGradientTape:
    """Wraps `tf.GradientTape`: `gradient()` returns gradients averaged over ranks."""

    def __init__(self, tape, op=Average):
        self._tape = tape
        self._op = op

    def __getattr__(self, name):
        return getattr(self._tape, name)

    def gradient(self, target, sources, output_gradients=None):
        grads = self._tape.gradient(target, sources, output_gradients)
        return allreduce_gradients(grads, op=self._op)
