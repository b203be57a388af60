"""``horovod.runner``: Horovod's launcher entry points. Jobs start with ``hvd run`` (or the ``horovodrun`` command of
the env, which calls it); starting workers from inside a Python function is refused with a message naming it."""

_RUN = (
    "horovod.run() starts workers from inside Python, which hvd does not do: put the training function in a "
    "script and start it with `hvd run` (a `step` with `workers = N` in the .hvd file) or `horovodrun -np N python "
    "script.py` in the env; docs/horovod.md"
)


def run(func, args=(), kwargs=None, np=1, **options):
    """Refused: see ``_RUN``."""
    raise NotImplementedError(_RUN)


__all__ = ["run"]
