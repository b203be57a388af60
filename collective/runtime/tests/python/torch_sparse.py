"""hvd.torch's DistributedOptimizer with sparse gradients (opt-in: needs torch), through ``horovod.torch`` as a
Horovod script calls it: ``nn.Embedding(sparse=True)`` reduced by allgathering indices and values, and with
``sparse_as_dense``; the optimizer gets the average (or sum) as a sparse gradient; a rank whose backward produced no
gradient submits an empty one; accumulation over two passes; sparse gradients refused in a group and with Max;
``_parameter_names`` the same on every rank for an optimizer built from parameter groups."""
import sys

import torch

import horovod.torch as hvd


def fail(message):
    print("rank {}: {}".format(hvd.rank(), message), file=sys.stderr)
    sys.exit(1)


hvd.init()
r, n = hvd.rank(), hvd.size()
ROWS, DIM = 10, 3


def inputs(rank, step):
    """Rank ``rank``'s token ids at ``step``: different rows and counts on each rank (rank-dependent lengths)."""
    return torch.tensor([[(rank * 3 + step + k * (rank + 1)) % ROWS for k in range(rank + 2)]])


def counts(rank, step):
    """The dense gradient of ``embedding(inputs).sum()``: each row once per occurrence."""
    g = torch.zeros(ROWS, DIM)
    for i in inputs(rank, step).reshape(-1).tolist():
        g[i] += 1
    return g


for sparse_as_dense in (False, True):
    for op in (hvd.Average, hvd.Sum):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(ROWS, DIM, sparse=True)
        hvd.broadcast_parameters(emb.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0), sparse_as_dense=sparse_as_dense,
                                       op=op, named_parameters=emb.named_parameters())
        what = "sparse_as_dense={} op={}".format(sparse_as_dense, op)
        for step in range(3):
            before = emb.weight.detach().clone()
            opt.zero_grad()
            ranks = range(n)
            if step == 2:
                # Rank 1 has no batch: its backward produces no gradient; it still takes part (an empty one).
                ranks = [k for k in range(n) if k != 1]
            if r in ranks:
                emb(inputs(r, step)).sum().backward()
            opt.synchronize()
            grad = emb.weight.grad
            total = sum(counts(k, step) for k in ranks)
            want = total / n if op == hvd.Average else total
            if grad is None or not grad.is_sparse:
                fail("{} step {}: the reduced gradient is not sparse: {!r}".format(what, step, grad))
            if not torch.allclose(grad.to_dense(), want):
                fail("{} step {}: gradient {} != {}".format(what, step, grad.to_dense(), want))
            with opt.skip_synchronize():
                opt.step()
            if not torch.allclose(emb.weight.detach(), before - want):
                fail("{} step {}: the step did not apply the reduced gradient".format(what, step))
        every = hvd.allgather(emb.weight.detach()[None], name="check {}".format(what))
        if not all(torch.equal(every[0], every[k]) for k in range(n)):
            fail("{}: embeddings differ between ranks".format(what))

# SparseAdam (it takes sparse gradients only), two passes accumulated before each step.
torch.manual_seed(1)
emb = torch.nn.Embedding(ROWS, DIM, sparse=True)
hvd.broadcast_parameters(emb.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1), backward_passes_per_step=2)
for step in range(2):
    opt.zero_grad()
    for p in range(2):
        emb(inputs(r, 2 * step + p)).sum().backward()
    opt.synchronize()
    want = sum(counts(k, 2 * step) + counts(k, 2 * step + 1) for k in range(n)) / (2 * n)
    if not torch.allclose(emb.weight.grad.to_dense(), want):
        fail("two passes: gradient {} != {}".format(emb.weight.grad.to_dense(), want))
    with opt.skip_synchronize():
        opt.step()
every = hvd.allgather(emb.weight.detach()[None], name="check sparse adam")
if not all(torch.equal(every[0], every[k]) for k in range(n)):
    fail("SparseAdam: embeddings differ between ranks")

# Refused: a sparse gradient in a group, and a sparse gradient with Max.
for kwargs, expect in (({"groups": 1}, "grouped allreduce"), ({"op": hvd.Max}, "summed or averaged")):
    emb = torch.nn.Embedding(ROWS, DIM, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0), **kwargs)
    try:
        emb(inputs(r, 0)).sum().backward()
        opt.synchronize()
    except ValueError as e:
        if expect not in str(e):
            fail("{}: unexpected message {}".format(kwargs, e))
    else:
        fail("{}: a sparse gradient was not refused".format(kwargs))

# Parameter groups without named_parameters: unique names, the same on every rank (Horovod's _parameter_names).
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
opt = hvd.DistributedOptimizer(torch.optim.SGD([{"params": model[0].parameters()},
                                                {"params": model[1].parameters()}], lr=0.1))
names = opt._parameter_names
if sorted(map(id, names)) != sorted(id(p) for p in model.parameters()) or len(set(names.values())) != 4:
    fail("_parameter_names: {}".format(names))
if any(x != [names[p] for p in model.parameters()] for x in hvd.allgather_object([names[p] for p in
                                                                                  model.parameters()])):
    fail("_parameter_names differ between ranks")

hvd.shutdown()
print("OK rank {}".format(r))
