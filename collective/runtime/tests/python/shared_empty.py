"""hvd.empty: arrays in shared buffers, allreduced in place between rank processes (exact sums at sizes around the
single copy's 1 MiB threshold and its segments), a dtype and shape as asked, zeroed, and the memory (its /dev/shm
file) freed only once the array and every view of it are gone, and a buffer still alive at exit only after the hooks
registered after hvd was imported (hvd.init's shutdown, which drains operations in flight) ran."""
import gc
import os
import subprocess
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

# Shapes given as numpy integers.
z = hvd.empty((np.int64(2), np.int32(3)), np.int8)
if z.shape != (2, 3) or hvd.empty(np.int64(4)).shape != (4,):
    fail("hvd.empty with numpy integer shapes gave {}".format(z.shape))
del z

# At exit, a live buffer outlasts every hook registered after hvd was imported (as hvd.init registers shutdown),
# and is freed after them. The child calls no hvd.init (hvd.empty needs none), so it joins no job.
child = r"""
import atexit, os, sys
import hvd
path = []
def check():
    if not os.path.exists(path[0]):
        print("freed before a later exit hook ran", file=sys.stderr)
        os._exit(2)
atexit.register(check)
x = hvd.empty(1 << 16, "uint8")
x[:] = 1
with open("/proc/self/maps") as f:
    path.append(next(l.split()[5] for l in f if l.split()[0].startswith(format(x.ctypes.data, "x") + "-")))
print(path[0])
"""
out = subprocess.run([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
if out.returncode != 0:
    fail("exit-order child failed ({}): {}".format(out.returncode, out.stderr.decode(errors="replace")))
left = out.stdout.decode().strip()
if not left.startswith("/dev/shm/hvd-buf-") or os.path.exists(left):
    fail("the buffer alive at exit was not freed after the exit hooks: {!r}".format(left))

hvd.shutdown()
print("rank {} ok".format(r))
