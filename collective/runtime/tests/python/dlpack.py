"""Tensors that only speak DLPack (as torch/jax/tensorflow CPU tensors do) go through the ctypes capsule parser."""
import sys

import numpy as np

import hvd
from support import OnlyDLPack

hvd.init()
r, n = hvd.rank(), hvd.size()
for dtype in [np.uint8, np.int8, np.int32, np.int64, np.float16, np.float32, np.float64]:
    x = np.arange(6, dtype=dtype).reshape(2, 3) + r
    got = hvd.allreduce(OnlyDLPack(x), op=hvd.Sum, name="dl.{}".format(np.dtype(dtype).name))
    want = sum(np.arange(6, dtype=dtype).reshape(2, 3) + k for k in range(n)).astype(dtype)
    if got.dtype != want.dtype or got.shape != (2, 3) or not np.array_equal(got, want):
        print("{}: got {!r} want {!r}".format(dtype, got, want), file=sys.stderr)
        sys.exit(1)
# In place through the capsule's data pointer (zero-copy).
buf = np.full(4, r + 1.0)
hvd.allreduce_(OnlyDLPack(buf), op=hvd.Sum, name="dl.inplace")
assert (buf == n * (n + 1) / 2).all(), buf
# A view with a byte offset.
base = np.arange(10, dtype=np.float32)
got = hvd.allgather(OnlyDLPack(base[4:6]), name="dl.offset")
assert np.array_equal(got, np.tile([4.0, 5.0], n)), got
# Non-contiguous tensors are refused with a clear message.
try:
    hvd.allreduce(OnlyDLPack(np.arange(12.0).reshape(3, 4)[:, ::2]), name="dl.strided")
    sys.exit("strided tensor accepted")
except ValueError as e:
    assert "contiguous" in str(e), e
hvd.shutdown()
print("ok dlpack rank {}".format(r))
