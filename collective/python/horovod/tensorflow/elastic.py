"""``horovod.tensorflow.elastic``: hvd's elastic training for tensorflow once hvd has it; until then the import fails
saying so."""

from horovod._reexport import reexport_elastic

reexport_elastic(globals(), "tensorflow")
del reexport_elastic
