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
"""

import copy
import functools
import os

import hvd as _hvd

__all__ = ["run", "State", "ObjectState", "TorchState", "HostsUpdatedInterrupt", "HorovodInternalError"]

HorovodInternalError = _hvd.HorovodInternalError


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's signal that the job's hosts changed: ``hvd.elastic.run`` re-forms the job without restoring the
    state (it is current: raised at a commit). With ``skip_sync`` the state is not broadcast again either. hvd's
    launcher adds no hosts to a running job yet, so hvd raises it only where a script does."""

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
        """Horovod's notification hook; hvd's launcher sends no host updates, so nothing calls it."""

    def commit(self):
        """Saves the state (what a failure goes back to), then checks for host changes."""
        self.save()
        self._hvd_commits = getattr(self, "_hvd_commits", 0) + 1
        self.check_host_updates()

    def check_host_updates(self):
        """Raises ``HostsUpdatedInterrupt`` when the job's hosts changed. hvd's launcher adds no hosts to a running
        job (losses arrive as ``HorovodInternalError`` from the collective in flight), so this returns."""

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
