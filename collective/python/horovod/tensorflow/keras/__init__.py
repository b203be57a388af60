"""``horovod.tensorflow.keras``: hvd.keras (Keras on TensorFlow: DistributedOptimizer, callbacks, elastic state,
collectives of Keras values). Importing it imports TensorFlow."""

from horovod._reexport import reexport
from horovod.common.util import nccl_built  # noqa: F401 - Horovod's answer is a version number

reexport(globals(), "hvd.keras")
del reexport

from horovod.tensorflow.keras import callbacks, elastic  # noqa: E402,F401 - Horovod's submodules
