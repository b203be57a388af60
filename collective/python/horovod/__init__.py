"""horovod: Horovod's module names over hvd's runtime, so that Horovod scripts run unchanged under ``hvd run``.

``hvd build`` adds this package to every env that neither locks nor builds the real Horovod (docs/horovod.md).
Every module re-exports hvd's implementation (``horovod.torch`` is ``hvd.torch``, ...); nothing here is a second
copy of it. Importing ``horovod`` imports no framework: ``horovod.torch`` imports torch as ``hvd.torch`` does.
"""

import sys

# Parses on python 2.7, like hvd/__init__.py, so that an old interpreter gets this message.
if sys.version_info < (3, 6):
    raise ImportError(
        "this env's horovod is hvd's compatibility package, which needs python 3.6 or newer (this is %d.%d); "
        "build the real Horovod into the env (std.horovod) to use it on this python" % sys.version_info[:2]
    )

from horovod.runner import run

# The Horovod release whose API these modules follow (its last one); `hvd --version` says which hvd runs them.
__version__ = "0.28.1"

__all__ = ["run"]
