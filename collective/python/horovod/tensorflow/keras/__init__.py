"""``horovod.tensorflow.keras``: hvd's Keras module when it has one, else hvd.tensorflow (the collectives and
``init``/``rank``/``size``; names hvd lacks, such as Keras callbacks, raise AttributeError naming docs/horovod.md)."""

from horovod._reexport import reexport
from horovod.common.util import nccl_built  # noqa: F401 - Horovod's answer is a version number

reexport(globals(), "hvd.tensorflow.keras", "hvd.tensorflow")
del reexport
