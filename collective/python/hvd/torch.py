"""PyTorch helpers over the pure-Python core (CPU tensors through DLPack; no compiled extension).

    import hvd.torch as hvd
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
"""

try:
    import torch
except ImportError as e:
    raise ImportError(
        "hvd.torch needs PyTorch, which is not installed in this environment; add torch to the environment's "
        "packages (or use hvd / hvd.numpy directly)"
    ) from e

import hvd as _core
from hvd import (  # noqa: F401 - re-exported API
    Average, HorovodInternalError, HvdError, Max, Min, Product, Sum, allgather_object, barrier, broadcast_object,
    cross_rank, cross_size, init, is_initialized, join, local_rank, local_size, poll, rank, shutdown, size,
    start_timeline, stop_timeline, synchronize,
)


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
    """Mixed into the wrapped optimizer's class: allreduces each gradient as soon as backward produces it."""

    def _hvd_setup(self, named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor):
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
        self._handles = {}
        self._passes = {id(p): 0 for p in params}
        self._hooks = []
        for p in params:
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook()))

    def _make_hook(self):
        def hook(p):
            key = id(p)
            self._passes[key] += 1
            if self._passes[key] < self.backward_passes_per_step:
                return
            self._passes[key] = 0
            if key in self._handles:
                raise AssertionError(
                    "gradients were computed more than backward_passes_per_step={} times before step(); call "
                    "step() (or synchronize()) after each group of backward passes, or raise "
                    "backward_passes_per_step".format(self.backward_passes_per_step))
            self._handles[key] = (p, self._submit(p))
        return hook

    def _submit(self, p):
        grad = p.grad.detach()
        compressed, ctx = self._compression.compress(grad.contiguous())
        prescale = 1.0 / self._predivide
        postscale = self._predivide
        if self.backward_passes_per_step > 1:
            prescale /= self.backward_passes_per_step
        h = _core.allreduce_async_(compressed, None, "grad." + self._names[id(p)], self._op, prescale, postscale)
        return h, compressed, ctx

    def synchronize(self):
        """Waits for every outstanding gradient allreduce and writes the results into ``.grad``."""
        for key, (p, (h, compressed, ctx)) in list(self._handles.items()):
            _core.synchronize(h)
            out = self._compression.decompress(compressed, ctx)
            if out.data_ptr() != p.grad.data_ptr():
                p.grad.copy_(out)
        self._handles.clear()

    def step(self, closure=None):
        self.synchronize()
        return super(self.__class__, self).step(closure)

    def zero_grad(self, *args, **kwargs):
        if self._handles:
            raise AssertionError("zero_grad() called while gradients are being allreduced; call step() first")
        return super(self.__class__, self).zero_grad(*args, **kwargs)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0):
    """Wraps a torch optimizer so that ``step()`` uses gradients averaged over every rank."""
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               {k: v for k, v in _DistributedOptimizer.__dict__.items() if not k.startswith("__")})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._hvd_setup(named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor)
    return wrapped
