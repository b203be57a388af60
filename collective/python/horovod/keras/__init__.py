"""``horovod.keras``: the same module as ``horovod.tensorflow.keras`` (Keras on TensorFlow)."""

from horovod._reexport import reexport

reexport(globals(), "hvd.keras", "hvd.tensorflow.keras", "hvd.tensorflow")
del reexport
