"""``horovod.torch``: Horovod's torch API. The collectives come from ``horovod.torch.mpi_ops`` (Horovod's signatures
and semantics over hvd.torch: autograd, ``alltoall`` splits, truncating integer scaling, grouped allgather and
reducescatter, duplicate-name errors); every other name (``DistributedOptimizer``, ``broadcast_parameters``, the
introspection functions, ...) is hvd.torch's. Importing it imports torch, as hvd.torch does."""

from horovod._reexport import reexport
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401
from horovod.common.util import nccl_built  # noqa: F401 - Horovod's answer is a version number
from horovod.common.process_sets import (  # noqa: F401
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from horovod.torch.mpi_ops import *  # noqa: F401,F403
from horovod.torch.mpi_ops import Handle, __all__ as _ops  # noqa: F401


def _with_process_set(fn):
    """hvd's ``fn`` taking Horovod's ``process_set=`` (global by default)."""
    from horovod.torch.mpi_ops import _ps

    def call(*args, process_set=global_process_set, **kwargs):
        return fn(*args, process_set=_ps(process_set), **kwargs)

    call.__name__ = call.__qualname__ = fn.__name__
    call.__doc__ = fn.__doc__
    return call


import hvd.torch as _ht  # noqa: E402

broadcast_object = _with_process_set(_ht.broadcast_object)
allgather_object = _with_process_set(_ht.allgather_object)

reexport(globals(), "hvd.torch")
del reexport
__all__ = sorted(k for k, v in globals().items() if not k.startswith("_") and not isinstance(v, type(_ht)))
