"""hvd.torch end to end (opt-in: needs torch): a data-parallel model trained with DistributedOptimizer (gradient
hooks, backward_passes_per_step, fp16 compression); broadcast_parameters, broadcast_optimizer_state,
broadcast_object, allgather_object; DLPack zero-copy inputs. Parameters are identical on every rank after every
step."""
import itertools
import sys
import warnings

import torch

import hvd.torch as hvd


def fail(message):
    print("rank {}: {}".format(hvd.rank(), message), file=sys.stderr)
    sys.exit(1)


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def assert_identical(model, what):
    flat = flat_params(model)
    every = hvd.allgather(flat[None, :], name="check." + what)
    if not isinstance(every, torch.Tensor):
        fail("allgather of a torch tensor returned {}".format(type(every)))
    for k in range(hvd.size()):
        if not torch.equal(every[0], every[k]):
            fail("{}: parameters of rank {} differ from rank 0".format(what, k))


hvd.init()
r, n = hvd.rank(), hvd.size()

# Objects.
obj = hvd.broadcast_object({"epoch": 3, "rank": r} if r == 0 else None, root_rank=0)
if obj != {"epoch": 3, "rank": 0}:
    fail("broadcast_object: {}".format(obj))
gathered = hvd.allgather_object(("rank", r, "x" * r))
if gathered != [("rank", k, "x" * k) for k in range(n)]:
    fail("allgather_object: {}".format(gathered))

# DLPack zero-copy: in-place ops write straight into the tensor's memory.
t = torch.full((4, 3), float(r + 1))
ptr = t.data_ptr()
hvd.allreduce_(t, op=hvd.Sum, name="inplace")
if t.data_ptr() != ptr or not torch.equal(t, torch.full((4, 3), float(n * (n + 1) / 2))):
    fail("allreduce_ in place: {}".format(t))
b = torch.arange(5, dtype=torch.int64) * (r + 1)
hvd.broadcast_(b, root_rank=n - 1, name="bcast")
if not torch.equal(b, torch.arange(5) * n):
    fail("broadcast_: {}".format(b))
# (6 elements go through the batch in a copy; 70000, above 64 KiB, take the per-call out-of-place path.)
for dtype, size in itertools.product(
        (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8,
         torch.int8), (6, 70000)):
    x = (torch.arange(size) % 7 + r).to(dtype)
    got = hvd.allreduce(x, op=hvd.Sum, name="dtype.{}.{}".format(dtype, size))
    want = sum((torch.arange(size) % 7 + k).to(dtype) for k in range(n)).to(dtype)
    if not isinstance(got, torch.Tensor) or got.dtype != dtype or not torch.equal(got, want):
        fail("allreduce {}: got {!r}, want {!r}".format(dtype, got, want))
avg = hvd.allreduce(torch.full((2,), float(r)), name="avg")
if not torch.allclose(avg, torch.full((2,), (n - 1) / 2)):
    fail("average: {}".format(avg))
g = hvd.allgather(torch.full((r + 1, 2), float(r)), name="gather")
if g.shape != (n * (n + 1) // 2, 2):
    fail("allgather shape {}".format(g.shape))
grouped = hvd.grouped_allreduce([torch.ones(3), torch.ones(2, dtype=torch.float64)], op=hvd.Sum, name="grp")
if not (torch.equal(grouped[0], torch.full((3,), float(n))) and grouped[1].dtype == torch.float64):
    fail("grouped_allreduce: {}".format(grouped))
half = hvd.allreduce(torch.full((3,), 0.5 * (r + 1)), op=hvd.Sum, name="fp16", compression=hvd.Compression.fp16)
if half.dtype != torch.float32 or not torch.allclose(half, torch.full((3,), 0.5 * n * (n + 1) / 2)):
    fail("fp16 compression: {!r}".format(half))

# Training: every rank starts from different parameters and its own data.
torch.manual_seed(1234 + r)
true_w = torch.arange(1.0, 9.0)
x = torch.randn(64, 8)
y = (x @ true_w)[:, None] + 0.01 * torch.randn(64, 1)

# In-place grouped allreduce of torch tensors.
ga, gb = torch.full((3,), float(r)), torch.full((2, 2), 1.0, dtype=torch.float64)
pa = ga.data_ptr()
out = hvd.synchronize(hvd.grouped_allreduce_async_([ga, gb], op=hvd.Sum, name="grp_"))
if ga.data_ptr() != pa or not torch.equal(ga, torch.full((3,), float(n * (n - 1) / 2))) or out[1] is not gb \
        or not torch.equal(gb, torch.full((2, 2), float(n), dtype=torch.float64)):
    fail("grouped_allreduce_async_: {} {}".format(ga, gb))

# groups: bad values are refused with a clear error.
probe = torch.nn.Linear(2, 1)
for bad in (0, -1, True, "2", [probe.weight], [[torch.zeros(1)]], [[probe.weight], [probe.weight]]):
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(probe.parameters(), lr=0.1), groups=bad)
    except ValueError:
        pass
    else:
        fail("groups={!r} was accepted".format(bad))

for compression, passes, groups in ((hvd.Compression.none, 1, None), (hvd.Compression.fp16, 1, None),
                                    (hvd.Compression.none, 2, None), (hvd.Compression.none, 1, 2),
                                    (hvd.Compression.fp16, 2, 1), (hvd.Compression.none, 1, "list")):
    tag = "{}.{}.{}".format(compression.__name__, passes, groups)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    if groups == "list":
        # The first layer's weight and the last layer as groups; the first layer's bias on its own.
        groups = [[model[0].weight], [model[2].weight, model[2].bias]]
    base = torch.optim.Adam(model.parameters(), lr=0.05)
    # Give rank 0's optimizer some state that the others lack, so broadcasting it matters.
    if r == 0:
        model(x).sum().backward()
        base.step()
        base.zero_grad()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(base, root_rank=0)
    assert_identical(model, tag + ".start")
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=compression,
                                   backward_passes_per_step=passes, groups=groups)
    if r != 0 and not opt.state_dict()["state"]:
        fail("broadcast_optimizer_state left rank {} without state".format(r))
    first = None
    for step in range(12):
        opt.zero_grad()
        for k in range(passes):
            part = slice(k * 32 // passes, (k + 1) * 32 // passes + 32 * (passes == 1))
            loss = torch.nn.functional.mse_loss(model(x[part]), y[part])
            loss.backward()
        opt.step()
        first = loss.item() if first is None else first
        assert_identical(model, "{}.step{}".format(tag, step))
    before, after = hvd.allreduce(torch.tensor([first, loss.item()], dtype=torch.float64), name="loss." + tag)
    if not after < before:
        fail("{}: the mean loss over ranks did not decrease ({} -> {})".format(tag, before, after))

# synchronize() then step() (or synchronize() twice) reduces once; skip_synchronize() as in Horovod; a frozen
# parameter in a group is left out.
for groups in (None, 1, "frozen"):
    w, v = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    frozen = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    if groups == "frozen":
        groups = [[w, frozen, v]]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w, v, frozen], lr=1.0), op=hvd.Sum, groups=groups)
    for step in range(2):
        opt.zero_grad()
        ((w * (r + 1)).sum() + (v * 2.0).sum()).backward()
        opt.synchronize()
        opt.synchronize()
        want_w, want_v = torch.full((3,), float(n * (n + 1) / 2)), torch.full((2,), 2.0 * n)
        if not (torch.equal(w.grad, want_w) and torch.equal(v.grad, want_v)):
            fail("groups={}: synchronize twice gave {} {}".format(groups, w.grad, v.grad))
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            if step == 0:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()  # Horovod's warning, and no second reduction
        said = [str(x.message) for x in ws if "skip_synchronize" in str(x.message)]
        if len(said) != step:
            fail("groups={}: step {} after synchronize warned {}".format(groups, step, said))
        if not torch.equal(w.detach(), -want_w * (step + 1)) or frozen.grad is not None:
            fail("groups={}: step {} after synchronize: {} {}".format(groups, step, w, frozen.grad))

# A backward pass more than backward_passes_per_step is refused at once (the gradient is being allreduced).
for groups in (None, 1):
    w = torch.nn.Parameter(torch.zeros(3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=0.1), backward_passes_per_step=2, groups=groups)
    for k in range(3):
        try:
            (w * 2.0).sum().backward()
        except AssertionError:
            if k != 2:
                fail("groups={}: pass {} of 2 refused".format(groups, k + 1))
        else:
            if k == 2:
                fail("groups={}: a third backward pass with backward_passes_per_step=2 was accepted".format(groups))
    opt.step()


# A lazily negated view (its memory holds the values un-negated) is refused in place; out of place it is resolved
# and reduced, at any size (torch_batched.py checks one above 64 KiB).
try:
    hvd.allreduce_(torch._neg_view(torch.ones(3)), name="neg")
except ValueError as e:
    if "resolve_neg" not in str(e):
        fail("negated view: {}".format(e))
else:
    fail("a lazily negated view was accepted in place")
neg = hvd.allreduce(torch._neg_view(torch.ones(3)), op=hvd.Sum, name="neg.copy")
if not torch.equal(neg, torch.full((3,), -float(n))):
    fail("out-of-place allreduce of a negated view: {}".format(neg))

# A layer that only some ranks use in a step (a data-dependent branch): the ranks without its gradient allreduce
# zeros in step(), as in Horovod, instead of leaving the others waiting; per gradient and grouped.
for groups in (None, 2):
    torch.manual_seed(99)
    trunk, branch = torch.nn.Linear(8, 4), torch.nn.Linear(4, 1)
    head = torch.nn.Linear(4, 1)
    params = list(trunk.parameters()) + list(branch.parameters()) + list(head.parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.01), groups=groups)
    for step in range(4):
        opt.zero_grad()
        h = trunk(x[:16])
        out = branch(h) if (step + r) % 2 == 0 else head(h)
        torch.nn.functional.mse_loss(out, y[:16]).backward()
        opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        every = hvd.allgather(flat[None, :], name="branch.{}.{}".format(groups, step))
        if not all(torch.equal(every[0], every[k]) for k in range(n)):
            fail("groups={}: parameters differ after step {} with a branch taken on some ranks".format(groups, step))

hvd.shutdown()
print("ok torch rank {} loss {:.4f}".format(r, loss.item()))
