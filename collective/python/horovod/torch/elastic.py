"""``horovod.torch.elastic``: hvd's elastic training for torch once hvd has it (``hvd.torch.elastic``, else
``hvd.elastic``); until then importing this raises ModuleNotFoundError saying so."""

from horovod._reexport import reexport

reexport(
    globals(),
    "hvd.torch.elastic",
    "hvd.elastic",
    missing="horovod.torch.elastic needs hvd's elastic training, which hvd does not have yet (`hvd run` has no "
    "elastic mode); docs/horovod.md",
)
del reexport
