"""Process sets on 4 ranks: sets {0,1} and {1,2,3} (rank 1 in both) run collectives at the same time with different
values, each member gets its set's result; a non-member's call and bad sets are refused; a set's mismatch fails in
that set alone; sets go away with remove and shutdown, and are added again after init."""
import os
import sys
import threading
import time

import numpy as np

import hvd


def fail(msg):
    print("rank {}: {}".format(hvd.rank(), msg), file=sys.stderr)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def refused(fn, cls, what, contains=None):
    try:
        fn()
    except cls as e:
        if contains is not None and contains not in str(e):
            fail("{}: message {!r} does not say {!r}".format(what, str(e), contains))
        return
    except Exception as e:  # noqa: BLE001
        fail("{}: raised {!r}, expected {}".format(what, e, cls.__name__))
    fail("{}: not refused".format(what))


backend = os.environ.get("HVD_COLLECTIVE_BACKEND", "")
a_ranks, b_ranks = [0, 1], [3, 2, 1]  # any order; kept sorted
a = hvd.ProcessSet(a_ranks)
hvd.init(process_sets=[a])
r, n = hvd.rank(), hvd.size()
check(n == 4, "expected 4 ranks, got {}".format(n))
check(hvd.global_process_set.process_set_id == 0 and hvd.global_process_set.ranks == [0, 1, 2, 3],
      "global set: {}".format(hvd.global_process_set))
# init(process_sets=...) added the first set; the second is added after init.
check(a.process_set_id == 1 and a.size() == 2, "set a from init: {}".format(a))
b = hvd.add_process_set(b_ranks)
check(b.ranks == [1, 2, 3] and b.process_set_id > 0, "set b: {}".format(b))
check(b.size() == 3, "b.size() = {}".format(b.size()))
check(b.included() == (r in (1, 2, 3)), "b.included() on rank {}".format(r))
if r in (1, 2, 3):
    check(b.rank() == [1, 2, 3].index(r), "b.rank() = {}".format(b.rank()))
else:
    refused(b.rank, ValueError, "rank() of a non-member")

refused(lambda: hvd.add_process_set(hvd.ProcessSet(a_ranks)), ValueError, "a set with the ranks of an existing one",
        "exists")

# Bad sets are refused on every rank alike (and the ranks stay in step for the next add).
refused(lambda: hvd.add_process_set([0, 0, 1]), ValueError, "a duplicate rank", "twice")
refused(lambda: hvd.add_process_set([0, 4]), ValueError, "a rank outside the job", "not a rank of the job")
# A rank past int64 is refused by name on every rank alike (ctypes would truncate it to a valid rank).
refused(lambda: hvd.add_process_set([0, 2**64 + 1]), ValueError, "a rank past int64", "rank 18446744073709551617")
refused(lambda: hvd.add_process_set([0, 1, 2, 3]), ValueError, "a set of every rank", "exists")
refused(lambda: hvd.ProcessSet([0, "x"]), ValueError, "a rank that is no integer")

# Concurrent collectives of both sets on rank 1 (one thread each) and on the others; different values per set.
results = {}


def in_a():
    x = np.full(5, 10.0 * (r + 1), np.float32)
    results["a.sum"] = hvd.allreduce(x, op=hvd.Sum, name="x", process_set=a)
    results["a.gather"] = hvd.allgather(np.array([r, r], np.int64), name="g", process_set=a)
    results["a.bcast"] = hvd.broadcast(np.array([r * 7], np.int32), root_rank=1, name="b", process_set=a)
    results["a.group"] = hvd.grouped_allreduce([np.ones(3, np.float64), np.full(2, r, np.float64)], op=hvd.Sum,
                                               name="grp", process_set=a)
    hvd.barrier(process_set=a)


def in_b():
    x = np.full(5, float(r), np.float32)
    results["b.sum"] = hvd.allreduce(x, op=hvd.Sum, name="x", process_set=b)
    results["b.gather"] = hvd.allgather(np.array([r] * r, np.int64), name="g", process_set=b)
    results["b.bcast"] = hvd.broadcast(np.array([r * 7], np.int32), root_rank=3, name="b", process_set=b)
    results["b.avg"] = hvd.allreduce(np.full(2, float(r), np.float64), name="avg", process_set=b)
    out, splits = hvd.alltoall(np.arange(3, dtype=np.int32) + 10 * r, name="a2a", process_set=b,
                               return_received_splits=True)
    results["b.alltoall"] = (out, splits)
    results["b.rs"] = hvd.reducescatter(np.ones(6, np.float32), op=hvd.Sum, name="rs", process_set=b)
    results["b.obj"] = hvd.broadcast_object({"from": r}, root_rank=2, process_set=b)
    hvd.barrier(b)  # Horovod's positional form


errors = []


def guarded(f):
    def run():
        try:
            f()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    return run


threads = []
if r in a.ranks:
    threads.append(threading.Thread(target=guarded(in_a)))
if r in b.ranks:
    threads.append(threading.Thread(target=guarded(in_b)))
for t in threads:
    t.start()
for t in threads:
    t.join()
check(not errors, "collectives failed: {!r}".format(errors))
if r in a.ranks:
    check(np.array_equal(results["a.sum"], np.full(5, 30.0, np.float32)), "a.sum {}".format(results["a.sum"]))
    check(results["a.gather"].tolist() == [0, 0, 1, 1], "a.gather {}".format(results["a.gather"]))
    check(results["a.bcast"].tolist() == [7], "a.bcast {}".format(results["a.bcast"]))
    grp = results["a.group"]
    check(grp[0].tolist() == [2.0] * 3 and grp[1].tolist() == [1.0, 1.0], "a.group {}".format(grp))
if r in b.ranks:
    check(np.array_equal(results["b.sum"], np.full(5, 6.0, np.float32)), "b.sum {}".format(results["b.sum"]))
    check(results["b.gather"].tolist() == [1, 2, 2, 3, 3, 3], "b.gather {}".format(results["b.gather"]))
    check(results["b.bcast"].tolist() == [21], "b.bcast {}".format(results["b.bcast"]))
    check(results["b.avg"].tolist() == [2.0, 2.0], "b.avg (average over 3 ranks) {}".format(results["b.avg"]))
    out, splits = results["b.alltoall"]
    me = b.rank()
    check(out.tolist() == [10 * s + me for s in (1, 2, 3)] and splits == [1, 1, 1],
          "b.alltoall {} {}".format(out, splits))
    check(results["b.rs"].tolist() == [3.0, 3.0], "b.rs {}".format(results["b.rs"]))
    check(results["b.obj"] == {"from": 2}, "b.obj {}".format(results["b.obj"]))

# A non-member's call is refused on that rank at once (nothing reaches the others).
if r not in b.ranks:
    refused(lambda: hvd.allreduce(np.ones(2, np.float32), process_set=b), ValueError, "a non-member's allreduce",
            "not a member")
if r in a.ranks:
    refused(lambda: hvd.broadcast(np.ones(1), root_rank=3, process_set=a), ValueError, "a root outside the set",
            "not a member")
# A set that was never added.
refused(lambda: hvd.allreduce(np.ones(1), process_set=hvd.ProcessSet([0, 2])), ValueError, "a set never added")

# A mismatch inside set b fails in b on every member; set a and the global set go on.
if r in b.ranks:
    try:
        hvd.allreduce(np.ones(2 + (r == 3), np.float32), name="bad", process_set=b)
        fail("a mismatched shape in set b was not refused")
    except hvd.MismatchError:
        pass
if r in a.ranks:
    check(hvd.allreduce(np.ones(1), op=hvd.Sum, name="after", process_set=a).tolist() == [2.0], "a after b's error")
check(hvd.allreduce(np.ones(1), op=hvd.Sum, name="global").tolist() == [4.0], "global after b's error")

# An add on one thread does not hold up another thread's collective over an existing set: rank 1 adds while its
# second thread submits set a's allreduce, which rank 0 waits for before it adds (a cycle if the add blocked it).
if r == 1:
    out = {}

    def late_z():
        time.sleep(0.3)  # the add has begun by now
        out["z"] = hvd.allreduce(np.ones(1), op=hvd.Sum, name="z", process_set=a)

    t = threading.Thread(target=guarded(late_z))
    t.start()
    e = hvd.add_process_set([2, 3])
    t.join()
    check(not errors and out.get("z") is not None and out["z"].tolist() == [2.0], "z: {} {!r}".format(out, errors))
else:
    if r == 0:
        check(hvd.allreduce(np.ones(1), op=hvd.Sum, name="z", process_set=a).tolist() == [2.0], "z on rank 0")
    e = hvd.add_process_set([2, 3])
if r in e.ranks:
    check(hvd.allreduce(np.ones(1), op=hvd.Sum, process_set=e).tolist() == [2.0], "e's allreduce")

# remove is agreed on: ranks that remove different sets all get a MismatchError and keep both sets.
refused(lambda: hvd.remove_process_set(b if r == 0 else e), hvd.MismatchError, "removes of different sets",
        "to remove set")
check(b.process_set_id is not None and e.process_set_id is not None, "a refused remove forgot a set")
# remove: the members forget the set; its id is refused afterwards.
check(hvd.remove_process_set(b) is True, "remove b")
check(b.process_set_id is None, "b still has an id after remove")
check(hvd.remove_process_set(b) is False, "removing b twice")
check(hvd.remove_process_set(hvd.global_process_set) is False, "removing the global set")
c = hvd.add_process_set([1, 2, 3])  # the same ranks again, now that b is gone
check(c.process_set_id not in (None, 1), "c: {}".format(c))
stale = []  # handles (waited for) of this init, which must mean nothing to the next
if r in c.ranks:
    h = hvd.allreduce_async(np.ones(1), op=hvd.Sum, process_set=c)
    check(hvd.synchronize(h).tolist() == [3.0], "c's allreduce")
    stale.append(h.id)
h = hvd.allreduce_async(np.ones(1), op=hvd.Sum, name="before shutdown")
hvd.synchronize(h)
stale.append(h.id)
hvd.shutdown()
check(c.process_set_id is None, "c keeps its id after shutdown")

# A new job (Horovod's tearDown/setUp): sets are added again, under new keys.
hvd.init()
d = hvd.add_process_set([0, 2])
c2 = hvd.add_process_set([1, 2, 3])  # c's ranks again, so an old id may name a live set
if r in d.ranks:
    check(hvd.allreduce(np.full(1, r, np.float64), op=hvd.Sum, process_set=d).tolist() == [2.0], "d after reinit")
if r in c2.ranks:
    check(hvd.allreduce(np.ones(1), op=hvd.Sum, process_set=c2).tolist() == [3.0], "c2 after reinit")
check(hvd.allreduce(np.ones(1), op=hvd.Sum, name="after init").tolist() == [4.0], "global after reinit")
# A handle from before the shutdown is refused by name, not read as one of the new engines' operations.
for old in stale:
    lib = hvd._l()
    check(lib.hvd_poll(old) == -1 and lib.hvd_wait(old) == -1, "stale handle {} accepted".format(old))
    check("before the last hvd_shutdown" in hvd._error(lib).args[0], "stale handle {}: {}".format(old, hvd._error(lib)))
hvd.barrier()
hvd.shutdown()
print("ok process sets rank {} backend {}".format(r, backend or "auto"))
