"""horovod: Horovod's module names over hvd's runtime, so that Horovod scripts run unchanged under ``hvd run``.

``hvd build`` adds this package to every env that neither locks nor builds the real Horovod (docs/horovod.md).
Every module re-exports hvd's implementation (``horovod.torch`` is ``hvd.torch``, ...); nothing here is a second
copy of it. Importing ``horovod`` imports no framework: ``horovod.torch`` imports torch as ``hvd.torch`` does.
"""

from horovod.runner import run

# The Horovod release whose API these modules follow (its last one); `hvd --version` says which hvd runs them.
__version__ = "0.28.1"

__all__ = ["run"]
