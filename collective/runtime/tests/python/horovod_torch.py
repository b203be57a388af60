"""horovod.torch as Horovod's scripts and test suites use it (opt-in: needs torch), checked against values computed
here: alltoall's (tensor, received_splits), integer scaling that truncates, int16, grouped allgather and
reducescatter, reducescatter_async, a name in flight twice, Adasum refused, gradients through the collectives, the
build questions, and init/shutdown around each "test" as Horovod's tearDown does."""
import sys

import numpy as np
import torch

import horovod.common.util as util
import horovod.torch as hvd
import hvd as core
from horovod.common.exceptions import HorovodInternalError


def check(cond, what):
    if not cond:
        print("rank {}: {}".format(core.rank() if core.is_initialized() else "?", what), file=sys.stderr)
        sys.exit(1)


def raises(cls, fn, what):
    try:
        fn()
    except cls as e:
        return e
    except Exception as e:  # noqa: BLE001 - the wrong class is the failure being reported
        check(False, "{} raised {!r}, expected {}".format(what, e, cls.__name__))
    check(False, "{} raised nothing, expected {}".format(what, cls.__name__))


# The build questions are hvd's answers, from every module a Horovod script asks.
for name in ("mpi_built", "gloo_built", "ddl_built", "ccl_built"):
    check(getattr(hvd, name)() == getattr(core, name)() == getattr(util, name)(), name)
# nccl_built is Horovod's version number: 0 without the nccl feature (or without a loadable NCCL), else >= 2700.
nccl = hvd.nccl_built()
usable = nccl == 0 if not core.nccl_built() else (nccl == 0 or nccl >= 2700)
check(type(nccl) is int and nccl == util.nccl_built() and usable, "nccl_built {!r}".format(nccl))
check(hvd.cuda_built() is False and hvd.rocm_built() is False, "cuda/rocm built")
check(HorovodInternalError is core.HorovodInternalError and hvd.HorovodInternalError is HorovodInternalError,
      "HorovodInternalError")

for round_ in range(3):  # Horovod's setUp/tearDown around each test
    hvd.init()
    r, n = hvd.rank(), hvd.size()

    # alltoall with splits: (tensor, received_splits of the splits' dtype); without: the tensor alone.
    send = torch.cat([torch.full((r + 1, 2), float(j)) for j in range(n)])
    splits = torch.tensor([r + 1] * n, dtype=torch.int32)
    out, received = hvd.alltoall(send, splits)
    check(received.dtype == torch.int32 and received.tolist() == [k + 1 for k in range(n)], "received splits")
    check(out.shape == (n * (n + 1) // 2, 2) and bool((out == r).all()), "alltoall rows")
    equal = hvd.alltoall(torch.arange(2 * n, dtype=torch.float32))
    check(isinstance(equal, torch.Tensor) and equal.tolist() == [float(2 * r), float(2 * r + 1)] * n,
          "equal-split alltoall")
    raises(ValueError, lambda: hvd.alltoall(torch.zeros(n), torch.ones(n)), "float splits")

    # Integer scaling truncates as Horovod's CPU kernels do: prescale per element, postscale and average on the sum.
    x = torch.tensor([-7, -3, 5, 9, 100], dtype=torch.int32)
    f = 0.37
    got = hvd.allreduce(x, average=False, prescale_factor=f)
    want = np.trunc(x.numpy().astype(np.float64) * f).astype(np.int32) * n
    check(got.dtype == torch.int32 and got.tolist() == want.tolist(), "int prescale: {} != {}".format(got, want))
    got = hvd.allreduce(x, op=hvd.Sum, postscale_factor=f)
    want = np.trunc(x.numpy().astype(np.float64) * n * f).astype(np.int32)
    check(got.tolist() == want.tolist(), "int postscale: {} != {}".format(got, want))
    odd = torch.tensor([r * 3 + 1, -(r * 3 + 1)], dtype=torch.int64)
    total = sum(k * 3 + 1 for k in range(n))
    got = hvd.allreduce(odd)  # average
    check(got.tolist() == [int(total / n), -int(total / n)], "int average truncates: {}".format(got))

    # int16 (carried as int32) in every operation, and a Sum that wraps as int16 arithmetic does.
    s = torch.tensor([30000, r], dtype=torch.int16)
    got = hvd.allreduce(s, op=hvd.Sum)
    wrapped = int(np.full(n, 30000, np.int16).sum(dtype=np.int16))
    check(got.dtype == torch.int16 and got.tolist() == [wrapped, sum(range(n))], "int16 sum: {}".format(got))
    check(hvd.allgather(s).dtype == torch.int16 and hvd.allgather(s)[1::2].tolist() == list(range(n)), "int16 gather")
    check(hvd.broadcast(s, 0).tolist() == [30000, 0], "int16 broadcast")

    # Grouped allgather (first dimensions differ by rank) and grouped reducescatter; reducescatter_async.
    ts = [torch.full((r + 1, 3), float(r)), torch.full((1,), float(r + 10))]
    g = hvd.grouped_allgather(ts, name="gag")
    check(g[0].shape == (n * (n + 1) // 2, 3) and g[1].tolist() == [float(k + 10) for k in range(n)], "grouped gag")
    rs = hvd.grouped_reducescatter([torch.ones(2 * n, 2), torch.arange(2 * n, dtype=torch.float64)], op=hvd.Sum)
    check(rs[0].shape == (2, 2) and bool((rs[0] == n).all()), "grouped reducescatter 0")
    check(rs[1].tolist() == [float(n * (2 * r)), float(n * (2 * r + 1))], "grouped reducescatter 1")
    h = hvd.reducescatter_async(torch.ones(n, 3), op=hvd.Sum)
    got = hvd.synchronize(h)
    check(hvd.poll(h) and got.shape == (1, 3) and bool((got == n).all()), "reducescatter_async")
    raises(NotImplementedError, lambda: hvd.reducescatter(torch.ones(n), op=hvd.Adasum), "Adasum")
    raises(ValueError, lambda: hvd.reducescatter(torch.tensor(1.0)), "scalar reducescatter")

    # A second operation under the name of one in flight: ValueError on this rank, before anything is sent.
    h = hvd.allreduce_async(torch.ones(3), name="dup")
    raises(ValueError, lambda: hvd.allreduce_async(torch.ones(3), name="dup"), "duplicate name")
    check(hvd.synchronize(h).tolist() == [1.0, 1.0, 1.0], "first dup")
    check(hvd.allreduce(torch.ones(1), name="dup").tolist() == [1.0], "name free after synchronize")
    # Names are per process set: the same name in flight in the job and in a set of this rank's.
    even = hvd.add_process_set([rk for rk in range(n) if rk % 2 == 0])
    odd = hvd.add_process_set([rk for rk in range(n) if rk % 2 == 1])
    mine = even if r % 2 == 0 else odd
    h = hvd.allreduce_async(torch.ones(3), name="dup")
    hs = hvd.allreduce_async(torch.ones(3), name="dup", process_set=mine, op=hvd.Sum)
    raises(ValueError, lambda: hvd.allreduce_async(torch.ones(3), name="dup", process_set=mine), "dup in a set")
    check(hvd.synchronize(hs).tolist() == [float(mine.size())] * 3, "the set's dup")
    check(hvd.synchronize(h).tolist() == [1.0, 1.0, 1.0], "the job's dup")
    check(hvd.remove_process_set(odd) and hvd.remove_process_set(even), "remove the sets")

    # Gradients as Horovod's ops register them.
    a = torch.ones(4, requires_grad=True)
    hvd.allreduce(a, op=hvd.Sum).sum().backward()
    check(a.grad.tolist() == [float(n)] * 4, "allreduce grad {}".format(a.grad))
    b = torch.full((r + 1, 2), 1.0, requires_grad=True)
    gathered = hvd.allgather(b)
    (gathered * 2).sum().backward()
    check(b.grad.shape == b.shape and bool((b.grad == 2).all()), "allgather grad {}".format(b.grad))
    c = torch.ones(3, requires_grad=True)
    hvd.broadcast(c, 0).sum().backward()
    check(c.grad.tolist() == ([1.0] * 3 if r == 0 else [0.0] * 3), "broadcast grad {}".format(c.grad))
    d = send.clone().requires_grad_()
    out, _ = hvd.alltoall(d, splits)
    out.sum().backward()
    check(bool((d.grad == 1).all()), "alltoall grad")
    e = torch.ones(2 * n, requires_grad=True)
    hvd.reducescatter(e, op=hvd.Sum).sum().backward()
    check(e.grad.tolist() == [float(n)] * (2 * n), "reducescatter grad {}".format(e.grad))

    # A sparse allreduce (allgathered indices and values) equals the dense one; Horovod's optimizer arguments.
    sparse = torch.zeros(n + 1, 3)
    sparse[r, 1] = r + 1.0
    sparse[n, 0] = 1.0
    got = hvd.sparse_allreduce_async(sparse.to_sparse(), name="sparse", op=hvd.Average)()
    check(torch.allclose(got.to_dense(), hvd.allreduce(sparse)), "sparse allreduce {}".format(got))
    model = torch.nn.Linear(2, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), num_groups=1)
    model(torch.full((1, 2), float(r))).sum().backward()
    opt.step()
    check(torch.equal(model.weight.grad, hvd.allreduce(model.weight.grad)), "num_groups optimizer")
    # sparse_as_dense is accepted (sparse gradients: torch_sparse.py); dense gradients are reduced as before.
    dense = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), sparse_as_dense=True)
    dense.zero_grad()
    model(torch.full((1, 2), float(r))).sum().backward()
    dense.synchronize()
    check(torch.equal(model.weight.grad, hvd.allreduce(model.weight.grad)), "sparse_as_dense optimizer")
    # Horovod's broadcast_optimizer_state gives a stateless optimizer its first step's state, then root's.
    fresh = torch.nn.Linear(2, 1)
    momentum = hvd.DistributedOptimizer(torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9),
                                        named_parameters=fresh.named_parameters())
    momentum.param_groups[0]["lr"] = 0.1 * (r + 1)
    hvd.broadcast_optimizer_state(momentum, root_rank=0)
    check(momentum.param_groups[0]["lr"] == 0.1 and fresh.weight.grad is not None
          and "momentum_buffer" in momentum.state[fresh.weight], "broadcast_optimizer_state")
    twice = list(model.named_parameters()) + [("weight", torch.nn.Parameter(torch.ones(1)))]
    raises(ValueError, lambda: hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in twice], lr=0.1),
                                                        named_parameters=twice), "duplicate parameter names")
    raises(ValueError, lambda: hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                        named_parameters=list(model.named_parameters())[:1]),
           "unnamed parameters")

    hvd.barrier()
    hvd.shutdown()
    check(not hvd.is_initialized(), "shut down")
print("ok horovod.torch rank {}".format(r))
