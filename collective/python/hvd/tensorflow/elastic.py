"""Elastic training for TensorFlow (Horovod's ``hvd.tensorflow.elastic``): hvd.elastic's names plus
``TensorFlowState``, a state of TensorFlow variables."""

import tensorflow as tf

from hvd import elastic as _elastic
from hvd.elastic import *  # noqa: F401,F403 - run, State, ObjectState, HostsUpdatedInterrupt, ...
from hvd.elastic import ObjectState

import hvd.tensorflow as _hvd_tf


class TensorFlowState(ObjectState):
    """``ObjectState`` plus TensorFlow variables (default: the graph's global variables): their values are copied
    at each commit and assigned back on restore; ``sync`` broadcasts rank 0's. In graph mode (tf.compat.v1) the
    values are read and written in ``session`` (default: the default session when the state is made). ``checkpoint()``
    writes the last commit's values (``variables.npz``) and attributes (hvd.elastic's format)."""

    def __init__(self, variables=None, session=None, **kwargs):
        self.variables = list(variables) if variables is not None else tf.compat.v1.global_variables()
        self.session = session or tf.compat.v1.get_default_session()
        self._eager = tf.executing_eagerly()
        self._bcast_op = None if self._eager else _hvd_tf.broadcast_variables(self.variables, root_rank=0)
        self._values = None
        self._save_variables()
        super().__init__(**kwargs)

    def _save_variables(self):
        if self._eager:
            self._values = [v.numpy() for v in self.variables]
        else:
            self._values = [v.eval(self.session) for v in self.variables]

    def _load_variables(self):
        for v, value in zip(self.variables, self._values):
            if self._eager:
                v.assign(value)
            else:
                v.load(value, self.session)

    def save(self):
        self._save_variables()
        super().save()

    def restore(self):
        self._load_variables()
        super().restore()

    def sync(self):
        if self._eager:
            _hvd_tf.broadcast_variables(self.variables, root_rank=0)
        elif self.session is not None:
            self.session.run(self._bcast_op)
        self._save_variables()
        super().sync()

    def _checkpoint_files(self):
        files = super()._checkpoint_files()
        files[_elastic._VARIABLES_FILE] = _elastic._variables_file(self._values)
        return files

    def _checkpoint_load(self, files):
        # Checked against the variables (number, shapes, dtypes) before anything is assigned.
        values = _elastic._variables_from(files, _elastic._VARIABLES_FILE, self._values)
        super()._checkpoint_load(files)
        self._values = values
        self._load_variables()


__all__ = list(_elastic.__all__) + ["TensorFlowState"]
