"""``horovod.tensorflow.util``: the helpers of Horovod's private util module that scripts and Horovod's own tests
import (eager-mode test, a cache per mode, variable references)."""

import tensorflow as tf


def _executing_eagerly():
    """Whether TensorFlow runs eagerly here (not inside a graph or a ``tf.function`` being traced)."""
    return tf.executing_eagerly()


def _make_subgraph(f):
    """``f`` as a ``tf.function``."""
    return tf.function(f)


def _cache(f):
    """``f`` memoized on its (hashable) arguments and on the execution mode."""
    results = {}

    def cached(*args):
        key = (args, _executing_eagerly())
        if key not in results:
            results[key] = f(*args)
        return results[key]

    return cached


def vars_to_refs(variables):
    """Hashable references of a variable or of nested lists of variables (lists become tuples)."""
    if isinstance(variables, list):
        return tuple(vars_to_refs(v) for v in variables)
    return variables.ref()


def refs_to_vars(refs):
    """The inverse of ``vars_to_refs``."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()
