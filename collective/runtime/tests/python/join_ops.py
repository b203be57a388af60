"""Every operation while a rank has joined: the last rank joins at once; the others run allreduce (every op),
allgather, broadcast, alltoall and reducescatter, before (so the responses are cached) and after that rank joined.
A joined rank contributes the identity to reductions and no rows to allgather/alltoall, and receives broadcasts;
a broadcast rooted at a joined rank fails with a clear error on every rank that submitted it."""
import sys

import numpy as np

import hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
j = n - 1  # the rank that joins
live = n - 1


def fail(what, got, want):
    print("rank {} {}: got {!r} want {!r}".format(r, what, got, want), file=sys.stderr)
    sys.exit(1)


def ops(phase, active):
    """The same sequence before the join (every rank) and after it (`active` ranks only)."""
    k = len(active)
    s = hvd.allreduce(np.full(3, r + 1.0), op=hvd.Sum, name="sum")
    if not np.array_equal(s, np.full(3, float(sum(a + 1 for a in active)))):
        fail(phase + " sum", s, sum(a + 1 for a in active))
    for op, want in ((hvd.Min, min(active) + 1), (hvd.Max, max(active) + 1),
                     (hvd.Product, np.prod([a + 1 for a in active]))):
        got = hvd.allreduce(np.full(2, r + 1, np.int64), op=op, name="op.{}".format(op))
        if not np.array_equal(got, np.full(2, want)):
            fail("{} op {}".format(phase, op), got, want)
    avg = hvd.allreduce(np.full(2, 6.0), name="avg")  # Average divides by the full size, as in Horovod
    if not np.allclose(avg, 6.0 * k / n):
        fail(phase + " average", avg, 6.0 * k / n)
    g = hvd.allgather(np.full((r + 1, 2), r, np.int32), name="gather")
    want = np.concatenate([np.full((a + 1, 2), a, np.int32) for a in active])
    if not np.array_equal(g, want):
        fail(phase + " allgather", g, want)
    b = hvd.broadcast(np.full(4, r, np.float32), root_rank=0, name="bcast")
    if not np.array_equal(b, np.zeros(4, np.float32)):
        fail(phase + " broadcast", b, 0)
    # alltoall: rank a sends (dst + 1) rows of value 100 * a + dst to rank dst.
    splits = [d + 1 for d in range(n)]
    x = np.concatenate([np.full((d + 1, 2), 100 * r + d, np.int64) for d in range(n)])
    got, received = hvd.alltoall(x, splits=splits, name="a2a", return_received_splits=True)
    want_rows = [r + 1 if a in active else 0 for a in range(n)]
    want = np.concatenate([np.full((rows, 2), 100 * a + r, np.int64) for a, rows in enumerate(want_rows)])
    if received != want_rows or not np.array_equal(got, want):
        fail(phase + " alltoall", (got, received), (want, want_rows))
    rs = hvd.reducescatter(np.ones((2 * n, 3), np.float32), op=hvd.Sum, name="rs")
    if rs.shape != (2, 3) or not (rs == k).all():
        fail(phase + " reducescatter", rs, k)


ops("before", list(range(n)))
for _ in range(2):  # cached: the response cache knows this broadcast once the join comes
    hvd.broadcast(np.zeros(2), root_rank=j, name="from.joined")
if r == j:
    last = hvd.join()
else:
    for step in range(3):
        ops("joined step {}".format(step), list(range(live)))
    # A broadcast rooted at the joined rank has no data: an error, not a hang, on every submitting rank.
    for attempt in range(2):
        try:
            hvd.broadcast(np.zeros(2), root_rank=j, name="from.joined")
            fail("broadcast from the joined rank", "success", "an error")
        except hvd.MismatchError:
            pass
    last = hvd.join()
if last != n - 2 if n > 1 else 0:
    fail("join", last, n - 2)
# Everything works again for every rank after the join.
ops("after", list(range(n)))
hvd.shutdown()
print("ok join_ops rank {}".format(r))
