"""Per-tensor in-place allreduces batched in Python before they reach the library (#22 §3).

``hvd.allreduce_async_`` of a plain numpy array (writable, C-contiguous, not empty, of a dtype seen before) or of a
contiguous CPU ``torch.Tensor`` (``hvd.torch``'s per-tensor allreduces and ``DistributedOptimizer``'s gradients
come this way), with a str name or none and float scale factors, on the global process set, makes no call into the
library: it appends the request to the open batch and returns a ``BatchedHandle``. One call into the library costs
about as much as the Python around it, so a 100-gradient step that made 200 of them (a submission and a wait per
tensor) was bound by them, fused or not.

The batch goes to the library in one call (``hvd_enqueue_allreduces``) as soon as this process could wait for
another rank, so that no rank ever waits for a request that another keeps in its batch:

- a ``synchronize`` or ``poll`` of any handle, any other submission (every blocking operation is one) and
  ``shutdown``;
- a batch of ``MAX_BATCH`` requests;
- a timer thread: a batch older than ``FLUSH_AFTER`` goes out on the next tick. A rank that submits and then leaves
  hvd for a while (computation, sleep, another channel) still lets the others complete the operation, as the
  engine's cycle did for a submission made per call.

Ranks thus send at different points. That is safe because the library submits each request of a batch on its own
(no fusion at submission, unlike a grouped allreduce): the engine negotiates every tensor by its name and fuses
whatever all ranks have ready, exactly as for requests submitted one call at a time.

Waiting: ``hvd_wait_batch`` waits for one handle, then releases the handles after it that have completed and marks
them in the batch's ``done`` bytes, so that the other waits of a step need no call. An error the engine reports for
one tensor (a mismatch, a name submitted twice) reaches that tensor's handle only. A failure to submit (the engine
stopped or shut down meanwhile) reaches each handle of the batch at its ``synchronize`` or ``poll``, not at
``allreduce_async_``: the request was accepted before the library saw it.
"""

import array
import copy
import ctypes
import itertools
import os
import sys
import threading
import time
import weakref

from . import _lib

# How old a batch gets before the timer sends it (seconds). The engine's default cycle time: a request submitted
# and then left alone starts about as soon as it did with a call per request.
FLUSH_AFTER = 0.001
# Requests per batch at most (bounds the memory and the delay of a loop that submits without ever waiting).
MAX_BATCH = 1024
# Ticks without a batch after which the timer thread sleeps until the next batch opens (an idle process does not
# wake a thousand times a second).
_IDLE_TICKS = 1000

_addressof = ctypes.addressof
_from_buffer = ctypes.c_char.from_buffer
_chain = itertools.chain.from_iterable
_monotonic = time.monotonic
_weakref = weakref.ref


class _Batch:
    """Requests appended since the last send and their arrays (``values``: numpy arrays or torch tensors, what
    ``synchronize`` returns; ``storages``: request index -> (storage, its ``data_ptr()`` at submission, name) of each
    torch tensor: the storage stays alive even if the tensor is given other memory while in flight, with ``set_`` or
    ``.data =``, and ``synchronize`` raises if the storage itself was given another buffer); once sent, their
    handles (``ids``, -1 for a refused one) and the ``done`` bytes that ``hvd_wait_batch`` marks (a bytearray, read
    without a call; ``done_c`` is the same memory for the library).

    The handles refer to the batch, so it lives while any of them does. What keeps the arrays alive while the
    library may write them is not the batch but its ``_Sent`` record in ``_inflight`` (no finalizer: a signal
    handler that raises inside ``__del__`` or a ``weakref.finalize`` callback has its exception swallowed, and the
    arrays were freed with the batch while in flight)."""

    __slots__ = ("entries", "values", "storages", "started", "n", "ids", "done", "done_c", "error", "__weakref__")

    def __init__(self):
        self.entries = []
        self.values = []
        self.storages = {}
        self.started = _monotonic()
        self.n = 0
        self.ids = None
        self.done = None
        self.done_c = None
        self.error = None


class _Sent:
    """A submitted batch's operations as ``_inflight`` keeps them: a weak reference to the batch (whose handles'
    waits release its operations while it lives), its handles, ``done`` bytes and arrays, and the ``hvd.shutdown``
    count it was sent under. No ``__eq__``: ``list.remove`` finds it by identity, in C."""

    __slots__ = ("batch", "ids", "done", "done_c", "n", "values", "storages", "epoch")

    def __init__(self, batch, ids, done, done_c, n):
        self.batch = _weakref(batch)
        self.ids, self.done, self.done_c, self.n = ids, done, done_c, n
        self.values, self.storages, self.epoch = batch.values, batch.storages, _epoch


class BatchedHandle:
    """The handle of an ``allreduce_async_`` made through a batch (``hvd.poll`` and ``hvd.synchronize`` take it like
    any other)."""

    __slots__ = ("_batch", "_index", "_done", "_result")

    def __init__(self, batch, index):
        self._batch = batch
        self._index = index
        self._done = False
        self._result = None

    @property
    def id(self):
        """The library's handle (None until the batch has been sent; -1 if it was refused)."""
        ids = self._batch.ids
        return None if ids is None else ids[self._index]

    def __repr__(self):
        return "hvd.BatchedHandle({}{})".format(self.id, ", done" if self._done else "")


_lock = threading.Lock()
_wake = threading.Condition(_lock)  # the timer thread sleeps on it while no batch is open for long
_open = None  # the batch being filled
_timer = None
_timer_asleep = False
# _Sent records of submitted batches, each from just before its library call until all its operations are known
# complete: the arrays the library writes stay referenced here whatever becomes of the batch and its handles.
_inflight = []
_epoch = 0  # hvd.shutdown()s that returned: a record of an earlier engine has no operation left in flight
_ndarray = None  # numpy.ndarray, once numpy is loaded
_codes = None  # numpy dtype -> hvd.h dtype code: the package's own table (hvd._NP_CODES), filled as dtypes are seen
_tensor = None  # torch.Tensor, once a torch tensor has come
_torch_codes = None  # torch dtype -> code (hvd._torch_table())
_strided = None  # torch.strided
_ops = ()  # the package's reduction codes (hvd._OPS)
_hvd = None


def _learn(cls):
    """Takes numpy's array type and torch's tensor type (with the package's tables) once they are loaded; whether
    ``cls`` is one of them now. Each type is set after its tables, so another thread sees it only with them."""
    global _ndarray, _codes, _tensor, _torch_codes, _strided, _ops, _hvd
    if _hvd is None:
        hvd = sys.modules[__name__.rpartition(".")[0]]
        _codes = hvd._NP_CODES
        _ops = hvd._OPS
        _hvd = hvd
    if _ndarray is None and "numpy" in sys.modules:
        import numpy

        _ndarray = numpy.ndarray
    if _tensor is None and cls.__name__ == "Tensor" and cls.__module__ == "torch":
        _torch_codes, _strided = _hvd._torch_table()
        _tensor = cls
    return cls is _ndarray or cls is _tensor


def allreduce_(tensor, name, op, prescale, postscale):
    """Appends an in-place allreduce of ``tensor`` to the open batch and returns its handle; None when the request
    is not one for a batch (the caller submits it the usual way, which also reports what is wrong with it).

    ``tensor``: a numpy array (writable, C-contiguous, not empty, of a dtype seen before) or a torch tensor
    (``torch.Tensor`` itself, not a subclass: on the CPU, strided, contiguous, not empty, not lazily negated, not
    requiring grad, of a dtype hvd has). The batch keeps ``tensor`` (what the handle's ``synchronize`` returns)
    and a torch tensor's storage, which stays alive even if the tensor is given other memory (``set_``, ``.data
    =``) while the operation is in flight. (``untyped_storage()`` costs a tenth of a ``detach()``.)"""
    cls = type(tensor)
    if cls is _ndarray:
        code = _codes.get(tensor.dtype)
        if code is None:
            return None
        try:
            ptr = _addressof(_from_buffer(tensor))  # refuses read-only, non-contiguous and empty arrays
        except (TypeError, ValueError, BufferError):
            return None
        shape = tensor.shape
    elif cls is _tensor:
        code = _torch_codes.get(tensor.dtype)
        if (code is None or not tensor.is_cpu or tensor.layout is not _strided or tensor.requires_grad
                or not tensor.is_contiguous() or tensor.is_neg() or not tensor.numel()):
            return None
        storage = tensor.untyped_storage()
        ptr = tensor.data_ptr()
        shape = tensor.shape
    elif _learn(cls):
        return allreduce_(tensor, name, op, prescale, postscale)
    else:
        return None
    # (`type(op) is int`: `1.0 in _ops` holds too, and a float would fail the whole batch's send, other threads'
    # requests with it.)
    if (type(op) is not int or op not in _ops or type(prescale) is not float or type(postscale) is not float
            or name is not None and (type(name) is not str or not name.isascii() or "\0" in name)):
        return None
    entry = (ptr, code, shape, name or "", op, prescale, postscale)
    # `with`, not acquire() and try/finally: a signal handler that raises (KeyboardInterrupt, hvd.elastic's SIGTERM
    # handler) runs after a call returns, so it could run between acquire() and the `try`, leaving the lock held and
    # the next submission or shutdown's flush waiting forever; `with` takes the lock inside its own protection.
    with _lock:
        batch = _open
        if batch is None:
            batch = _start()
            if batch is None:
                return None
        entries = batch.entries
        entries.append(entry)
        batch.values.append(tensor)
        if cls is _tensor:
            batch.storages[len(entries) - 1] = (storage, storage.data_ptr(), name)
        handle = BatchedHandle(batch, len(entries) - 1)
        if len(entries) >= MAX_BATCH:
            _send(batch)
    return handle


def _start():
    """Opens a batch (the caller holds the lock); None when the library has no engine (the usual path then raises
    NotInitializedError at once, as it always did)."""
    global _open, _timer, _timer_asleep
    lib = _lib._lib
    if lib is None or not lib.hvd_is_initialized():
        return None
    _open = _Batch()
    if _timer is None:
        _timer = threading.Thread(target=_tick, name="hvd-batch-timer", daemon=True)
        _timer.start()
    elif _timer_asleep:
        _timer_asleep = False
        _wake.notify()
    return _open


def flush():
    """Sends the open batch, if any, to the library."""
    if _open is not None:
        with _lock:
            if _open is not None:
                _send(_open)


def _send(batch):
    """Submits ``batch`` (the caller holds the lock). Raises nothing but what a signal handler raises (on the main
    thread: KeyboardInterrupt, SystemExit): what fails is kept for the batch's handles.

    A signal handler runs after any call returns. Before the library's call it leaves the batch open and whole;
    from there the batch changes by stores alone, and ``batch.ids`` is set in a ``finally``: the handles that the
    library wrote (``ids`` starts as -1 everywhere) are the operations in flight, whose arrays the batch must keep
    even when a handler raised as the call returned."""
    global _open
    entries = batch.entries
    n = len(entries)
    ids = (ctypes.c_int64 * n).from_buffer_copy(b"\xff" * (8 * n))  # -1: not submitted
    done = bytearray(n)
    done_c = (ctypes.c_int8 * n).from_buffer(done)
    error = None
    try:
        args = _columns(entries)
        error = _hvd.HvdError("the batch's submission was interrupted (a signal handler raised) before its result "
                              "was read")
    except Exception as e:  # handed to every handle of the batch instead of lost in the timer thread
        args, error = None, e
    if _open is batch:
        _open = None
    batch.entries = None
    batch.n = n
    batch.error = error
    batch.done_c = done_c
    batch.done = done
    try:
        if args is not None:
            # Registered before the call: from the call on the library may write the arrays, and a signal handler
            # that raises after it returns must find them kept (``ids`` is -1 everywhere until the call writes it).
            _inflight.append(_Sent(batch, ids, done, done_c, n))
            lib = _lib._lib
            ok = lib.hvd_enqueue_allreduces(n, *args, ids)
            batch.error = None if ok == n else _hvd._error(lib)
    except Exception as e:  # (as above)
        batch.error = e
    finally:
        batch.ids = ids  # last: a batch with ids is complete
    _sweep()


_last = ([], None)  # the last batch's entries and their columns


def _columns(entries):
    """The arguments of ``hvd_enqueue_allreduces`` for ``entries`` (one request each: pointer, dtype code, shape,
    name, op, scale factors), as arrays. A training loop sends the same batch every step: comparing it with the
    last one costs about a fifth of building the arrays again, and the library copies what it needs, so the last
    batch's arrays serve again (the caller holds the lock)."""
    global _last
    if entries == _last[0]:
        return _last[1][0]
    ptrs, codes, shapes, names, ops, pre, post = zip(*entries)
    arrays = (array.array("q", ptrs), array.array("i", codes), array.array("i", map(len, shapes)),
              array.array("q", _chain(shapes)))
    rest = (array.array("i", ops), array.array("d", pre), array.array("d", post))
    blob = "\0".join(names).encode("ascii") + b"\0"
    args = tuple(a.buffer_info()[0] if len(a) else None for a in arrays) + (blob,) + tuple(
        a.buffer_info()[0] for a in rest)
    _last = (entries, (args, arrays, rest))
    return args


def _sent(handle):
    """The batch of ``handle``, submitted first if it has not been yet."""
    batch = handle._batch
    if batch.ids is None:
        with _lock:
            if batch.ids is None:
                _send(batch)
    return batch


def synchronize(handle):
    """``hvd.synchronize`` of a batched handle that is not done yet (``hvd.synchronize`` itself returns at once
    when the batch's ``done`` byte says that an earlier wait released it)."""
    batch = _sent(handle)
    i = handle._index
    handle._done = True
    if batch.done[i] != 1:
        if batch.ids[i] < 0:
            raise copy.copy(batch.error)
        lib = _lib._lib
        if lib.hvd_wait_batch(batch.ids, batch.n, i, batch.done_c) != 0:
            raise _hvd._error(lib)
    if batch.storages:
        check_storage(batch, handle)
        batch.storages.pop(i, None)
    handle._result = value = batch.values[i]
    batch.values[i] = None  # (the handle keeps its result: a surviving handle keeps no other's tensor)
    return value


def check_storage(batch, handle):
    """Raises if request ``i``'s torch tensor's storage holds other memory than at its submission: ``resize_`` to a
    larger size, ``storage.resize_``, ``share_memory_`` give the storage a new buffer and free the old one, which the
    library may have written after it was freed (the batch keeps the storage object, not its buffer)."""
    i = handle._index
    kept = batch.storages.get(i)
    if kept is not None and kept[0].data_ptr() != kept[1]:
        handle._done = False  # (every synchronize says it)
        raise _hvd.HvdError(
            "the storage of the tensor of allreduce_async_ {!r} was given other memory while the allreduce was in "
            "flight (resize_, share_memory_, storage().resize_): its result went to the freed memory, which may "
            "have been written since; keep a tensor's storage as it is until synchronize".format(
                kept[2] or "#{}".format(i)))


def poll(handle):
    """``hvd.poll`` of a batched handle that is not done yet."""
    batch = _sent(handle)
    i = handle._index
    if batch.done[i] or batch.ids[i] < 0:
        return True
    lib = _lib._lib
    rc = lib.hvd_poll(batch.ids[i])
    if rc < 0:
        raise _hvd._error(lib)
    return rc == 1


def _sweep():
    """Lets go of the records in ``_inflight`` whose operations are all known complete (the caller holds the lock).

    A batch that is alive (a handle refers to it) is complete once each operation is marked in ``done`` (its waits
    released it) or has no handle (-1, never submitted): no call. A batch whose handles were all dropped keeps its
    record until the library says each operation has completed (``hvd_poll`` 1, which ``hvd_wait_batch`` then
    releases, marking ``done``) or does not know it (-1: released already). A record of an engine that
    ``hvd.shutdown`` ended (an earlier ``_epoch``) goes without a call: its handles mean nothing to a later engine.

    A record leaves only through one ``remove`` of that very record, after the check: a signal handler that raises
    during the sweep (it runs after a call returns) only delays the release to the next sweep."""
    lib = _lib._lib
    for rec in _inflight[:]:
        if rec.epoch == _epoch and lib is not None:
            ids, done = rec.ids, rec.done
            alive = rec.batch() is not None
            i = done.find(0)
            while i >= 0:
                if ids[i] >= 0:
                    if alive:
                        break  # its handles' waits release it
                    rc = lib.hvd_poll(ids[i])
                    if rc == 0:
                        break
                    if rc == 1:
                        lib.hvd_wait_batch(ids, rec.n, i, rec.done_c)  # completed: marks it (and what follows)
                i = done.find(0, i + 1)
            if i >= 0:
                continue
        try:
            _inflight.remove(rec)
        except ValueError:
            pass


def shut_down():
    """After ``hvd_shutdown`` returned (every operation of its engine has ended): lets go of every record."""
    global _epoch
    _epoch += 1
    with _lock:
        _sweep()


def _tick():
    """The timer thread: sends a batch older than FLUSH_AFTER; sleeps until the next batch after a long idle time."""
    global _timer_asleep
    idle = 0
    while True:
        time.sleep(FLUSH_AFTER)
        with _lock:
            batch = _open
            if batch is None:
                idle += 1
                if idle >= _IDLE_TICKS:
                    _timer_asleep = True
                    while _timer_asleep:
                        _wake.wait()
                    idle = 0
            else:
                idle = 0
                if _monotonic() - batch.started >= FLUSH_AFTER:
                    _send(batch)


def _after_fork():
    # A child has no timer thread (nor the parent's engine, whose handles _inflight holds): start afresh.
    global _lock, _wake, _open, _timer, _timer_asleep, _inflight, _last
    _lock = threading.Lock()
    _wake = threading.Condition(_lock)
    _open = None
    _timer = None
    _timer_asleep = False
    _inflight = []
    _last = ([], None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
