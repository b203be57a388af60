"""PyTorch helpers over the pure-Python core (CPU tensors through DLPack; no compiled extension).

    import hvd.torch as hvd
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
"""

import contextlib
import warnings

try:
    import torch
except ImportError as e:
    raise ImportError(
        "hvd.torch needs PyTorch, which is not installed in this environment; add torch to the environment's "
        "packages (or use hvd / hvd.numpy directly)"
    ) from e

import hvd as _core
from hvd import Average, broadcast_object, synchronize

_core._reexport(globals(), tensor_ops=False)


class Compression:
    """Gradient compression for allreduce: ``none`` or ``fp16`` (floating tensors travel as float16)."""

    class none:
        @staticmethod
        def compress(tensor):
            return tensor, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor

    class fp16:
        @staticmethod
        def compress(tensor):
            if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
                return tensor.to(torch.float16), tensor.dtype
            return tensor, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor if ctx is None else tensor.to(ctx)


def _cpu(tensor):
    if tensor.device.type != "cpu":
        raise ValueError("hvd.torch handles CPU tensors; this one is on {}".format(tensor.device))
    return tensor.detach().contiguous()


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    compression=Compression.none):
    compressed, ctx = compression.compress(_cpu(tensor))
    h = _core.allreduce_async(compressed, average, name, op, prescale_factor, postscale_factor)
    finish = h._finish
    h._finish = lambda hid: compression.decompress(finish(hid), ctx)
    return h


def allreduce(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
              compression=Compression.none):
    return synchronize(allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor, compression))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0):
    """In place on a contiguous CPU tensor (its memory is shared with the library until synchronize)."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("in-place operations need a contiguous CPU tensor")
    return _core.allreduce_async_(tensor.detach(), average, name, op, prescale_factor, postscale_factor)


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
                   groups, process_set=None):
        self._process_set = process_set
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
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook()))

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

    def _submit(self, p):
        compressed, ctx = self._compression.compress(_grad_or_zeros(p).detach().contiguous())
        prescale, postscale = self._scales()
        h = _core.allreduce_async_(compressed, None, "grad." + self._names[id(p)], self._op, prescale, postscale,
                                   self._process_set)
        return h, compressed, ctx

    def _submit_group(self, i):
        """One grouped allreduce for group ``i`` (fused by the engine at submission)."""
        members = []
        for p in self._groups[i]:
            compressed, ctx = self._compression.compress(_grad_or_zeros(p).detach().contiguous())
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


def _grad_or_zeros(p):
    """``p.grad``, or zeros where backward did not produce one (kept as the gradient of a trainable parameter)."""
    if p.grad is not None:
        return p.grad
    zeros = torch.zeros_like(p)
    if p.requires_grad:
        p.grad = zeros
    return zeros


def _write_grad(p, out):
    if p.grad is not None and out.data_ptr() != p.grad.data_ptr():
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
                         op=Average, gradient_predivide_factor=1.0, groups=None, process_set=None):
    """Wraps a torch optimizer so that ``step()`` uses gradients averaged over every rank (over the ranks of
    ``process_set`` when given; on a rank outside it, ``step()`` uses the rank's own gradients, as in Horovod).

    ``groups`` (as in Horovod): a number of groups, or a list of lists of parameters; the gradients of a group are
    allreduced together once backward has produced all of them (one grouped allreduce, fused by the engine), instead
    of one allreduce per gradient as soon as it is ready."""
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               {k: v for k, v in _DistributedOptimizer.__dict__.items() if not k.startswith("__")})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._hvd_setup(named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
                       groups, process_set)
    return wrapped
