"""hvd.torch's per-tensor allreduces through the package's batch (hvd/_batch.py), as numpy arrays go (opt-in: needs
torch): ``allreduce_async_``, small ``allreduce_async`` and DistributedOptimizer's gradient hooks submit CPU tensors
without a library call per tensor; their results equal those of the call per tensor (the batch switched off), in
place; a tensor dropped, or given other memory, while its operation is in flight keeps its memory until the
operation completes, also across ``shutdown()``/``init()`` (every elastic reset); a signal handler that raises
during submissions leaves no lock held. What the batch does not take (large out-of-place tensors, other layouts,
compression, process sets) keeps the call per tensor.
"""
import gc
import os
import sys

import torch
from torch.multiprocessing.reductions import StorageWeakRef

import hvd as core
import support
import hvd.torch as hvd
from hvd import _batch

if os.environ.get("HVD_BATCHED_TIMER") == "off":
    _batch.FLUSH_AFTER = 3600.0  # no timer: every batch goes out with a wait, a poll or another submission
hvd.init()
r, n = hvd.rank(), hvd.size()
flags = os.environ["HVD_BATCHED_DIR"]
gen = torch.Generator().manual_seed(1000 + r)


def fail(message):
    sys.exit("rank {}: {}".format(r, message))


def batched(h, what):
    support.batched(h, what, fail)


def not_batched(h, what):
    if type(h) is _batch.BatchedHandle:
        fail("{} went through the batch".format(what))


def order(count):
    return torch.randperm(count, generator=gen).tolist()


def wait_for(path, what):
    support.wait_for(path, what, fail)


class Unbatched:
    """The call per tensor, as before the batch took torch tensors (allreduce_async out of place, without a copy):
    the reference for results."""

    def __enter__(self):
        self.saved = _batch.allreduce_, hvd._COPY_TO_BATCH
        _batch.allreduce_ = lambda *args: None
        hvd._COPY_TO_BATCH = -1

    def __exit__(self, *exc):
        _batch.allreduce_, hvd._COPY_TO_BATCH = self.saved


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8,
          torch.int8, torch.bool]
SHAPES = [(), (1,), (7,), (3, 4), (2, 3, 5), (1024,)]
OPS = [(hvd.Sum, 1.0, 1.0), (hvd.Sum, 0.5, 2.0), (hvd.Average, 1.0, 1.0), (hvd.Max, 1.0, 1.0), (hvd.Min, 1.0, 1.0)]


def tensors(step, count):
    out = []
    for i in range(count):
        dtype, shape = DTYPES[i % len(DTYPES)], SHAPES[i % len(SHAPES)]
        values = (torch.arange(int(torch.tensor(shape).prod()), dtype=torch.int64) % 5).reshape(shape)
        out.append((values + r + step).to(dtype))
    return out


def op_of(i, dtype):
    # (Integer averages round, and bool tensors reduce as uint8: the point here is that the paths agree.)
    return OPS[i % len(OPS)]


# 1. Many tensors per step, in orders of each rank's own, through allreduce_async_ (in place) and allreduce_async
# (a new tensor), against the call per tensor on the same values.
count = 70
for step in range(4):
    mine, want_in, want_out = tensors(step, count), tensors(step, count), tensors(step, count)
    ptrs = [t.data_ptr() for t in mine]
    with Unbatched():
        refs = {}
        for i in order(count):
            op, pre, post = op_of(i, mine[i].dtype)
            h = hvd.allreduce_async_(want_in[i], op=op, prescale_factor=pre, postscale_factor=post,
                                     name="ref{}.{}".format(step, i))
            not_batched(h, "the reference")
            refs[i] = h
        outs = {}
        for i in order(count):
            op, pre, post = op_of(i, want_out[i].dtype)
            outs[i] = hvd.allreduce_async(want_out[i], op=op, prescale_factor=pre, postscale_factor=post,
                                          name="refout{}.{}".format(step, i))
        for i in order(count):
            not_batched(outs[i], "the reference")
            hvd.synchronize(refs[i])
            want_out[i] = hvd.synchronize(outs[i])
    handles, out_handles = {}, {}
    inputs, fresh = tensors(step, count), tensors(step, count)
    for i in order(count):
        op, pre, post = op_of(i, mine[i].dtype)
        handles[i] = hvd.allreduce_async_(mine[i], op=op, prescale_factor=pre, postscale_factor=post,
                                          name="step{}.{}".format(step, i))
        batched(handles[i], "allreduce_async_ {}".format(i))
        out_handles[i] = hvd.allreduce_async(inputs[i], op=op, prescale_factor=pre, postscale_factor=post,
                                             name="out{}.{}".format(step, i))
        if inputs[i].dtype is torch.bool:
            not_batched(out_handles[i], "allreduce_async of bool {}".format(i))  # (a uint8 result, as when large)
        else:
            batched(out_handles[i], "allreduce_async {}".format(i))
    for i in order(count):
        got = hvd.synchronize(handles[i])
        if mine[i].data_ptr() != ptrs[i] or got.data_ptr() != ptrs[i]:
            fail("step {} tensor {}: the result is not in the tensor's own memory".format(step, i))
        if got.dtype != want_in[i].dtype or not torch.equal(mine[i], want_in[i]):
            fail("step {} tensor {} ({}, {}): got {}, the call per tensor gave {}".format(
                step, i, mine[i].dtype, op_of(i, mine[i].dtype), mine[i], want_in[i]))
        out = hvd.synchronize(out_handles[i])
        if out.data_ptr() == inputs[i].data_ptr() or not torch.equal(inputs[i], fresh[i]):
            fail("allreduce_async {} wrote into its input".format(i))
        if out.dtype != want_out[i].dtype or out.shape != want_out[i].shape or not torch.equal(out, want_out[i]):
            fail("allreduce_async {}: got {}, the call per tensor gave {}".format(i, out, want_out[i]))
        if hvd.synchronize(handles[i]) is not got or not hvd.poll(handles[i]):
            fail("a second synchronize or poll of tensor {}".format(i))
# A bool tensor's out-of-place allreduce: uint8 (the ranks' Trues counted) whatever its size, never a bool tensor
# holding bytes above 1; a lazily negated view is reduced by its values whatever its size.
for size in (4, (1 << 16) + 1):
    got = hvd.allreduce(torch.ones(size, dtype=torch.bool), op=hvd.Sum, name="bool.{}".format(size))
    if got.dtype != torch.uint8 or not torch.equal(got, torch.full((size,), n, dtype=torch.uint8)):
        fail("bool allreduce of {} elements: {} {}".format(size, got.dtype, got[:4]))
    view = torch._neg_view(torch.ones(size))  # (lazily negated: is_neg())
    got = hvd.allreduce(view, op=hvd.Sum, name="neg.{}".format(size))
    if not torch.equal(got, torch.full((size,), -float(n))):
        fail("negated view of {} elements: {}".format(size, got[:4]))
# The exact values, for the plain sums.
x = torch.arange(6, dtype=torch.float32) + r
hvd.synchronize(hvd.allreduce_async_(x, op=hvd.Sum, name="exact"))
if not torch.equal(x, torch.arange(6, dtype=torch.float32) * n + sum(range(n))):
    fail("exact sum: {}".format(x))

# 2. What the batch does not take keeps the call per tensor, with its results and errors.
big = torch.full((1 << 15,), float(r))  # 128 KiB: out of place without a copy
h = hvd.allreduce_async(big, op=hvd.Sum, name="big")
not_batched(h, "a 128 KiB allreduce_async")
if not torch.equal(hvd.synchronize(h), torch.full((1 << 15,), float(sum(range(n))))):
    fail("big")
strided = torch.arange(12, dtype=torch.float32).reshape(3, 4).t() + r  # not contiguous: copied, then batched
assert not strided.is_contiguous()
h = hvd.allreduce_async(strided, op=hvd.Sum, name="strided")
batched(h, "a non-contiguous allreduce_async")
if not torch.equal(hvd.synchronize(h), torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * n + sum(range(n))):
    fail("strided")
try:
    hvd.allreduce_async_(strided, name="strided.inplace")
    fail("an in-place allreduce of a non-contiguous tensor was accepted")
except ValueError:
    pass
half = hvd.allreduce_async(torch.full((3,), float(r)), op=hvd.Sum, name="fp16", compression=hvd.Compression.fp16)
not_batched(half, "a compressed allreduce_async")
got = hvd.synchronize(half)
if got.dtype != torch.float32 or not torch.equal(got, torch.full((3,), float(sum(range(n))))):
    fail("fp16: {}".format(got))
grad = torch.ones(4, requires_grad=True)
h = hvd.allreduce_async_(grad, op=hvd.Sum, name="requires_grad")  # hvd.torch detaches it: batched
batched(h, "a tensor that requires grad")
hvd.synchronize(h)
if not torch.equal(grad.detach(), torch.full((4,), float(n))):
    fail("requires_grad: {}".format(grad))
try:
    core.allreduce_async_(torch.ones(2, requires_grad=True), name="core.requires_grad")
    fail("hvd.allreduce_async_ of a tensor that requires grad was accepted")
except (TypeError, ValueError, RuntimeError, BufferError):
    pass  # refused, as before the batch
sixteen = torch.ones(2, dtype=torch.int16)
try:
    hvd.allreduce_async_(sixteen, name="int16")
    fail("an int16 tensor was accepted")
except (TypeError, ValueError):
    pass
neg = torch.ones(2)._neg_view()
try:
    core.allreduce_async_(neg, name="neg")
    fail("a lazily negated view was accepted")
except ValueError:
    pass
empty = torch.ones(0)
h = hvd.allreduce_async_(empty, name="empty")
not_batched(h, "an empty tensor")
hvd.synchronize(h)

# 3. DistributedOptimizer: its gradient hooks submit through the batch, and training gives what the call per
# tensor gives (the same start, the same data; every rank's parameters identical).
def train(use_batch):
    torch.manual_seed(77)  # the same start on every rank and in both runs
    model = torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(12)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    data = torch.Generator().manual_seed(5 + r)
    for step in range(6):
        x = torch.randn(8, 6, generator=data)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        kinds = {type(h) for h, _, _ in (v[1] for v in opt._handles.values())}
        if use_batch and kinds != {_batch.BatchedHandle}:
            fail("DistributedOptimizer's gradients went {} (want the batch)".format(kinds))
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = hvd.allgather(flat[None, :], name="params.{}".format(use_batch))
    for k in range(n):
        if not torch.equal(every[0], every[k]):
            fail("parameters of rank {} differ from rank 0's".format(k))
    return flat


batched_params = train(True)
with Unbatched():
    reference = train(False)
if not torch.allclose(batched_params, reference, rtol=1e-5, atol=1e-6):
    fail("training through the batch differs from the call per tensor: {}".format(
        (batched_params - reference).abs().max()))


# 4. A tensor dropped while its operation is in flight (the other ranks submit it only later) keeps its memory
# until the operation completes, and lets it go after that; so does one given other memory (`set_`), whose new
# memory the operation leaves alone.
def release_ticks(refs, tag):
    support.release_ticks(hvd, lambda: torch.ones(1), lambda: all(ref.expired() for ref in refs), tag, fail)


if r == 0:
    x, y, z = torch.full((256,), 1.0), torch.full((3,), 2.0), torch.full((4,), 3.0)
    hx = hvd.allreduce_async_(x, op=hvd.Sum, name="alive.x")
    hy = core.allreduce_async_(y, op=hvd.Sum, name="alive.y")  # (hvd's own entry takes torch tensors too)
    hz = hvd.allreduce_async_(z, op=hvd.Sum, name="alive.z")
    for h in (hx, hy, hz):
        batched(h, "alive")
    refs = [StorageWeakRef(t.untyped_storage()) for t in (x, y, z)]
    del x, hx, hz, h
    y.set_(torch.zeros(5))  # the tensors now have other memory; the operations still write the old
    z.set_(torch.zeros(6))
    if hvd.poll(hy):  # (sends the batch)
        fail("alive.y completed before the other ranks submitted it")
    gc.collect()
    if any(ref.expired() for ref in refs):
        fail("the memory of an operation in flight was freed (dropped, set_, set_ and dropped): {}".format(
            [ref.expired() for ref in refs]))
    open(os.path.join(flags, "alive"), "w").close()
    if hvd.synchronize(hy) is not y or not torch.equal(y, torch.zeros(5)):
        fail("set_ while in flight: the operation wrote into the tensor's new memory: {}".format(y))
    del hy  # the batch goes, alive.z still in flight: its old memory must stay with the orphans
    gc.collect()
    if refs[2].expired():
        fail("the old memory of a tensor given other memory was freed with its batch, its operation in flight")
    open(os.path.join(flags, "dropped"), "w").close()
else:
    wait_for(os.path.join(flags, "alive"), "rank 0's in-flight tensors")
    hvd.allreduce_(torch.full((256,), 1.0), op=hvd.Sum, name="alive.x")
    hvd.allreduce_(torch.full((3,), 2.0), op=hvd.Sum, name="alive.y")
    wait_for(os.path.join(flags, "dropped"), "rank 0's dropped batch")
    hvd.allreduce_(torch.full((4,), 3.0), op=hvd.Sum, name="alive.z")
    refs = []
release_ticks(refs, "alive")

# 4b. A storage given another buffer while its operation is in flight (resize_ to a larger size, storage.resize_,
# share_memory_ free the old buffer, which the batch, keeping the storage object, cannot keep): synchronize raises,
# naming the tensor, instead of returning a tensor that never got the result; every synchronize of it says so, and
# the others of its batch are unaffected. (Resized here only once the operation completed: the library never writes
# freed memory in this test.) Both waits: one that an earlier wait of its batch released, and its own.
a, b = torch.full((4,), float(r)), torch.full((4,), float(r))
ha = hvd.allreduce_async_(a, op=hvd.Sum, name="resized.a")
hb = hvd.allreduce_async_(b, op=hvd.Sum, name="resized.b")
batched(hb, "resized.b")
while not hvd.poll(hb):
    pass
hvd.synchronize(ha)  # releases resized.b, completed, with it
c = torch.full((4,), float(r))
hc = hvd.allreduce_async_(c, op=hvd.Sum, name="resized.c")
batched(hc, "resized.c")
while not hvd.poll(hc):
    pass
b.resize_(1 << 16)
c.untyped_storage().resize_(0)
for h, what in ((hb, "resized.b"), (hc, "resized.c"), (hb, "resized.b"), (hc, "resized.c")):
    try:
        hvd.synchronize(h)
        fail("{}: a storage given another buffer while in flight was not reported".format(what))
    except core.HvdError as e:
        if what not in str(e) or "resize_" not in str(e):
            fail("{}: unclear error: {}".format(what, e))
if not torch.equal(a, torch.full((4,), float(sum(range(n))))):
    fail("resized.a: {}".format(a))

# 5. Across hvd.shutdown() and hvd.init() (every elastic reset): an operation in flight whose tensor was dropped
# keeps its memory until the reset, and the first send after it lets it go (the library no longer knows the
# handle); the batch works on the new engine.
if r == 0:
    x = torch.ones(3)
    hx = hvd.allreduce_async_(x, op=hvd.Sum, name="reset.x")
    batched(hx, "reset.x")
    if hvd.poll(hx):
        fail("reset.x completed before the other ranks submitted it")
    dropped = StorageWeakRef(x.untyped_storage())
    del x, hx
    gc.collect()
    if dropped.expired():
        fail("the memory of an operation in flight was freed with its handle")
    open(os.path.join(flags, "reset"), "w").close()
else:
    wait_for(os.path.join(flags, "reset"), "rank 0's reset.x")
    hvd.allreduce_(torch.ones(3), op=hvd.Sum, name="reset.x")
hvd.barrier()
hvd.shutdown()
hvd.init()
after = torch.full((2,), float(r))
h = hvd.allreduce_async_(after, op=hvd.Sum, name="reset.after")
batched(h, "after init")
hvd.synchronize(h)
gc.collect()
if r == 0 and not dropped.expired():
    fail("a dropped operation from before hvd.shutdown()/hvd.init() still holds its memory")
if not torch.equal(after, torch.full((2,), float(sum(range(n))))):
    fail("after init: {}".format(after))


# 6. A signal handler that raises while this rank submits (Ctrl-C's KeyboardInterrupt, hvd.elastic's SIGTERM
# handler's SystemExit) never leaves the batch's lock held: the submissions after it, and shutdown's send of the
# open batch below, would wait for it forever (the harness then kills the ranks and the test fails). The handler
# raises only in hvd's own code (hvd.torch's and the batch's), 2000 times. One name per rank: the first request is
# in flight until shutdown (the other ranks, leaving, join it), the others are refused as duplicates.
sig = torch.ones(1)
submitted = support.interrupted_submissions(
    lambda: hvd.allreduce_async_(sig, op=hvd.Sum, name="sig.{}".format(r)))
if submitted < 100:  # (the loop did submit: a lock left held makes the next submission block until interrupted)
    fail("only {} submissions between 2000 interrupts".format(submitted))

hvd.shutdown()
try:
    hvd.allreduce_async_(torch.ones(2), name="after.shutdown")
    fail("an allreduce_async_ after shutdown was accepted")
except core.NotInitializedError:
    pass
print("ok torch_batched rank {}".format(r))
