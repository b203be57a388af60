"""``horovod.tensorflow``: hvd.tensorflow. Importing it imports TensorFlow, as hvd.tensorflow does."""

from horovod._reexport import reexport

reexport(globals(), "hvd.tensorflow")
del reexport
