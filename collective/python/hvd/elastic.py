"""Elastic training with Horovod's names: a training function that survives the loss of workers.

Under ``hvd run`` with an elastic step (``workers = { min = 2, max = 8 }`` or ``--min-workers``), a worker that
dies does not stop the others: their collective in flight fails with ``hvd.HorovodInternalError`` (a
``PeerLostError``), and ``hvd.elastic.run`` then restores the state to its last ``commit()``, leaves the job
(``hvd.shutdown()``), joins the next round with the survivors (``hvd.init()``: the launcher's rendezvous gives every
member its new rank and the round's size), broadcasts the state from the new rank 0, and calls the function again::

    import hvd, numpy as np
    hvd.init()
    state = hvd.elastic.ObjectState(epoch=0, weights=np.zeros(10))

    @hvd.elastic.run
    def train(state):
        while state.epoch < 100:
            state.weights -= 0.1 * hvd.allreduce(gradient(state.weights))
            state.epoch += 1
            state.commit()

    train(state)

What is lost in a failure is the work since the last ``commit()`` (docs/running.md, Elastic steps).

In an elastic step (``HVD_ELASTIC=1``) every ``commit()`` ends with a tiny agreement among the members (one allreduce,
``check_host_updates``): whether a member was preempted, and whether new workers wait to join. Preemption (SIGTERM:
spot reclaim, Kubernetes eviction) is a hand-over, not a loss: ``run`` installs a SIGTERM handler that only marks the
worker; at its next ``commit()`` the worker saves, the others learn it leaves and re-form at once without it, and it
tells the launcher's rendezvous it leaves (``hvd_elastic_leave``) and exits 0. Nothing committed is lost or counted
twice. A worker that reaches no commit within ``HVD_PREEMPT_GRACE`` seconds (default 30) of the SIGTERM ends with code
143, as SIGTERM would have ended it: a lost worker. A second SIGTERM ends it at once, the same way. New workers (host
discovery) join at a commit the same way: the members re-form and sync the state from rank 0.
"""

import copy
import functools
import os
import signal
import sys
import threading
import time

import hvd as _hvd

__all__ = ["run", "State", "ObjectState", "TorchState", "HostsUpdatedInterrupt", "HorovodInternalError", "Preempted"]

HorovodInternalError = _hvd.HorovodInternalError


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's signal that the job's hosts changed: ``hvd.elastic.run`` re-forms the job without restoring the
    state (it is current: raised at a commit). With ``skip_sync`` the state is not broadcast again either (only
    members left: they all hold it). ``commit()`` raises it on every member at once when a member was preempted or
    new workers wait to join."""

    def __init__(self, skip_sync=False):
        super().__init__("the job's hosts changed")
        self.skip_sync = skip_sync


class State:
    """The state of a training function that ``hvd.elastic.run`` keeps across failures: ``commit()`` saves it,
    ``restore()`` goes back to the last commit, ``sync()`` gives every rank rank 0's. Subclasses define ``save``,
    ``restore`` and ``sync``."""

    def __init__(self, bcast_object=None, get_rank=None):
        self._bcast_object = bcast_object or _hvd.broadcast_object
        self._get_rank = get_rank or _hvd.rank
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Functions (no arguments) called after each re-form of the job, before the state is synced (e.g. to scale
        the learning rate with the new ``hvd.size()``)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp=None, update_res=None):
        """Horovod's notification hook; hvd's members learn of changes in ``check_host_updates``, so nothing calls
        it."""

    def commit(self):
        """Saves the state (what a failure goes back to), then checks for host changes (``check_host_updates``): a
        preempted worker leaves here, and the others re-form without it or with new workers."""
        self.save()
        self._hvd_commits = getattr(self, "_hvd_commits", 0) + 1
        self.check_host_updates()

    def check_host_updates(self):
        """In an elastic step under ``hvd run``: every member says whether it was preempted (SIGTERM) and whether
        the launcher has new workers waiting to join (one allreduce, named ``hvd.elastic.commit``, so every member
        must call it at the same commit, as ``commit()`` does). A preempted worker then leaves the job and exits 0
        (``SystemExit``); the others raise ``HostsUpdatedInterrupt``, which ``run`` answers with a re-form without
        restoring (the state was just committed), syncing from rank 0 only when new workers join. Outside an elastic
        step it returns."""
        if not _elastic() or not _hvd.is_initialized():
            return
        np = _hvd._np()
        leaving = 1 if _preemption.marked is not None else 0
        joining = 1 if _new_workers_waiting() else 0
        agreed = _hvd.allreduce(np.array([leaving, joining], np.int64), op=_hvd.Max, name="hvd.elastic.commit")
        if leaving:
            _leave()
        if int(agreed[0]) or int(agreed[1]):
            raise HostsUpdatedInterrupt(skip_sync=not int(agreed[1]))

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError

    def reset(self):
        """Called after each re-form, before the reset callbacks."""


class ObjectState(State):
    """A state of picklable attributes: ``ObjectState(epoch=0, weights=w)`` has ``state.epoch`` and
    ``state.weights``; ``commit()`` keeps a deep copy of each, ``restore()`` puts the copies back, ``sync()``
    broadcasts rank 0's committed values."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self):
        self._saved_state = {attr: copy.deepcopy(getattr(self, attr)) for attr in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        if self._saved_state:
            # A fixed name: ranks of a new round may have made different numbers of unnamed object broadcasts.
            self._saved_state = self._bcast_object(self._saved_state, root_rank=0, name="hvd.elastic.sync")
            self._set_attrs()

    def _set_attrs(self):
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))


class TorchState(ObjectState):
    """``ObjectState`` plus a torch model and optimizer (Horovod's ``hvd.torch.elastic.TorchState``): their
    ``state_dict()`` is copied at each commit and loaded back on restore; sync broadcasts rank 0's parameters and
    optimizer state. Needs torch."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        import hvd.torch as torch_hvd  # raises an ImportError that names torch when it is missing

        self._torch = torch_hvd
        self.model = model
        self.optimizer = optimizer
        self._saved_model = None
        self._saved_optimizer = None
        super().__init__(**kwargs)
        self._save_modules()

    def _save_modules(self):
        if self.model is not None:
            self._saved_model = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._saved_optimizer = copy.deepcopy(self.optimizer.state_dict())

    def save(self):
        self._save_modules()
        super().save()

    def restore(self):
        if self.model is not None and self._saved_model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None and self._saved_optimizer is not None:
            self.optimizer.load_state_dict(self._saved_optimizer)
        super().restore()

    def sync(self):
        if self.model is not None:
            self._torch.broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            self._torch.broadcast_optimizer_state(self.optimizer, root_rank=0)
        super().sync()
        self._save_modules()


# How many times a re-form is tried when joining the new round fails.
_RESET_ATTEMPTS = 3


def _reset():
    """Leaves the job and joins its next round (new ranks, new size, new communicators). A join that fails with
    ``HorovodInternalError`` is tried again, up to ``_RESET_ATTEMPTS`` times: a peer that died after asking to join
    (``PeerLostError`` from the round's connections, or a rendezvous timeout when it died before publishing its
    address) makes the next round form without it. A worker the round formed without, or one below the step's
    minimum, fails every attempt and raises."""
    for attempt in range(_RESET_ATTEMPTS):
        _hvd.shutdown()
        try:
            _hvd.init()
            return
        except HorovodInternalError:
            if attempt + 1 == _RESET_ATTEMPTS:
                raise


def _reset_limit():
    """``HVD_ELASTIC_RESET_LIMIT``: how many re-forms in a row without a ``commit()`` ``run`` allows (default 10;
    0: no limit)."""
    value = os.environ.get("HVD_ELASTIC_RESET_LIMIT", "10").strip()
    if not value.isdigit():
        raise _hvd.InvalidArgumentError(
            "HVD_ELASTIC_RESET_LIMIT={!r} is not a non-negative number of re-forms (0: no limit)".format(value))
    return int(value)


def _elastic():
    return os.environ.get("HVD_ELASTIC", "").strip() == "1"


def _preempt_grace():
    """``HVD_PREEMPT_GRACE``: seconds a SIGTERM'd worker has to reach its next commit (default 30)."""
    value = os.environ.get("HVD_PREEMPT_GRACE", "30").strip()
    try:
        grace = float(value)
    except ValueError:
        grace = -1.0
    if not 0 <= grace < 1e9:
        raise _hvd.InvalidArgumentError(
            "HVD_PREEMPT_GRACE={!r} is not a non-negative number of seconds".format(value))
    return grace


class _Preemption:
    """The SIGTERM handler ``run`` installs in an elastic step, and what it marked."""

    def __init__(self):
        self.marked = None  # time.monotonic() of the first SIGTERM
        self.previous = None  # the handler it replaced
        self.depth = 0  # nested run() calls
        self.timer = None
        self.grace = 30.0

    def install(self):
        self.depth += 1
        if self.depth > 1:
            return
        self.grace = _preempt_grace()
        try:
            previous = signal.getsignal(signal.SIGTERM)
            # Ignored on purpose (nohup-like): stay ignored. Another thread: signals are the main thread's.
            if previous is signal.SIG_IGN or threading.current_thread() is not threading.main_thread():
                self.previous = None
                return
            signal.signal(signal.SIGTERM, self.handle)
            self.previous = previous
        except (ValueError, OSError):
            self.previous = None

    def uninstall(self, finished):
        """The outermost ``run`` ends: the previous handler comes back. A SIGTERM that found no commit since is
        answered when the training ``finished`` (``run`` returned: the worker's work is done, and the script goes on
        to exit normally); when ``run`` ends with an exception it is delivered to the previous handler now (by
        default: the process ends with 143, a lost worker), as it would have been without ``run``."""
        self.depth -= 1
        if self.depth > 0 or self.previous is None:
            return
        previous, self.previous = self.previous, None
        signal.signal(signal.SIGTERM, previous)
        if self.marked is not None:
            self.cancel()
            self.marked = None
            if finished:
                sys.stderr.write("hvd.elastic: SIGTERM: the training finished before another commit; this worker "
                                 "(slot {}) goes on to exit normally\n".format(os.environ.get("HVD_RANK", "?")))
                sys.stderr.flush()
            else:
                os.kill(os.getpid(), signal.SIGTERM)

    def handle(self, signum, frame):
        if self.marked is not None:
            # A second SIGTERM: end now, as SIGTERM would.
            self.end("a second SIGTERM")
        previous = self.previous
        if _launcher_stopping():
            # `hvd run` stops the step (a failure, below the minimum, an interrupt): no hand-over to wait for. End
            # now, unwinding (finally blocks and atexit run), with the code SIGTERM would have given.
            sys.stderr.write("hvd.elastic: SIGTERM: hvd run is stopping the step; this worker (slot {}) ends now "
                             "(exit code 143)\n".format(os.environ.get("HVD_RANK", "?")))
            sys.stderr.flush()
            if callable(previous) and previous is not signal.default_int_handler:
                previous(signum, frame)
            raise SystemExit(128 + signal.SIGTERM)
        self.marked = time.monotonic()
        sys.stderr.write(
            "hvd.elastic: SIGTERM: this worker (slot {}) commits, hands over and leaves at its next commit (within "
            "HVD_PREEMPT_GRACE={:g} s)\n".format(os.environ.get("HVD_RANK", "?"), self.grace))
        sys.stderr.flush()
        self.timer = threading.Timer(self.grace, self.end, args=("no commit within HVD_PREEMPT_GRACE={:g} s of "
                                                                  "SIGTERM".format(self.grace),))
        self.timer.daemon = True
        self.timer.start()
        # Chain a handler of the script's own (it may log, flush, save); the default action is what this replaces.
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    def cancel(self):
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    @staticmethod
    def end(why):
        """Ends the process as SIGTERM would have (code 143): the launcher counts it as a lost worker."""
        try:
            sys.stderr.write("hvd.elastic: {}: ending as a lost worker (exit code 143)\n".format(why))
            sys.stderr.flush()
        finally:
            os._exit(128 + signal.SIGTERM)


_preemption = _Preemption()


class Preempted(SystemExit):
    """Raised by ``commit()`` in a preempted worker once it has committed, handed over and left the job: the
    process exits 0 (it is a ``SystemExit``), which the launcher reports as preempted."""

    def __init__(self, message):
        super().__init__(0)
        self.message = message

    def __str__(self):
        return self.message


def _leave():
    """The preempted worker's hand-over, after its last commit and the members' agreement: leave the job (the
    others shut down too, to re-form), tell the launcher's rendezvous, end with ``Preempted``. The leave goes first
    (it needs no engine): a teardown slower than the round window would otherwise let the next round form without
    this worker, refuse its leave, and count it as lost."""
    lib = _hvd._l()
    leave = lib.hvd_elastic_leave
    leave.restype, leave.argtypes = _ctypes_i32(), []
    left = leave()
    _hvd.shutdown()
    _preemption.cancel()
    # Handed over: the SIGTERM is answered, so leaving run() does not deliver it again.
    _preemption.marked = None
    if left < 0:
        sys.stderr.write("hvd.elastic: preempted, but the launcher was not told ({}); exiting anyway\n".format(
            _hvd._error(lib)))
    else:
        sys.stderr.write("hvd.elastic: preempted: committed and left the job; {} workers go on\n".format(left))
    sys.stderr.flush()
    raise Preempted("hvd.elastic: this worker was preempted (SIGTERM) and left the job after its last commit")


def _ctypes_i32():
    import ctypes

    return ctypes.c_int32


# How often (seconds) a member asks the launcher whether new workers wait to join; commits in between reuse the answer.
_JOIN_CHECK_INTERVAL = 1.0
# How long one ask may take, and how long commits skip asking after one failed (a rendezvous that does not answer
# would otherwise stall every commit for the whole timeout).
_JOIN_CHECK_TIMEOUT = 5.0
_JOIN_CHECK_BACKOFF = 30.0
_join_check = {"at": None, "waiting": False, "warned": False, "failed_at": None}


def _round_status(timeout):
    """The launcher's answer to ``GET /elastic/v1/round``: ``(status, words)``, ``words`` being
    ``v1 <round> <size> <waiting> [<stopping>]`` on a 200. ``None`` when there is no HTTP rendezvous. Raises
    ``OSError``, ``ValueError`` or ``http.client.HTTPException`` when it cannot be asked."""
    import http.client

    address = os.environ.get("HVD_RENDEZVOUS", "")
    token = os.environ.get("HVD_JOB_TOKEN", "")
    if not address or address.startswith("file:") or ":" not in address:
        return None
    host, _, port = address.rpartition(":")
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)
    try:
        conn.request("GET", "/elastic/v1/round", headers={"Authorization": "Bearer " + token})
        answer = conn.getresponse()
        return answer.status, answer.read(256).decode("ascii", "replace").split()
    finally:
        conn.close()


def _launcher_stopping():
    """Whether ``hvd run`` is stopping the step (it says so in the round status before it sends SIGTERM): then a
    SIGTERM is a stop, not a preemption. A rendezvous that cannot be asked (within 2 s) counts as no: a preemption."""
    import http.client

    try:
        answer = _round_status(2)
    except (OSError, ValueError, http.client.HTTPException):
        return False
    return answer is not None and answer[0] == 200 and len(answer[1]) >= 5 and answer[1][4] == "1"


def _new_workers_waiting():
    """Whether the launcher's rendezvous has new workers (host discovery) waiting to join the next round:
    ``GET /elastic/v1/round`` at most every ``_JOIN_CHECK_INTERVAL`` seconds. A failed request counts as no, and
    the next ``_JOIN_CHECK_BACKOFF`` seconds do not ask."""
    now = time.monotonic()
    if _join_check["at"] is not None and now - _join_check["at"] < _JOIN_CHECK_INTERVAL:
        return _join_check["waiting"]
    if _join_check["failed_at"] is not None and now - _join_check["failed_at"] < _JOIN_CHECK_BACKOFF:
        return False
    _join_check["at"] = now
    waiting = False
    import http.client

    try:
        answer = _round_status(_JOIN_CHECK_TIMEOUT)
        if answer is None:
            pass
        elif answer[0] == 200 and len(answer[1]) >= 4 and answer[1][0] == "v1" and answer[1][3].isdigit():
            waiting = int(answer[1][3]) > 0
        else:
            _join_check["failed_at"] = time.monotonic()
            if not _join_check["warned"]:
                _join_check["warned"] = True
                sys.stderr.write("hvd.elastic: the rendezvous answered {} {} to GET /elastic/v1/round; new workers "
                                 "cannot join\n".format(answer[0], " ".join(answer[1])))
    except (OSError, ValueError, http.client.HTTPException) as e:
        _join_check["failed_at"] = time.monotonic()
        if not _join_check["warned"]:
            _join_check["warned"] = True
            sys.stderr.write("hvd.elastic: cannot ask the rendezvous {} for new workers ({}); going on\n".format(
                os.environ.get("HVD_RENDEZVOUS", ""), e))
    _join_check["waiting"] = waiting
    return waiting


def run(func):
    """Decorates ``func(state, ...)``: syncs the state from rank 0 and calls it; when a collective fails with
    ``HorovodInternalError`` (a peer was lost), restores the state to its last commit, re-forms the job (shutdown,
    init), and calls it again. ``HostsUpdatedInterrupt`` re-forms without restoring. Other exceptions propagate, and
    so does a failure of ``hvd.init()`` itself (e.g. fewer workers than the step's minimum: the launcher ends the
    run). More than ``HVD_ELASTIC_RESET_LIMIT`` re-forms in a row without a ``commit()`` (default 10; 0: no limit;
    Horovod's ``--reset-limit``) raise ``HorovodInternalError`` from the last failure: a failure that repeats every
    time (a stall, a timeout) ends the worker instead of re-forming forever."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if not _elastic():
            return _run(state, *args, **kwargs)
        _preemption.install()
        finished = False
        try:
            result = _run(state, *args, **kwargs)
            finished = True
            return result
        finally:
            _preemption.uninstall(finished)

    def _run(state, *args, **kwargs):
        limit = _reset_limit()
        skip_sync = False
        resets = 0
        commits = getattr(state, "_hvd_commits", 0)
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError as e:
                state.restore()
                skip_sync = False
                failure = e
            except HostsUpdatedInterrupt as e:
                skip_sync = e.skip_sync
                failure = e
            if getattr(state, "_hvd_commits", 0) != commits:
                commits, resets = getattr(state, "_hvd_commits", 0), 0
            resets += 1
            if limit and resets > limit:
                raise HorovodInternalError(
                    "hvd.elastic.run: {} re-forms in a row without a commit() (HVD_ELASTIC_RESET_LIMIT={}); the last "
                    "failure: {}".format(resets - 1, limit, failure)) from failure
            _reset()
            state.on_reset()

    return wrapper
