"""Elastic training of Keras models (Horovod's ``horovod.tensorflow.keras.elastic``): ``KerasState`` and the callbacks
that commit it and keep its batch and epoch, over ``hvd.elastic``."""

import tensorflow as tf

from hvd import elastic as _elastic
from hvd.elastic import run  # noqa: F401 - Horovod's horovod.tensorflow.keras.elastic.run
from hvd.keras import _ops

keras = tf.keras


class KerasState(_elastic.ObjectState):
    """``ObjectState`` plus a Keras model and its optimizer (``optimizer`` defaults to the model's): ``commit()``
    copies their weights, ``restore()`` puts the copies back, ``sync()`` gives every rank rank 0's. Other keyword
    arguments (``epoch=0, batch=0``) are attributes, as in ``ObjectState``."""

    def __init__(self, model, optimizer=None, **kwargs):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self._saved_model = None
        self._saved_optimizer = None
        super().__init__(**kwargs)
        self._save_weights()

    def _optimizer_variables(self):
        if self.optimizer is None:
            return []
        return _ops.optimizer_variables(self.optimizer)

    def _save_weights(self):
        self._saved_model = [v.numpy() for v in self.model.variables]
        self._saved_optimizer = [v.numpy() for v in self._optimizer_variables()]

    def save(self):
        self._save_weights()
        super().save()

    def restore(self):
        for v, value in zip(self.model.variables, self._saved_model):
            v.assign(value)
        opt_vars = self._optimizer_variables()
        if len(opt_vars) == len(self._saved_optimizer):
            for v, value in zip(opt_vars, self._saved_optimizer):
                v.assign(value)
        super().restore()

    def sync(self):
        _ops.broadcast_variables(list(self.model.variables), root_rank=0)
        _ops.broadcast_variables(self._optimizer_variables(), root_rank=0)
        super().sync()
        self._save_weights()

    def _checkpoint_files(self):
        raise NotImplementedError("KerasState.checkpoint() is not implemented yet: checkpoint the model with "
                                  "model.save_weights on rank 0, or use ObjectState for what must survive the job")

    def _checkpoint_load(self, files):
        raise _elastic._Refused("KerasState has no checkpoints (a checkpoint found is not loaded)")


class CommitStateCallback(keras.callbacks.Callback):
    """Commits ``state`` every ``batches_per_commit`` batches and at the end of every epoch."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        # Every rank starts counting again after a re-form, so they commit at the same batches.
        self.batches_remaining = self.batches_per_commit

    def on_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps ``state.batch`` at the batch just finished (0 after each epoch); with a known number of steps per
    epoch, the first epoch after a restore runs only the batches that remain."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.steps_per_epoch = None

    def on_train_begin(self, logs=None):
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params.get("steps")
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps ``state.epoch`` at the number of epochs finished, counted across restarts (Keras counts from 0 in
    each ``fit``)."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.initial_epoch = self.state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1


__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]
