"""Helpers shared by the test scripts here (not a test itself: tests/python.rs runs the scripts it names)."""


class OnlyDLPack:
    """Hides numpy behind the DLPack protocol, like a framework tensor."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, stream=None):
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


# The batch's tests (batched.py with numpy, torch_batched.py with torch) share these.


def batched(h, what, fail):
    """The batch must be the path under test: a silent fallback to a call per tensor would pass everything else."""
    from hvd import _batch

    if type(h) is not _batch.BatchedHandle:
        fail("{} did not go through the batch: {!r}".format(what, h))


def wait_for(path, what, fail, timeout=30):
    import os
    import time

    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            fail("never saw " + what)
        time.sleep(0.01)


def release_ticks(hvd, one, is_released, tag, fail):
    """Until rank 0's ``is_released()``: each step sends a batch (an ``allreduce_async_`` of ``one()``, which
    releases the completed operations of dropped batches), then every rank asks rank 0 (an allreduce of
    ``one() * released``)."""
    for k in range(3000):
        hvd.synchronize(hvd.allreduce_async_(one(), op=hvd.Sum, name="{}.tick.{}".format(tag, k)))
        flag = one() * (1 if hvd.rank() == 0 and is_released() else 0)
        if hvd.allreduce(flag, op=hvd.Sum, name="{}.released.{}".format(tag, k))[0]:
            return
    fail("the completed operations of dropped batches were never released ({})".format(tag))


class Interrupted(Exception):
    pass


def interrupted_submissions(submit, times=2000):
    """Calls ``submit()`` in a loop while a SIGALRM handler raises ``Interrupted`` in hvd's own code ``times`` times
    (the handler raises only there: Ctrl-C's KeyboardInterrupt or hvd.elastic's SIGTERM exit landing in hvd);
    returns how many submissions completed. A lock that a raise leaves held makes the next submission block until
    the next interrupt, so few submit then."""
    import signal

    hits = [0]

    def interrupt(signum, frame):
        if frame is not None and frame.f_globals.get("__name__", "").startswith("hvd"):
            hits[0] += 1
            raise Interrupted()

    signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.0002, 0.0002)
    submitted = 0
    try:
        while hits[0] < times:
            try:
                while hits[0] < times:
                    submit()
                    submitted += 1
            except Interrupted:
                pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
    return submitted
