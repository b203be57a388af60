"""hvd.empty: arrays in shared buffers, allreduced in place between rank processes (exact sums at sizes around the
single copy's 1 MiB threshold and its segments), a dtype and shape as asked, zeroed, and the memory (its /dev/shm
file) freed only once the array and every view of it are gone."""
import gc
import os
import sys

import numpy as np

import hvd
from hvd import _shared

hvd.init()
r, n = hvd.rank(), hvd.size()


def fail(msg):
    print("rank {}: {}".format(r, msg), file=sys.stderr)
    sys.exit(1)


a = hvd.empty((3, 5), np.int32)
if a.shape != (3, 5) or a.dtype != np.int32 or not a.flags.c_contiguous or a.any():
    fail("hvd.empty((3, 5), int32) gave {} {} {}".format(a.shape, a.dtype, a))
if not _shared.is_shared(a) or not _shared.is_shared(a[1:]):
    fail("hvd.empty's array is not in a shared buffer")
if _shared.is_shared(np.zeros(4)):
    fail("a plain numpy array counts as shared")
del a
alloc, free, shared = _shared._alloc_fns()
if free(4096) != -1 or shared(4096) != -1:
    fail("hvd_free or hvd_alloc_is_shared accepted a pointer hvd_alloc never returned")

for count in [(1 << 18) + 1, (1 << 19) + 3, (1 << 20) + 7]:
    x = hvd.empty(count, "float32")
    x[:] = (np.arange(count) % 1000) + r
    hvd.allreduce_(x, op=hvd.Sum, name="x{}".format(count))
    want = n * (np.arange(count) % 1000) + n * (n - 1) / 2
    if not np.array_equal(x, want.astype(np.float32)):
        bad = int(np.flatnonzero(x != want)[0])
        fail("{} floats: element {} is {}, expected {}".format(count, bad, x[bad], want[bad]))
    del x

# Lifetime: a view keeps the buffer (and its file) alive; dropping the last one frees it.
def mapped_file(addr):
    """The file mapped at addr in this process (from /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi and len(parts) >= 6:
                return parts[5]
    return None


gc.collect()
y = hvd.empty(1 << 20, np.float64)
path = mapped_file(y.__array_interface__["data"][0])
if not path or not path.startswith("/dev/shm/hvd-buf-") or not os.path.exists(path):
    fail("hvd.empty's memory is mapped from {!r}, not a shared buffer file".format(path))
if os.stat(path).st_mode & 0o777 != 0o600:
    fail("{} has mode {:o}".format(path, os.stat(path).st_mode & 0o777))
view = y[10:20]
del y
gc.collect()
if not os.path.exists(path):
    fail("the buffer was freed while a view of it lived")
view[:] = 1.0
del view
gc.collect()
if os.path.exists(path):
    fail("the buffer outlived its last array")

hvd.shutdown()
print("rank {} ok".format(r))
