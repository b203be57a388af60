"""``horovod.torch``: hvd.torch (PyTorch, CPU tensors through DLPack). Importing it imports torch, as hvd.torch
does."""

from horovod._reexport import reexport

reexport(globals(), "hvd.torch")
del reexport
