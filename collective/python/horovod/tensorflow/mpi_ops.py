"""``horovod.tensorflow.mpi_ops``: the ops of ``horovod.tensorflow`` (hvd.tensorflow's), under the module name
Horovod defines them in, and ``_basics._get_process_set_ids_and_ranks()`` (Horovod's process-set tests call it)."""

import hvd as _hvd
from horovod._reexport import reexport


class _Basics:
    """The one method of Horovod's private ``HorovodBasics`` object that its test suites call."""

    @staticmethod
    def _get_process_set_ids_and_ranks():
        """``{process set id: its global ranks}`` of the sets this rank knows: the global set (0) and every set
        added and not removed."""
        sets = {0: list(_hvd.global_process_set.ranks or [])}
        for ps_id, ps in sorted(_hvd._SETS.items()):
            sets[ps_id] = list(ps.ranks)
        return sets


_basics = _Basics()

reexport(globals(), "hvd.tensorflow")
del reexport
