"""``horovod.tensorflow.keras.callbacks``: hvd.keras.callbacks."""

from horovod._reexport import reexport

reexport(globals(), "hvd.keras.callbacks")
del reexport
