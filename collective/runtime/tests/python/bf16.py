"""bfloat16 through numpy: ml_dtypes.bfloat16 arrays directly, and uint16 bit patterns wrapped in
hvd.BFloat16Bits (numpy has no bfloat16 of its own). Values are small integers, exact in bfloat16."""
import sys

import numpy as np

import hvd


def to_bits(f32):
    return (np.asarray(f32, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def from_bits(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


hvd.init()
r, n = hvd.rank(), hvd.size()
x = np.arange(6, dtype=np.float32).reshape(2, 3) + r
want = sum(np.arange(6, dtype=np.float32).reshape(2, 3) + k for k in range(n))

# Bit patterns, out of place and in place, and through the other operations.
got = hvd.allreduce(hvd.BFloat16Bits(to_bits(x)), op=hvd.Sum, name="bits.sum")
assert got.dtype == np.uint16 and got.shape == (2, 3), got
assert np.array_equal(from_bits(got), want), from_bits(got)
wrapped = hvd.BFloat16Bits(to_bits(x))
hvd.allreduce_(wrapped, op=hvd.Max, name="bits.max")
assert np.array_equal(from_bits(wrapped.bits), x - r + n - 1), from_bits(wrapped.bits)
avg = hvd.allreduce(hvd.BFloat16Bits(to_bits(np.full(4, 2.0 * r))), name="bits.avg")
assert np.array_equal(from_bits(avg), np.full(4, float(n - 1), np.float32)), from_bits(avg)
gathered = hvd.allgather(hvd.BFloat16Bits(to_bits(np.full((1, 2), r))), name="bits.gather")
assert np.array_equal(from_bits(gathered), np.repeat(np.arange(n, dtype=np.float32), 2).reshape(n, 2)), gathered
root = hvd.broadcast(hvd.BFloat16Bits(to_bits(np.full(3, r + 1.0))), root_rank=n - 1, name="bits.bcast")
assert np.array_equal(from_bits(root), np.full(3, float(n), np.float32)), from_bits(root)
grouped = hvd.grouped_allreduce([hvd.BFloat16Bits(to_bits(x)), np.ones(2, np.float32)], op=hvd.Sum, name="bits.grp")
assert np.array_equal(from_bits(grouped[0]), want) and np.array_equal(grouped[1], np.full(2, n, np.float32))
try:
    hvd.BFloat16Bits(np.ones(2, np.float32))
    sys.exit("BFloat16Bits accepted float32")
except TypeError as e:
    assert "uint16" in str(e), e

# ml_dtypes.bfloat16 arrays (scripts/install-deps installs ml_dtypes): results keep the dtype.
try:
    import ml_dtypes
except ImportError:
    sys.exit("ml_dtypes is not installed: scripts/install-deps installs it")
b = x.astype(ml_dtypes.bfloat16)
got = hvd.allreduce(b, op=hvd.Sum, name="ml.sum")
assert got.dtype == ml_dtypes.bfloat16 and np.array_equal(got.astype(np.float32), want), got
hvd.allreduce_(b, op=hvd.Min, name="ml.min")
assert np.array_equal(b.astype(np.float32), x - r), b
rs = hvd.reducescatter(np.ones((n, 2), ml_dtypes.bfloat16), op=hvd.Sum, name="ml.rs")
assert rs.dtype == ml_dtypes.bfloat16 and rs.shape == (1, 2) and (rs.astype(np.float32) == n).all(), rs
hvd.shutdown()
print("ok bf16 rank {} (bits and ml_dtypes {})".format(r, ml_dtypes.__version__))
