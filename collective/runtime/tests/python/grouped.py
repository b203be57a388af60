"""The grouped API: many tensors in one call into the library and one handle (one wait) for the group; in place
and out of place; mixed dtypes, shapes, empty, read-only, non-contiguous and DLPack-only tensors; poll; errors."""
import os
import sys

import numpy as np

import hvd
from support import OnlyDLPack


def check(got, want, what):
    if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
        print("{}: got {!r} want {!r}".format(what, got, want), file=sys.stderr)
        sys.exit(1)


hvd.init()
r, n = hvd.rank(), hvd.size()
total = sum(range(n))
grads = [np.empty(1024, np.float32) for i in range(50)]
for step in range(5):
    # In place: a training loop's gradients, the same arrays every step (remembered from the second step, prepared
    # once in the library from the third).
    for i, g in enumerate(grads):
        g[:] = r + i + step
    h = hvd.grouped_allreduce_async_(grads, op=hvd.Sum, name="grads")
    if step >= 2 and os.environ.get("HVD_FUSION_THRESHOLD") != "0":
        assert h._group is None, "a prepared group fused into one operation takes one handle"
    out = hvd.synchronize(h)
    assert hvd.poll(h) and len(out) == len(grads) and all(a is b for a, b in zip(out, grads))
    for i, g in enumerate(grads):
        check(g, np.full(1024, total + n * (i + step), np.float32), "in place {}".format(i))

# Steps 3-5 went through the group the library prepared once (this path must be the one tested above).
assert hvd._GROUPS["grads"][6] is not None, "the in-place group was never prepared in the library"

# The same group name with changed members: a reshaped array, a new array object, a dtype change in place, a
# different scale factor (the library remembers prepared in-place groups of numpy arrays and must notice).
grads[0].shape = (32, 32)
grads[1] = np.full(7, r, np.float64)
grads[2].dtype = np.int32
grads[2][:] = r
for postscale in (1.0, 2.0):
    grads[0][:] = r
    grads[1][:] = r
    grads[2][:] = r
    hvd.grouped_allreduce_(grads, op=hvd.Sum, name="grads", postscale_factor=postscale)
    check(grads[0], np.full((32, 32), total * postscale, np.float32), "reshaped")
    check(grads[1], np.full(7, total * postscale, np.float64), "replaced")
    check(grads[2], np.full(1024, total * int(postscale), np.int32), "dtype changed")

# A fused group of 480 KB (on 3 ranks more than one shared-memory arena chunk: the transport reads and writes the
# members piece by piece, chunk by chunk), with both scale factors, out of place.
big = [np.arange(3000, dtype=np.float32) % 7 + r + i for i in range(40)]
outs = hvd.grouped_allreduce(big, op=hvd.Sum, name="big", prescale_factor=0.5, postscale_factor=4.0)
for i, o in enumerate(outs):
    check(o, ((np.arange(3000, dtype=np.float32) % 7 + i) * n + total) * 2, "big {}".format(i))
    check(big[i], np.arange(3000, dtype=np.float32) % 7 + r + i, "big input {} untouched".format(i))

# One array twice in an in-place group larger than an arena chunk on every rank count, fused: both members are
# reduced from the array as it was (a transport writing the first chunk's results before reading the second must
# not feed the first member's result to the second). Unfused they are two in-place allreduces of one array, one
# after the other.
x = np.full(1024, float(r + 1), np.float32)
fill = [np.ones(1024, np.float32) for _ in range(140)]
hvd.grouped_allreduce_([x] + fill + [x], op=hvd.Sum, name="alias")
once = float(sum(k + 1 for k in range(n)))
check(x, np.full(1024, once if os.environ.get("HVD_FUSION_THRESHOLD") != "0" else once * n, np.float32),
      "one array twice in place")
check(fill[0], np.full(1024, float(n), np.float32), "its neighbours")

# Out of place, every kind of input in one group; the inputs stay untouched.
base = np.arange(24, dtype=np.float64).reshape(4, 6)
readonly = np.arange(5, dtype=np.int32) + r
readonly.flags.writeable = False
mixed = [
    np.arange(6, dtype=np.int64).reshape(2, 3) + r,
    np.float16(r),  # a numpy scalar
    np.zeros((0, 3), np.float32),
    readonly,
    base[:, ::2] * (r + 1),  # non-contiguous: copied first
    OnlyDLPack(np.full(3, r + 1, np.uint8)),
    np.full((2, 2), r, np.float32),
]
h = hvd.grouped_allreduce_async(mixed, op=hvd.Sum, name="mixed", postscale_factor=2.0)
while not hvd.poll(h):
    pass
got = hvd.synchronize(h)
assert hvd.synchronize(h) is got, "a second synchronize returns the same results"
check(got[0], (np.arange(6, dtype=np.int64).reshape(2, 3) * n + total) * 2, "int64")
check(got[1], np.asarray(np.float16(total * 2)), "scalar")
check(got[2], np.zeros((0, 3), np.float32), "empty")
check(got[3], (np.arange(5, dtype=np.int32) * n + total) * 2, "read-only")
check(got[4], base[:, ::2] * sum(k + 1 for k in range(n)) * 2, "strided")
check(got[5], np.full(3, sum(k + 1 for k in range(n)) * 2, np.uint8), "dlpack")
check(got[6], np.full((2, 2), total * 2, np.float32), "float32")
check(readonly, np.arange(5, dtype=np.int32) + r, "input untouched")

# Without a name: every rank still agrees (the library names them in submission order).
outs = hvd.grouped_allreduce([np.ones(2, np.float32), np.ones(3, np.float64)], op=hvd.Average)
check(outs[0], np.ones(2, np.float32), "noname 0")
check(outs[1], np.ones(3, np.float64), "noname 1")

# In place needs writable, contiguous tensors: a clear error before anything is submitted.
for bad in (readonly, base[:, ::2]):
    try:
        hvd.grouped_allreduce_([np.ones(2, np.float32), bad], name="bad")
        sys.exit("in-place grouped allreduce accepted {!r}".format(bad))
    except ValueError as e:
        assert "in-place" in str(e), e

# A mismatch inside a group fails the group's handle on every rank, and the engine carries on.
try:
    hvd.grouped_allreduce([np.ones(2, np.float32), np.ones(2 + (r == 0), np.float32)], name="mismatch")
    sys.exit("a shape mismatch inside a group passed")
except hvd.MismatchError as e:
    assert "mismatch.1" in str(e), e
check(hvd.grouped_allreduce([np.ones(1, np.float32)], op=hvd.Sum, name="after")[0],
      np.full(1, n, np.float32), "after the error")
# Handles dropped while in flight: their buffers stay alive until the library is done, then are released.
import gc  # noqa: E402

for i in range(20):
    hvd.allreduce_async(np.full(1000, float(r), np.float32), op=hvd.Sum, name="drop.{}".format(i))
    hvd.grouped_allreduce_async([np.ones(10), np.ones(3, np.float32)], name="gdrop.{}".format(i))
gc.collect()


def dropped():
    # The records of dropped handles (hvd._inflight keeps those of live handles too, until their synchronize).
    return [rec for rec in hvd._inflight if rec.handle() is None]


assert len(dropped()) > 0, "dropped in-flight handles were not kept"
hvd.barrier()
hvd.allreduce(np.ones(1), name="sweep")
hvd._sweep_inflight()  # (a submission sweeps every 64 or so: amortized) releases the completed ones
assert len(dropped()) == 0, dropped()


# A signal handler that raises right after one of the sweep's calls into the library (Ctrl-C's KeyboardInterrupt,
# hvd.elastic's SIGTERM SystemExit: Python runs handlers between bytecodes, so after a call returns) must not lose an
# orphan whose operation is in flight: its buffers would be freed while the library may still read or write them.
# The library is wrapped so that the call itself raises after returning, at each kind of call the sweep makes: while
# the operations are in flight (the polls), then once they completed (after the release and the group's wait; the
# next sweep polls -1 for a handle already released, and lets it go).
class Interrupting(object):
    def __init__(self, lib, names):
        self.lib, self.names = lib, names

    def __getattr__(self, name):
        call = getattr(self.lib, name)
        if name not in self.names:
            return call

        def interrupted(*args):
            call(*args)
            raise KeyboardInterrupt

        return interrupted


def interrupted_sweeps(names, times):
    """Sweeps `times` times with the library's `names` raising; how many sweeps raised (the interruption reaches the
    caller, as a signal handler's exception does)."""
    real = hvd._lib._lib
    hvd._lib._lib = Interrupting(real, names)
    raised = 0
    try:
        for _ in range(times):
            try:
                hvd._sweep_inflight()
            except KeyboardInterrupt:
                raised += 1
    finally:
        hvd._lib._lib = real
    return raised


import weakref  # noqa: E402

if r == 0:
    a, g = np.full(5, 1.0, np.float32), np.ones(4)
    hvd.allreduce_async(a, op=hvd.Sum, name="interrupted.a")
    hvd.grouped_allreduce_async([g], op=hvd.Sum, name="interrupted.g")
    alive = [weakref.ref(a), weakref.ref(g)]
    del a, g
    gc.collect()
    assert len(dropped()) == 2, dropped()
    raised = interrupted_sweeps(("hvd_poll", "hvd_poll_many"), 4)  # each sweep raises at its first poll
    gc.collect()
    if any(ref() is None for ref in alive) or len(dropped()) != 2:
        sys.exit("rank 0: an interrupted sweep lost an orphan in flight: {} left, buffers alive {}".format(
            len(dropped()), [ref() is not None for ref in alive]))
    assert raised == 4, raised
    plain = [o.id for o in dropped() if o.group is None]
hvd.allreduce(np.ones(1), name="interrupted.go")  # the other ranks submit them only after this
if r != 0:
    hvd.allreduce(np.full(5, 1.0, np.float32), op=hvd.Sum, name="interrupted.a")
    hvd.grouped_allreduce([np.ones(4)], op=hvd.Sum, name="interrupted.g")
hvd.barrier()
if r == 0:
    # Released, then interrupted before the removal: the plain handle's first, then the group's.
    raised = [interrupted_sweeps(("hvd_wait_and_release",), 1), interrupted_sweeps(("hvd_wait_many",), 1)]
    assert raised == [1, 1] and len(dropped()) == 1, (raised, dropped())
    hvd.allreduce(np.ones(1), name="interrupted.sweep")
    hvd._sweep_inflight()  # a later sweep lets them go all the same
    gc.collect()
    if dropped() or any(ref() is not None for ref in alive):
        sys.exit("rank 0: completed orphans kept after interrupted sweeps: {!r}".format(dropped()))
    # Let go in the engine too (-1: unknown), not only here: hvd_release alone left the engine's entry behind.
    if [hvd._lib._lib.hvd_poll(hid) for hid in plain] != [-1]:
        sys.exit("rank 0: a released orphan's handle is still in the engine: {}".format(plain))
else:
    hvd.allreduce(np.ones(1), name="interrupted.sweep")
hvd.shutdown()
print("ok grouped rank {}".format(r))
