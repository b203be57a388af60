"""``horovod.tensorflow.elastic``: hvd.tensorflow.elastic (hvd's elastic training: ``run``, ``State``,
``ObjectState``, ``TensorFlowState``, ...)."""

from horovod._reexport import reexport_elastic

reexport_elastic(globals(), "tensorflow")
del reexport_elastic
