"""Per-tensor ``allreduce_async_`` through the Python-side batch (hvd/_batch.py): ranks submit and wait in orders of
their own, send their batches at different points, wait, poll or do nothing at all; every handle completes with the
right data, and an error reaches the handle of its tensor only.

``HVD_BATCHED_TIMER=off``: the timer thread never sends a batch, so every case but the lone operation (skipped
then) must complete through the sends that waiting, polling and submitting make; with the timer on, the lone
operation must complete through it.
"""
import dis
import gc
import os
import signal
import sys
import time
import weakref

import numpy as np

import hvd
import support
from hvd import _batch

timer = os.environ.get("HVD_BATCHED_TIMER", "on") == "on"
if not timer:
    _batch.FLUSH_AFTER = 3600.0  # before the first batch starts the timer thread
hvd.init()
r, n = hvd.rank(), hvd.size()
rng = np.random.default_rng(1000 + r)


def check(got, want, what):
    if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
        sys.exit("rank {}: {}: got {!r}, want {!r}".format(r, what, got, want))


def fail(message):
    sys.exit("rank {}: {}".format(r, message))


def batched(h, what):
    support.batched(h, what, fail)


DTYPES = [np.float32, np.float64, np.int32, np.int64, np.float16, np.uint8]
SHAPES = [(), (1,), (7,), (3, 4), (2, 3, 5), (1024,)]
for dtype in DTYPES:
    np.ones(1, dtype).sum()
    # A dtype's first array takes the per-call path, which teaches the package its code; then it is batched.
    hvd.allreduce_(np.ones(1, dtype), op=hvd.Sum, name="warm.{}".format(np.dtype(dtype).name))

# 1. Many tensors per step, submitted in an order of each rank's own and waited in another.
count = 48
for step in range(5):
    arrays, want = {}, {}
    for i in range(count):
        dtype, shape = DTYPES[i % len(DTYPES)], SHAPES[i % len(SHAPES)]
        values = (np.arange(int(np.prod(shape)), dtype=np.int64) % 5).reshape(shape)
        arrays[i] = np.array(values + r + step, dtype)  # (np.array: a 0-d array stays an array)
        want[i] = np.array(values * n + sum(range(n)) + step * n, dtype)
    handles = {}
    for i in rng.permutation(count):
        handles[i] = hvd.allreduce_async_(arrays[i], op=hvd.Sum, name="step{}.t{}".format(step, i))
        batched(handles[i], "tensor {}".format(i))
    for i in rng.permutation(count):
        got = hvd.synchronize(handles[i])
        assert got is arrays[i]
        check(got, want[i], "step {} tensor {}".format(step, i))
        assert hvd.synchronize(handles[i]) is got and hvd.poll(handles[i])

# 2. Batches sent at different points on every rank: rank 0 waits for each tensor right after submitting it (a
# batch of one each), the last rank submits everything first and waits last, the others poll.
xs = [np.full(5, r + i, np.float32) for i in range(30)]
if r == 0:
    for i, x in enumerate(xs):
        hvd.synchronize(hvd.allreduce_async_(x, op=hvd.Sum, name="points.{}".format(i)))
elif r == n - 1:
    hs = [hvd.allreduce_async_(x, op=hvd.Sum, name="points.{}".format(i)) for i, x in enumerate(xs)]
    for h in reversed(hs):
        hvd.synchronize(h)
else:
    hs = [hvd.allreduce_async_(x, op=hvd.Sum, name="points.{}".format(i)) for i, x in enumerate(xs)]
    while not all(hvd.poll(h) for h in hs):
        pass
for i, x in enumerate(xs):
    check(x, np.full(5, sum(range(n)) + i * n, np.float32), "points {}".format(i))

# 3. Another rank waits for a tensor before it submits the one this rank blocks in: the batch must go out before
# this rank blocks in an operation that does not go through the batch (out of place, a broadcast, a barrier).
a, b = np.full(3, r, np.float64), np.full(3, 10 * r, np.float64)
if r == 0:
    ha = hvd.allreduce_async_(a, op=hvd.Sum, name="dep.a")
    batched(ha, "dep.a")
    b = hvd.allreduce(b, op=hvd.Sum, name="dep.b")
    hb = hvd.allreduce_async_(b, op=hvd.Sum, name="dep.c")
    hvd.broadcast_(np.zeros(1), root_rank=n - 1, name="dep.d")
    hvd.barrier()
    hvd.synchronize(ha)
    hvd.synchronize(hb)
else:
    hvd.allreduce_(a, op=hvd.Sum, name="dep.a")
    b = hvd.allreduce(b, op=hvd.Sum, name="dep.b")
    hvd.allreduce_(b, op=hvd.Sum, name="dep.c")
    hvd.broadcast_(np.zeros(1), root_rank=n - 1, name="dep.d")
    hvd.barrier()
check(a, np.full(3, sum(range(n)), np.float64), "dep.a")
check(b, np.full(3, 10 * sum(range(n)) * n, np.float64), "dep.c")

# 4. A lone operation and nothing else: rank 0 submits and then waits outside hvd until every other rank has
# received the result (which needs rank 0's request): only the timer can send rank 0's batch.
flag = os.path.join(os.environ["HVD_BATCHED_DIR"], "lone.{}")
lone = np.full(4, r + 1, np.int32)
if not timer:
    lone[:] = n * (n + 1) // 2
elif r == 0:
    h = hvd.allreduce_async_(lone, op=hvd.Sum, name="lone")
    batched(h, "lone")
    deadline = time.monotonic() + 30
    while not all(os.path.exists(flag.format(k)) for k in range(1, n)):
        if time.monotonic() > deadline:
            sys.exit("rank 0: the other ranks never got the lone allreduce (the batch was not sent)")
        time.sleep(0.01)
    hvd.synchronize(h)
else:
    hvd.allreduce_(lone, op=hvd.Sum, name="lone")
    open(flag.format(r), "w").close()
check(lone, np.full(4, n * (n + 1) // 2, np.int32), "lone")

# 5. Errors reach their own handle: tensor 3's shape differs on the last rank (a mismatch on every rank), tensor 6's
# name is taken by tensor 5 of the same batch (refused where it is submitted twice: without the timer, the batch
# cannot be sent between the two); the others are reduced.
ys = [np.full(3 if (i == 3 and r == n - 1) else 2, r + i, np.float32) for i in range(8)]
names = ["err.{}".format(5 if i == 6 and not timer else i) for i in range(8)]
hs = [hvd.allreduce_async_(y, op=hvd.Sum, name=name) for y, name in zip(ys, names)]
for i in rng.permutation(8):
    try:
        hvd.synchronize(hs[i])
    except hvd.MismatchError as e:
        if i != 3:
            sys.exit("rank {}: tensor {} got tensor 3's mismatch: {}".format(r, i, e))
    except hvd.InvalidArgumentError as e:
        if i != 6 or timer or "err.5" not in str(e):
            sys.exit("rank {}: tensor {} got the duplicate name's error: {}".format(r, i, e))
    else:
        if i == 3 or i == 6 and not timer:
            sys.exit("rank {}: tensor {} should have failed".format(r, i))
        check(ys[i], np.full(2, sum(range(n)) + i * n, np.float32), "err {}".format(i))

# 6. Dropped handles: their arrays stay alive until the operations complete; later operations are not disturbed.
for i in range(10):
    hvd.allreduce_async_(np.full(100, r, np.float32), op=hvd.Sum, name="dropped.{}".format(i))
gc.collect()
hvd.barrier()
check(hvd.allreduce(np.ones(2, np.float32), op=hvd.Sum, name="after.drop"), np.full(2, n, np.float32), "after")

# 7. Unnamed, batched: the library names them in submission order on every rank.
zs = [np.full(2, r, np.int64) for _ in range(6)]
for h in [hvd.allreduce_async_(z, op=hvd.Sum) for z in zs]:
    hvd.synchronize(h)
for z in zs:
    check(z, np.full(2, sum(range(n)), np.int64), "unnamed")

# 8. The batch, not each handle, keeps the arrays alive: once every handle of a sent batch is gone, the array of an
# operation still in flight (the other ranks submit it only later) stays alive until it completes, and is let go
# after that (a later send releases it).
flag = os.path.join(os.environ["HVD_BATCHED_DIR"], "alive.{}")
if r == 0:
    a, x = np.full(3, 1.0, np.float32), np.full(3, 1.0, np.float32)
    ha = hvd.allreduce_async_(a, op=hvd.Sum, name="alive.a")
    hx = hvd.allreduce_async_(x, op=hvd.Sum, name="alive.x")
    batched(hx, "alive.x")
    alive = weakref.ref(x)
    del x, hx
    hvd.synchronize(ha)  # sends the batch; alive.x cannot complete yet
    del ha
    gc.collect()
    if alive() is None:
        sys.exit("rank 0: the array of an operation in flight was freed with its batch's handles")
    open(flag.format(0), "w").close()
else:
    hvd.allreduce_(np.full(3, 1.0, np.float32), op=hvd.Sum, name="alive.a")
    support.wait_for(flag.format(0), "rank 0's check of its in-flight array", fail, 30)
    hvd.allreduce_(np.full(3, 1.0, np.float32), op=hvd.Sum, name="alive.x")
support.release_ticks(hvd, lambda: np.ones(1, np.float32), lambda: alive() is None, "alive", fail)

# 9. An op that is not an int (1.0 == hvd.Average) is not batched: the usual path refuses it at the call, and the
# batch that it would have joined goes out whole (it used to join it and fail the whole batch's send).
good = np.full(2, r, np.float32)
hg = hvd.allreduce_async_(good, op=hvd.Sum, name="floatop.good")
batched(hg, "floatop.good")
try:
    h = hvd.allreduce_async_(np.ones(2, np.float32), op=float(hvd.Average), name="floatop.bad")
    sys.exit("rank {}: op=1.0 was accepted: {!r}".format(r, h))
except (TypeError, ValueError):
    pass
hvd.synchronize(hg)
check(good, np.full(2, sum(range(n)), np.float32), "floatop.good")

# 10. A dropped batch whose operation is in flight across hvd.shutdown() and hvd.init() (every elastic reset): the
# library refuses the old handle afterwards (the operation went with the old engine), so the next send lets its
# array go instead of keeping it and polling the handle on every send forever.
flag = os.path.join(os.environ["HVD_BATCHED_DIR"], "reset.{}")
if r == 0:
    x = np.ones(3, np.float32)
    hx = hvd.allreduce_async_(x, op=hvd.Sum, name="reset.x")
    batched(hx, "reset.x")
    if hvd.poll(hx):  # (sends the batch)
        sys.exit("rank 0: reset.x completed before the other ranks submitted it")
    alive = weakref.ref(x)
    del x, hx
    gc.collect()
    if alive() is None:
        sys.exit("rank 0: the array of an operation in flight was freed with its batch's handles")
    open(flag.format(0), "w").close()
else:
    support.wait_for(flag.format(0), "rank 0's reset.x", fail, 30)
    hvd.allreduce_(np.ones(3, np.float32), op=hvd.Sum, name="reset.x")
hvd.barrier()
hvd.shutdown()
hvd.init()
hvd.synchronize(hvd.allreduce_async_(np.ones(1, np.float32), op=hvd.Sum, name="reset.tick"))
gc.collect()
if r == 0 and alive() is not None:
    sys.exit("rank 0: a dropped operation from before hvd.shutdown()/hvd.init() still holds its array")


# 12. Batches and handles dropped while a signal handler raises (Ctrl-C's KeyboardInterrupt): the arrays of their
# operations in flight (the other ranks submit them only later) stay alive until the operations complete, and every
# exception the handler raises reaches this code. A finalizer (``__del__``, ``weakref.finalize``) interrupted by the
# handler had its exception swallowed ("Exception ignored in") and its batch's arrays freed while the library could
# write them.
flag = os.path.join(os.environ["HVD_BATCHED_DIR"], "dropsig.{}")
ROUNDS, PER = 60, 50
if r == 0:
    dropping, raised, caught = [False], [0], 0

    def interrupt_drop(signum, frame):
        if dropping[0]:
            raised[0] += 1
            raise KeyboardInterrupt()

    refs = []
    signal.signal(signal.SIGALRM, interrupt_drop)
    signal.setitimer(signal.ITIMER_REAL, 0.00005, 0.00005)
    for k in range(ROUNDS):
        xs = [np.full(3, 1.0, np.float32) for _ in range(PER)]
        refs += [weakref.ref(x) for x in xs]
        hs = [hvd.allreduce_async_(x, op=hvd.Sum, name="dropsig.{}.{}".format(k, i)) for i, x in enumerate(xs)]
        batched(hs[-1], "dropsig")
        hvd.poll(hs[0])  # sends the batch
        # And handles of the per-call path (out of place: the library reads the input and writes a new array).
        ys = [np.full(3, 1.0, np.float32) for _ in range(5)]
        refs += [weakref.ref(y) for y in ys]
        hs += [hvd.allreduce_async(y, op=hvd.Sum, name="dropsig.out.{}.{}".format(k, i)) for i, y in enumerate(ys)]
        del xs, ys
        try:
            dropping[0] = True
            del hs
            dropping[0] = False
        except KeyboardInterrupt:
            dropping[0] = False
            caught += 1
        hs = None
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    gc.collect()
    freed = sum(ref() is None for ref in refs)
    if freed:
        sys.exit("rank 0: {} arrays of operations in flight were freed with their dropped batches".format(freed))
    if caught != raised[0]:
        sys.exit("rank 0: {} of {} KeyboardInterrupts raised while batches were dropped were swallowed".format(
            raised[0] - caught, raised[0]))
    print("rank 0: {} interrupts while dropping, none lost".format(raised[0]))
    open(flag.format(0), "w").close()
else:
    support.wait_for(flag.format(0), "rank 0's end of the drops", fail, 60)
    hs = [hvd.allreduce_async_(np.full(3, 1.0, np.float32), op=hvd.Sum, name="dropsig.{}.{}".format(k, i))
          for k in range(ROUNDS) for i in range(PER)]
    hs += [hvd.allreduce_async(np.full(3, 1.0, np.float32), op=hvd.Sum, name="dropsig.out.{}.{}".format(k, i))
           for k in range(ROUNDS) for i in range(5)]
    for h in hs:
        hvd.synchronize(h)
    hs = None
support.release_ticks(hvd, lambda: np.ones(1, np.float32), lambda: all(ref() is None for ref in refs), "dropsig",
                      fail)


# 13. A surviving handle keeps its own array only: once synchronized, the batch lets go of each index's array (a
# batch holds up to 1024 of them).
xs = [np.full(2, r, np.float32) for _ in range(3)]
hs = [hvd.allreduce_async_(x, op=hvd.Sum, name="keep.{}".format(i)) for i, x in enumerate(xs)]
batched(hs[2], "keep")
for h in hs:
    hvd.synchronize(h)
kept = [weakref.ref(x) for x in xs]
last = hs[2]
del hs, xs, h
gc.collect()
if kept[0]() is not None or kept[1]() is not None or kept[2]() is None:
    fail("a surviving handle keeps its batch's other arrays: {}".format([k() is not None for k in kept]))
check(hvd.synchronize(last), np.full(2, sum(range(n)), np.float32), "keep.2")
del last

# 14. A child forked after hvd.init() (a DataLoader worker) has none of the engine: a submission there raises an
# HvdError naming the fork instead of waiting forever (SIGALRM's default action kills it if it hangs); the topology
# still reads, and the child's exit runs no shutdown.
child = os.fork()
if child == 0:
    signal.alarm(20)
    code = 0
    try:
        if hvd.rank() != r:
            code = 3
        hvd.allreduce_async_(np.ones(2, np.float32), op=hvd.Sum, name="forked")
        code = 4
    except hvd.HvdError as e:
        if "fork" not in str(e):
            code = 5
    except BaseException:
        code = 6
    try:
        hvd.allreduce(np.ones(2, np.float32), op=hvd.Sum, name="forked.out")
        code = code or 7
    except hvd.HvdError as e:
        if "fork" not in str(e):
            code = code or 8
    hvd.shutdown()  # (a no-op here)
    os._exit(code)
_, status = os.waitpid(child, 0)
if status != 0:
    sys.exit("rank {}: the forked child's submission did not raise the fork's error (status {:#x})".format(r, status))
check(hvd.allreduce(np.ones(2, np.float32), op=hvd.Sum, name="after.fork"), np.full(2, n, np.float32), "after.fork")

# 15. Per-call submissions (out of place: hvd.allreduce_async) interrupted by a signal handler that raises (Ctrl-C's
# KeyboardInterrupt, hvd.elastic's SIGTERM SystemExit) right after the library call returned, before its handle
# existed: the arrays of the operations that went stay alive until they complete (the other ranks submit them only
# later). The record that keeps them was made by the Handle after the call, so the raise left them held by locals
# only and freed them while the library could still read and write them. The handler raises only in hvd._submit;
# an interrupt at or after the library call's instruction counts as submitted (its id unknown to this code).
code = list(dis.get_instructions(hvd._submit))
start = next(i for i, ins in enumerate(code) if ins.argval == "hvd_enqueue")
call_at = None
for ins in code[start:]:
    if ins.opname == "STORE_FAST" or ins.opname.startswith("JUMP"):
        break
    if ins.opname == "CALL" or ins.opname == "CALL_FUNCTION":
        call_at = ins.offset
if call_at is None:
    fail("hvd._submit has no hvd_enqueue call to interrupt after")
names = os.path.join(os.environ["HVD_BATCHED_DIR"], "aftercall.names")
if r == 0:
    after, submitted, attempts, refs = [], [], 0, {}
    current = [None]

    def interrupt_submit(signum, frame):
        if frame is not None and frame.f_code is hvd._submit.__code__:
            if frame.f_lasti >= call_at:
                after.append(current[0])
            raise KeyboardInterrupt()

    signal.signal(signal.SIGALRM, interrupt_submit)
    signal.setitimer(signal.ITIMER_REAL, 0.00003, 0.00003)
    while len(after) < 30 and attempts < 4000:
        y = np.full(3, 1.0, np.float32)
        name = "aftercall.{}".format(attempts)
        attempts += 1
        refs[name] = weakref.ref(y)
        current[0] = name
        try:
            hvd.allreduce_async(y, op=hvd.Sum, name=name)  # the handle is dropped at once
            submitted.append(name)
        except KeyboardInterrupt:
            pass
        del y
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    gc.collect()
    freed = [name for name in after if refs[name]() is None]
    if freed:
        sys.exit("rank 0: {} of {} arrays of operations interrupted right after their library call were freed while in "
                 "flight".format(len(freed), len(after)))
    print("rank 0: {} per-call submissions interrupted right after the library call, {} whole, of {}".format(
        len(after), len(submitted), attempts))
    with open(names + ".part", "w") as f:
        f.write("\n".join(submitted + after))
    os.rename(names + ".part", names)
else:
    support.wait_for(names, "rank 0's per-call submissions", fail, 120)
    with open(names) as f:
        hs = [hvd.allreduce_async(np.full(3, 1.0, np.float32), op=hvd.Sum, name=name) for name in f.read().split()]
    for h in hs:
        hvd.synchronize(h)
    hs = None
# The whole submissions' records go once complete; an interrupted one's (its id never stored) at shutdown.
support.release_ticks(hvd, lambda: np.ones(1, np.float32),
                      lambda: all(refs[name]() is None for name in submitted), "aftercall", fail)
hvd.shutdown()
hvd.init()
gc.collect()
if r == 0:
    kept = [name for name in after if refs[name]() is not None]
    if kept:
        sys.exit("rank 0: {} arrays of interrupted per-call submissions outlived hvd.shutdown()".format(len(kept)))
    del refs, after, submitted

# 11. A signal handler that raises while this rank submits (Ctrl-C's KeyboardInterrupt, hvd.elastic's SIGTERM
# handler's SystemExit) never leaves the batch's lock held: the submissions after it, and shutdown's send of the
# open batch below, would wait for it forever (the harness then kills the ranks and the test fails). The handler
# raises only in hvd's own code, 2000 times, at whatever point the timer lands. One name per rank: the first
# request is in flight until shutdown (the other ranks, leaving, join it), the others are refused as duplicates.
sig = np.ones(1, np.float32)
submitted = support.interrupted_submissions(
    lambda: hvd.allreduce_async_(sig, op=hvd.Sum, name="sig.{}".format(r)))
if submitted < 100:  # (the loop did submit: a lock left held makes the next submission block until interrupted)
    sys.exit("rank {}: only {} submissions between 2000 interrupts".format(r, submitted))

hvd.shutdown()
# After shutdown the batch is not used: the call itself refuses, as it always did.
try:
    hvd.allreduce_async_(np.ones(2, np.float32), name="after.shutdown")
    sys.exit("an allreduce_async_ after shutdown was accepted")
except hvd.NotInitializedError:
    pass
print("ok batched rank {}".format(r))
