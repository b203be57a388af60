"""hvd: Horovod-style collectives for training processes started by ``hvd run``.

Pure Python over the C ABI of ``libhvd_runtime.so`` (see ``hvd/_lib.py`` for how the library is found), so one
copy serves every Python version and framework. Tensors: numpy arrays (zero-copy through the buffer protocol)
and any CPU tensor with ``__dlpack__`` (torch, jax, tensorflow).

    import hvd, numpy as np
    hvd.init()
    total = hvd.allreduce(np.ones(3, np.float32), op=hvd.Sum)   # = size() everywhere
"""

import sys

# This file parses on python 2.7 (no `raise ... from`, no f-strings) so that an old interpreter gets this message
# rather than a SyntaxError; the rest of the package needs 3.6+.
if sys.version_info < (3, 6):
    raise ImportError(
        "hvd (the worker runtime of `hvd run`) needs python 3.6 or newer; this env's python is %d.%d. "
        "Use a python >= 3.6 in hvd.toml, or `import horovod` with Horovod's own runtime on this python"
        % sys.version_info[:2]
    )

import atexit
import ctypes
import operator
import os
import pickle
import threading
import weakref

from . import _batch, _lib
from ._dlpack import DLPackView
from ._shared import empty

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size", "cross_rank",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_async",
    "grouped_allreduce_", "grouped_allreduce_async_",
    "allgather", "allgather_async", "broadcast", "broadcast_async", "broadcast_", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "barrier", "join", "poll", "synchronize",
    "broadcast_object", "allgather_object", "start_timeline", "stop_timeline", "Sum", "Average", "Min", "Max", "Product",
    "HvdError", "InvalidArgumentError", "MismatchError", "NotInitializedError", "HorovodInternalError", "PeerLostError",
    "CollectiveTimeoutError", "StallError", "Handle", "library_path", "BFloat16Bits", "elastic", "HostsUpdatedInterrupt",
    "mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "mpi_enabled",
    "gloo_enabled", "mpi_threads_supported", "is_homogeneous", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set", "empty",
]

# Reduce operations (hvd.h enum hvd_reduce_op).
Sum, Average, Min, Max, Product = 0, 1, 2, 3, 4
_OPS = (Sum, Average, Min, Max, Product)

_ALLREDUCE, _ALLGATHER, _BROADCAST, _ALLTOALL, _REDUCESCATTER, _BARRIER, _JOIN = range(7)


class HvdError(RuntimeError):
    """Base class of every hvd failure; the subclasses say which kind it is (hvd.h ``enum hvd_error_kind``)."""


class InvalidArgumentError(HvdError, ValueError):
    """A bad argument or request, refused on this rank before anything ran."""


class MismatchError(HvdError):
    """The ranks' requests disagree (name, operation, dtype, shape, root, group; a broadcast rooted at a joined
    rank): the operation failed on every rank, and the job goes on."""


class NotInitializedError(HvdError, ValueError):
    """No engine: ``hvd.init()`` was not called, or ``hvd.shutdown()`` was."""


class HorovodInternalError(HvdError):
    """The job cannot go on: every later operation fails too. As in Horovod, elastic training catches this class
    (and only this one) to restore its state and start again. Subclasses name the cause; this class itself is
    raised for any other (a broken connection, an I/O error, a bug)."""


class PeerLostError(HorovodInternalError):
    """A peer died or left; ``rank`` is the lost rank (None when unknown)."""

    rank = None


class CollectiveTimeoutError(HorovodInternalError):
    """No progress from some rank within ``HVD_COLLECTIVE_TIMEOUT``."""


class StallError(HorovodInternalError):
    """A rank did not submit an operation that the others wait for within ``HVD_STALL_SHUTDOWN_TIME``."""


# hvd.h enum hvd_error_kind -> class (0, none, and unknown kinds: the base class).
_ERRORS = {1: InvalidArgumentError, 2: MismatchError, 3: PeerLostError, 4: CollectiveTimeoutError, 5: StallError,
           6: NotInitializedError, 7: HorovodInternalError}


def _l():
    return _lib._lib or _lib.load()


def _error(lib=None):
    """The exception for the calling thread's last failure in the library: its kind's class, with its message."""
    lib = lib or _l()
    cls = _ERRORS.get(lib.hvd_last_error_kind(), HvdError)
    e = cls(lib.hvd_last_error().decode("utf-8", "replace"))
    if cls is PeerLostError:
        rank = lib.hvd_last_error_rank()
        e.rank = None if rank < 0 else rank
    return e


def _check(rc):
    if rc < 0:
        raise _error()
    return rc


def library_path():
    """The shared library in use."""
    return str(_lib.path())


def init(comm=None, process_sets=None):
    """Joins the job described by the environment (``hvd run``, mpirun, srun; none: a job of one rank). With
    ``process_sets`` (a list of ``ProcessSet``), adds each as ``add_process_set`` does, in order (every rank passes
    the same list); one with the ranks of an earlier one in the list is left without an id, as in Horovod."""
    if comm is not None:
        raise ValueError("hvd.init() takes no communicator: the job comes from the environment")
    _check(_l().hvd_init())
    global _init_pid
    _init_pid = os.getpid()
    global_process_set.ranks = list(range(size()))
    if process_sets:
        if isinstance(process_sets, ProcessSet):
            process_sets = [process_sets]
        seen = set()
        for ps in process_sets:
            if not isinstance(ps, ProcessSet):
                ps = ProcessSet(ps)
            key = tuple(ps.ranks or ())
            if key in seen or ps is global_process_set or key == tuple(global_process_set.ranks):
                ps._invalidate()
                continue
            seen.add(key)
            add_process_set(ps)
    # A new job (or a new round of an elastic one) numbers its unnamed object collectives from 0 on every rank.
    _object_counter.__dict__.clear()
    global _atexit_registered
    if not _atexit_registered:
        # Leaving without shutdown would look like a dead peer to the other ranks.
        atexit.register(shutdown)
        _atexit_registered = True


_atexit_registered = False
_init_pid = None  # the process that called hvd.init() (until shutdown): a child forked from it has no engine


class _Forked(object):
    """``_lib._lib`` in a child forked from an initialized process (a DataLoader worker, multiprocessing's fork): the
    child has the library's state but none of its engine threads, so a submission would wait forever. The topology
    reads pass; anything else raises an ``HvdError`` naming the fork."""

    _READS = frozenset(("hvd_rank", "hvd_size", "hvd_local_rank", "hvd_local_size", "hvd_cross_rank",
                        "hvd_cross_size", "hvd_is_homogeneous", "hvd_build_features", "hvd_last_error",
                        "hvd_last_error_kind", "hvd_last_error_rank"))

    def __init__(self, lib, parent):
        self._real, self._parent = lib, parent

    def __getattr__(self, name):
        if name in self._READS:
            return getattr(self._real, name)
        raise HvdError(
            "hvd was initialized in process {} and this process ({}) is a child forked from it: a forked child has "
            "none of hvd's engine, so it cannot run collectives or call {} (a DataLoader worker or a multiprocessing "
            "fork); run them in the parent, or start the child with the 'spawn' method".format(
                self._parent, os.getpid(), name))


def _after_fork_child():
    global _init_pid
    _inflight.clear()  # (the parent's engine's operations: none in this process)
    if _init_pid is not None and _lib._lib is not None and type(_lib._lib) is not _Forked:
        _lib._lib = _Forked(_lib._lib, _init_pid)
        _init_pid = None


def shutdown():
    """Leaves the job once every rank has called shutdown (meanwhile this rank acts as joined); every process set
    is removed with it."""
    _GROUPS.clear()  # the library forgets its prepared groups
    for ps in list(_SETS.values()):
        ps._invalidate()
    _SETS.clear()
    if type(_lib._lib) is _Forked:
        return  # a forked child is no member of the job (its atexit runs the parent's registration)
    _batch.flush()  # batched allreduces are submitted before this rank leaves
    global _init_pid
    _init_pid = None
    if _lib._lib is not None:
        rc = _l().hvd_shutdown()
        if rc == 0:
            # The engine has ended: no operation of it is in flight, and its handles mean nothing to a later one.
            _batch.shut_down()
            _sweep_inflight()
        _check(rc)


def start_timeline(file_path, mark_cycles=False):
    """Starts writing a Chrome-trace timeline to ``file_path`` (as ``HVD_TIMELINE`` does from the start; one being
    written is closed first). Call it on every rank: rank 0 writes the file, or every rank its own with ``{rank}``
    in the path. ``mark_cycles`` marks the engine's cycles."""
    _check(_l().hvd_start_timeline(os.fsencode(file_path), int(bool(mark_cycles))))


def stop_timeline():
    """Stops writing the timeline; when this returns the file is complete."""
    _check(_l().hvd_stop_timeline())


def is_initialized():
    return bool(_l().hvd_is_initialized())


def _topology(fn):
    v = fn()
    if v < 0:
        raise ValueError("hvd is not initialized: call hvd.init() first")
    return v


def _topology_function(name, doc):
    symbol = "hvd_" + name

    def get():
        return _topology(getattr(_l(), symbol))

    get.__name__ = get.__qualname__ = name
    get.__doc__ = doc + " Raises ValueError before ``hvd.init()``."
    return get


size = _topology_function("size", "Number of ranks in the job.")
rank = _topology_function("rank", "This process's rank, ``0..size()``.")
local_size = _topology_function("local_size", "Number of ranks on this host.")
local_rank = _topology_function("local_rank", "This process's rank among the ranks on this host.")
cross_size = _topology_function("cross_size", "Number of hosts.")
cross_rank = _topology_function("cross_rank", "Index of this host among the hosts.")


# ---------------------------------------------------------------------------------------------------------------
# Build and job introspection (Horovod's names; docs/runtime.md gives each answer's reason)

_BUILT_MPI, _BUILT_NCCL = 1, 2  # hvd.h enum hvd_build_feature


def mpi_built():
    """True when the runtime library was compiled with the mpi backend (cargo feature ``mpi``). Needs no init."""
    return bool(_l().hvd_build_features() & _BUILT_MPI)


def nccl_built():
    """True when the runtime library was compiled with the nccl backend (cargo feature ``nccl``; NCCL itself is
    loaded at run time). Needs no init."""
    return bool(_l().hvd_build_features() & _BUILT_NCCL)


def gloo_built():
    """Always False: hvd has no Gloo. Its own tcp, shm and hierarchical communicators are not Gloo."""
    return False


def ddl_built():
    """Always False: hvd has no IBM DDL support."""
    return False


def ccl_built():
    """Always False: hvd has no oneCCL support."""
    return False


def cuda_built():
    """Always False: no hvd operation takes GPU memory (tensors must be on the CPU; even the nccl backend stages
    host buffers through the GPU)."""
    return False


def rocm_built():
    """Always False: hvd has no ROCm support."""
    return False


def _backend():
    name = _l().hvd_backend()
    return None if name is None else name.decode("ascii", "replace")


def mpi_enabled():
    """True when this job's collectives run over MPI (``HVD_COLLECTIVE_BACKEND=mpi``); False otherwise and before
    ``hvd.init()``."""
    return _backend() == "MPI"


def gloo_enabled():
    """Always False: hvd never runs Gloo (its tcp/shm communicators are its own)."""
    return False


def mpi_threads_supported():
    """Whether other MPI users (mpi4py) may share this process's MPI. Raises ValueError when MPI is not enabled
    (as Horovod does), or before ``hvd.init()``."""
    if not is_initialized():
        raise ValueError("hvd is not initialized: call hvd.init() first")
    if not mpi_enabled():
        raise ValueError(
            "MPI is not enabled in this job (its communicator is {}): run with HVD_COLLECTIVE_BACKEND=mpi under "
            "mpirun and a runtime built with the mpi feature".format(_backend()))
    raise ValueError(
        "hvd does not know yet whether its MPI library provides MPI_THREAD_MULTIPLE (the mpi backend does not "
        "report the thread level it got); do not assume mpi4py can share this process's MPI")


def is_homogeneous():
    """True when every host runs the same number of ranks (every rank's local size, gathered at init). Raises
    ValueError before ``hvd.init()``."""
    return bool(_topology(_l().hvd_is_homogeneous))


# ---------------------------------------------------------------------------------------------------------------
# Tensors


_numpy = None
_ndarray = None  # numpy.ndarray once numpy is loaded (a fast path checks `type(x) is _ndarray`)


def _np():
    global _numpy, _ndarray
    if _numpy is not None:
        return _numpy
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy is in every environment hvd builds
        raise ImportError("hvd needs numpy for its results; install numpy in this environment")
    _numpy, _ndarray = numpy, numpy.ndarray
    return numpy


_NP_NAMES = {"uint8": 0, "int8": 1, "int32": 2, "int64": 3, "float16": 4, "float32": 5, "float64": 6,
             "bfloat16": 7, "bool": 0}
_NP_CODES = {}  # numpy dtype object -> code, filled on first sight (dtype.name is slow)
_CODE_NAMES = {0: "uint8", 1: "int8", 2: "int32", 3: "int64", 4: "float16", 5: "float32", 6: "float64"}


def _np_dtype(code):
    np = _np()
    if code == 7:
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError("bfloat16 results need the ml_dtypes package")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(_CODE_NAMES[code])


class BFloat16Bits:
    """A numpy ``uint16`` array read as bfloat16 bit patterns (the upper half of float32s). numpy has no bfloat16
    dtype: with the ``ml_dtypes`` package installed, pass ``ml_dtypes.bfloat16`` arrays directly; without it, wrap
    the bits. Results come back as ``uint16`` arrays of bfloat16 bits; in-place operations update ``bits``.

        bits = (np.float32_array.view(np.uint32) >> 16).astype(np.uint16)
        summed = hvd.allreduce(hvd.BFloat16Bits(bits), op=hvd.Sum)
        as_f32 = (summed.astype(np.uint32) << 16).view(np.float32)
    """

    __slots__ = ("bits",)

    def __init__(self, bits):
        np = _np()
        if not isinstance(bits, np.ndarray) or bits.dtype != np.uint16:
            raise TypeError("BFloat16Bits wraps a numpy uint16 array of bfloat16 bit patterns, not {!r}".format(
                getattr(bits, "dtype", type(bits))))
        self.bits = bits

    def __repr__(self):
        return "hvd.BFloat16Bits({!r})".format(self.bits)


def _base(tensor):
    """The array an in-place operation writes to."""
    return tensor.bits if type(tensor) is BFloat16Bits else tensor


_from_buffer = ctypes.c_char.from_buffer
_addressof = ctypes.addressof


def _np_ptr(arr):
    """Data pointer of a C-contiguous numpy array. The buffer protocol (writable arrays) costs well under a
    microsecond; ``__array_interface__`` builds a dict per call (several microseconds), so it is only the fallback
    (read-only or empty arrays)."""
    try:
        return _addressof(_from_buffer(arr))
    except (TypeError, ValueError, BufferError):
        return arr.__array_interface__["data"][0]


_TORCH_TABLE = None  # (torch dtype -> code, torch.strided), built when the first torch tensor comes


def _torch_table():
    """torch's dtypes -> hvd.h dtype codes, and ``torch.strided`` (the one layout hvd reads); for ``_torch_fast`` and
    the batch (hvd/_batch.py). Called once a torch tensor has come, so torch is loaded."""
    global _TORCH_TABLE
    if _TORCH_TABLE is None:
        import torch

        _TORCH_TABLE = ({torch.uint8: 0, torch.int8: 1, torch.int32: 2, torch.int64: 3, torch.float16: 4,
                         torch.float32: 5, torch.float64: 6, torch.bfloat16: 7, torch.bool: 0}, torch.strided)
    return _TORCH_TABLE


def _torch_fast(t, obj):
    """Fills ``t`` from a contiguous CPU torch tensor through its own accessors, about 2 us where DLPack through
    ctypes takes about 12 (a gradient allreduce per parameter per step pays it). Anything else (other types, other
    devices and layouts, tensors that require grad, dtypes hvd lacks) is left to DLPack, which also gives the
    errors."""
    cls = type(obj)
    if cls.__name__ != "Tensor" or cls.__module__ != "torch":
        return False
    codes, strided = _torch_table()
    if obj.is_neg():
        # A lazily negated view: its memory holds the values un-negated (DLPack would read them so, silently).
        raise ValueError("hvd reads a tensor's memory; this one is a lazily negated view: call .resolve_neg() first")
    code = codes.get(obj.dtype)
    if (code is None or obj.layout is not strided or obj.requires_grad or obj.device.type != "cpu"
            or not obj.is_contiguous()):
        return False
    t.array = None
    # (Not None: results are turned back into torch tensors by ``wrap``.) The storage, not just the tensor: a
    # tensor given new memory (``set_``, ``.data =``) while an operation is in flight must not free the old.
    t.view = obj.untyped_storage()
    t.ptr = obj.data_ptr()
    t.dtype = code
    t.shape = tuple(obj.shape)
    t.np_dtype = None
    return True


class _Tensor:
    """A contiguous CPU buffer: pointer, dtype code, shape, and how to turn results back into the caller's type."""

    __slots__ = ("obj", "array", "view", "ptr", "dtype", "shape", "np_dtype")

    def __init__(self, obj):
        self.obj = obj
        self.view = None
        if type(obj) is _ndarray:
            code = _NP_CODES.get(obj.dtype)
            if code is not None:
                try:
                    self.ptr = _addressof(_from_buffer(obj))  # refuses non-contiguous, read-only and empty arrays
                except (TypeError, ValueError, BufferError):
                    pass
                else:
                    self.array = obj
                    self.dtype = code
                    self.shape = obj.shape
                    self.np_dtype = obj.dtype
                    return
        elif _torch_fast(self, obj):
            return
        np = _np()
        if type(obj) is BFloat16Bits:
            arr = obj.bits if obj.bits.flags.c_contiguous else np.ascontiguousarray(obj.bits)
            self.array = arr
            self.ptr = _np_ptr(arr)
            self.dtype = 7
            self.shape = arr.shape
            self.np_dtype = arr.dtype
        elif isinstance(obj, np.ndarray) or not hasattr(obj, "__dlpack__"):
            arr = obj if type(obj) is np.ndarray and obj.flags.c_contiguous else np.asarray(obj, order="C")
            code = _NP_CODES.get(arr.dtype)
            if code is None:
                code = _NP_CODES[arr.dtype] = _NP_NAMES.get(arr.dtype.name)
            if code is None:
                raise TypeError("hvd does not support dtype {} (supported: {})".format(
                    arr.dtype, ", ".join(sorted(_NP_NAMES))))
            self.array = arr
            self.ptr = _np_ptr(arr)
            self.dtype = code
            self.shape = arr.shape
            self.np_dtype = arr.dtype
        else:
            view = DLPackView(obj)
            self.array = None
            self.view = view
            self.ptr = view.data
            self.dtype = view.dtype
            self.shape = view.shape
            self.np_dtype = None

    def is_numpy(self):
        return self.array is not None and self.array is self.obj

    def empty(self, shape):
        """A new numpy array of this tensor's dtype."""
        np = _np()
        if self.np_dtype is not None:
            return np.empty(shape, self.np_dtype)
        if self.dtype == 7:
            return np.empty(shape, np.uint16)  # bf16 bits; converted by _wrap
        return np.empty(shape, _np_dtype(self.dtype))

    def wrap(self, arr):
        """A numpy result as the caller's tensor type."""
        if self.view is None:
            return arr
        module = type(self.obj).__module__.split(".")[0]
        if module == "torch":
            import torch

            if self.dtype == 7:
                # (bf16 bits come as uint16, which torch.from_numpy takes only from torch 2.3 on; int16 always.)
                return torch.from_numpy(arr.view(_np().int16)).view(torch.bfloat16)
            return torch.from_numpy(arr)
        if module in ("jax", "jaxlib"):
            import jax.numpy as jnp

            return jnp.asarray(arr.view(_np_dtype(7)) if self.dtype == 7 else arr)
        if module == "tensorflow":
            import tensorflow as tf

            if self.dtype == 7:
                return tf.bitcast(tf.convert_to_tensor(arr), tf.bfloat16)
            return tf.convert_to_tensor(arr)
        return arr


class Handle:
    """An operation in flight. ``poll(h)`` tells whether it is done; ``synchronize(h)`` returns its result.
    ``_value`` set: the result is that object (already in the caller's memory), nothing to read from the library.
    ``_group`` set (the number of handles in ``id``, a ctypes array): a grouped operation, waited for with one
    call. ``_keep``: the ``_InFlight`` record that keeps its buffers alive (appended before the library call), or
    None."""

    __slots__ = ("id", "_keep", "_finish", "_done", "_result", "_value", "_group", "__weakref__")

    def __init__(self, hid, rec, finish, value=None, group=None):
        self.id = hid
        self._finish = finish
        self._done = False
        self._result = None
        self._value = value
        self._group = group
        self._keep = rec
        if rec is not None:
            # The handle first, then the id: a sweep in another thread between the two stores sees the id unknown
            # (kept) or the handle alive (kept), never a known id with no handle yet (released under it).
            rec.handle = _weakref(self)
            rec.group = group
            rec.id = hid

    def __repr__(self):
        return "hvd.Handle({}{})".format(self.id, ", done" if self._done else "")


class _InFlight(object):
    """An operation in flight with the buffers it keeps alive, in ``_inflight`` from just before its library call
    until its ``synchronize`` or, once its handle is dropped (``handle`` a dead weak reference), until it has
    completed. Appended before the call, so that a signal handler raising right after the call returns (Ctrl-C's
    KeyboardInterrupt, hvd.elastic's SIGTERM SystemExit) cannot leave the buffers held by locals only: until the
    call's id is stored (``id`` None, ``handle`` none yet) the record stays until ``hvd.shutdown`` returns (its
    operation may be in flight under an id nobody knows). No finalizer: a signal handler that raises inside
    ``__del__`` has its exception swallowed and the buffers were freed while the library could still write them. No
    ``__eq__``: ``list.remove`` finds it by identity, in C, without running Python code."""

    __slots__ = ("handle", "id", "group", "keep", "epoch")

    def __init__(self, keep):
        self.handle, self.id, self.group, self.keep, self.epoch = _no_handle, None, None, keep, _batch._epoch


def _no_handle():
    return None


def _hold(keep):
    """Registers ``keep`` (the buffers of a submission about to be made) in ``_inflight``; returns its record, or
    None when there is nothing to keep."""
    if keep is None:
        return None
    rec = _InFlight(keep)
    _inflight.append(rec)
    return rec


_inflight = []
# Submissions until the next sweep of _inflight: at least 64, and half its length after a sweep, so that the records
# of live handles, which stay, cost a submission O(1) amortized; a dropped handle's buffers go within that many.
_sweep_in = [64]
_Batched = _batch.BatchedHandle
_weakref = weakref.ref
if hasattr(os, "register_at_fork"):
    # A child has none of the parent's engine: the records of its handles go, and submissions raise.
    os.register_at_fork(after_in_child=_after_fork_child)


def _forget(rec):
    """Takes a synchronized handle's record out of ``_inflight`` (its operation has ended)."""
    if rec is not None:
        try:
            _inflight.remove(rec)
        except ValueError:
            pass  # an hvd.shutdown's sweep let it go


def _sweep_inflight():
    """Releases the operations of dropped handles that have completed, and with them their buffers.

    Any thread may sweep (no lock), so a record leaves the list only through one ``remove`` of that very record,
    after its operation is known complete: never popped into a local while it is polled, where a signal handler that
    raises after a call (Ctrl-C's KeyboardInterrupt, hvd.elastic's SIGTERM SystemExit) would lose it and free
    buffers the library may still write. Interrupted after its release, a record stays; the next sweep polls -1
    for it (a handle the library does not know), which lets it go. A record of a live handle stays for its
    ``synchronize``; one from before the last ``hvd.shutdown`` goes without a call. A completed handle is released
    with ``hvd_wait_and_release``, which takes it out of the engine too."""
    lib = _lib._lib
    epoch = _batch._epoch
    for rec in _inflight[:]:
        if rec.epoch == epoch and lib is not None:
            if rec.id is None or rec.handle() is not None:
                continue  # submitted under an id not yet stored (or never: interrupted), or a live handle's
            if rec.group is not None:
                if lib.hvd_poll_many(rec.id, rec.group) == 0:
                    continue
                lib.hvd_wait_many(rec.id, rec.group)
            elif lib.hvd_poll(rec.id) == 0:
                continue
            else:
                lib.hvd_wait_and_release(rec.id)  # completed (or unknown): returns at once
        _forget(rec)
    _sweep_in[0] = max(64, len(_inflight) // 2)


# ---------------------------------------------------------------------------------------------------------------
# Process sets


class ProcessSet:
    """Horovod's process set: some of the job's ranks (global ranks, kept sorted), which run collectives among
    themselves once added (``add_process_set``, or ``init(process_sets=...)``): pass it as ``process_set=`` to a
    collective, which only its members call. ``process_set_id`` is None until added."""

    process_set_id = None
    ranks = None

    def __init__(self, ranks):
        try:
            ranks = sorted(ranks)
        except TypeError:
            raise ValueError("ProcessSet takes a list of ranks (hvd has no MPI communicators), not {!r}".format(ranks))
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError("ProcessSet takes a list of integer ranks, not {!r}".format(ranks))
        self.ranks = ranks

    def _invalidate(self):
        self.process_set_id = None

    def size(self):
        """The number of ranks, or None before the set is added."""
        if self.process_set_id is None:
            return None
        return _check(_l().hvd_process_set_size(self.process_set_id))

    def rank(self):
        """This rank's rank in the set (its position among the set's ranks), or None before the set is added; a
        ValueError when this rank is not a member. (A broadcast's root is still a global rank.)"""
        if self.process_set_id is None:
            return None
        return _check(_l().hvd_process_set_rank(self.process_set_id))

    def included(self):
        """Whether this rank is a member (None without ranks)."""
        if self.process_set_id == 0:
            return True
        if self.ranks is None:
            return None
        return rank() in self.ranks

    def __str__(self):
        # Horovod's form; hvd's sets have no MPI communicator.
        return "ProcessSet(process_set_id={}, ranks={}, mpi_comm=None)".format(self.process_set_id, self.ranks)

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
# Added sets by id, until removed or shutdown.
_SETS = {}


def add_process_set(process_set):
    """Adds a process set (a ``ProcessSet`` or a list of global ranks) and returns it with its id. Every rank of the
    job calls it with the same ranks, in the same order as its other adds. Refused with a ValueError: duplicate
    ranks, ranks outside the job, every rank, or the ranks of a set that exists already."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    ranks = process_set.ranks
    lib = _l()
    job_size = _check(lib.hvd_size())
    # A rank outside the job (one past int64 would be truncated by ctypes) goes to the library as -1: the add is
    # still agreed on by every rank (a rank raising alone would leave the others waiting), all fail alike, and the
    # error names the rank as given.
    bad = [rk for rk in ranks if not 0 <= rk < job_size]
    arr = (ctypes.c_int64 * max(len(ranks), 1))(*[rk if 0 <= rk < job_size else -1 for rk in ranks])
    ps_id = lib.hvd_add_process_set(arr, len(ranks))
    if bad:
        raise InvalidArgumentError("invalid process set {}: rank {} is not a rank of the job (ranks are 0..{})".format(
            ranks, bad[0], job_size))
    if ps_id < 0:
        raise _error(lib)
    process_set.process_set_id = ps_id
    _SETS[ps_id] = process_set
    return process_set


def remove_process_set(process_set):
    """Removes an added set: every rank calls it with the same set, in the same order as its other adds and removes
    (as in Horovod; its id is forgotten). Returns whether a set was removed: False for the global set or a set that
    was never added (or already removed). Ranks that remove different sets all get a MismatchError and keep them; a
    StallError when the set's engine did not stop in time (the set is forgotten)."""
    ps_id = process_set.process_set_id
    if ps_id is None or ps_id == 0 or not is_initialized():
        return False
    lib = _l()
    if lib.hvd_remove_process_set(ps_id) == 0:
        process_set._invalidate()
        _SETS.pop(ps_id, None)
        return True
    e = _error(lib)
    if isinstance(e, InvalidArgumentError):
        return False
    if not isinstance(e, MismatchError):
        process_set._invalidate()
        _SETS.pop(ps_id, None)
    raise e


def _set_id(process_set):
    """The library's id of ``process_set`` (None: the global set)."""
    if process_set is None:
        return 0
    ps_id = getattr(process_set, "process_set_id", None)
    if ps_id is None:
        raise ValueError("{} has not been added (hvd.add_process_set) or was removed".format(process_set))
    return ps_id


def _set_rank(process_set, global_rank, what):
    """``global_rank``'s rank in set ``ps_id`` (a broadcast's root)."""
    ranks = process_set.ranks
    if process_set.process_set_id == 0 or not ranks:
        return global_rank
    try:
        return ranks.index(global_rank)
    except ValueError:
        raise InvalidArgumentError("the {} rank {} is not a member of {}".format(what, global_rank, process_set))


_tls = threading.local()
_MAX_NDIM = 64


def _scratch():
    """This thread's reusable request and shape array: ``hvd_enqueue`` copies what it needs from them before it
    returns (only the tensors' buffers must outlive the call), so one of each serves every submission."""
    try:
        return _tls.req, _tls.shape
    except AttributeError:
        _tls.req, _tls.shape = _lib.HvdRequest(), (ctypes.c_int64 * _MAX_NDIM)()
        return _tls.req, _tls.shape


def _request(kind, tensor, name, out_ptr=None, op=Sum, root=0, prescale=1.0, postscale=1.0, splits=None):
    """The parameters of one submission; ``_submit`` writes them into the thread's scratch request."""
    return (kind, tensor, name, out_ptr, op, root, prescale, postscale, splits), []


def _submit(request, keep, finish, value=None, ps_id=0):
    if _batch._open is not None:
        _batch.flush()  # a rank blocked in this operation must not hold back one that another rank waits for
    if _inflight:
        _sweep_in[0] -= 1
        if _sweep_in[0] <= 0:
            _sweep_inflight()
    kind, tensor, name, out_ptr, op, root, prescale, postscale, splits = request
    req, shape = _scratch()
    req.kind = kind
    req.name = name.encode("utf-8") if name else None
    if tensor is None:
        req.dtype = req.ndim = 0
        req.input = None
    else:
        dims = tensor.shape
        n = len(dims)
        if n > _MAX_NDIM:
            shape = (ctypes.c_int64 * n)(*dims)
        else:
            shape[:n] = dims
        req.dtype = tensor.dtype
        req.ndim = n
        req.input = tensor.ptr
    req.shape = shape
    req.output = out_ptr
    req.op = op
    req.root = root
    req.prescale = prescale
    req.postscale = postscale
    if splits is None:
        req.splits = None
        req.nsplits = 0
    else:
        req.splits = (ctypes.c_int64 * max(len(splits), 1))(*[int(s) for s in splits])
        req.nsplits = len(splits)
    lib = _l()
    if keep is not None:
        rec = _InFlight(keep)  # (_hold, inlined: the hot path)
        _inflight.append(rec)
    else:
        rec = None
    hid = lib.hvd_enqueue(_byref(req)) if ps_id == 0 else lib.hvd_enqueue_ps(_byref(req), ps_id)
    if hid < 0:
        _forget(rec)  # refused: nothing in flight
        _check(hid)
    return Handle(hid, rec, finish, value)


_byref = ctypes.byref


def _resolve_op(average, op, default=Average):
    if op is not None and average is not None:
        raise ValueError("pass either op or average, not both")
    if op is None:
        if average is None:
            return default
        return Average if average else Sum
    if op not in _OPS:
        raise ValueError("unknown op {!r}: use hvd.Sum, hvd.Average, hvd.Min, hvd.Max or hvd.Product".format(op))
    return op


def _owned_result(t):
    """Finisher for ops whose result the library owns (allgather, alltoall, reducescatter)."""

    def finish(hid):
        lib = _l()
        ndim = _check(lib.hvd_result_ndim(hid))
        shape = (ctypes.c_int64 * max(ndim, 1))()
        _check(lib.hvd_result_shape(hid, shape))
        out = t.empty(tuple(shape[i] for i in range(ndim)))
        nbytes = _check(lib.hvd_result_nbytes(hid))
        _check(lib.hvd_result_copy(hid, _np_ptr(out) if nbytes else None, nbytes))
        return t.wrap(out)

    return finish


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=None):
    """Starts an allreduce (default: average over the ranks, of ``process_set`` when given); ``synchronize`` returns
    a new tensor."""
    ps_id = _set_id(process_set)
    t = _Tensor(tensor)
    out = t.empty(t.shape)
    req, keep = _request(_ALLREDUCE, t, name, _np_ptr(out), _resolve_op(average, op), 0, prescale_factor,
                         postscale_factor)
    keep += [t, out]
    return _submit(req, keep, lambda hid: t.wrap(out), None, ps_id)


def allreduce(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    return synchronize(allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=None):
    """In-place allreduce of a contiguous numpy array or DLPack tensor; ``synchronize`` returns the tensor."""
    if process_set is None or _set_id(process_set) == 0:
        # (The per-tensor path: an op given alone needs no call to _resolve_op, the global set none to _set_id.)
        resolved = op if average is None and op in _OPS else _resolve_op(average, op)
        handle = _batch.allreduce_(tensor, name, resolved, prescale_factor, postscale_factor)
        if handle is not None:
            return handle  # batched: no call into the library yet (hvd/_batch.py)
    ps_id = _set_id(process_set)
    t = _Tensor(tensor)
    if t.array is not None and (t.array is not _base(tensor) or not t.array.flags.writeable):
        raise ValueError("in-place operations need a writable, C-contiguous numpy array")
    req, keep = _request(_ALLREDUCE, t, name, t.ptr, _resolve_op(average, op), 0, prescale_factor,
                         postscale_factor)
    keep.append(t)
    return _submit(req, keep, None, tensor, ps_id)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


_REQUEST_DTYPE = None


def _request_dtype():
    """``hvd_request_t`` as a numpy structured dtype, so a group's requests are filled column by column."""
    global _REQUEST_DTYPE
    if _REQUEST_DTYPE is None:
        np = _np()
        kinds = {ctypes.c_int32: "<i4", ctypes.c_double: "<f8"}
        names, formats, offsets = [], [], []
        for field, ctype in _lib.HvdRequest._fields_:
            names.append(field)
            formats.append(kinds.get(ctype, "<u{}".format(ctypes.sizeof(ctypes.c_void_p))))
            offsets.append(getattr(_lib.HvdRequest, field).offset)
        _REQUEST_DTYPE = np.dtype({"names": names, "formats": formats, "offsets": offsets,
                                   "itemsize": ctypes.sizeof(_lib.HvdRequest)})
    return _REQUEST_DTYPE


def _grouped_allreduce(tensors, average, name, op, prescale_factor, postscale_factor, in_place, ps_id=0):
    """Submits the allreduces of ``tensors`` with one call (one engine cycle, fused) and returns one handle for the
    group. numpy arrays take a fast path: a buffer-protocol pointer and no per-tensor ctypes objects."""
    np = _np()
    op = _resolve_op(average, op)
    tensors = list(tensors)
    n = len(tensors)
    if _batch._open is not None:
        _batch.flush()
    if _inflight:
        _sweep_in[0] -= 1
        if _sweep_in[0] <= 0:
            _sweep_inflight()
    params = (op, prescale_factor, postscale_factor)
    cached = _GROUPS.get(name) if in_place and name and ps_id == 0 else None
    if (cached is not None and cached[0] == params and len(cached[1]) == n
            and all(map(_is, tensors, cached[1])) and list(map(_shape, tensors)) == cached[2]
            and (all(map(_is, map(_dtype, tensors), cached[3]))
                 or list(map(_dtype, tensors)) == cached[3])):
        # The same arrays as last time (a training loop's gradients): the prepared requests still hold.
        return _enqueue_prepared(cached, n, tensors)
    fast = _numpy_group(np, tensors, in_place)
    if fast is not None:
        ptrs, out_ptrs, codes, ndims, dims, outs = fast
        wraps, keep = [None] * n, []
    else:
        ptrs, out_ptrs, codes, ndims, dims, outs, wraps, keep = _any_group(np, tensors, in_place)
    reqs = np.zeros(n, _request_dtype())
    shapes = np.array(dims or [0], np.int64)
    names = None
    if n:
        nd = np.array(ndims, np.uint64)
        reqs["kind"] = _ALLREDUCE
        reqs["dtype"] = codes
        reqs["ndim"] = ndims
        reqs["shape"] = np.uint64(shapes.ctypes.data) + np.uint64(8) * (np.cumsum(nd) - nd)
        reqs["input"] = ptrs
        reqs["output"] = out_ptrs
        reqs["op"] = op
        reqs["prescale"] = prescale_factor
        reqs["postscale"] = postscale_factor
        if name:
            names, offsets = _group_names(np, name, n)
            reqs["name"] = np.uint64(names.ctypes.data) + offsets
    keep += [tensors, outs, reqs, shapes, names]
    if in_place and name and fast is not None and ps_id == 0:
        # Only plain numpy arrays are remembered: their data pointers cannot move while we hold a reference
        # (resize() refuses), unlike a framework tensor's storage.
        if len(_GROUPS) >= 64:
            for entry in _GROUPS.values():
                _release_group(entry)
            _GROUPS.clear()
        old = _GROUPS.get(name)
        if old is not None:
            _release_group(old)
        _GROUPS[name] = [params, tensors, list(map(_shape, tensors)), list(map(_dtype, tensors)), reqs, keep, None,
                         None]
    finish = None if in_place else (lambda hid: [o if w is None else w.wrap(o) for o, w in zip(outs, wraps)])
    return _enqueue_group(reqs, n, keep, tensors, finish, in_place, ps_id)


# In-place groups of numpy arrays by name: [params, tensors, shapes, dtypes, requests, keep, library group id,
# whether the library group goes as one handle (None: not asked yet)].
_GROUPS = {}
_is = operator.is_
# The same checks, looped in C: a step of a 100-tensor group spends about 20 us on them instead of 40. Builtin
# dtypes are singletons, so an identity check usually settles the dtypes (equality is the fallback).
_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")


def _enqueue_prepared(entry, n, tensors):
    """Submits a remembered in-place group. The first time this is called for it, the library checks and fuses it
    once (``hvd_group_prepare``); from then on a step is one call with no per-tensor work."""
    lib = _l()
    gid = entry[6]
    if gid is None:
        gid = lib.hvd_group_prepare(entry[4].ctypes.data_as(ctypes.POINTER(_lib.HvdRequest)), n)
        if gid < 0:
            # A request the engine refuses: the per-call path reports it as it always does.
            return _enqueue_group(entry[4], n, entry, tensors, None, True)
        entry[6] = gid
    rec = _hold(entry)
    if entry[7] is not False:
        hid = lib.hvd_group_submit(gid)
        if hid > 0:
            # Fused into one operation: one handle for the whole group.
            entry[7] = True
            return Handle(hid, rec, None, tensors)
        if hid < 0:
            _forget(rec)
            raise _error(lib)
        entry[7] = False
    ids = (ctypes.c_int64 * max(n, 1))()
    if lib.hvd_group_enqueue(gid, ids) != n:
        raise _error(lib)  # (the record stays until shutdown: whether any of them went is unknown)
    return Handle(ids, rec, None, tensors, group=n)


def _release_group(entry):
    gid = entry[6]
    entry[6] = entry[7] = None
    if gid is not None and _lib._lib is not None:
        _lib._lib.hvd_group_release(gid)


def _enqueue_group(reqs, n, keep, tensors, finish, in_place, ps_id=0):
    ids = (ctypes.c_int64 * max(n, 1))()
    lib = _l()
    requests = reqs.ctypes.data_as(ctypes.POINTER(_lib.HvdRequest))
    rec = _hold(keep)
    ok = lib.hvd_enqueue_many(requests, n, ids) if ps_id == 0 else lib.hvd_enqueue_many_ps(requests, n, ids, ps_id)
    if ok != n:
        error = _error(lib)
        lib.hvd_wait_many(ids, n)  # the accepted ones still run on the other ranks: wait for them
        _forget(rec)
        raise error
    if in_place:
        return Handle(ids, rec, None, tensors, group=n)
    return Handle(ids, rec, finish, group=n)


_GROUP_NAMES = {}


def _group_names(np, name, n):
    """The NUL-terminated names ``name.0 .. name.{n-1}`` in one buffer, and each one's offset (cached: a training
    loop submits the same group every step)."""
    key = (name, n)
    hit = _GROUP_NAMES.get(key)
    if hit is None:
        encoded = ["{}.{}\0".format(name, i).encode("utf-8") for i in range(n)]
        lengths = np.array([len(e) for e in encoded], np.uint64)
        hit = (np.frombuffer(b"".join(encoded), np.uint8).copy(), np.cumsum(lengths) - lengths)
        if len(_GROUP_NAMES) > 4096:
            _GROUP_NAMES.clear()
        _GROUP_NAMES[key] = hit
    return hit


def _numpy_group(np, tensors, in_place):
    """Pointers, dtype codes and shapes of a group made only of writable, C-contiguous, non-empty numpy arrays of
    supported dtypes, with list comprehensions (the common case); None for anything else."""
    ndarray = np.ndarray
    if not all(type(x) is ndarray for x in tensors):
        return None
    get = _NP_CODES.get
    codes = [get(x.dtype) for x in tensors]
    if None in codes:
        return None
    try:
        # The buffer protocol refuses non-contiguous, read-only and empty arrays: those take the general path.
        ptrs = [_addressof(_from_buffer(x)) for x in tensors]
        if in_place:
            outs = tensors
            out_ptrs = ptrs
        else:
            outs = [np.empty_like(x) for x in tensors]
            out_ptrs = [_addressof(_from_buffer(o)) for o in outs]
    except (TypeError, ValueError, BufferError):
        return None
    shapes = [x.shape for x in tensors]
    return ptrs, out_ptrs, codes, [len(s) for s in shapes], [d for s in shapes for d in s], outs


def _any_group(np, tensors, in_place):
    ptrs, out_ptrs, codes, ndims, dims, outs, wraps, keep = [], [], [], [], [], [], [], []
    ndarray = np.ndarray
    for x in tensors:
        if in_place and isinstance(_base(x), ndarray) and not _base(x).flags.writeable:
            raise ValueError("in-place operations need a writable array")
        if type(x) is ndarray and x.flags.c_contiguous and x.size:
            code = _NP_CODES.get(x.dtype)
            if code is None:
                code = _NP_NAMES.get(x.dtype.name)
                if code is None:
                    raise TypeError("hvd does not support dtype {} (supported: {})".format(
                        x.dtype, ", ".join(sorted(_NP_NAMES))))
                _NP_CODES[x.dtype] = code
            ptr = _np_ptr(x)
            shape = x.shape
            wrap = None
            if in_place:
                out, optr = x, ptr
            else:
                out = np.empty_like(x)
                optr = _np_ptr(out)
        else:
            t = _Tensor(x)
            if in_place and t.array is not None and t.array is not _base(x):
                raise ValueError("in-place operations need a C-contiguous numpy array")
            code, ptr, shape = t.dtype, t.ptr, t.shape
            keep.append(t)
            if in_place:
                out, optr, wrap = x, ptr, None
            else:
                out = t.empty(shape)
                optr = _np_ptr(out) if out.size else 0
                wrap = t
        ptrs.append(ptr)
        out_ptrs.append(optr)
        codes.append(code)
        ndims.append(len(shape))
        dims.extend(shape)
        outs.append(out)
        wraps.append(wrap)
    return ptrs, out_ptrs, codes, ndims, dims, outs, wraps, keep


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=None):
    """Allreduces a list of tensors submitted with one call into the library, so that they run in one engine cycle
    and fuse; returns one handle whose ``synchronize`` returns the list of results (one wait for the group).
    With ``name``, tensor i is named ``name.i``."""
    return _grouped_allreduce(tensors, average, name, op, prescale_factor, postscale_factor, False,
                              _set_id(process_set))


def grouped_allreduce(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=None):
    return synchronize(grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor,
                                               process_set))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=None):
    """In-place grouped allreduce of C-contiguous numpy arrays or DLPack tensors; ``synchronize`` returns the list
    of tensors."""
    return _grouped_allreduce(tensors, average, name, op, prescale_factor, postscale_factor, True,
                              _set_id(process_set))


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=None):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def allgather_async(tensor, name=None, process_set=None):
    """Concatenates every rank's tensor along dimension 0 (ranks may differ in that dimension), in rank order."""
    ps_id = _set_id(process_set)
    t = _Tensor(tensor)
    req, keep = _request(_ALLGATHER, t, name)
    keep.append(t)
    return _submit(req, keep, _owned_result(t), None, ps_id)


def allgather(tensor, name=None, process_set=None):
    return synchronize(allgather_async(tensor, name, process_set))


def broadcast_async(tensor, root_rank, name=None, process_set=None):
    """Rank ``root_rank``'s tensor, as a new tensor on every rank (of ``process_set``: ``root_rank`` is still a
    global rank, a member of the set)."""
    ps_id = _set_id(process_set)
    root = root_rank if ps_id == 0 else _set_rank(process_set, root_rank, "root")
    t = _Tensor(tensor)
    out = t.empty(t.shape)
    req, keep = _request(_BROADCAST, t, name, _np_ptr(out), root=root)
    keep += [t, out]
    return _submit(req, keep, lambda hid: t.wrap(out), None, ps_id)


def broadcast(tensor, root_rank, name=None, process_set=None):
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_async_(tensor, root_rank, name=None, process_set=None):
    """In-place broadcast into a contiguous numpy array or DLPack tensor."""
    ps_id = _set_id(process_set)
    root = root_rank if ps_id == 0 else _set_rank(process_set, root_rank, "root")
    t = _Tensor(tensor)
    if t.array is not None and (t.array is not _base(tensor) or not t.array.flags.writeable):
        raise ValueError("in-place operations need a writable, C-contiguous numpy array")
    req, keep = _request(_BROADCAST, t, name, t.ptr, root=root)
    keep.append(t)
    return _submit(req, keep, None, tensor, ps_id)


def broadcast_(tensor, root_rank, name=None, process_set=None):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def alltoall_async(tensor, splits=None, name=None, process_set=None):
    """Sends rows ``splits[j]`` of dimension 0 to rank j (default: equal parts; j counts the ranks of
    ``process_set`` when given); ``synchronize`` returns ``(received tensor, received splits)``."""
    ps_id = _set_id(process_set)
    t = _Tensor(tensor)
    if splits is not None:
        splits = [int(s) for s in (splits.tolist() if hasattr(splits, "tolist") else splits)]
    req, keep = _request(_ALLTOALL, t, name, splits=splits)
    keep.append(t)
    owned = _owned_result(t)

    def finish(hid):
        out = owned(hid)
        n = _l().hvd_process_set_size(ps_id)
        arr = (ctypes.c_int64 * max(n, 1))()
        _check(_l().hvd_result_splits(hid, arr))
        return out, [arr[i] for i in range(n)]

    return _submit(req, keep, finish, None, ps_id)


def alltoall(tensor, splits=None, name=None, return_received_splits=False, process_set=None):
    out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    return (out, received) if return_received_splits else out


def reducescatter_async(tensor, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """Reduces over ranks and leaves rank r its block of dimension 0 (the first ``dim0 % size`` ranks get one row
    more; r and size those of ``process_set`` when given)."""
    ps_id = _set_id(process_set)
    t = _Tensor(tensor)
    req, keep = _request(_REDUCESCATTER, t, name, op=_resolve_op(None, op), prescale=prescale_factor,
                         postscale=postscale_factor)
    keep.append(t)
    return _submit(req, keep, _owned_result(t), None, ps_id)


def reducescatter(tensor, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    return synchronize(reducescatter_async(tensor, name, op, prescale_factor, postscale_factor, process_set))


def barrier(name=None, process_set=None):
    """Returns once every rank (of ``process_set`` when given; Horovod's ``barrier(process_set)`` positionally
    works too) has called it."""
    if isinstance(name, ProcessSet):
        name, process_set = None, name
    ps_id = _set_id(process_set)
    req, keep = _request(_BARRIER, None, name)
    synchronize(_submit(req, keep, lambda hid: None, None, ps_id))


def join():
    """Declares that this rank has no more data: until every rank has joined, it contributes zeros (the reduction's
    identity) to the others' allreduces. Returns the rank that joined last."""
    req, keep = _request(_JOIN, None, None)
    return synchronize(_submit(req, keep, lambda hid: int(_l().hvd_result_value(hid))))


def poll(handle):
    """True when the operation has completed (``synchronize`` will not block)."""
    if handle._done:
        return True
    if type(handle) is _Batched:
        done = handle._batch.done
        if done is not None and done[handle._index]:
            return True  # released by an earlier wait of its batch (1), or failed there (255)
        return _batch.poll(handle)
    if _batch._open is not None:
        _batch.flush()
    if handle._group is not None:
        return _check(_l().hvd_poll_many(handle.id, handle._group)) == 1
    return _check(_l().hvd_poll(handle.id)) == 1


def synchronize(handle):
    """Waits for the operation and returns its result; raises an HvdError (its subclass names the kind of failure)
    if it failed."""
    if handle._done:
        return handle._result
    if type(handle) is _Batched:
        batch = handle._batch
        done = batch.done
        if done is not None and done[handle._index] == 1:
            # Released by an earlier wait of its batch (the usual case: one wait per batch makes a call).
            handle._done = True
            i = handle._index
            if batch.storages:
                _batch.check_storage(batch, handle)
                batch.storages.pop(i, None)
            handle._result = value = batch.values[i]
            batch.values[i] = None  # (the handle keeps its result: a surviving handle keeps no other's tensor)
            return value
        return _batch.synchronize(handle)
    if _batch._open is not None:
        _batch.flush()
    lib = _l()
    if handle._group is not None:
        handle._done = True
        rc = lib.hvd_wait_many(handle.id, handle._group)
        _forget(handle._keep)
        if rc != 0:
            raise _error(lib)
        handle._result = handle._value if handle._finish is None else handle._finish(None)
        return handle._result
    if handle._value is not None:
        handle._done = True
        rc = lib.hvd_wait_and_release(handle.id)
        _forget(handle._keep)
        if rc != 0:
            raise _error(lib)
        handle._result = handle._value
        return handle._result
    try:
        if lib.hvd_wait(handle.id) != 0:
            raise _error(lib)
        handle._result = handle._finish(handle.id)
        return handle._result
    finally:
        handle._done = True
        lib.hvd_release(handle.id)
        _forget(handle._keep)


# ---------------------------------------------------------------------------------------------------------------
# Python objects

_object_counter = threading.local()


def _object_name(kind, name):
    if name:
        return name
    n = getattr(_object_counter, kind, 0)
    setattr(_object_counter, kind, n + 1)
    return "{}.{}".format(kind, n)


def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    """A picklable object of rank ``root_rank``, on every rank (of ``process_set``)."""
    np = _np()
    name = _object_name("broadcast_object", name)
    data = pickle.dumps(obj) if rank() == root_rank else b""
    length = broadcast(np.array([len(data)], np.int64), root_rank, name + ".len", process_set)
    buf = np.frombuffer(data, np.uint8).copy() if rank() == root_rank else np.zeros(int(length[0]), np.uint8)
    buf = broadcast(buf, root_rank, name + ".data", process_set)
    return pickle.loads(buf.tobytes())


def allgather_object(obj, name=None, process_set=None):
    """Every rank's picklable object, in rank order."""
    np = _np()
    name = _object_name("allgather_object", name)
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    lengths = allgather(np.array([len(data)], np.int64), name + ".len", process_set)
    blob = allgather(data, name + ".data", process_set).tobytes()
    out, at = [], 0
    for n in lengths.tolist():
        out.append(pickle.loads(blob[at:at + n]))
        at += n
    return out


# ---------------------------------------------------------------------------------------------------------------
# The framework modules

# What hvd.torch, hvd.jax and hvd.tensorflow take over from this module as it is (each adds its own helpers).
_SHARED_API = (
    "ccl_built", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "is_homogeneous", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rocm_built", "Average", "Max", "Min", "Product", "Sum", "HvdError",
    "InvalidArgumentError", "MismatchError", "NotInitializedError", "HorovodInternalError", "PeerLostError",
    "CollectiveTimeoutError", "StallError", "allgather_object", "barrier", "broadcast_object", "cross_rank",
    "cross_size", "init", "is_initialized", "join", "local_rank", "local_size", "poll", "rank", "shutdown", "size",
    "start_timeline", "stop_timeline", "synchronize", "elastic", "HostsUpdatedInterrupt", "ProcessSet",
    "global_process_set", "add_process_set", "remove_process_set",
)
# The tensor operations, taken over by the framework modules that do not define their own (hvd.jax, hvd.tensorflow).
_TENSOR_API = (
    "allgather", "allgather_async", "allreduce", "allreduce_async", "alltoall", "broadcast", "broadcast_async",
    "grouped_allreduce", "reducescatter",
)


def _reexport(namespace, tensor_ops=True):
    """Puts the shared API (and with ``tensor_ops`` the tensor operations) into a framework module's namespace."""
    names = _SHARED_API + (_TENSOR_API if tensor_ops else ())
    namespace.update((name, globals()[name]) for name in names)


# Elastic training (Horovod's ``hvd.elastic``); imported last: it uses the names above.
from . import elastic  # noqa: E402
from .elastic import HostsUpdatedInterrupt  # noqa: E402
