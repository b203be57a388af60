"""``horovod.torch.mpi_ops``: Horovod's torch collectives with Horovod's signatures and semantics, over hvd.torch.

hvd.torch moves the tensors (CPU, DLPack); this module gives them the shape a Horovod script expects: Horovod's
argument order (``compression`` before ``op``), ``process_set=``, autograd through every collective (the gradients
Horovod's ops register), ``alltoall(t, splits)`` -> ``(tensor, received_splits)``, integer pre/postscaling and
averaging that truncate (Horovod scales integer buffers in double and converts back), int16 tensors (carried as
int32: exact for every op here), ``grouped_allgather``, ``grouped_reducescatter``, ``reducescatter_async``, and a
``ValueError`` for a second operation under the name of one still in flight. docs/horovod.md says what differs.
"""

import threading
import weakref

import hvd as _core
import hvd.torch as _ht  # first: without torch, its ImportError says what to do

import torch  # noqa: E402

from horovod.common.process_sets import global_process_set  # noqa: E402

Sum, Average, Min, Max, Product = _core.Sum, _core.Average, _core.Min, _core.Max, _core.Product
# Not an hvd.h reduce op: hvd has no Adasum, so every collective refuses it (NotImplementedError, a RuntimeError, as
# Horovod's own refusals of Adasum are). Any value unlike the five above would do.
Adasum = 101

Compression = _ht.Compression

__all__ = [
    "Sum", "Average", "Min", "Max", "Product", "Adasum", "Compression", "init", "shutdown", "poll", "synchronize",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_async",
    "grouped_allreduce_", "grouped_allreduce_async_", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_async", "broadcast_", "broadcast_async_", "alltoall",
    "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
    "join", "barrier", "sparse_allreduce_async", "DistributedOptimizer", "broadcast_optimizer_state",
]


# ---------------------------------------------------------------------------------------------------------------
# Arguments


def _ps(process_set):
    """hvd's ``process_set=`` for Horovod's: None for the global set."""
    if process_set is None or process_set is global_process_set or getattr(process_set, "process_set_id", None) == 0:
        return None
    return process_set


def _keys(names, ps):
    """The in-flight keys of ``names`` (names are per process set, as in Horovod: the same name may be in flight in
    two sets at once)."""
    if ps is None:
        return names
    return ["{} [process set {}]".format(n, ps.process_set_id) if n else n for n in names]


def _set_rank(ps):
    return _core.rank() if ps is None else ps.rank()


def _set_size(ps):
    return _core.size() if ps is None else ps.size()


def _resolve_op(average, op):
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        return Average if average is None or average else Sum
    if op == Adasum:
        raise NotImplementedError("hvd does not implement the Adasum reduction: use op=Average or op=Sum")
    if op not in (Sum, Average, Min, Max, Product):
        raise ValueError("unknown op {!r}: use Sum, Average, Min, Max or Product".format(op))
    return op


# hvd's runtime has no int16: such tensors travel as int32 and come back as int16. Exact for every operation here:
# gathering, broadcasting and exchanging copy values that fit, Min and Max pick one of them, and a Sum or Product
# in int32 converted back to int16 keeps the low 16 bits, as int16 arithmetic that wraps does.
_WIRE = {torch.int16: torch.int32}
_INTEGER = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _to_wire(tensor):
    wire = _WIRE.get(tensor.dtype)
    return tensor if wire is None else tensor.detach().to(wire)


def _from_wire(result, dtype):
    return result if result.dtype == dtype else result.to(dtype)


def _truncating_scale(tensor, factor):
    """Horovod's CPU scaling of an integer buffer: each element times ``factor`` in double, converted back
    (truncated toward zero)."""
    return (tensor.to(torch.float64) * factor).trunc().to(tensor.dtype)


class _Reduction:
    """How one tensor's reduction runs on hvd: the tensor it submits, the op and scale factors it passes, and what
    turns the result into Horovod's. Integer tensors that are averaged or scaled are scaled here, not by hvd's
    runtime (which rounds): prescaled element by element before the sum, and the sum scaled by postscale / size
    (Horovod's average) with truncation."""

    __slots__ = ("tensor", "op", "prescale", "postscale", "dtype", "after")

    def __init__(self, tensor, op, prescale, postscale):
        self.dtype = tensor.dtype
        self.after = None
        if tensor.dtype in _INTEGER and (op == Average or prescale != 1.0 or postscale != 1.0):
            x = tensor.detach()
            if prescale != 1.0:
                x = _truncating_scale(x, prescale)
            after = postscale / _core.size() if op == Average else postscale
            self.tensor, self.op, self.prescale, self.postscale = _to_wire(x), (Sum if op == Average else op), 1.0, 1.0
            self.after = None if after == 1.0 else after
        else:
            self.tensor, self.op, self.prescale, self.postscale = _to_wire(tensor), op, prescale, postscale

    def key(self):
        return self.op, self.prescale, self.postscale

    def finish(self, result):
        result = _from_wire(result, self.dtype)
        return result if self.after is None else _truncating_scale(result, self.after)


# ---------------------------------------------------------------------------------------------------------------
# Handles and names in flight

_lock = threading.Lock()
# name -> (weak reference to the handle the script holds, the hvd handles): a name is taken from its submission until
# its handle is synchronized (or polled done); a handle the script dropped keeps it until a later synchronize(), poll(),
# barrier() or join() finds its operation complete.
_in_flight = {}


class Handle:
    """An operation (or a group of them) submitted by this module; ``poll`` and ``synchronize`` take it."""

    __slots__ = ("_inner", "_finish", "_names", "_done", "_result", "__weakref__")

    def __init__(self, inner, finish, names):
        self._inner = inner
        self._finish = finish
        self._names = names
        self._done = False
        self._result = None

    def __repr__(self):
        return "horovod.torch.Handle({} operation(s){})".format(len(self._inner), ", done" if self._done else "")


def _take_names(names):
    """Refuses names still in flight, as Horovod does (ValueError)."""
    with _lock:
        for n in names:
            if n in _in_flight:
                raise ValueError(
                    "an operation named {!r} is still in flight: Horovod refuses a second one under the same name "
                    "until the first is synchronized; use another name".format(n))


def _submit(names, submit, finish):
    """Checks ``names``, runs ``submit()`` (-> list of hvd handles) and returns the Handle."""
    names = [n for n in names if n]
    _take_names(names)
    inner = submit()
    handle = Handle(inner, finish, names)
    if names:
        ref = weakref.ref(handle)
        with _lock:
            for n in names:
                _in_flight[n] = (ref, inner)
    return handle


def _release(handle):
    if handle._names:
        with _lock:
            for n in handle._names:
                entry = _in_flight.get(n)
                if entry is not None and entry[1] is handle._inner:
                    del _in_flight[n]


def _sweep():
    """Forgets the names of dropped handles whose operations completed (their results are released too)."""
    with _lock:
        dropped = [(n, inner) for n, (ref, inner) in _in_flight.items() if ref() is None]
    for n, inner in dropped:
        try:
            if not all(_core.poll(h) for h in inner):
                continue
            for h in inner:
                _core.synchronize(h)
        except _core.HvdError:
            pass  # nobody waits for this result: its failure is the script's to see elsewhere
        with _lock:
            entry = _in_flight.get(n)
            if entry is not None and entry[1] is inner:
                del _in_flight[n]


def poll(handle):
    """True when the operation has completed (``synchronize`` will not block)."""
    if not isinstance(handle, Handle):
        return _core.poll(handle)
    if handle._done:
        return True
    done = all(_core.poll(h) for h in handle._inner)
    if done:
        _release(handle)
    return done


def synchronize(handle):
    """Waits for the operation and returns its result (Horovod's: ``(tensor, received_splits)`` for an alltoall)."""
    if not isinstance(handle, Handle):
        return _core.synchronize(handle)
    if handle._done:
        return handle._result
    results, failure = [], None
    for h in handle._inner:
        try:
            results.append(_core.synchronize(h))
        except BaseException as e:  # noqa: B036 - raised below, once every member has completed
            failure = failure or e
            results.append(None)
    handle._done = True
    _release(handle)
    _sweep()
    if failure is not None:
        raise failure
    handle._result = handle._finish(results)
    return handle._result


def init(comm=None, process_sets=None):
    """Joins the job (``hvd.init``), adding ``process_sets`` in order as Horovod does."""
    _core.init(comm, process_sets)


def shutdown():
    """Leaves the job (``hvd.shutdown``); names in flight are forgotten with the job's operations."""
    with _lock:
        _in_flight.clear()
    _core.shutdown()


def _names(name, count):
    if not name:
        return [None] * count
    return ["{}.{}".format(name, i) for i in range(count)]


def _needs_grad(tensors):
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


# ---------------------------------------------------------------------------------------------------------------
# Allreduce


def _allreduce_group_async(tensors, average, name, op, prescale_factor, postscale_factor, process_set, in_place,
                           compression=Compression.none):
    """The allreduces of ``tensors`` (one name each: ``name`` for one tensor, ``name.i`` in a group) as one Handle.
    Tensors that reduce alike go as one hvd grouped allreduce (one engine cycle, fused)."""
    ps = _ps(process_set)
    op = _resolve_op(average, op)
    plans, contexts = [], []
    for t in tensors:
        compressed, ctx = compression.compress(_ht._cpu(t))
        plans.append(_Reduction(compressed, op, prescale_factor, postscale_factor))
        contexts.append(ctx)
    single = len(tensors) == 1 and name is not None
    names = [name] if single else _names(name, len(tensors))

    def submit():
        handles = []
        if len({p.key() for p in plans}) <= 1 and len(plans) > 1:
            o, pre, post = plans[0].key()
            handles.append(_core.grouped_allreduce_async([p.tensor for p in plans], None, name, o, pre, post, ps))
        else:
            for p, n in zip(plans, names):
                o, pre, post = p.key()
                handles.append(_core.allreduce_async(p.tensor, None, n, o, pre, post, ps))
        return handles

    def finish(results):
        outs = results[0] if len(results) == 1 and len(plans) > 1 else results
        outs = [compression.decompress(p.finish(r), c) for p, r, c in zip(plans, outs, contexts)]
        if in_place:
            for t, r in zip(tensors, outs):
                t.data.copy_(r)
            return list(tensors)
        return outs

    return _submit(_keys(names, ps) if name is not None else [], submit, finish)


def _allreduce_one_async(tensor, average, name, op, prescale_factor, postscale_factor, process_set, in_place):
    """The handle of a one-tensor allreduce, whose ``synchronize`` returns that tensor's result alone."""
    h = _allreduce_group_async([tensor], average, name, op, prescale_factor, postscale_factor, process_set, in_place)
    finish = h._finish
    h._finish = lambda results: finish(results)[0]
    return h


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    """Starts an allreduce (default: average); ``synchronize`` returns a new tensor."""
    return _allreduce_one_async(tensor, average, name, op, prescale_factor, postscale_factor, process_set, False)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, compression, process_set):
        ctx.args = average, op, prescale_factor, postscale_factor, process_set
        h = _allreduce_group_async([tensor], average, name, op, prescale_factor, postscale_factor, process_set, False,
                                   compression)
        return synchronize(h)[0]

    @staticmethod
    def backward(ctx, grad):
        average, op, pre, post, ps = ctx.args
        return allreduce(grad, average=average, op=op, prescale_factor=pre, postscale_factor=post,
                         process_set=ps), None, None, None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """The allreduce of ``tensor`` over every rank (default: average); differentiable."""
    if _needs_grad([tensor]):
        return _Allreduce.apply(tensor, average, name, op, prescale_factor, postscale_factor, compression,
                                process_set)
    h = _allreduce_group_async([tensor], average, name, op, prescale_factor, postscale_factor, process_set, False,
                               compression)
    return synchronize(h)[0]


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    """In place: ``synchronize`` writes the result into ``tensor`` and returns it."""
    return _allreduce_one_async(tensor, average, name, op, prescale_factor, postscale_factor, process_set, True)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set):
    return _allreduce_group_async(list(tensors), average, name, op, prescale_factor, postscale_factor, process_set,
                                  False)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, compression, process_set, *tensors):
        ctx.args = average, op, prescale_factor, postscale_factor, process_set
        return tuple(synchronize(_allreduce_group_async(list(tensors), average, name, op, prescale_factor,
                                                        postscale_factor, process_set, False, compression)))

    @staticmethod
    def backward(ctx, *grads):
        average, op, pre, post, ps = ctx.args
        return (None,) * 7 + tuple(grouped_allreduce(list(grads), average=average, op=op, prescale_factor=pre,
                                                     postscale_factor=post, process_set=ps))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set):
    tensors = list(tensors)
    if _needs_grad(tensors):
        return list(_GroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor, compression,
                                            process_set, *tensors))
    return synchronize(_allreduce_group_async(tensors, average, name, op, prescale_factor, postscale_factor,
                                              process_set, False, compression))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=global_process_set):
    return _allreduce_group_async(list(tensors), average, name, op, prescale_factor, postscale_factor, process_set,
                                  True)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


# ---------------------------------------------------------------------------------------------------------------
# Allgather


def _allgather_group_async(tensors, name, process_set):
    ps = _ps(process_set)
    names = [name] if len(tensors) == 1 else _names(name, len(tensors))
    dtypes = [t.dtype for t in tensors]

    def submit():
        return [_core.allgather_async(_to_wire(_ht._cpu(t)), n, ps) for t, n in zip(tensors, names)]

    def finish(results):
        return [_from_wire(r, d) for r, d in zip(results, dtypes)]

    return _submit(_keys(names, ps), submit, finish)


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Starts an allgather (concatenation along dimension 0; ranks may differ in it)."""
    h = _allgather_group_async([tensor], name, process_set)
    finish = h._finish
    h._finish = lambda results: finish(results)[0]
    return h


def _own_rows(grad_reduced, dims, process_set=None):
    """This rank's rows of a gathered gradient, given every rank's first dimension (of the set's ranks)."""
    r = _set_rank(_ps(process_set))
    offset = int(sum(dims[:r]))
    return grad_reduced.narrow(0, offset, int(dims[r]))


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim = tensor.shape[0]
        ctx.ps = process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        # Horovod's gradient: the average of every rank's gradient of the gathered tensor, this rank's rows of it.
        reduced = allreduce(grad, average=True, process_set=ctx.ps)
        dims = allgather(torch.tensor([ctx.dim], dtype=torch.int64), process_set=ctx.ps).tolist()
        return _own_rows(reduced, dims, ctx.ps), None, None


def allgather(tensor, name=None, process_set=global_process_set):
    if _needs_grad([tensor]):
        return _Allgather.apply(tensor, name, process_set)
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """The allgathers of ``tensors`` as one handle. hvd's runtime has no grouped allgather: each tensor is its own
    allgather (``name.i``), submitted together; the results are the same, the operations are not fused."""
    return _allgather_group_async(list(tensors), name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.dims = [t.shape[0] for t in tensors]
        ctx.ps = process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        reduced = grouped_allreduce(list(grads), average=True, process_set=ctx.ps)
        dims = grouped_allgather([torch.tensor([d], dtype=torch.int64) for d in ctx.dims], process_set=ctx.ps)
        return (None, None) + tuple(_own_rows(g, d.tolist(), ctx.ps) for g, d in zip(reduced, dims))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    tensors = list(tensors)
    if _needs_grad(tensors):
        return list(_GroupedAllgather.apply(name, process_set, *tensors))
    return synchronize(grouped_allgather_async(tensors, name, process_set))


# ---------------------------------------------------------------------------------------------------------------
# Broadcast


def _broadcast_async(tensor, root_rank, name, process_set, in_place):
    ps = _ps(process_set)
    dtype = tensor.dtype

    def submit():
        return [_core.broadcast_async(_to_wire(_ht._cpu(tensor)), root_rank, name, ps)]

    def finish(results):
        out = _from_wire(results[0], dtype)
        if in_place:
            tensor.data.copy_(out)
            return tensor
        return out

    return _submit(_keys([name], ps), submit, finish)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    return _broadcast_async(tensor, root_rank, name, process_set, False)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank = root_rank
        ctx.ps = process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        # Horovod's gradient: the average over ranks, on the root only.
        reduced = allreduce(grad, average=True, process_set=ctx.ps)
        if _core.rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    if _needs_grad([tensor]):
        return _Broadcast.apply(tensor, root_rank, name, process_set)
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    return _broadcast_async(tensor, root_rank, name, process_set, True)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ---------------------------------------------------------------------------------------------------------------
# Alltoall


def _split_list(splits):
    """``splits`` (a tensor, array or sequence of integers) as a list of ints; anything but integers is refused
    (Horovod wants int32 splits)."""
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point or splits.dtype.is_complex or splits.dtype == torch.bool:
            raise ValueError("alltoall splits must be integers (Horovod takes an int32 tensor), not {}".format(
                splits.dtype))
        return [int(s) for s in splits.reshape(-1).tolist()]
    values = splits.tolist() if hasattr(splits, "tolist") else list(splits)
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in values):
        raise ValueError("alltoall splits must be integers, not {!r}".format(values))
    return values


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Starts an alltoall; ``synchronize`` returns ``(tensor, received_splits)`` (an int32 tensor, or of the splits
    tensor's dtype)."""
    ps = _ps(process_set)
    dtype = tensor.dtype
    split_list = None if splits is None else _split_list(splits)
    splits_dtype = splits.dtype if isinstance(splits, torch.Tensor) else torch.int32

    def submit():
        return [_core.alltoall_async(_to_wire(_ht._cpu(tensor)), split_list, name, ps)]

    def finish(results):
        out, received = results[0]
        return _from_wire(out, dtype), torch.tensor(received, dtype=splits_dtype)

    return _submit(_keys([name], ps), submit, finish)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received = received
        ctx.ps = process_set
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, *unused):
        # Horovod's gradient: the output's gradient sent back where each row came from.
        back, _ = alltoall(grad, splits=ctx.received, process_set=ctx.ps)
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Sends rows ``splits[j]`` of dimension 0 to rank j (default: equal parts). Returns the received tensor, and
    with ``splits`` given ``(tensor, received_splits)``, as Horovod does; differentiable."""
    if _needs_grad([tensor]):
        return _Alltoall.apply(tensor, splits, name, process_set)
    out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    return out if splits is None else (out, received)


# ---------------------------------------------------------------------------------------------------------------
# Reducescatter


def _reducescatter_group_async(tensors, name, op, process_set, prescale_factor, postscale_factor,
                               compression=Compression.none):
    ps = _ps(process_set)
    if op == Adasum:
        raise NotImplementedError("hvd does not implement the Adasum reduction (Horovod's reducescatter refuses it "
                                  "too): use op=Average or op=Sum")
    op = _resolve_op(None, op)
    plans, contexts = [], []
    for t in tensors:
        if t.dim() == 0:
            raise ValueError("reducescatter needs a tensor of at least one dimension (it splits dimension 0); this "
                             "one is a scalar")
        compressed, ctx = compression.compress(_ht._cpu(t))
        plans.append(_Reduction(compressed, op, prescale_factor, postscale_factor))
        contexts.append(ctx)
    names = [name] if len(tensors) == 1 else _names(name, len(tensors))

    def submit():
        out = []
        for p, n in zip(plans, names):
            o, pre, post = p.key()
            out.append(_core.reducescatter_async(p.tensor, n, o, pre, post, ps))
        return out

    def finish(results):
        return [compression.decompress(p.finish(r), c) for p, r, c in zip(plans, results, contexts)]

    return _submit(_keys(names, ps), submit, finish)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    """Starts a reducescatter: rank r gets its block of dimension 0 of the reduction (the first ``dim0 % size``
    ranks one row more)."""
    h = _reducescatter_group_async([tensor], name, op, process_set, prescale_factor, postscale_factor)
    finish = h._finish
    h._finish = lambda results: finish(results)[0]
    return h


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, compression, process_set):
        ctx.args = op, prescale_factor, postscale_factor, process_set
        h = _reducescatter_group_async([tensor], name, op, process_set, prescale_factor, postscale_factor,
                                       compression)
        return synchronize(h)[0]

    @staticmethod
    def backward(ctx, grad):
        return _reducescatter_grad([grad], *ctx.args)[0], None, None, None, None, None, None


def _reducescatter_grad(grads, op, prescale, postscale, process_set=None):
    """Horovod's gradient of a reducescatter: each block's gradient (times size for a Sum, times the scale factors)
    gathered back to the full tensor."""
    factor = (_set_size(_ps(process_set)) if op == Sum else 1) * prescale * postscale
    grads = [g * factor if factor != 1 else g for g in grads]
    return grouped_allgather(grads, process_set=process_set)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    if _needs_grad([tensor]):
        return _Reducescatter.apply(tensor, name, op, prescale_factor, postscale_factor, compression, process_set)
    h = _reducescatter_group_async([tensor], name, op, process_set, prescale_factor, postscale_factor, compression)
    return synchronize(h)[0]


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0):
    """The reducescatters of ``tensors`` as one handle. hvd's runtime has no grouped reducescatter: each tensor is
    its own reducescatter (``name.i``), submitted together; the results are the same, the operations not fused."""
    return _reducescatter_group_async(list(tensors), name, op, process_set, prescale_factor, postscale_factor)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, compression, process_set, *tensors):
        ctx.args = op, prescale_factor, postscale_factor, process_set
        return tuple(synchronize(_reducescatter_group_async(list(tensors), name, op, process_set, prescale_factor,
                                                            postscale_factor, compression)))

    @staticmethod
    def backward(ctx, *grads):
        return (None,) * 6 + tuple(_reducescatter_grad(list(grads), *ctx.args))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    tensors = list(tensors)
    if _needs_grad(tensors):
        return list(_GroupedReducescatter.apply(name, op, prescale_factor, postscale_factor, compression, process_set,
                                                *tensors))
    return synchronize(_reducescatter_group_async(tensors, name, op, process_set, prescale_factor, postscale_factor,
                                                  compression))


# ---------------------------------------------------------------------------------------------------------------
# Sparse tensors and the optimizer


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Horovod's allreduce of a sparse COO tensor: every rank's indices and values are allgathered (the sum of
    sparse tensors is their concatenation; duplicate indices add up when the result is coalesced or made dense).
    Returns a function that waits and returns the sparse result (divided by size for ``Average``)."""
    op = _resolve_op(None, op)
    if op not in (Sum, Average):
        raise ValueError("a sparse allreduce sums or averages; op {!r} is not one of them".format(op))
    # Allgather concatenates along dimension 0, so the indices travel as (nnz, ndim).
    indices = allgather_async(tensor._indices().transpose(0, 1).contiguous(), name="{}.indices".format(name),
                              process_set=process_set)
    values = allgather_async(tensor._values(), name="{}.values".format(name), process_set=process_set)

    def wait():
        v = synchronize(values)
        i = synchronize(indices)
        if op == Average:
            v = v / _set_size(_ps(process_set))
        try:
            # Checked: the indices come from the other ranks, and out-of-range ones would crash later, not here.
            return torch.sparse_coo_tensor(i.transpose(0, 1), v, tensor.size(), check_invariants=True)
        except TypeError:  # torch < 2.0 has no check_invariants
            return torch.sparse_coo_tensor(i.transpose(0, 1), v, tensor.size())

    return wait


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=global_process_set):
    """hvd.torch's DistributedOptimizer with Horovod's arguments: ``num_groups`` is hvd's ``groups=<number>``; sparse
    gradients are allgathered (indices and values), or with ``sparse_as_dense`` allreduced dense, as in Horovod."""
    if num_groups and groups is not None:
        raise ValueError("pass num_groups or groups, not both")
    if named_parameters is not None:
        # Horovod's checks, before anything is wrapped: (name, parameter) pairs, unique names, every parameter of
        # the optimizer named (a gradient's name is what the ranks match it by).
        named_parameters = list(named_parameters)
        if not all(isinstance(p, tuple) and len(p) == 2 for p in named_parameters):
            raise ValueError("named_parameters must be a sequence of (name, parameter) tuples, as "
                             "model.named_parameters() gives")
        seen, duplicates = set(), set()
        for n, _ in named_parameters:
            (duplicates if n in seen else seen).add(n)
        if duplicates:
            raise ValueError("named_parameters has duplicate names: {}".format(", ".join(sorted(map(str, duplicates)))))
        named = {id(p) for _, p in named_parameters}
        unnamed = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in named]
        if unnamed:
            raise ValueError("named_parameters was given but names only some of the optimizer's parameters ({} "
                             "unnamed): name all of them, or pass none".format(len(unnamed)))
    return _ht.DistributedOptimizer(optimizer, named_parameters, compression, backward_passes_per_step, op,
                                    gradient_predivide_factor, groups if groups is not None else (num_groups or None),
                                    _ps(process_set), sparse_as_dense)


def broadcast_optimizer_state(optimizer, root_rank, process_set=global_process_set):
    """Makes every rank's optimizer state equal to root's (hvd.torch's), first giving an optimizer that has no state
    yet the state one step creates, as Horovod does: every parameter that requires a gradient gets a zero gradient
    and the wrapped optimizer steps once (without allreducing), so that momentum buffers and step counts exist on
    every rank before root's are sent. Over the global set only: another process set is refused
    (NotImplementedError)."""
    if _ps(process_set) is not None:
        raise NotImplementedError("hvd's broadcast_optimizer_state runs over every rank; a process set is not "
                                  "implemented for it (broadcast the state with broadcast_object(process_set=...))")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast the state of torch.optim.LBFGS (its step needs a closure)")
    if len(optimizer.state_dict()["state"]) == 0:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        if hasattr(optimizer, "_hvd_setup"):
            super(optimizer.__class__, optimizer).step()  # hvd.torch's wrapper: the base class's step, no allreduce
        else:
            optimizer.step()
    _ht.broadcast_optimizer_state(optimizer, root_rank)


# ---------------------------------------------------------------------------------------------------------------
# Synchronization points


def join(device=-1):
    """This rank has no more data (``hvd.join``); returns the rank that joined last. ``device`` is accepted and
    unused: hvd's joined rank contributes from the CPU."""
    rank = _core.join()
    _sweep()
    return rank


def barrier(process_set=global_process_set):
    _core.barrier(process_set=_ps(process_set))
    _sweep()
