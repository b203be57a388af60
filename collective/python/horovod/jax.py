"""``horovod.jax``: hvd.jax (Horovod itself has no JAX module; hvd's is here under the same naming scheme)."""

from horovod._reexport import reexport

reexport(globals(), "hvd.jax")
del reexport
