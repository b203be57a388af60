"""``horovod.tensorflow``: hvd.tensorflow. Importing it imports TensorFlow, as hvd.tensorflow does."""

from horovod._reexport import reexport
from horovod.common.util import nccl_built  # noqa: F401 - Horovod's answer is a version number

reexport(globals(), "hvd.tensorflow")
del reexport

from horovod.tensorflow import util  # noqa: E402,F401 - Horovod's tests reach it as hvd.util
from horovod.tensorflow import mpi_ops  # noqa: E402,F401 - Horovod's tests reach it as hvd.mpi_ops
