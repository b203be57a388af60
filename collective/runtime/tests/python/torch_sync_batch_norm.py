"""``horovod.torch.SyncBatchNorm`` (opt-in: needs torch): on every rank its output, running statistics and
gradients equal those of torch's BatchNorm over the batches of all ranks together: uneven batch sizes (a rank with an
empty batch too), 2-D to 4-D inputs, without affine parameters, a cumulative average (``momentum=None``), evaluation
mode (no communication), and a layer over a process set of ranks {0, 1}."""
import sys

import torch

import horovod.torch as hvd


def fail(message):
    print("rank {}: {}".format(hvd.rank(), message), file=sys.stderr)
    sys.exit(1)


def close(a, b, what):
    if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
        fail("{}: {} != {}".format(what, a, b))


hvd.init()
r, n = hvd.rank(), hvd.size()
C = 3


def batch(rank, shape, step, empty_rank=None):
    """Rank ``rank``'s batch: ``rank + 1`` samples (none for ``empty_rank``), the same on every rank."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    rows = 0 if rank == empty_rank else rank + 1
    return torch.randn((rows, C) + shape, generator=g, dtype=torch.float64) * (rank + 1) + rank


def check(shape, affine=True, momentum=0.1, empty_rank=None, steps=2):
    what = "shape {} affine {} momentum {} empty {}".format(shape, affine, momentum, empty_rank)
    sync = hvd.SyncBatchNorm(C, affine=affine, momentum=momentum).double()
    ref = torch.nn.BatchNorm1d(C, affine=affine, momentum=momentum).double()
    if affine:
        with torch.no_grad():
            for m in (sync, ref):
                m.weight.copy_(torch.tensor([0.5, 2.0, -1.0]))
                m.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    for step in range(steps):
        xs = [batch(k, shape, step, empty_rank).requires_grad_() for k in range(n)]
        mine = xs[r].detach().clone().requires_grad_()
        out = sync(mine)
        # The reference sees every rank's batch at once (BatchNorm1d takes (N, C, L): the spatial dims flattened).
        full = torch.cat(xs)
        ref_out = ref(full.reshape(full.size(0), C, -1)).reshape(full.shape)
        start = sum(k + 1 for k in range(r) if k != empty_rank)
        close(out, ref_out[start:start + mine.size(0)], what + " output")
        close(sync.running_mean, ref.running_mean, what + " running_mean")
        close(sync.running_var, ref.running_var, what + " running_var")
        # A loss whose gradient differs per element; each rank's part of it.
        weights = torch.linspace(-1, 1, full[0].numel(), dtype=torch.float64).reshape(full.shape[1:])
        (out * weights).sum().backward()
        (ref_out * weights).sum().backward()
        close(mine.grad, xs[r].grad, what + " input gradient")
        if affine:
            # Each rank's parameter gradient is its own batch's part; their sum is the full batch's.
            close(hvd.allreduce(sync.weight.grad, op=hvd.Sum, name="w"), ref.weight.grad, what + " weight gradient")
            close(hvd.allreduce(sync.bias.grad, op=hvd.Sum, name="b"), ref.bias.grad, what + " bias gradient")
            for m in (sync, ref):
                m.weight.grad = m.bias.grad = None
    # Evaluation: the running statistics, no communication (a rank alone may evaluate).
    sync.eval()
    ref.eval()
    if r == 0:
        x = batch(0, shape, 99)
        close(sync(x), ref(x.reshape(x.size(0), C, -1)).reshape(x.shape), what + " eval")


check(())
check((4,))
check((2, 3), affine=False)
check((5,), momentum=None, steps=3)
check((2,), empty_rank=1)

# A process set of ranks {0, 1}: statistics over those two ranks' batches; ranks outside it normalize alone.
pair = hvd.add_process_set([0, 1]) if n > 2 else hvd.global_process_set  # (on 2 ranks: the global set's object)
sync = (hvd.SyncBatchNorm(C, process_set=pair, name="pair") if r < 2 else torch.nn.BatchNorm1d(C)).double()
mine = batch(r, (2,), 0)
if r < 2:
    members = torch.cat([batch(k, (2,), 0) for k in (0, 1)])
    start = 0 if r == 0 else 1
else:
    members, start = mine, 0
ref = torch.nn.BatchNorm1d(C).double()
close(sync(mine), ref(members)[start:start + mine.size(0)], "process set output")
close(sync.running_var, ref.running_var, "process set running_var")

try:
    hvd.SyncBatchNorm(C)(torch.ones(3))
except ValueError as e:
    if "2D" not in str(e):
        fail("1-D input: {}".format(e))
else:
    fail("a 1-D input was not refused")

hvd.shutdown()
print("OK rank {}".format(r))
