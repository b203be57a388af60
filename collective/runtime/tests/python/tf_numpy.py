"""hvd._tf_numpy (the numpy side of hvd.tensorflow's ops; no framework): 2-byte integers and bool travel through
every op unchanged, 16-bit sums wrap, integer averages and scale factors truncate toward zero as Horovod's do, a
mixed list of dtypes reduces member by member, alltoall returns the received splits, reducescatter blocks, and bad
splits or bool reductions are refused before anything is submitted."""
import sys

import numpy as np

import hvd
from hvd import _tf_numpy as tfnp


def check(what, got, want):
    got = np.asarray(got)
    if got.dtype != np.asarray(want).dtype or got.shape != np.asarray(want).shape or not np.array_equal(got, want):
        print("rank {}: {}: got {!r} want {!r}".format(hvd.rank(), what, got, want), file=sys.stderr)
        sys.exit(1)


hvd.init()
r, n = hvd.rank(), hvd.size()

for dtype in (np.int16, np.uint16, np.bool_, np.int8, np.float32):
    mine = (np.arange(3) + r).astype(dtype)
    every = [(np.arange(3) + k).astype(dtype) for k in range(n)]
    check("allgather " + np.dtype(dtype).name, tfnp.allgather([mine], "g." + np.dtype(dtype).name, None)[0],
          np.concatenate(every))
    check("broadcast " + np.dtype(dtype).name, tfnp.broadcast([mine], n - 1, "b." + np.dtype(dtype).name, None)[0],
          every[n - 1])
    out, received = tfnp.alltoall(np.repeat(mine, n), None, "a." + np.dtype(dtype).name, None)
    check("alltoall " + np.dtype(dtype).name, out, np.concatenate([np.repeat(e, n)[r * 3:(r + 1) * 3]
                                                                   for e in every]))
    check("alltoall splits", received, np.full(n, 3, np.int32))

# Scalars stay scalars.
check("scalar broadcast", tfnp.broadcast([np.float32(r)], 0, "scalar.b", None)[0], np.float32(0))
check("scalar int16 sum", tfnp.allreduce([np.int16(r + 1)], "scalar.s", hvd.Sum, 1.0, 1.0, None)[0],
      np.int16(sum(range(1, n + 1))))
check("scalar uint16 broadcast", tfnp.broadcast([np.uint16(r + 7)], 0, "scalar.u", None)[0], np.uint16(7))

# 16-bit sums wrap as a 16-bit reduction does.
big = np.array([30000, -30000], np.int16)
check("int16 sum wraps", tfnp.allreduce([big], "wrap", hvd.Sum, 1.0, 1.0, None)[0],
      (big.astype(np.int64) * n).astype(np.int16))

# Integer average truncates toward zero: ranks hold r * 3 + 1 and -(r * 3 + 1).
values = np.array([r * 3 + 1, -(r * 3 + 1)], np.int32)
total = sum(k * 3 + 1 for k in range(n))
check("int average truncates", tfnp.allreduce([values], "avg", hvd.Average, 1.0, 1.0, None)[0],
      np.array([int(total / n), -int(total / n)], np.int32))
# Integer scale factors: scaled in double, truncated, before and after.
check("int prescale/postscale", tfnp.allreduce([np.array([3, -3], np.int64)], "scale", hvd.Sum, 0.5, 1.5, None)[0],
      np.trunc(np.trunc(np.array([1.5, -1.5])) * n * 1.5).astype(np.int64))

# A list of mixed dtypes reduces member by member.
got = tfnp.allreduce([np.ones(2, np.float32) * r, np.ones(3, np.int16) * r], "mixed", hvd.Sum, 1.0, 1.0, None)
check("mixed float", got[0], np.full(2, sum(range(n)), np.float32))
check("mixed int16", got[1], np.full(3, sum(range(n)), np.int16))

# Reducescatter: rank k gets its block of rows (the first dim0 % n ranks one row more).
rows = 2 * n + 1
x = np.arange(rows * 2, dtype=np.int32).reshape(rows, 2) + r
block = [k for k in range(rows) if (k < (rows // n + 1) * (rows % n) and k // (rows // n + 1) == r) or
         (k >= (rows // n + 1) * (rows % n) and r >= rows % n and
          (k - (rows // n + 1) * (rows % n)) // (rows // n) == r - rows % n)]
want = (np.arange(rows * 2, dtype=np.int64).reshape(rows, 2) * n + sum(range(n)))[block]
check("reducescatter sum", tfnp.reducescatter([x], "rs", hvd.Sum, 1.0, 1.0, None)[0], want.astype(np.int32))

# Refusals come before any submission: every rank raises alike and the job goes on.
for bad, what in ((lambda: tfnp.allreduce([np.ones(2, np.bool_)], "bool", hvd.Sum, 1.0, 1.0, None), TypeError),
                  (lambda: tfnp.alltoall(np.ones(4), [-1, 5][:n] + [0] * (n - 2), "neg", None), ValueError),
                  (lambda: tfnp.alltoall(np.ones(2), [2] * n, "long", None), ValueError),
                  (lambda: tfnp.reducescatter([np.ones([2, 1]), np.float32(r)], "scalar", hvd.Sum, 1.0, 1.0, None),
                   ValueError)):
    try:
        bad()
    except what:
        pass
    else:
        print("rank {}: a bad request was not refused ({})".format(r, what.__name__), file=sys.stderr)
        sys.exit(1)
check("after refusals", tfnp.allreduce([np.ones(1)], "after", hvd.Sum, 1.0, 1.0, None)[0], np.full(1, float(n)))

check("split", [len(p) for p in tfnp.split(list(range(7)), 3)], [3, 2, 2])
check("split more parts than items", [len(p) for p in tfnp.split([1, 2], 4)], [1, 1])
hvd.shutdown()
print("ok tf_numpy rank {}".format(r))
