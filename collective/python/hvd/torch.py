"""PyTorch helpers over the pure-Python core (CPU tensors through DLPack; no compiled extension).

    import hvd.torch as hvd
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
"""

import contextlib
import warnings

from hvd import _frameworks

torch = _frameworks.require("torch", "hvd.torch", "PyTorch", "torch", " (or use hvd / hvd.numpy directly)")

import hvd as _core
from hvd import _compression
from hvd import Average, broadcast_object, synchronize

_core._reexport(globals(), tensor_ops=False)


class _TorchCastCompressor(_compression.CastCompressor):
    is_floating = staticmethod(lambda dtype: dtype.is_floating_point)
    cast = staticmethod(lambda tensor, dtype: tensor.to(dtype))


class Compression:
    """Gradient compression for allreduce: ``none`` or ``fp16`` (floating tensors travel as float16)."""

    none = _compression.NoneCompressor

    class fp16(_TorchCastCompressor):
        dtype = torch.float16


def _check_cpu(tensor):
    if not tensor.is_cpu:
        raise ValueError("hvd.torch handles CPU tensors; this one is on {}".format(tensor.device))


def _cpu(tensor):
    _check_cpu(tensor)
    # (resolve_neg: hvd reads memory, which a lazily negated view holds un-negated; reduced like any tensor, as the
    # small allreduces below are.)
    return tensor.detach().contiguous().resolve_neg()


# Out-of-place allreduces of tensors up to this size reduce a copy in place, through the batch: the copy costs less
# than the library call per tensor that the batch saves (the library reads the input and writes the output where
# they are, so for large tensors the copy would be an extra pass over memory).
_COPY_TO_BATCH = 1 << 16


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    compression=Compression.none):
    if (compression is Compression.none and tensor.layout is torch.strided and tensor.dtype is not torch.bool
            and tensor.numel() * tensor.element_size() <= _COPY_TO_BATCH):
        # In place in a copy: a per-tensor in-place allreduce of a CPU tensor goes through the package's batch
        # (hvd/_batch.py, no library call per tensor). Not bool: reduced as uint8 (a Sum counts the ranks' Trues),
        # whose result is a uint8 tensor at any size (a bool copy would hold bytes above 1, invalid bools).
        # (A detach() only where autograd needs one, clone() rather than clone(memory_format=...): 0.5 and 1.0 us.)
        _check_cpu(tensor)
        src = tensor.detach() if tensor.requires_grad else tensor
        if src.is_neg():
            src = src.resolve_neg()  # (the batch reads memory, which a lazily negated view holds un-negated)
        copy = src.clone() if src.is_contiguous() else src.contiguous()
        return _core.allreduce_async_(copy, average, name, op, prescale_factor, postscale_factor)
    compressed, ctx = compression.compress(_cpu(tensor))
    h = _core.allreduce_async(compressed, average, name, op, prescale_factor, postscale_factor)
    finish = h._finish
    h._finish = lambda hid: compression.decompress(finish(hid), ctx)
    return h


def allreduce(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
              compression=Compression.none):
    return synchronize(allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor, compression))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0):
    """In place on a contiguous CPU tensor (its memory is shared with the library until synchronize). Goes through
    the package's batch (hvd/_batch.py: no library call per tensor) where it can; ``synchronize`` returns the tensor
    (a detached alias of it when it requires grad)."""
    # (`is_cpu`, not `device.type`: 0.05 against 0.35 us; a detach() costs 0.5 us and is needed only where autograd
    # would refuse the export.)
    if not tensor.is_cpu or not tensor.is_contiguous():
        raise ValueError("in-place operations need a contiguous CPU tensor")
    return _core.allreduce_async_(tensor.detach() if tensor.requires_grad else tensor, average, name, op,
                                  prescale_factor, postscale_factor)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0):
    synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor))
    return tensor


def grouped_allreduce(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0):
    return _core.grouped_allreduce([_cpu(t) for t in tensors], average, name, op, prescale_factor, postscale_factor)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0):
    return _core.grouped_allreduce_async([_cpu(t) for t in tensors], average, name, op, prescale_factor,
                                         postscale_factor)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0):
    """In-place grouped allreduce of contiguous CPU tensors; ``synchronize`` returns the list."""
    for t in tensors:
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("in-place operations need contiguous CPU tensors")
    # (Tensors that require grad cannot be exported through DLPack; their detached views share the memory.)
    return _core.grouped_allreduce_async_([t.detach() if t.requires_grad else t for t in tensors], average, name,
                                          op, prescale_factor, postscale_factor)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0):
    synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor))
    return tensors


def allgather(tensor, name=None):
    return _core.allgather(_cpu(tensor), name)


def allgather_async(tensor, name=None):
    return _core.allgather_async(_cpu(tensor), name)


def broadcast(tensor, root_rank, name=None):
    return _core.broadcast(_cpu(tensor), root_rank, name)


def broadcast_async(tensor, root_rank, name=None):
    return _core.broadcast_async(_cpu(tensor), root_rank, name)


def broadcast_async_(tensor, root_rank, name=None):
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("in-place operations need a contiguous CPU tensor")
    return _core.broadcast_async_(tensor.detach(), root_rank, name)


def broadcast_(tensor, root_rank, name=None):
    synchronize(broadcast_async_(tensor, root_rank, name))
    return tensor


def alltoall(tensor, splits=None, name=None, return_received_splits=False):
    return _core.alltoall(_cpu(tensor), splits, name, return_received_splits)


def reducescatter(tensor, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0):
    return _core.reducescatter(_cpu(tensor), name, op, prescale_factor, postscale_factor)


def broadcast_parameters(params, root_rank=0):
    """Overwrites parameters (a state_dict, or named_parameters()) with root's, in place."""
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    handles = []
    for name, p in items:
        if p is None:
            continue
        t = p.data if isinstance(p, torch.nn.Parameter) else p
        handles.append(broadcast_async_(t, root_rank, name="broadcast_parameters." + str(name)))
    for h in handles:
        synchronize(h)


def broadcast_optimizer_state(optimizer, root_rank=0):
    """Makes every rank's optimizer state (step counts, moments, hyper-parameters) equal to root's."""
    state = broadcast_object(optimizer.state_dict(), root_rank, name="broadcast_optimizer_state")
    optimizer.load_state_dict(state)


class _DistributedOptimizer:
    """Mixed into the wrapped optimizer's class: allreduces each gradient (or each group of gradients) as soon as
    backward produces it."""

    def _hvd_setup(self, named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
                   groups, process_set=None, sparse_as_dense=False):
        self._process_set = process_set
        self._sparse_as_dense = sparse_as_dense
        # id(parameter) -> sparse_dim() of its last sparse gradient: a rank whose backward did not produce that
        # gradient submits an empty sparse one, so that every rank runs the same operations.
        self._sparse_dims = {}
        self._compression = compression
        self._op = op
        self._predivide = gradient_predivide_factor
        self.backward_passes_per_step = backward_passes_per_step
        params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            names = {id(p): n for n, p in named}
            if len(names) != len(named):
                raise ValueError("named_parameters has duplicate parameters")
        else:
            names = {}
        self._names = {id(p): names.get(id(p), "param.{}".format(i)) for i, p in enumerate(params)}
        # Horovod's attribute (parameter -> the name its gradient is reduced under), which scripts and Horovod's
        # tests read: the same names on every rank.
        self._parameter_names = {p: self._names[id(p)] for p in params}
        self._trainable = [p for p in params if p.requires_grad]
        self._groups = _gradient_groups(groups, self._trainable, params)
        self._group_of = {id(p): i for i, g in enumerate(self._groups) for p in g}
        self._handles = {}
        self._group_ready = [set() for _ in self._groups]
        self._group_handles = {}
        self._passes = {id(p): 0 for p in params}
        # True from a synchronize() until the next gradient, zero_grad() or step(): a second synchronize() (or the
        # step() after `synchronize(); clip_grad_norm_(...)`) then does nothing instead of reducing again.
        self._synchronized = False
        self._hooks = []
        if process_set is not None and not process_set.included():
            return  # as in Horovod: a rank outside the set steps on its own gradients
        for p in self._trainable:
            self._hooks.append(_after_accumulate(p, self._make_hook()))

    def _make_hook(self):
        def hook(p):
            key = id(p)
            self._synchronized = False
            # A gradient already sent (or waiting for its group) must not be accumulated into again: the library
            # may be writing the result into that memory. Checked on every pass, so pass 3 of 2 fails at once.
            group = self._group_of.get(key)
            if key in self._handles or group is not None and (key in self._group_ready[group]
                                                              or group in self._group_handles):
                raise AssertionError(
                    "gradients were computed more than backward_passes_per_step={} times before step(); call "
                    "step() (or synchronize()) after each group of backward passes, or raise "
                    "backward_passes_per_step".format(self.backward_passes_per_step))
            self._passes[key] += 1
            if self._passes[key] < self.backward_passes_per_step:
                return
            self._passes[key] = 0
            if group is None:
                self._handles[key] = (p, self._submit(p))
                return
            self._group_ready[group].add(key)
            if len(self._group_ready[group]) == len(self._groups[group]):
                self._submit_group(group)
        return hook

    def _scales(self):
        prescale = 1.0 / self._predivide
        if self.backward_passes_per_step > 1:
            prescale /= self.backward_passes_per_step
        return prescale, self._predivide

    def _gradient(self, p):
        """``p``'s gradient to reduce: dense (a sparse one made dense with ``sparse_as_dense``), or sparse."""
        grad = _grad_or_zeros(p, self._sparse_dims.get(id(p)))
        if grad.is_sparse:
            self._sparse_dims[id(p)] = grad.sparse_dim()
            if self._sparse_as_dense:
                return grad.detach().to_dense()
        return grad.detach() if grad.requires_grad else grad

    def _submit(self, p):
        grad = self._gradient(p)
        if grad.is_sparse:
            return _SparseReduction(self, p, grad), None, None
        compressed, ctx = self._compression.compress(grad.contiguous())
        prescale, postscale = self._scales()
        h = _core.allreduce_async_(compressed, None, "grad." + self._names[id(p)], self._op, prescale, postscale,
                                   self._process_set)
        return h, compressed, ctx

    def _submit_group(self, i):
        """One grouped allreduce for group ``i`` (fused by the engine at submission)."""
        members = []
        for p in self._groups[i]:
            grad = self._gradient(p)
            if grad.is_sparse:
                raise ValueError("parameter {!r} has a sparse gradient, which a grouped allreduce cannot reduce: "
                                 "pass sparse_as_dense=True, or leave it out of groups".format(self._names[id(p)]))
            compressed, ctx = self._compression.compress(grad.contiguous())
            members.append((p, compressed, ctx))
        prescale, postscale = self._scales()
        # (A space: no parameter name from named_parameters() has one, so no gradient's name can be the same.)
        h = _core.grouped_allreduce_async_([c for _, c, _ in members], None, "grad group {}".format(i), self._op,
                                           prescale, postscale, self._process_set)
        self._group_handles[i] = (h, members)

    def synchronize(self):
        """Waits for every outstanding gradient allreduce and writes the results into ``.grad``. Called again
        before new gradients, it does nothing.

        As in Horovod, a parameter whose gradient backward did not produce on this rank since the last step (a
        layer this rank's batch did not use) is allreduced now with a zero gradient, so every rank submits the
        same operations instead of the others waiting for this one. Parameters frozen since the optimizer was
        wrapped (``requires_grad`` now False) are left out, unless they belong to a group."""
        if self._synchronized:
            return
        if self._process_set is not None and not self._process_set.included():
            self._synchronized = True
            return
        failure = None
        try:
            for p in self._trainable:
                key = id(p)
                if p.requires_grad and key not in self._group_of and key not in self._handles:
                    self._handles[key] = (p, self._submit(p))
            for i in range(len(self._groups)):
                if i not in self._group_handles:
                    self._submit_group(i)
        except BaseException as e:  # noqa: B036 - re-raised below, once what was submitted has completed
            failure = e
        # Wait for everything submitted even after a failure, then forget it all, so that the next step starts
        # clean (the first error is raised).
        waits = [(h, [(p, compressed, ctx)]) for p, (h, compressed, ctx) in self._handles.values()]
        waits += list(self._group_handles.values())
        self._handles.clear()
        self._group_handles.clear()
        self._reset_counts()
        for h, members in waits:
            try:
                if isinstance(h, _SparseReduction):
                    members[0][0].grad = h.wait()
                    continue
                _core.synchronize(h)
                for p, compressed, ctx in members:
                    _write_grad(p, self._compression.decompress(compressed, ctx))
            except BaseException as e:  # noqa: B036
                failure = failure or e
        if failure is not None:
            raise failure
        self._synchronized = True

    def _reset_counts(self):
        for ready in self._group_ready:
            ready.clear()
        for key in self._passes:
            self._passes[key] = 0

    @contextlib.contextmanager
    def skip_synchronize(self):
        """As in Horovod: ``step()`` inside this block does not synchronize (for ``synchronize()``, then gradient
        clipping, then ``step()``; a plain ``step()`` after ``synchronize()`` also does not reduce again)."""
        self._skip_synchronize = True
        try:
            yield
        finally:
            self._skip_synchronize = False

    def step(self, closure=None):
        if not getattr(self, "_skip_synchronize", False):
            if self._synchronized:
                # Horovod's warning; hvd then does not reduce again (synchronize() below does nothing).
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                              "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                              "your code.")
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, *args, **kwargs):
        if self._handles or self._group_handles:
            raise AssertionError("zero_grad() called while gradients are being allreduced; call step() first")
        # Gradients counted since the last step (a step skipped, say for a non-finite loss) are gone.
        self._reset_counts()
        self._synchronized = False
        return super(self.__class__, self).zero_grad(*args, **kwargs)


def _after_accumulate(p, hook):
    """Calls ``hook(p)`` each time backward has accumulated ``p``'s gradient into ``p.grad``: torch >= 2.1's
    post-accumulate-grad hook, else (torch <= 2.0, which has none) a hook on the node that accumulates it, as
    Horovod does; that node is kept alive beside its hook's handle."""
    if hasattr(p, "register_post_accumulate_grad_hook"):
        return p.register_post_accumulate_grad_hook(hook)
    with torch.enable_grad():  # (the optimizer may be wrapped under no_grad)
        accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
    return accumulator, accumulator.register_hook(lambda *_: hook(p))


class _SparseReduction:
    """Horovod's reduction of a sparse gradient: every rank's indices and values are allgathered (the sum of sparse
    tensors is their concatenation) and the result coalesced, so duplicate indices add up; scaled as a dense
    gradient would be (divided by the number of ranks for ``Average``)."""

    def __init__(self, opt, p, grad):
        if opt._op not in (_core.Sum, _core.Average):
            raise ValueError("parameter {!r} has a sparse gradient, which can only be summed or averaged (op={!r}); "
                             "pass sparse_as_dense=True".format(opt._names[id(p)], opt._op))
        grad = grad.coalesce()
        prescale, postscale = opt._scales()
        ps = opt._process_set
        self._factor = prescale * postscale / ((ps.size() if ps is not None else _core.size())
                                               if opt._op == _core.Average else 1)
        self._shape = grad.shape
        name = "grad." + opt._names[id(p)]
        # (Allgather concatenates dimension 0: the indices travel as (nnz, sparse_dim).)
        self._indices = _core.allgather_async(grad.indices().transpose(0, 1).contiguous(), name + " indices", ps)
        self._values = _core.allgather_async(grad.values().contiguous(), name + " values", ps)

    def wait(self):
        indices = _core.synchronize(self._indices)
        values = _core.synchronize(self._values)
        if self._factor != 1:
            values = values * self._factor
        # The indices come from other ranks: checked here, rather than crash in the optimizer's step.
        return _sparse_coo(indices.transpose(0, 1), values, self._shape).coalesce()


def _sparse_coo(indices, values, shape):
    """A sparse COO tensor whose invariants (indices in range) are checked."""
    try:
        return torch.sparse_coo_tensor(indices, values, shape, check_invariants=True)
    except TypeError:  # torch < 2.0 has no check_invariants
        return torch.sparse_coo_tensor(indices, values, shape)


def _grad_or_zeros(p, sparse_dim=None):
    """``p.grad``, or zeros where backward did not produce one (kept as the gradient of a trainable parameter):
    an empty sparse tensor with ``sparse_dim`` sparse dimensions when given (a parameter whose gradients are sparse),
    else dense zeros."""
    if p.grad is not None:
        return p.grad
    if sparse_dim is not None:
        zeros = _sparse_coo(torch.zeros((sparse_dim, 0), dtype=torch.long),
                            p.detach().new_zeros((0,) + tuple(p.shape[sparse_dim:])), p.shape)
    else:
        zeros = torch.zeros_like(p)
    if p.requires_grad:
        p.grad = zeros
    return zeros


def _write_grad(p, out):
    if p.grad is not None and p.grad.is_sparse:
        # sparse_as_dense: the optimizer (e.g. SparseAdam) still gets a sparse gradient, as in Horovod.
        p.grad = out.to_sparse(p.grad.sparse_dim())
    elif p.grad is not None and out.data_ptr() != p.grad.data_ptr():
        p.grad.copy_(out)


def _gradient_groups(groups, trainable, params):
    """Horovod's ``groups``: None (every gradient on its own), a number of groups (the trainable parameters in
    order, split into that many contiguous groups of near-equal size), or a list of lists of parameters (the
    parameters in no list go on their own; frozen ones are left out, as in Horovod)."""
    if groups is None:
        return []
    if isinstance(groups, bool) or not isinstance(groups, (int, list, tuple)) or isinstance(groups, int) and groups < 1:
        raise ValueError("groups must be a positive number of groups or a list of lists of parameters, not {!r}"
                         .format(groups))
    if isinstance(groups, int):
        k = min(groups, len(trainable))
        size, extra = divmod(len(trainable), k) if k else (0, 0)
        out, at = [], 0
        for i in range(k):
            n = size + (i < extra)
            out.append(trainable[at:at + n])
            at += n
        return out
    known = {id(p) for p in params}
    seen = set()
    out = []
    for g in groups:
        if isinstance(g, torch.Tensor) or not isinstance(g, (list, tuple)):
            raise ValueError("groups must be a list of lists of parameters; found {!r} in it".format(type(g)))
        for p in g:
            if not isinstance(p, torch.Tensor) or id(p) not in known:
                raise ValueError("every tensor in groups must be a parameter of the optimizer")
            if id(p) in seen:
                raise ValueError("a parameter is in more than one of groups")
            seen.add(id(p))
        g = [p for p in g if p.requires_grad]
        if g:
            out.append(g)
    return out


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, groups=None, process_set=None,
                         sparse_as_dense=False):
    """Wraps a torch optimizer so that ``step()`` uses gradients averaged over every rank (over the ranks of
    ``process_set`` when given; on a rank outside it, ``step()`` uses the rank's own gradients, as in Horovod).

    Sparse gradients (``nn.Embedding(sparse=True)``) are reduced as Horovod does: every rank's indices and values
    allgathered, the optimizer stepping on the coalesced sum (or average); with ``sparse_as_dense`` they are
    allreduced as dense tensors and handed back sparse. Either way they take ``op`` Sum or Average only, and a
    parameter whose gradient is sparse cannot be in ``groups`` unless ``sparse_as_dense``. (As in Horovod, a rank
    whose first backward produces no gradient for such a parameter submits dense
    zeros, which do not match the other ranks' operations: once a rank has seen a sparse gradient for a parameter,
    it submits an empty sparse one for it when backward produced none.)

    ``groups`` (as in Horovod): a number of groups, or a list of lists of parameters; the gradients of a group are
    allreduced together once backward has produced all of them (one grouped allreduce, fused by the engine), instead
    of one allreduce per gradient as soon as it is ready."""
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               {k: v for k, v in _DistributedOptimizer.__dict__.items() if not k.startswith("__")})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._hvd_setup(named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
                       groups, process_set, sparse_as_dense)
    return wrapped


def _set_or_none(process_set):
    """hvd's ``process_set=`` (None: every rank) from hvd's or Horovod's set object."""
    if process_set is None or getattr(process_set, "process_set_id", None) == 0:
        return None
    return process_set


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch normalization over the batches of every rank: the forward pass gathers each rank's count, mean and sum
    of squared deviations (combined exactly, in float64, whatever a rank's count), the backward pass sums the two
    per-channel reductions the input's gradient needs. The statistics travel through the CPU (they are a few numbers
    per channel), so the input may live on any device."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_set, name):
        dims = [0] + list(range(2, x.dim()))
        channels = x.size(1)
        count = x.numel() // channels if channels else 0
        local = torch.zeros(1, 2 * channels + 1, dtype=torch.float64)
        local[0, -1] = count
        if count:
            var, mean = torch.var_mean(x.detach(), dims, unbiased=False)
            local[0, :channels] = mean.to("cpu", torch.float64)
            local[0, channels:2 * channels] = var.to("cpu", torch.float64) * count
        every = _core.allgather(local, name + ".stats", process_set)
        counts, means, m2s = every[:, -1:], every[:, :channels], every[:, channels:2 * channels]
        total = float(counts.sum())
        if total == 0:
            raise ValueError("SyncBatchNorm got no samples on any rank (every batch was empty)")
        mean = (counts * means).sum(0) / total
        var = (m2s + counts * (means - mean) ** 2).sum(0) / total  # biased: what normalizes the batch
        if running_mean is not None:
            unbiased = var * total / (total - 1) if total > 1 else var
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var), alpha=momentum)
        invstd = (var + eps).rsqrt()
        shape = [1, channels] + [1] * (x.dim() - 2)
        mean = mean.to(x.device, x.dtype).reshape(shape)
        invstd = invstd.to(x.device, x.dtype).reshape(shape)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total, ctx.dims, ctx.process_set, ctx.name = total, dims, process_set, name
        ctx.has_bias = bias is not None
        out = (x - mean) * invstd
        if weight is not None:
            out = out * weight.reshape(shape) + bias.reshape(shape)
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        dims, shape = ctx.dims, mean.shape
        xmu = x - mean
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            # The input's gradient depends on every rank's batch through these two sums; the parameters' gradients
            # stay local (the DistributedOptimizer averages them, as for any parameter).
            local = torch.cat([sum_dy, sum_dy_xmu]).to("cpu", torch.float64)
            sums = _core.allreduce(local, None, ctx.name + ".grad", _core.Sum, 1.0, 1.0, ctx.process_set)
            channels = x.size(1)
            mean_dy = (sums[:channels] / ctx.total).to(dy.device, dy.dtype).reshape(shape)
            mean_dy_xmu = (sums[channels:] / ctx.total).to(dy.device, dy.dtype).reshape(shape)
            scale = invstd if weight is None else invstd * weight.reshape(shape)
            grad_x = (dy - mean_dy - xmu * invstd * invstd * mean_dy_xmu) * scale
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xmu * invstd.reshape(-1)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = sum_dy
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Horovod's ``SyncBatchNorm``: batch normalization whose statistics, in training, are those of the batches of
    every rank together (or of ``process_set``'s ranks), forward and backward; in evaluation it uses the running
    statistics, as ``BatchNorm`` does, and communicates nothing. Any input of at least two dimensions ``(N, C, ...)``
    on CPU or on a device (its per-channel statistics travel through the CPU). Every rank of the set must run each
    training forward (and backward) of the layer, in the same order (each call completes before it returns, so
    every layer's operations can share one ``name``)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_set=None, name="sync_batch_norm", **kwargs):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, **kwargs)
        self.process_set = process_set
        self.name = name

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError("expected at least 2D input (got {}D input)".format(input.dim()))

    def forward(self, input):
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average
                momentum = 1.0 / float(self.num_batches_tracked)
        if not self.training and self.track_running_stats:
            return torch.nn.functional.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                                  self.bias, False, momentum, self.eps)
        ps = _set_or_none(self.process_set)
        if (ps.size() if ps is not None else _core.size()) == 1:
            return torch.nn.functional.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                                  self.bias, True, momentum, self.eps)
        running = self.training and self.track_running_stats
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias,
                                            self.running_mean if running else None,
                                            self.running_var if running else None, self.eps, momentum, ps,
                                            self.name)
