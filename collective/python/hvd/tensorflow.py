"""TensorFlow (eager) helpers over the pure-Python core (CPU tensors through DLPack)."""

try:
    import tensorflow as tf
except ImportError as e:
    raise ImportError(
        "hvd.tensorflow needs TensorFlow, which is not installed in this environment; add tensorflow to the "
        "environment's packages"
    ) from e

import hvd as _core

_core._reexport(globals())


def broadcast_variables(variables, root_rank=0):
    """Assigns root's values to every `tf.Variable` in `variables`."""
    for i, v in enumerate(variables):
        v.assign(_core.broadcast(v.value(), root_rank, name="broadcast_variables.{}".format(i)))


broadcast_parameters = broadcast_variables


def allreduce_gradients(grads, op=_core.Average, name="grad"):
    """Averages (by default) a list of gradients over ranks (None entries stay None)."""
    present = [g for g in grads if g is not None]
    out = iter(_core.grouped_allreduce(present, op=op, name=name))
    return [None if g is None else next(out) for g in grads]


class DistributedGradientTape:
    """Wraps `tf.GradientTape`: `gradient()` returns gradients averaged over ranks."""

    def __init__(self, tape, op=_core.Average):
        self._tape = tape
        self._op = op

    def __getattr__(self, name):
        return getattr(self._tape, name)

    def gradient(self, target, sources, output_gradients=None):
        grads = self._tape.gradient(target, sources, output_gradients)
        return allreduce_gradients(grads, op=self._op)
