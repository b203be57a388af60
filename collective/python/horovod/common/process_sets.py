"""Horovod's process sets (``horovod.common.process_sets``): hvd's, each set with its own negotiation and
communicator in the runtime (docs/runtime.md, "Process sets")."""

from hvd import ProcessSet, add_process_set, global_process_set, remove_process_set  # noqa: F401

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]
