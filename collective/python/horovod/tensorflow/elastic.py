"""``horovod.tensorflow.elastic``: hvd's elastic training for tensorflow once hvd has it (``hvd.tensorflow.elastic``, else
``hvd.elastic``); until then importing this raises ModuleNotFoundError saying so."""

from horovod._reexport import reexport

reexport(
    globals(),
    "hvd.tensorflow.elastic",
    "hvd.elastic",
    missing="horovod.tensorflow.elastic needs hvd's elastic training, which hvd does not have yet (`hvd run` has no "
    "elastic mode); docs/horovod.md",
)
del reexport
