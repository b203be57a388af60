"""JAX helpers (CPU arrays through DLPack). JAX arrays are immutable: every operation returns a new array."""

from hvd import _frameworks

jax = _frameworks.require("jax", "hvd.jax", "JAX", "jax")
import jax.numpy as jnp

import hvd as _core

_core._reexport(globals())


def broadcast_parameters(params, root_rank=0):
    """Root's values of a pytree of arrays, on every rank (returns the new pytree)."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    handles = [_core.broadcast_async(leaf, root_rank, name="broadcast_parameters.{}".format(i))
               for i, leaf in enumerate(leaves)]
    return jax.tree_util.tree_unflatten(tree, [_core.synchronize(h) for h in handles])


def allreduce_gradients(grads, op=_core.Average, name="grad"):
    """Averages (by default) a pytree of gradients over ranks."""
    leaves, tree = jax.tree_util.tree_flatten(grads)
    return jax.tree_util.tree_unflatten(tree, _core.grouped_allreduce(leaves, op=op, name=name))
