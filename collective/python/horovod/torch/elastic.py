"""``horovod.torch.elastic``: hvd's elastic training for torch once hvd has it; until then the import fails
saying so."""

from horovod._reexport import reexport_elastic

reexport_elastic(globals(), "torch")
del reexport_elastic
