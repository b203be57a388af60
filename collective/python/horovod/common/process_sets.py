"""Horovod's process sets: hvd's when it has them; until then the global set (every rank) works and creating or
changing a set is refused with a message naming the gap."""

import hvd as _hvd

_MISSING = (
    "hvd does not implement Horovod's process sets yet: every collective runs over all ranks (the global process "
    "set); docs/horovod.md lists what works"
)


class _GlobalProcessSet:
    """The set of every rank of the job, Horovod's ``global_process_set`` (id 0)."""

    process_set_id = 0

    @property
    def ranks(self):
        return list(range(_hvd.size()))

    def size(self):
        return _hvd.size()

    def rank(self):
        return _hvd.rank()

    def included(self):
        return True

    def __repr__(self):
        return "ProcessSet(process_set_id=0, ranks=all)"


class _RefusedProcessSet:
    """Stands for Horovod's ``ProcessSet`` class: constructing one is refused (hvd has no process sets yet)."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(_MISSING)


def _refused(*args, **kwargs):
    raise NotImplementedError(_MISSING)


ProcessSet = getattr(_hvd, "ProcessSet", _RefusedProcessSet)
global_process_set = getattr(_hvd, "global_process_set", None) or _GlobalProcessSet()
add_process_set = getattr(_hvd, "add_process_set", _refused)
remove_process_set = getattr(_hvd, "remove_process_set", _refused)

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]
