"""``horovod.keras.elastic``: hvd.keras.elastic (KerasState and its callbacks over hvd.elastic)."""

from horovod._reexport import reexport

reexport(globals(), "hvd.keras.elastic")
del reexport
