"""The numpy side of hvd.tensorflow's ops: Horovod's semantics for lists of arrays over hvd's collectives (no
framework needed). 2-byte integers travel in a dtype the library carries, integer averages and scale factors truncate
as Horovod's do, and a list is submitted before any member is waited for."""

import numpy as np

import hvd as _core


def _ps(process_set):
    """None for the global set (the core's default), else the set."""
    if process_set is None or getattr(process_set, "process_set_id", None) == 0:
        return None
    return process_set


def set_size(process_set):
    """The number of ranks of ``process_set`` (None: the job)."""
    ps = _ps(process_set)
    return _core.size() if ps is None else ps.size()


def set_rank(process_set):
    """This rank's rank in ``process_set`` (None: the job)."""
    ps = _ps(process_set)
    return _core.rank() if ps is None else ps.rank()


def split(items, n):
    """``items`` in ``n`` consecutive parts of near-equal length (the first ``len % n`` one longer); empty parts
    are left out."""
    size, extra = divmod(len(items), n)
    out, at = [], 0
    for i in range(n):
        k = size + (1 if i < extra else 0)
        out.append(items[at:at + k])
        at += k
    return [part for part in out if part]


# numpy dtypes hvd's library does not carry, and what they travel as: 2-byte integers are reinterpreted as float16
# where only bytes move (gather, broadcast, alltoall), widened to int32 where values are combined (and wrapped back,
# as a 16-bit reduction wraps).
_TWO_BYTE = (np.dtype(np.int16), np.dtype(np.uint16))


def _contiguous(arr):
    """``arr`` C-contiguous, with its shape (``np.ascontiguousarray`` makes a scalar 1-d)."""
    arr = np.asarray(arr)
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr).reshape(arr.shape)


def _to_wire(arr, reducing):
    arr = _contiguous(arr)
    if arr.dtype in _TWO_BYTE:
        return arr.astype(np.int32) if reducing else arr.view(np.float16)
    if arr.dtype == np.bool_ and reducing:
        raise TypeError("hvd cannot reduce bool tensors; cast them to an integer type")
    return arr


def _from_wire(arr, dtype, reducing):
    if arr.dtype == dtype:
        return arr
    if reducing:
        return arr.astype(dtype)
    return _contiguous(arr).view(dtype)


def _is_integer(dtype):
    return np.issubdtype(dtype, np.integer)


def _truncate(values, dtype):
    """Float64 values as integers of ``dtype``, truncated toward zero (Horovod scales integers in double)."""
    return np.trunc(values).astype(dtype)




def allreduce(arrays, name, op, prescale, postscale, process_set):
    ps = _ps(process_set)
    wires, plans = [], []
    for a in arrays:
        w = _to_wire(a, True)
        if _is_integer(a.dtype) and (op == _core.Average or prescale != 1.0 or postscale != 1.0):
            # Horovod scales integers in double and truncates; hvd's library would round.
            if prescale != 1.0:
                w = _truncate(w.astype(np.float64) * prescale, w.dtype)
            post = postscale / (set_size(ps) if op == _core.Average else 1)
            plans.append((_core.Sum if op == _core.Average else op, 1.0, 1.0, post))
        else:
            plans.append((op, prescale, postscale, None))
        wires.append(w)
    same = len(set((p[0], p[1], p[2]) for p in plans)) == 1 and len(set(w.dtype for w in wires)) == 1
    if len(wires) > 1 and same:
        p = plans[0]
        outs = _core.grouped_allreduce(wires, name=name, op=p[0], prescale_factor=p[1], postscale_factor=p[2],
                                       process_set=ps)
    else:
        handles = [
            _core.allreduce_async(w, name=None if name is None else (name if len(wires) == 1 else
                                                                      "{}.{}".format(name, i)),
                                  op=p[0], prescale_factor=p[1], postscale_factor=p[2], process_set=ps)
            for i, (w, p) in enumerate(zip(wires, plans))
        ]
        outs = [_core.synchronize(h) for h in handles]
    result = []
    for a, out, p in zip(arrays, outs, plans):
        if p[3] is not None and p[3] != 1.0:
            out = _truncate(out.astype(np.float64) * p[3], out.dtype)
        result.append(_from_wire(out, a.dtype, True))
    return result


def _member_names(name, n):
    if name is None:
        return [None] * n
    return [name] if n == 1 else ["{}.{}".format(name, i) for i in range(n)]


def allgather(arrays, name, process_set):
    ps = _ps(process_set)
    handles = [_core.allgather_async(_to_wire(a, False), name=nm, process_set=ps)
               for a, nm in zip(arrays, _member_names(name, len(arrays)))]
    return [_from_wire(_core.synchronize(h), a.dtype, False) for a, h in zip(arrays, handles)]


def broadcast(arrays, root_rank, name, process_set):
    ps = _ps(process_set)
    handles = [_core.broadcast_async(_to_wire(a, False), root_rank, name=nm, process_set=ps)
               for a, nm in zip(arrays, _member_names(name, len(arrays)))]
    return [_from_wire(_core.synchronize(h), a.dtype, False) for a, h in zip(arrays, handles)]


def alltoall(array, splits, name, process_set):
    ps = _ps(process_set)
    wire = _to_wire(array, False)
    if splits is not None:
        splits = [int(s) for s in np.asarray(splits).reshape(-1)]
        if any(s < 0 for s in splits):
            raise _core.InvalidArgumentError("alltoall splits must be non-negative, got {}".format(splits))
        if sum(splits) > (wire.shape[0] if wire.ndim else 0):
            raise _core.InvalidArgumentError(
                "alltoall splits sum to {} but the tensor has {} rows".format(sum(splits), wire.shape[0]))
    out, received = _core.synchronize(_core.alltoall_async(wire, splits, name=name, process_set=ps))
    return [_from_wire(out, array.dtype, False), np.asarray(received, np.int32)]


def reducescatter(arrays, name, op, prescale, postscale, process_set):
    if any(np.ndim(a) == 0 for a in arrays):
        # Refused before any member is submitted, so every rank fails alike and nothing is left in flight.
        raise _core.InvalidArgumentError("reducescatter needs tensors of at least one dimension, not a scalar")
    ps = _ps(process_set)
    wires, afters = [], []
    for a in arrays:
        w = _to_wire(a, True)
        core_op, pre, post, after = op, prescale, postscale, None
        if _is_integer(a.dtype) and (op == _core.Average or prescale != 1.0 or postscale != 1.0):
            if prescale != 1.0:
                w = _truncate(w.astype(np.float64) * prescale, w.dtype)
            core_op, pre, post = (_core.Sum if op == _core.Average else op), 1.0, 1.0
            after = postscale / (set_size(ps) if op == _core.Average else 1)
        wires.append((w, core_op, pre, post))
        afters.append(after)
    handles = [_core.reducescatter_async(w, name=nm, op=o, prescale_factor=pre, postscale_factor=post,
                                         process_set=ps)
               for (w, o, pre, post), nm in zip(wires, _member_names(name, len(arrays)))]
    result = []
    for a, h, after in zip(arrays, handles, afters):
        out = _core.synchronize(h)
        if after is not None and after != 1.0:
            out = _truncate(out.astype(np.float64) * after, out.dtype)
        result.append(_from_wire(out, a.dtype, True))
    return result
