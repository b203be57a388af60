"""``horovod.keras``: the same module as ``horovod.tensorflow.keras`` (Keras on TensorFlow)."""

from horovod._reexport import reexport
from horovod.common.util import nccl_built  # noqa: F401 - Horovod's answer is a version number

reexport(globals(), "hvd.keras", "hvd.tensorflow.keras", "hvd.tensorflow")
del reexport
