"""``horovod.runner.common.util.env``: ``get_env_rank_and_size`` (Horovod's process-set test suites call it before
``hvd.init()`` to know the job's size)."""

import os

# Launchers' (rank, size) variables, in the order they are asked: hvd run's own, the names hvd run also sets for
# Horovod's scripts, Open MPI's and PMI's (mpirun, srun).
_PAIRS = (("HVD_RANK", "HVD_SIZE"), ("HOROVOD_RANK", "HOROVOD_SIZE"),
          ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"))


def get_env_rank_and_size():
    """``(rank, size)`` of this worker from the first launcher's pair of variables that is set, or None when no
    launcher set one (as Horovod's). A pair with only one of its variables set, or a value that is not a number, is a
    ``RuntimeError`` naming the variables."""
    for rank_var, size_var in _PAIRS:
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is None and size is None:
            continue
        if rank is None or size is None:
            raise RuntimeError("{} is set but {} is not: a launcher sets both".format(
                rank_var if rank is not None else size_var, size_var if rank is not None else rank_var))
        try:
            return int(rank), int(size)
        except ValueError:
            raise RuntimeError("{}={!r} and {}={!r}: not numbers".format(rank_var, rank, size_var, size)) from None
    return None
