"""numpy helpers with the names of Horovod's framework modules."""

import numpy as np

import hvd
from hvd import *  # noqa: F401,F403 - the core API, as `hvd.numpy.allreduce` etc.
from hvd import allgather_object, broadcast_object  # noqa: F401


def broadcast_parameters(params, root_rank=0):
    """Overwrites every array of `params` (a dict name -> array, or a list of (name, array)) with root's, in place."""
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    handles = [hvd.broadcast_async_(_contiguous(a, name), root_rank, name="bp." + str(name)) for name, a in items]
    for h in handles:
        hvd.synchronize(h)


def allreduce_gradients(grads, op=hvd.Average, name="grad"):
    """Averages (by default) a dict or list of gradient arrays over ranks, fused into few collectives."""
    if isinstance(grads, dict):
        keys = sorted(grads)
        out = hvd.grouped_allreduce([grads[k] for k in keys], op=op, name=name)
        return dict(zip(keys, out))
    return hvd.grouped_allreduce(list(grads), op=op, name=name)


def _contiguous(a, name):
    if not isinstance(a, np.ndarray) or not a.flags["C_CONTIGUOUS"]:
        raise ValueError("parameter {} must be a C-contiguous numpy array to be broadcast in place".format(name))
    return a
