"""``hvd.empty``: numpy arrays in shared buffers (``hvd_alloc``), which the other ranks on this host map, so that a
large allreduce of them between worker processes copies each byte once (docs/collective.md, "Single-copy
allreduce")."""

import atexit
import ctypes
import math
import operator
import weakref

from . import _lib

_declared = None
# The buffers still alive: address -> a weak reference to the ctypes array over it, whose callback frees the buffer
# once that array is collected. Not ``weakref.finalize``: its exit hook, registered at the first ``hvd.empty`` and
# so after ``hvd.init`` registered ``shutdown``, would free them before ``shutdown`` drained the operations in
# flight. ``_free_left`` frees what is left at exit; it is registered when this module is imported, before
# ``hvd.init`` can register ``shutdown``, so it runs after it.
_live = {}


def _track(raw, ptr, free):
    def gone(_ref):
        if _live.pop(ptr, None) is not None:
            free(ptr)

    _live[ptr] = weakref.ref(raw, gone)


@atexit.register
def _free_left():
    while _live:
        ptr, _ = _live.popitem()
        _alloc_fns()[1](ptr)


def _alloc_fns():
    """``hvd_alloc``, ``hvd_free`` and ``hvd_alloc_is_shared`` of the loaded library, declared once."""
    global _declared
    if _declared is None:
        lib = _lib.load()
        alloc, free, shared = lib.hvd_alloc, lib.hvd_free, lib.hvd_alloc_is_shared
        alloc.restype, alloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        free.restype, free.argtypes = ctypes.c_int32, [ctypes.c_void_p]
        shared.restype, shared.argtypes = ctypes.c_int32, [ctypes.c_void_p]
        _declared = (alloc, free, shared)
    return _declared


def empty(shape, dtype="float32"):
    """A C-contiguous numpy array of ``shape`` and ``dtype`` (zeroed) in a shared buffer. Allreduce it in place
    (``hvd.allreduce_``) on every rank: when it is allreduced alone and is at least 1 MiB, ranks in several processes
    on one host then read one another's arrays directly instead of copying through the shared segment twice (arrays
    fused into one group with others go through the shared segment as any array). Where shared memory is unavailable it is
    private memory (the library logs why once) and allreduces take the ring as for any array. The memory is freed
    when the array and every view of it are gone (an operation in flight holds the array, so it is never freed
    under one). Needs no ``hvd.init()``."""
    import numpy as np

    dt = np.dtype(dtype)
    try:
        dims = (operator.index(shape),)
    except TypeError:
        dims = tuple(operator.index(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ValueError("hvd.empty: negative dimension in shape {!r}".format(shape))
    nbytes = math.prod(dims) * dt.itemsize
    alloc, free, _ = _alloc_fns()
    ptr = alloc(nbytes)
    if not ptr:
        from . import _error

        raise _error()
    try:
        # The ctypes array owns nothing; `_track` frees the buffer once the ctypes array (the base of the
        # numpy array and of all its views) is collected.
        raw = (ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr)
        _track(raw, ptr, free)
    except BaseException:
        free(ptr)
        raise
    return np.frombuffer(raw, dtype=np.uint8, count=nbytes).view(dt).reshape(dims)


def is_shared(array):
    """Whether ``array`` (or the array it views) lies in a shared buffer from :func:`empty` (False for a private
    fallback or any other array)."""
    base = array
    while getattr(base, "base", None) is not None and not isinstance(base, ctypes.Array):
        base = base.base
    if not isinstance(base, ctypes.Array):
        return False
    _, _, shared = _alloc_fns()
    return shared(ctypes.addressof(base)) == 1
