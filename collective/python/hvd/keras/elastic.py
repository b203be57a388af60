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
    arguments (``epoch=0, batch=0``) are attributes, as in ``ObjectState``. ``checkpoint()`` writes the last commit's
    model weights (``model.npz``), optimizer variables (``optimizer.npz``) and attributes (hvd.elastic's format)."""

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

    def _legacy_optimizer(self):
        return hasattr(self.optimizer, "_create_all_weights")  # tf.keras.optimizers.legacy.*

    def _optimizer_built(self):
        """Whether the optimizer has its slots: Keras creates them at the first step (the new Keras 2 optimizers and
        Keras 3's have their step counter before that)."""
        if self.optimizer is None:
            return False
        if self._legacy_optimizer():
            return bool(self._optimizer_variables())
        return bool(getattr(self.optimizer, "built", False) or getattr(self.optimizer, "_built", False))

    def _build_optimizer(self):
        """Creates the optimizer's variables (its step counter and slots for the model's trainable variables) as its
        first step would, so that a checkpoint's or rank 0's values have somewhere to go."""
        if self.optimizer is None:
            return
        trainable = list(self.model.trainable_variables)
        if self._legacy_optimizer():
            self.optimizer._create_all_weights(trainable)  # gets or creates each slot
        elif not self._optimizer_built():
            self.optimizer.build(trainable)

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
        # A rank that has made no step yet (a new worker, or every rank but 0 after rank 0 resumed from a checkpoint)
        # has no optimizer slots: it creates them when rank 0 has them, so that every rank broadcasts the same list.
        # (Rank 0 without them: no rank's optimizer is synced; they are as a step has never been made on rank 0.)
        if self._bcast_object(self._optimizer_built(), root_rank=0, name="hvd.keras.elastic.optimizer"):
            self._build_optimizer()
            _ops.broadcast_variables(self._optimizer_variables(), root_rank=0)
        super().sync()
        self._save_weights()

    def _checkpoint_files(self):
        files = super()._checkpoint_files()
        files[_elastic._MODEL_FILE] = _elastic._variables_file(self._saved_model)
        files[_elastic._OPTIMIZER_FILE] = _elastic._variables_file(self._saved_optimizer)
        return files

    def _checkpoint_load(self, files):
        # Everything is checked before anything is assigned: a refused checkpoint leaves the state as it was (but
        # the optimizer's slots may have been created, with the values a first step starts from).
        model = _elastic._variables_from(files, _elastic._MODEL_FILE, self._saved_model)
        if _elastic._variables_count(files, _elastic._OPTIMIZER_FILE) != len(self._optimizer_variables()):
            self._build_optimizer()  # the checkpoint was committed after a step, this optimizer has made none
        optimizer = _elastic._variables_from(files, _elastic._OPTIMIZER_FILE,
                                             [v.numpy() for v in self._optimizer_variables()])
        super()._checkpoint_load(files)
        for v, value in zip(self.model.variables, model):
            v.assign(value)
        for v, value in zip(self._optimizer_variables(), optimizer):
            v.assign(value)
        self._save_weights()


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
