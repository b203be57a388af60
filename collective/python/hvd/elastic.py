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
143, as SIGTERM would have ended it: a lost worker. A further SIGTERM while the hand-over is under way is the same
notice delivered again (e.g. a Kubernetes eviction, passed on by the pod and by hvd's launcher) and changes nothing,
unless ``hvd run`` is stopping the step: then, as for any SIGTERM then, the worker ends at once. New workers (host
discovery) join at a commit the same way: the members re-form and sync the state from rank 0.

Checkpoints beyond the process: in a step with ``checkpoints = "ckpt/"`` or ``"s3://bucket/prefix"`` (or under
``hvd run --checkpoints``) the workers get ``HVD_CHECKPOINT_DIR``; ``state.checkpoint()`` writes the last commit there (rank 0 writes: a temporary
directory, every file fsynced, a manifest with the commit number and each file's size and SHA-256 last, then one
rename), keeping the latest ``keep`` (default 3) of the run's own history; older histories are never deleted. ``hvd.elastic.run`` first loads the latest complete checkpoint on
rank 0 (a torn, corrupt or refused one is skipped with a warning, never loaded) and syncs it to every rank, so a new
``hvd run`` after the whole job died goes on from there. The format holds no pickle: ``ObjectState`` values must be
plain (None, bool, int, float, str, list, tuple, dict, numpy arrays and scalars of non-object dtypes: JSON and a
``.npz`` read with ``allow_pickle=False``); ``TorchState``'s model and optimizer go through ``torch.save`` and
``torch.load(weights_only=True)``; ``KerasState``'s and ``TensorFlowState``'s variables go into npz files of
plain arrays (``model.npz``, ``optimizer.npz``, ``variables.npz``), each checked against the state's variables
(number, shapes, dtypes) before anything is assigned.
"""

import copy
import functools
import hashlib
import io
import json
import math
import os
import re
import signal
import socket
import stat
import sys
import threading
import time

import hvd as _hvd

__all__ = ["run", "State", "ObjectState", "TorchState", "HostsUpdatedInterrupt", "HorovodInternalError", "Preempted",
           "CheckpointError"]

HorovodInternalError = _hvd.HorovodInternalError


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's signal that the job's hosts changed: ``hvd.elastic.run`` re-forms the job without restoring the
    state (it is current: raised at a commit). With ``skip_sync`` the state is not broadcast again either (only
    members left: they all hold it). ``commit()`` raises it on every member at once when a member was preempted or
    new workers wait to join."""

    def __init__(self, skip_sync=False):
        super().__init__("the job's hosts changed")
        self.skip_sync = skip_sync


class CheckpointError(RuntimeError):
    """``state.checkpoint()`` could not write the checkpoint (on rank 0; every rank raises it), or a value of the
    state cannot go into one."""


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

    def checkpoint(self, keep=3):
        """Writes the last commit to ``HVD_CHECKPOINT_DIR`` (a step's ``checkpoints``, ``hvd run --checkpoints``) as
        ``ckpt-<commit>``, atomically, and keeps the latest ``keep`` checkpoints of this run's lineage (others are
        never deleted; one at or above this commit is moved aside as ``.old-ckpt-*``). Every rank calls it at the same
        point: rank 0 writes, then one allreduce (``hvd.elastic.checkpoint``) tells every rank whether it succeeded;
        on failure every rank raises ``CheckpointError``. Returns the checkpoint's path on rank 0 (else None); without
        ``HVD_CHECKPOINT_DIR`` it does nothing and returns None."""
        if type(keep) is not int or keep < 1:
            raise ValueError("keep={!r}: keep at least 1 checkpoint".format(keep))
        directory = _checkpoint_dir()
        if directory is None:
            return None
        commit = getattr(self, "_hvd_commits", 0)
        path, error = None, None
        if _rank() == 0:
            try:
                path = _write_checkpoint(directory, commit, self._checkpoint_files(), keep)
            except (OSError, TypeError, ValueError) as e:
                error = e
        if _hvd.is_initialized() and _hvd.size() > 1:
            np = _hvd._np()
            ok = _hvd.allreduce(np.array([0 if error else 1], np.int64), op=_hvd.Min, name="hvd.elastic.checkpoint")
            if not int(ok[0]) and error is None:
                raise CheckpointError("rank 0 could not write the checkpoint of commit {} to {} (its error is in its "
                                      "log)".format(commit, directory))
        if error is not None:
            raise CheckpointError("cannot write the checkpoint of commit {} to {}: {}".format(
                commit, directory, error)) from error
        return path

    def load_checkpoint(self):
        """Loads the latest complete checkpoint of ``HVD_CHECKPOINT_DIR`` into this rank's state, as its last commit
        (and the live values): returns its commit number, or None when there is none (or no ``HVD_CHECKPOINT_DIR``).
        One that is torn, corrupt, or names a file outside itself is skipped with a warning on stderr, and an older
        one is tried; nothing of it is loaded. ``hvd.elastic.run`` calls it on rank 0 before its first sync."""
        directory = _checkpoint_dir()
        if directory is None:
            return None
        skipped = 0
        for name, commit, files, lineage in _complete_checkpoints(directory):
            try:
                self._checkpoint_load(files)
            except _Refused as e:
                _warn_skipped(directory, name, e)
                skipped += 1
                continue
            self._hvd_commits = commit
            # This process now continues that history: its writes prune it (one without a lineage: a new one).
            _lineages[directory] = lineage or _new_lineage()
            return commit
        return None

    def _checkpoint_files(self):
        """The files of a checkpoint of the last commit: ``{name: bytes}``."""
        raise NotImplementedError

    def _checkpoint_load(self, files):
        """Takes a verified checkpoint's files as the last commit (all or nothing); ``_Refused`` when they do not fit
        this state."""
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
        # A fixed name: ranks of a new round may have made different numbers of unnamed object broadcasts. The commit
        # count goes along: a checkpoint's number is rank 0's count, and rank 0 may have resumed from one.
        saved, commits = self._bcast_object((self._saved_state, getattr(self, "_hvd_commits", 0)), root_rank=0,
                                            name="hvd.elastic.sync")
        self._saved_state, self._hvd_commits = saved, commits
        self._set_attrs()

    def _set_attrs(self):
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))

    def _checkpoint_files(self):
        arrays = {}
        attrs = {}
        for attr, value in self._saved_state.items():
            try:
                attrs[attr] = _encode(value, arrays)
            except TypeError as e:
                raise TypeError("state.{}: {}".format(attr, e)) from None
        files = {_STATE_FILE: json.dumps({"attrs": attrs}, allow_nan=False, sort_keys=True).encode("utf-8")}
        if arrays:
            np = _hvd._np()
            buf = io.BytesIO()
            np.savez(buf, **arrays)
            files[_ARRAYS_FILE] = buf.getvalue()
        return files

    def _checkpoint_load(self, files):
        if _STATE_FILE not in files:
            raise _Refused("it has no {}".format(_STATE_FILE))
        try:
            doc = json.loads(files[_STATE_FILE].decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise _Refused("{} is not JSON ({})".format(_STATE_FILE, e)) from None
        attrs = doc.get("attrs") if isinstance(doc, dict) else None
        if not isinstance(attrs, dict):
            raise _Refused("{} has no attributes".format(_STATE_FILE))
        if set(attrs) != set(self._saved_state):
            raise _Refused("it holds the attributes {} but this state has {}".format(
                sorted(attrs), sorted(self._saved_state)))
        arrays = _load_arrays(files.get(_ARRAYS_FILE))
        try:
            saved = {attr: _decode(value, arrays) for attr, value in attrs.items()}
        except (TypeError, ValueError, KeyError, RecursionError) as e:
            raise _Refused("{} does not decode ({})".format(_STATE_FILE, e)) from None
        self._saved_state = saved
        self._set_attrs()


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

    def _checkpoint_files(self):
        import torch

        files = super()._checkpoint_files()
        buf = io.BytesIO()
        torch.save({"model": self._saved_model, "optimizer": self._saved_optimizer}, buf)
        files[_TORCH_FILE] = buf.getvalue()
        return files

    def _checkpoint_load(self, files):
        import torch

        if _TORCH_FILE not in files:
            raise _Refused("it has no {} (not a TorchState's checkpoint)".format(_TORCH_FILE))
        if not _torch_loads_safely(torch.__version__):
            raise _Refused("torch {} is older than 2.6, where torch.load(weights_only=True) can still run code from "
                           "the file (CVE-2025-32434): {} is not loaded; upgrade torch to resume from it".format(
                               torch.__version__, _TORCH_FILE))
        try:
            # weights_only: tensors and plain containers, no code from the file.
            modules = torch.load(io.BytesIO(files[_TORCH_FILE]), map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises many kinds (UnpicklingError, RuntimeError, ...) for a bad file
            raise _Refused("{} does not load with weights_only=True ({})".format(_TORCH_FILE, e)) from None
        if not isinstance(modules, dict) or set(modules) != {"model", "optimizer"}:
            raise _Refused("{} is not a model and an optimizer".format(_TORCH_FILE))
        if (modules["model"] is None) != (self.model is None) or \
                (modules["optimizer"] is None) != (self.optimizer is None):
            raise _Refused("{} does not hold the same model and optimizer as this state".format(_TORCH_FILE))
        before = self._saved_state
        super()._checkpoint_load(files)
        try:
            if self.model is not None:
                self.model.load_state_dict(modules["model"])
            if self.optimizer is not None:
                self.optimizer.load_state_dict(modules["optimizer"])
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            # All or nothing: back to the last commit, which the model may have partly left.
            self._saved_state = before
            self.restore()
            raise _Refused("{} does not fit the model or optimizer ({})".format(_TORCH_FILE, e)) from None
        self._save_modules()


# Checkpoints: `ckpt-<12-digit commit>` directories in HVD_CHECKPOINT_DIR, each with these files and a manifest.
_CKPT_NAME = re.compile(r"ckpt-([0-9]{12})\Z")
_CKPT_TEMP = ".tmp-ckpt-"
_MANIFEST = "MANIFEST.json"
_MANIFEST_FORMAT = "hvd-checkpoint"
_MANIFEST_LIMIT = 1 << 20
_STATE_FILE = "state.json"
_ARRAYS_FILE = "arrays.npz"
_TORCH_FILE = "torch.pt"
# Variables of TensorFlow states (hvd.keras.elastic.KerasState, hvd.tensorflow.elastic.TensorFlowState): one array
# per variable, in the variables' order (``_variables_file``).
_MODEL_FILE = "model.npz"
_OPTIMIZER_FILE = "optimizer.npz"
_VARIABLES_FILE = "variables.npz"
# The only names a manifest may list: a name from the checkpoint never becomes a path of its own.
_CKPT_FILES = (_STATE_FILE, _ARRAYS_FILE, _TORCH_FILE, _MODEL_FILE, _OPTIMIZER_FILE, _VARIABLES_FILE)
_ARRAY_ENTRY = re.compile(r"a[0-9]{1,9}\.npy\Z")
# A run's lineage (in each manifest): the checkpoints one history wrote, across the processes that resumed it. A run
# prunes only its own lineage's checkpoints; any other one at or above its commit is moved aside (`.old-ckpt-*`).
_LINEAGE_HEX = 16
_LINEAGE = re.compile(r"[0-9a-f]{16}\Z")
_CKPT_ASIDE = ".old-"
_CKPT_LOCK = ".hvd-checkpoint.lock"
# Per checkpoint directory (or URL): the lineage this process writes (what it resumed from, or a new one).
_lineages = {}


def _torch_loads_safely(version):
    """Whether torch ``version`` (``"2.6.0+cu124"``) has a ``torch.load(weights_only=True)`` that runs no code from
    the file: 2.6 and later (CVE-2025-32434). A version that does not parse counts as too old."""
    match = re.match(r"([0-9]+)\.([0-9]+)", str(version))
    return bool(match) and (int(match.group(1)), int(match.group(2))) >= (2, 6)


class _Refused(Exception):
    """Why a checkpoint is skipped (torn, corrupt, hostile, or not this state's)."""


def _checkpoint_dir():
    value = os.environ.get("HVD_CHECKPOINT_DIR", "")
    return value or None


def _rank():
    if _hvd.is_initialized():
        return _hvd.rank()
    value = os.environ.get("HVD_RANK", "0").strip()
    return int(value) if value.isdigit() else 0


def _warn_skipped(directory, name, why):
    sys.stderr.write("hvd.elastic: warning: checkpoint {}/{} skipped: {}; trying an older one\n".format(
        directory.rstrip("/"), name, why))
    sys.stderr.flush()


def _encode(value, arrays):
    """A JSON value for ``value``; numpy arrays go into ``arrays``. Every object in the JSON is a one-key tag:
    ``a`` an array, ``s`` a numpy scalar, ``t`` a tuple, ``d`` a dict (pairs), ``f`` a float that JSON lacks."""
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {"f": repr(value)}
    if kind is list:
        return [_encode(v, arrays) for v in value]
    if kind is tuple:
        return {"t": [_encode(v, arrays) for v in value]}
    if kind is dict:
        return {"d": [[_encode(k, arrays), _encode(v, arrays)] for k, v in value.items()]}
    np = sys.modules.get("numpy")
    if np is not None and kind is np.ndarray:
        if value.dtype.hasobject:
            raise TypeError("a numpy array of Python objects cannot go into a checkpoint (no pickle)")
        name = "a{}".format(len(arrays))
        arrays[name] = value
        return {"a": name}
    if np is not None and isinstance(value, np.generic) and not value.dtype.hasobject:
        name = "a{}".format(len(arrays))
        arrays[name] = np.asarray(value)
        return {"s": name}
    raise TypeError("a {} cannot go into a checkpoint: use None, bool, int, float, str, list, tuple, dict and numpy "
                    "arrays (TorchState for a torch model)".format(kind.__name__))


def _decode(value, arrays):
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is list:
        return [_decode(v, arrays) for v in value]
    if type(value) is not dict or len(value) != 1:
        raise ValueError("not a value of a checkpoint")
    (tag, inner), = value.items()
    if tag == "a" and type(inner) is str:
        # Each name is one array of its own (the loader made it); a second reference to a name shares it.
        return arrays[inner]
    if tag == "s" and type(inner) is str:
        return arrays[inner][()]
    if tag == "t" and type(inner) is list:
        return tuple(_decode(v, arrays) for v in inner)
    if tag == "f" and inner in ("nan", "inf", "-inf"):
        return float(inner)
    if tag == "d" and type(inner) is list:
        out = {}
        for pair in inner:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("a dict entry is not a pair")
            out[_decode(pair[0], arrays)] = _decode(pair[1], arrays)
        return out
    raise ValueError("unknown tag {!r}".format(tag))


def _load_arrays(data, name=None):
    """The arrays of the npz file ``name`` (``arrays.npz`` unless named) by name; ``{}`` without one. Only stored
    (uncompressed) ``a<n>.npy`` entries are read, with ``allow_pickle=False``, and only when each entry's header
    declares exactly the bytes the entry holds: no code, no decompression bomb, no array larger than the file."""
    name = name or _ARRAYS_FILE
    if data is None:
        return {}
    import zipfile

    np = _hvd._np()
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            for info in archive.infolist():
                if not _ARRAY_ENTRY.match(info.filename):
                    raise _Refused("{} holds {!r}, a name no checkpoint writes".format(name, info.filename))
                if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
                    raise _Refused("{} holds {!r} compressed ({} bytes for {}); a checkpoint stores its arrays "
                                   "as they are".format(name, info.filename, info.compress_size, info.file_size))
                with archive.open(info) as entry:
                    _check_npy_header(np, _CountingReader(entry), info.file_size, name, info.filename)
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, MemoryError, OverflowError) as e:
        # MemoryError and OverflowError: a backstop behind the header check (an array numpy cannot allocate).
        raise _Refused("{} does not load ({})".format(name, e)) from None


class _CountingReader(object):
    """A reader that counts the bytes read through it (a zip entry has no ``tell()`` before python 3.7)."""

    def __init__(self, raw):
        self._raw = raw
        self.count = 0

    def read(self, size=-1):
        data = self._raw.read(size)
        self.count += len(data)
        return data


def _check_npy_header(np, entry, size, name, entry_name):
    """Refuses the ``.npy`` entry ``entry_name`` of ``name`` (``size`` bytes, read from ``entry``, a
    ``_CountingReader``) unless its header
    parses and its shape and dtype account for exactly the bytes after the header: numpy allocates the declared
    array before it reads the data, so a header of a few bytes could otherwise ask for any amount of memory."""
    fmt = np.lib.format
    version = fmt.read_magic(entry)
    if version == (1, 0):
        shape, _, dtype = fmt.read_array_header_1_0(entry)
    elif version in ((2, 0), (3, 0)):
        # 3.0 (structured dtypes with non-latin-1 field names) differs from 2.0 only in the names' encoding: read as
        # latin-1 they come out mangled, but the shape and the item size are the same.
        shape, _, dtype = fmt.read_array_header_2_0(entry)
    else:
        raise _Refused("{} holds {!r} in .npy version {}.{}, which no checkpoint writes".format(
            name, entry_name, *version))
    if dtype.hasobject:
        return  # np.load refuses it (allow_pickle=False), naming why
    if any(n < 0 for n in shape):
        raise _Refused("{} holds {!r} with the shape {}".format(name, entry_name, list(shape)))
    declared = dtype.itemsize
    for n in shape:
        declared *= n
    held = size - entry.count
    if declared != held:
        raise _Refused("{} holds {!r} declaring {} {} ({} bytes) in {} bytes of data".format(
            name, entry_name, dtype, list(shape), declared, held))


def _variables_file(values):
    """A checkpoint file of a list of variable values (numpy arrays, in order): ``a0.npy``, ``a1.npy``, ... in an
    uncompressed npz, which ``_variables_from`` reads back."""
    np = _hvd._np()
    buf = io.BytesIO()
    arrays = {}
    for i, value in enumerate(values):
        value = np.asarray(value)
        if value.dtype.hasobject or value.dtype.kind == "V":
            raise TypeError("variable {} has the dtype {}, which cannot go into a checkpoint".format(i, value.dtype))
        arrays["a{}".format(i)] = value
    np.savez(buf, **arrays)
    return buf.getvalue()


def _variables_from(files, name, like):
    """The variable values in checkpoint file ``name`` (``_variables_file``), checked against ``like`` (the current
    values, or None to take any number of them): the same number, and each the same shape and dtype. ``_Refused``
    names the file and the first variable that does not fit; nothing is assigned here."""
    if name not in files:
        raise _Refused("it has no {}".format(name))
    arrays = _load_arrays(files[name], name)
    expected = ["a{}".format(i) for i in range(len(arrays))]
    if sorted(arrays) != sorted(expected):
        raise _Refused("{} does not hold the arrays a0 to a{} (one per variable)".format(name, len(arrays) - 1))
    values = [arrays[key] for key in expected]
    if like is None:
        return values
    if len(values) != len(like):
        raise _Refused("{} holds {} variables where this state has {}".format(name, len(values), len(like)))
    np = _hvd._np()
    for i, (value, current) in enumerate(zip(values, like)):
        current = np.asarray(current)
        if value.shape != current.shape or value.dtype != current.dtype:
            raise _Refused("{}: variable {} is {} {} where this state's is {} {}".format(
                name, i, value.dtype, list(value.shape), current.dtype, list(current.shape)))
    return values


def _variables_count(files, name):
    """How many variables checkpoint file ``name`` (``_variables_file``) holds, from its zip directory alone (nothing
    is decoded: ``_variables_from`` checks the values); ``_Refused`` without the file or when it is not a zip."""
    if name not in files:
        raise _Refused("it has no {}".format(name))
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(files[name])) as archive:
            return len(archive.infolist())
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise _Refused("{} does not load ({})".format(name, e)) from None


def _open_in(dir_fd, name, flags):
    return os.open(name, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)


def _read_in(dir_fd, name, limit):
    """A regular file's bytes, at most ``limit`` + 1 of them (never more than the file holds, so a sparse file's
    claimed size is never allocated); never through a link, never blocking on a FIFO."""
    fd = _open_in(dir_fd, name, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Refused("{} is not a regular file".format(name))
        if st.st_size > limit:
            raise _Refused("{} has {} bytes where at most {} are expected".format(name, st.st_size, limit))
        chunks, left = [], st.st_size + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _listed(root_fd):
    """``(name, commit)`` of the ``ckpt-<commit>`` entries of the checkpoint directory, newest first."""
    found = []
    for name in os.listdir(root_fd):
        match = _CKPT_NAME.match(name)
        if match:
            found.append((name, int(match.group(1))))
    found.sort(key=lambda entry: entry[1], reverse=True)
    return found


def _verified(root_fd, name, commit):
    """The files of checkpoint ``name`` of a directory, each checked against the manifest (names, sizes, SHA-256);
    ``_Refused`` otherwise."""
    try:
        fd = _open_in(root_fd, name, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise _Refused("it is not a directory one can open without following a link ({})".format(e)) from None
    try:
        return _verify(lambda file, limit: _read_in(fd, file, limit), commit)
    finally:
        os.close(fd)


def _memory():
    """This machine's memory in bytes (what the files of one checkpoint may hold at most), or None."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _verify(read, commit):
    """``(files, lineage)``: the files of the checkpoint of ``commit`` that ``read(name, limit)`` (at most ``limit``
    + 1 bytes; ``OSError`` when it cannot) reads, each checked against the manifest, and the manifest's ``lineage``
    (None without one); ``_Refused`` otherwise. Sizes that add up to more than this machine's memory are refused
    before anything is read."""
    try:
        raw = read(_MANIFEST, _MANIFEST_LIMIT)
    except OSError as e:
        raise _Refused("no readable {} ({}): torn or incomplete".format(_MANIFEST, e)) from None
    if len(raw) > _MANIFEST_LIMIT:
        raise _Refused("{} is larger than {} bytes".format(_MANIFEST, _MANIFEST_LIMIT))
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _Refused("{} is not JSON ({}): torn or corrupt".format(_MANIFEST, e)) from None
    if not isinstance(manifest, dict) or manifest.get("format") != _MANIFEST_FORMAT or \
            manifest.get("version") != 1:
        raise _Refused("{} is not an hvd checkpoint manifest of version 1".format(_MANIFEST))
    if type(manifest.get("commit")) is not int or manifest["commit"] != commit:
        raise _Refused("{} names commit {!r}, not {}".format(_MANIFEST, manifest.get("commit"), commit))
    entries = manifest.get("files")
    if type(entries) is not list or len(entries) > len(_CKPT_FILES):
        raise _Refused("{} has no valid file list".format(_MANIFEST))
    claimed = sum(e.get("size") for e in entries if type(e) is dict and type(e.get("size")) is int and e["size"] > 0)
    memory = _memory()
    if memory is not None and claimed > memory:
        raise _Refused("{} claims {} bytes of files, more than this machine's memory ({} bytes)".format(
            _MANIFEST, claimed, memory))
    lineage = manifest.get("lineage")
    if lineage is not None and (type(lineage) is not str or not _LINEAGE.match(lineage)):
        raise _Refused("{} has a lineage that is not {} hex digits".format(_MANIFEST, _LINEAGE_HEX))
    files = {}
    for entry in entries:
        if type(entry) is not dict:
            raise _Refused("{} has no valid file list".format(_MANIFEST))
        file, size, digest = entry.get("name"), entry.get("size"), entry.get("sha256")
        if file not in _CKPT_FILES:
            raise _Refused("{} names the file {!r}, which is not one of {} (refused: no name from a checkpoint "
                           "becomes a path)".format(_MANIFEST, file, ", ".join(_CKPT_FILES)))
        if file in files or type(size) is not int or size < 0 or type(digest) is not str:
            raise _Refused("{} lists {} twice or without a size and a hash".format(_MANIFEST, file))
        try:
            data = read(file, size)
        except OSError as e:
            raise _Refused("{} cannot be read ({})".format(file, e)) from None
        if len(data) != size:
            raise _Refused("{} has {} bytes where the manifest says {}: torn".format(
                file, len(data) if len(data) <= size else "more", size))
        if hashlib.sha256(data).hexdigest() != digest:
            raise _Refused("{} does not match its SHA-256 in the manifest: corrupt".format(file))
        files[file] = data
    return files, lineage


def _complete_checkpoints(directory):
    """``(name, commit, files)`` of each verified checkpoint in ``directory`` (or ``s3://`` URL), newest first; each
    skipped one is named in a warning."""
    if directory.startswith("s3://"):
        try:
            store = _S3.of(directory)
        except ValueError as e:
            sys.stderr.write("hvd.elastic: warning: {}; starting without a checkpoint\n".format(e))
            return
        yield from store.complete_checkpoints()
        return
    try:
        root = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return
    except OSError as e:
        sys.stderr.write("hvd.elastic: warning: cannot read the checkpoint directory {} ({}); starting without "
                         "a checkpoint\n".format(directory, e))
        return
    try:
        try:
            listed = _listed(root)
        except OSError as e:
            sys.stderr.write("hvd.elastic: warning: cannot list the checkpoint directory {} ({}); starting without "
                             "a checkpoint\n".format(directory, e))
            return
        for name, commit in listed:
            try:
                files, lineage = _verified(root, name, commit)
            except _Refused as e:
                _warn_skipped(directory, name, e)
                continue
            yield name, commit, files, lineage
    finally:
        os.close(root)


def _write_in(dir_fd, name, data):
    fd = _open_in(dir_fd, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _new_lineage():
    return os.urandom(_LINEAGE_HEX // 2).hex()


def _lineage_of(directory):
    """The lineage this process writes into ``directory``: the one it resumed from, else a new one."""
    if directory not in _lineages:
        _lineages[directory] = _new_lineage()
    return _lineages[directory]


def _remove_entry(root_fd, name, depth=0):
    """Removes ``name`` (a directory tree, or a link itself, never what it points to) from the directory ``root_fd``:
    every step relative to an open directory, never through a link. A checkpoint is one level deep: a deeper tree is
    left, with an ``OSError``."""
    try:
        st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=root_fd)
        return
    if depth > 1:
        raise OSError("{} holds directories within directories, which no checkpoint writes: not removed".format(name))
    fd = _open_in(root_fd, name, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for entry in os.listdir(fd):
            _remove_entry(fd, entry, depth + 1)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=root_fd)


def _lineage_in(root_fd, name):
    """The lineage in the manifest of checkpoint ``name`` of a directory, or None (no readable manifest, none)."""
    try:
        fd = _open_in(root_fd, name, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        manifest = json.loads(_read_in(fd, _MANIFEST, _MANIFEST_LIMIT).decode("utf-8"))
    except (OSError, _Refused, UnicodeDecodeError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)
    lineage = manifest.get("lineage") if isinstance(manifest, dict) else None
    return lineage if type(lineage) is str and _LINEAGE.match(lineage) else None


def _manifest(commit, files, lineage):
    entries = [{"name": name, "size": len(files[name]), "sha256": hashlib.sha256(files[name]).hexdigest()}
               for name in sorted(files)]
    manifest = {"format": _MANIFEST_FORMAT, "version": 1, "commit": commit, "written": time.time(),
                "lineage": lineage, "files": entries}
    return json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8")


def _write_checkpoint(directory, commit, files, keep):
    """Writes ``files`` as checkpoint ``ckpt-<commit>`` of ``directory``: into a temporary directory, every file
    fsynced, the manifest last, then renamed into place and the directory fsynced, all under an exclusive lock on
    ``.hvd-checkpoint.lock`` there (writers never sweep each other's temporary directories). A checkpoint at this or a
    later commit (a history this run did not resume from, or a torn one it skipped) is moved aside as
    ``.old-ckpt-<commit>-<time>``, never deleted; of this run's lineage the latest ``keep`` stay, and no other
    checkpoint is removed. Returns the checkpoint's path. An ``s3://`` URL: see ``_S3.write``."""
    if directory.startswith("s3://"):
        return _S3.of(directory).write(commit, files, keep)
    import fcntl

    lineage = _lineage_of(directory)
    os.makedirs(directory, exist_ok=True)
    root = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:
        lock = _open_in(root, _CKPT_LOCK, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK)
    except OSError:
        os.close(root)
        raise
    try:
        if not stat.S_ISREG(os.fstat(lock).st_mode):
            raise OSError("{}/{} is not a regular file".format(directory.rstrip("/"), _CKPT_LOCK))
        fcntl.flock(lock, fcntl.LOCK_EX)
        temp = "{}{:012d}-{}".format(_CKPT_TEMP, commit, os.getpid())
        for name in os.listdir(root):
            # What a writer killed mid-way left, and an earlier try of this one (a live writer holds the lock).
            if name.startswith(_CKPT_TEMP):
                _remove_entry(root, name)
        os.mkdir(temp, 0o700, dir_fd=root)
        fd = _open_in(root, temp, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for name in sorted(files):
                _write_in(fd, name, files[name])
            _write_in(fd, _MANIFEST, _manifest(commit, files, lineage))
            os.fsync(fd)
        finally:
            os.close(fd)
        final = "ckpt-{:012d}".format(commit)
        for name, number in _listed(root):
            if number >= commit:
                aside = "{}{}-{}".format(_CKPT_ASIDE, name, time.time_ns())
                os.rename(name, aside, src_dir_fd=root, dst_dir_fd=root)
                sys.stderr.write("hvd.elastic: warning: {}/{} is at or above commit {} and not what this run "
                                 "resumed from: moved aside as {}\n".format(directory.rstrip("/"), name, commit,
                                                                          aside))
        os.rename(temp, final, src_dir_fd=root, dst_dir_fd=root)
        os.fsync(root)
        ours = [name for name, _ in _listed(root) if _lineage_in(root, name) == lineage]
        for name in ours[keep:]:
            _remove_entry(root, name)
        return os.path.join(directory, final)
    finally:
        os.close(lock)
        os.close(root)


# What one request to an S3 server may take in all (connect, send, the whole answer), and the most an index of
# checkpoints may hold.
_S3_TIMEOUT = 120.0
_S3_INDEX = "INDEX"
_S3_INDEX_LIMIT = 64 << 10
_S3_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]\Z")
_S3_SEGMENT = re.compile(r"[A-Za-z0-9._=+-]{1,255}\Z")


class _S3:
    """Checkpoints in an S3 bucket (``s3://bucket/prefix``; any S3-compatible server at ``HVD_S3_ENDPOINT`` or
    ``AWS_ENDPOINT_URL``, path-style, requests signed with AWS Signature V4 from ``AWS_ACCESS_KEY_ID`` /
    ``AWS_SECRET_ACCESS_KEY`` [/ ``AWS_SESSION_TOKEN``], ``AWS_REGION``; unsigned without a key). Objects are
    ``<prefix>/ckpt-<commit>/<file>`` and ``<prefix>/INDEX``, the names of the complete checkpoints, one a line: a
    checkpoint is complete once INDEX names it, which is written after its files and manifest. What the server
    answers is read as untrusted: bounded reads, names from INDEX only when they are ``ckpt-<12 digits>``."""

    def __init__(self, url, endpoint, region, key_id, secret, token):
        self.url = url
        bucket, _, prefix = url[len("s3://"):].partition("/")
        segments = [p for p in prefix.split("/") if p]
        if not _S3_BUCKET.match(bucket) or not all(_S3_SEGMENT.match(p) and p not in (".", "..") for p in segments):
            raise ValueError("{} is not s3://bucket/prefix (a bucket name, then path segments of [A-Za-z0-9._=+-])"
                             .format(url))
        import urllib.parse

        parts = urllib.parse.urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
            raise ValueError("the S3 endpoint {!r} is not an http(s)://host[:port] URL".format(endpoint))
        self.https = parts.scheme == "https"
        self.host = parts.netloc
        self.base = "/" + "/".join([p for p in parts.path.split("/") if p] + [bucket] + segments)
        self.region, self.key_id, self.secret, self.token = region, key_id, secret, token

    @classmethod
    def of(cls, url):
        env = os.environ.get
        region = env("AWS_REGION") or env("AWS_DEFAULT_REGION") or "us-east-1"
        endpoint = env("HVD_S3_ENDPOINT") or env("AWS_ENDPOINT_URL") or "https://s3.{}.amazonaws.com".format(region)
        return cls(url, endpoint, region, env("AWS_ACCESS_KEY_ID") or "", env("AWS_SECRET_ACCESS_KEY") or "",
                   env("AWS_SESSION_TOKEN") or "")

    def _request(self, method, key, body=b"", limit=0):
        """``(status, body)``: at most ``limit`` + 1 bytes of the answer's body are read."""
        import hmac
        import http.client
        import urllib.parse

        path = urllib.parse.quote(self.base + "/" + key, safe="/-_.~")
        payload = hashlib.sha256(body).hexdigest()
        now = time.gmtime()
        stamp, day = time.strftime("%Y%m%dT%H%M%SZ", now), time.strftime("%Y%m%d", now)
        headers = {"host": self.host, "x-amz-content-sha256": payload, "x-amz-date": stamp}
        if self.token:
            headers["x-amz-security-token"] = self.token
        if self.key_id and self.secret:
            names = sorted(headers)
            canonical = "\n".join([method, path, "", "".join("{}:{}\n".format(n, headers[n]) for n in names),
                                   ";".join(names), payload])
            scope = "{}/{}/s3/aws4_request".format(day, self.region)
            to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
            signing = ("AWS4" + self.secret).encode()
            for part in (day, self.region, "s3", "aws4_request"):
                signing = hmac.new(signing, part.encode(), hashlib.sha256).digest()
            signature = hmac.new(signing, to_sign.encode(), hashlib.sha256).hexdigest()
            headers["authorization"] = "AWS4-HMAC-SHA256 Credential={}/{}, SignedHeaders={}, Signature={}".format(
                self.key_id, scope, ";".join(names), signature)
        connection = (http.client.HTTPSConnection if self.https else http.client.HTTPConnection)(
            self.host, timeout=_S3_TIMEOUT)
        # The whole request (connect, send, answer) ends by the deadline: a server that drips its answer byte by byte
        # (each read within the socket's timeout) has the connection shut under it then.
        late = threading.Event()
        opened = []

        def expire():
            late.set()
            # The socket itself, not `connection.sock`: the connection lets go of it once the answer is the last.
            for sock in opened:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        timer = threading.Timer(_S3_TIMEOUT, expire)
        timer.daemon = True
        timer.start()
        try:
            connection.connect()
            opened.append(connection.sock)
            if late.is_set():
                expire()
            connection.request(method, path, body=body, headers=headers)
            answer = connection.getresponse()
            chunks, left = [], limit + 1
            while left > 0 and not late.is_set():
                chunk = answer.read(min(left, 1 << 16))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            if late.is_set():
                raise OSError("{} {}: no whole answer within {} s".format(method, self.where(key), _S3_TIMEOUT))
            return answer.status, b"".join(chunks)
        except (http.client.HTTPException, ValueError, OSError) as e:
            if late.is_set():
                raise OSError("{} {}: no whole answer within {} s".format(method, self.where(key), _S3_TIMEOUT)) \
                    from None
            if isinstance(e, OSError):
                raise
            raise OSError("{} {}: {}".format(method, self.where(key), e)) from None
        finally:
            timer.cancel()
            connection.close()

    def where(self, key):
        return "{}/{}".format(self.url.rstrip("/"), key)

    def get(self, key, limit):
        """The object's bytes (at most ``limit`` + 1), or None when there is none; ``OSError`` otherwise."""
        status, body = self._request("GET", key, limit=limit)
        if status == 404:
            return None
        if status != 200:
            raise OSError("GET {}: HTTP {}: {}".format(self.where(key), status, body[:200].decode("utf-8", "replace")))
        return body

    def put(self, key, data):
        status, body = self._request("PUT", key, body=data, limit=4096)
        if status not in (200, 201, 204):
            raise OSError("PUT {}: HTTP {}: {}".format(self.where(key), status, body[:200].decode("utf-8", "replace")))

    def delete(self, key):
        status, body = self._request("DELETE", key, limit=4096)
        if status not in (200, 202, 204, 404):
            raise OSError("DELETE {}: HTTP {}: {}".format(self.where(key), status,
                                                          body[:200].decode("utf-8", "replace")))

    def index(self):
        """``(name, commit)`` of the checkpoints INDEX names, newest first."""
        raw = self.get(_S3_INDEX, _S3_INDEX_LIMIT) or b""
        if len(raw) > _S3_INDEX_LIMIT:
            raise OSError("{} is larger than {} bytes".format(self.where(_S3_INDEX), _S3_INDEX_LIMIT))
        found = {}
        for line in raw.decode("ascii", "replace").split("\n"):
            match = _CKPT_NAME.match(line.strip())
            if match:
                found[line.strip()] = int(match.group(1))
        return sorted(found.items(), key=lambda entry: entry[1], reverse=True)

    def complete_checkpoints(self):
        try:
            listed = self.index()
        except OSError as e:
            sys.stderr.write("hvd.elastic: warning: cannot read the checkpoints at {} ({}); starting without a "
                             "checkpoint\n".format(self.url, e))
            return
        for name, commit in listed:

            def read(file, limit, name=name):
                data = self.get("{}/{}".format(name, file), limit)
                if data is None:
                    raise OSError("{} is not there".format(self.where("{}/{}".format(name, file))))
                return data

            try:
                files, lineage = _verify(read, commit)
            except _Refused as e:
                _warn_skipped(self.url, name, e)
                continue
            yield name, commit, files, lineage

    def lineage(self, name):
        """The lineage in the manifest of checkpoint ``name``, or None (none, or not readable)."""
        try:
            raw = self.get("{}/{}".format(name, _MANIFEST), _MANIFEST_LIMIT)
            manifest = json.loads(raw.decode("utf-8")) if raw and len(raw) <= _MANIFEST_LIMIT else None
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            return None
        lineage = manifest.get("lineage") if isinstance(manifest, dict) else None
        return lineage if type(lineage) is str and _LINEAGE.match(lineage) else None

    def write(self, commit, files, keep):
        """Uploads the checkpoint (its files, then its manifest), then names it in INDEX. A checkpoint INDEX names at
        this or a later commit leaves INDEX (its objects stay: moved aside, as in a directory); of this run's lineage
        the latest ``keep`` stay in INDEX and the objects of the others are deleted; every other checkpoint stays. An
        INDEX that cannot be read fails the write (``OSError``) before anything is removed."""
        lineage = _lineage_of(self.url)
        final = "ckpt-{:012d}".format(commit)
        for name in sorted(files):
            self.put("{}/{}".format(final, name), files[name])
        self.put("{}/{}".format(final, _MANIFEST), _manifest(commit, files, lineage))
        before = [(n, c) for n, c in self.index() if n != final]
        for name, number in before:
            if number >= commit:
                sys.stderr.write("hvd.elastic: warning: {} is at or above commit {} and not what this run resumed "
                                 "from: left out of INDEX (its objects stay)\n".format(self.where(name), commit))
        older = [(n, c, self.lineage(n) == lineage) for n, c in before if c < commit]
        ours = [n for n, _, mine in older if mine]
        pruned = set(ours[max(keep - 1, 0):])
        kept = [(final, commit)] + [(n, c) for n, c, _ in older if n not in pruned]
        self.put(_S3_INDEX, "".join(n + "\n" for n, _ in reversed(kept)).encode("ascii"))
        for name in sorted(pruned):
            for file in (_MANIFEST,) + _CKPT_FILES:
                self.delete("{}/{}".format(name, file))
        return self.where(final)


def _resume(state):
    """Once per state, before ``run``'s first sync: rank 0 loads the latest complete checkpoint (the sync then gives
    it to every rank), says so on stderr and tells ``hvd run``: through the rendezvous (``_report_resume``), else in
    the file ``HVD_CHECKPOINT_REPORT``."""
    if getattr(state, "_hvd_resume_tried", False):
        return
    state._hvd_resume_tried = True
    if _checkpoint_dir() is None or _rank() != 0:
        return
    commit = state.load_checkpoint()
    if commit is None:
        return
    sys.stderr.write("hvd.elastic: resumed from checkpoint at commit {} ({}/ckpt-{:012d})\n".format(
        commit, _checkpoint_dir().rstrip("/"), commit))
    sys.stderr.flush()
    if _report_resume(commit):
        return
    report = os.environ.get("HVD_CHECKPOINT_REPORT", "")
    if report:
        try:
            # Never through a link (the report's directory is the launcher's, but what is in it may not be).
            fd = os.open(report, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                         0o600)
            try:
                os.write(fd, "commit {}\n".format(commit).encode("ascii"))
            finally:
                os.close(fd)
        except OSError as e:
            sys.stderr.write("hvd.elastic: warning: cannot tell hvd run that it resumed ({}: {})\n".format(report, e))


# Where rank 0 tells ``hvd run`` that it resumed (``commit N``): a key of the launcher's rendezvous, which rank 0
# reaches on any host when the launcher started every rank itself (it says so: ``HVD_CHECKPOINT_REPORT_RENDEZVOUS=1``;
# launcher/src/supervisor.rs reads the key when the step ends). Under mpirun or srun ``HVD_RENDEZVOUS`` may be a
# loopback address on another host than the launcher's, where whatever listens must not get the job's token.
_RESUMED_PATH = "/kv/hvd.checkpoint/resumed"
_RESUMED_TIMEOUT = 5.0


def _report_resume(commit):
    """Puts ``commit N`` at the rendezvous's ``_RESUMED_PATH``; whether it was taken (False: the launcher did not say
    its rendezvous is reachable for this, there is no HTTP rendezvous, or it did not answer 200 within
    ``_RESUMED_TIMEOUT`` in all: then the file ``HVD_CHECKPOINT_REPORT``)."""
    import http.client
    import threading

    if os.environ.get("HVD_CHECKPOINT_REPORT_RENDEZVOUS", "").strip() != "1":
        return False
    answers = []

    def put():
        try:
            answers.append(_rendezvous_request("PUT", _RESUMED_PATH, _RESUMED_TIMEOUT,
                                               "commit {}\n".format(commit).encode("ascii")))
        except (OSError, ValueError, http.client.HTTPException):
            pass

    # One deadline for the whole request (the socket's timeout is per operation: a server that trickles its answer
    # would hold rank 0 far longer); a late answer is ignored, the file says it instead.
    request = threading.Thread(target=put, name="hvd-report-resume", daemon=True)
    request.start()
    request.join(_RESUMED_TIMEOUT)
    answer = answers[0] if answers else None
    return answer is not None and answer[0] == 200


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
    # At most a day, the bound the launcher reads it with (past it the ssh wrapper would kill the worker after 30 s
    # while the worker still counted on its own grace).
    if not 0 <= grace <= 86400:
        raise _hvd.InvalidArgumentError(
            "HVD_PREEMPT_GRACE={!r} is not a number of seconds from 0 to 86400 (a day)".format(value))
    return grace


class _Preemption:
    """The SIGTERM handler ``run`` installs in an elastic step, and what it marked."""

    def __init__(self):
        self.marked = None  # time.monotonic() of the first SIGTERM
        self.previous = None  # the handler it replaced
        self.depth = 0  # nested run() calls
        self.timer = None
        self.grace = 30.0
        # Set once this worker hands over (`_leave`): every SIGTERM after that is the same notice again (Kubernetes:
        # the launcher's hand-over request, once it sees the pod being deleted, can come after the pod's own SIGTERM
        # was answered), and the process is on its way out with code 0 (SIGTERM is ignored from then on).
        self.left = False

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
        if self.depth > 0 or self.previous is None or self.left:
            # (Handed over: SIGTERM stays ignored, a late duplicate notice, while the process exits.)
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
        if self.left:
            return
        # Marked first: a SIGTERM that arrives while this handler asks the launcher (Python may run the handler again
        # inside itself) is then taken for what it is, not for a first notice of its own.
        first = self.marked is None
        if first:
            self.marked = time.monotonic()
        previous = self.previous
        if _launcher_stopping():
            # `hvd run` stops the step (a failure, below the minimum, an interrupt): no hand-over to wait for. End
            # now, unwinding (finally blocks and atexit run), with the code SIGTERM would have given; nothing is
            # marked (leaving `run` must not deliver this SIGTERM again).
            self.cancel()
            self.marked = None
            _say_stopped()
            if callable(previous) and previous is not signal.default_int_handler:
                previous(signum, frame)
            raise SystemExit(128 + signal.SIGTERM)
        if not first:
            # The same notice again: a platform and hvd's launcher both pass one eviction on (Kubernetes: the worker
            # pod's SIGTERM, and the launcher's hand-over request once it sees the pod being deleted). The hand-over
            # is under way; HVD_PREEMPT_GRACE bounds it.
            return
        sys.stderr.write(
            "hvd.elastic: SIGTERM: this worker (slot {}) commits, hands over and leaves at its next commit (within "
            "HVD_PREEMPT_GRACE={:g} s)\n".format(os.environ.get("HVD_RANK", "?"), self.grace))
        sys.stderr.flush()
        self.cancel()
        self.timer = threading.Timer(self.grace, self.end, args=("no commit within HVD_PREEMPT_GRACE={:g} s of "
                                                                  "SIGTERM".format(self.grace),))
        self.timer.daemon = True
        self.timer.start()
        # Chain a handler of the script's own (it may log, flush, save); the default action is what this replaces.
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    def ignore_late_notices(self):
        """Once this worker hands over, a later SIGTERM is the same notice again and is ignored (``SIG_IGN``), not
        absorbed by ``handle``: the interpreter puts the default action back for a Python handler as it exits, so a
        notice that came then (the launcher's hand-over request after the pod's own SIGTERM) ended the worker with
        143, a loss, after it had handed over. A process the worker starts from here on inherits the ignored SIGTERM.
        Only when this handler is the one installed (the main thread's ``run``)."""
        try:
            if signal.getsignal(signal.SIGTERM) == self.handle:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
        except (ValueError, OSError):
            pass

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
    this worker, refuse its leave, and count it as lost. A leave the launcher refuses because it is stopping the step
    ends the worker as stopped (``SystemExit(143)``), as the stop's SIGTERM would have."""
    _preemption.left = True
    _preemption.ignore_late_notices()
    lib = _hvd._l()
    leave = lib.hvd_elastic_leave
    leave.restype, leave.argtypes = _ctypes_i32(), []
    left = leave()
    error = _hvd._error(lib) if left < 0 else None
    _hvd.shutdown()
    _preemption.cancel()
    # Handed over: the SIGTERM is answered, so leaving run() does not deliver it again.
    _preemption.marked = None
    if left < 0:
        if _launcher_stopping():
            # The launcher refused the hand-over: it began to stop the step first (its stop ended the worker this one
            # waited for in its last step, so that step completed and this one committed; the stop's SIGTERM may come
            # later, or have found the handler gone). No job goes on to hand over to: end as stopped.
            sys.stderr.write("hvd.elastic: preempted, but hvd run began to stop the step before the hand-over "
                             "({})\n".format(error))
            _say_stopped()
            raise SystemExit(128 + signal.SIGTERM)
        sys.stderr.write("hvd.elastic: preempted, but the launcher was not told ({}); exiting anyway\n".format(error))
    else:
        sys.stderr.write("hvd.elastic: preempted: committed and left the job; {} workers go on\n".format(left))
    sys.stderr.flush()
    raise Preempted("hvd.elastic: this worker was preempted (SIGTERM) and left the job after its last commit")


def _say_stopped():
    sys.stderr.write("hvd.elastic: SIGTERM: hvd run is stopping the step; this worker (slot {}) ends now (exit code "
                     "143)\n".format(os.environ.get("HVD_RANK", "?")))
    sys.stderr.flush()


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
    answer = _rendezvous_request("GET", "/elastic/v1/round", timeout)
    return None if answer is None else (answer[0], answer[1].decode("ascii", "replace").split())


def _rendezvous_request(method, path, timeout, body=None):
    """One request with the job token to the launcher's HTTP rendezvous (``HVD_RENDEZVOUS``): ``(status, the first
    256 bytes of the answer)``, or ``None`` when there is no HTTP rendezvous. Raises ``OSError``, ``ValueError`` or
    ``http.client.HTTPException`` when it cannot be asked."""
    import http.client

    address = os.environ.get("HVD_RENDEZVOUS", "")
    token = os.environ.get("HVD_JOB_TOKEN", "")
    if not address or address.startswith("file:") or ":" not in address:
        return None
    host, _, port = address.rpartition(":")
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Authorization": "Bearer " + token})
        answer = conn.getresponse()
        return answer.status, answer.read(256)
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
        _resume(state)
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
