"""Every operation x dtype x shape against numpy references computed from every rank's (deterministic) data."""
import sys

import numpy as np

import hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
assert 0 <= r < n and hvd.local_rank() == r and hvd.local_size() == n and hvd.cross_size() == 1

DTYPES = [np.uint8, np.int8, np.int32, np.int64, np.float16, np.float32, np.float64]
SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 4), (0,), (1000,)]


def data(rank, shape, dtype, salt=0):
    size = int(np.prod(shape)) if shape else 1
    rng = np.random.default_rng(1000 * rank + salt)
    if np.issubdtype(dtype, np.integer):
        # Small values keep sums and products inside every integer type.
        return rng.integers(1, 3, size=size).astype(dtype).reshape(shape)
    return rng.uniform(0.5, 1.5, size=size).astype(dtype).reshape(shape)


def close(got, want, dtype):
    if np.issubdtype(dtype, np.integer):
        return got.dtype == want.dtype and np.array_equal(got, want)
    tol = {np.float16: 2e-2, np.float32: 1e-5, np.float64: 1e-12}[dtype]
    return got.dtype == want.dtype and got.shape == want.shape and np.allclose(got, want, rtol=tol, atol=tol)


failures = []


def check(what, got, want, dtype):
    if not close(np.asarray(got), np.asarray(want), dtype):
        failures.append("{}: got {!r} want {!r}".format(what, got, want))


for dtype in DTYPES:
    for shape in SHAPES:
        tag = "{}{}".format(np.dtype(dtype).name, shape)
        mine = data(r, shape, dtype)
        every = [data(k, shape, dtype) for k in range(n)]
        stacked = np.stack(every).astype(np.float64)
        refs = {
            hvd.Sum: stacked.sum(0),
            hvd.Min: stacked.min(0),
            hvd.Max: stacked.max(0),
            hvd.Product: stacked.prod(0),
            hvd.Average: stacked.sum(0) / n,
        }
        for op, ref in refs.items():
            if op == hvd.Average and np.issubdtype(dtype, np.integer):
                ref = np.round(ref)
            got = hvd.allreduce(mine, op=op, name="ar.{}.{}".format(tag, op))
            check("allreduce op {} {}".format(op, tag), got, ref.astype(dtype), dtype)
        # Scaling factors (floats only: integer scaling rounds at each step).
        if not np.issubdtype(dtype, np.integer):
            got = hvd.allreduce(mine, op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0, name="sc." + tag)
            check("scaled " + tag, got, (stacked.sum(0) * 2.0).astype(dtype), dtype)
        # In-place.
        buf = mine.copy()
        if buf.ndim > 0:
            hvd.allreduce_(buf, op=hvd.Max, name="inplace." + tag)
            check("allreduce_ " + tag, buf, stacked.max(0).astype(dtype), dtype)
        got = hvd.broadcast(mine, root_rank=n - 1, name="bc." + tag)
        check("broadcast " + tag, got, every[n - 1], dtype)
        if shape:
            # Allgather with a different first dimension per rank.
            rows = [data(k, (k + 1,) + shape[1:], dtype, salt=1) for k in range(n)]
            got = hvd.allgather(rows[r], name="ag." + tag)
            check("allgather " + tag, got, np.concatenate(rows), dtype)
            # Reducescatter of (n + 1) rows: rank 0 gets two rows.
            full = [data(k, (n + 1,) + shape[1:], dtype, salt=2) for k in range(n)]
            red = np.stack(full).astype(np.float64).sum(0).astype(dtype)
            got = hvd.reducescatter(full[r], op=hvd.Sum, name="rs." + tag)
            start = 0 if r == 0 else r + 1
            check("reducescatter " + tag, got, red[start:start + (2 if r == 0 else 1)], dtype)
            # Alltoall with uneven splits: rank k sends j + 1 rows to rank j.
            sends = [data(k, (n * (n + 1) // 2,) + shape[1:], dtype, salt=3) for k in range(n)]
            splits = [j + 1 for j in range(n)]
            got, received = hvd.alltoall(sends[r], splits=splits, name="a2a." + tag, return_received_splits=True)
            offset = sum(splits[:r])
            want = np.concatenate([sends[k][offset:offset + r + 1] for k in range(n)])
            check("alltoall " + tag, got, want, dtype)
            if received != [r + 1] * n:
                failures.append("alltoall received splits {} {}".format(tag, received))

# Async handles, poll, synchronize; barrier; objects.
h = hvd.allreduce_async(np.full(4, r, np.float32), op=hvd.Sum, name="async")
while not hvd.poll(h):
    pass
check("async", hvd.synchronize(h), np.full(4, n * (n - 1) / 2, np.float32), np.float32)
hvd.barrier()
check("broadcast_object", np.array(hvd.broadcast_object({"r": r}, root_rank=1)["r"]), np.array(1), np.int64)
if hvd.allgather_object(("rank", r)) != [("rank", k) for k in range(n)]:
    failures.append("allgather_object")
hvd.shutdown()
if failures:
    print("\n".join(failures[:20]), file=sys.stderr)
    print("{} failures".format(len(failures)), file=sys.stderr)
    sys.exit(1)
print("ok ops rank {}".format(r))
