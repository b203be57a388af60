"""Horovod's Keras callbacks: broadcast the initial state, average the epoch's metrics, schedule and warm up the
learning rate, keep the best model."""

import numpy as np
import tensorflow as tf

import hvd as _core
from hvd import _lr_schedule
from hvd.keras import _ops

keras = tf.keras


def _get_lr(optimizer):
    lr = optimizer.learning_rate if hasattr(optimizer, "learning_rate") else optimizer.lr
    if hasattr(lr, "numpy"):
        return float(lr.numpy())
    return float(keras.backend.get_value(lr)) if tf.is_tensor(lr) else float(lr)


def _set_attr(optimizer, attr, value):
    current = getattr(optimizer, attr)
    if hasattr(current, "assign"):
        current.assign(value)
    else:
        setattr(optimizer, attr, value)


def _set_lr(optimizer, value):
    _set_attr(optimizer, "learning_rate" if hasattr(optimizer, "learning_rate") else "lr", value)


def _get_value(x):
    if hasattr(x, "numpy"):
        return x.numpy()
    return keras.backend.get_value(x) if tf.is_tensor(x) else x


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the end of the first batch, gives every rank ``root_rank``'s model and optimizer variables (all of them:
    the optimizer's exist only once it has applied a step), except ``local_variables`` (or those added with
    ``register_local_var``). ``device`` is accepted and unused (hvd reduces CPU memory)."""

    def __init__(self, root_rank, device="", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._local_vars = set()
        if local_variables is not None:
            if not isinstance(local_variables, (list, tuple, set)):
                local_variables = [local_variables]
            for var in local_variables:
                self.register_local_var(var)

    def register_local_var(self, var):
        """``var`` keeps this rank's value."""
        self._local_vars.add(_ops._key(var))

    def on_batch_end(self, batch, logs=None):
        if self.broadcast_done:
            return
        if tf.executing_eagerly():
            model_vars = [v for v in self.model.variables if _ops._key(v) not in self._local_vars]
            _ops.broadcast_variables(model_vars, root_rank=self.root_rank)
            optimizer = getattr(self.model, "optimizer", None)
            if optimizer is not None:
                opt_vars = [v for v in _ops.optimizer_variables(optimizer)
                            if _ops._key(v) not in self._local_vars]
                _ops.broadcast_variables(opt_vars, root_rank=self.root_rank)
        else:
            variables = [v for v in tf.compat.v1.global_variables() if _ops._key(v) not in self._local_vars]
            op = _ops.broadcast_variables_op(variables, self.root_rank, "BroadcastGlobalVariablesCallback")
            tf.compat.v1.keras.backend.get_session().run(op)
        self.broadcast_done = True

    on_train_batch_end = on_batch_end


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of each epoch replaces every metric in ``logs`` with its average over the ranks (before the
    callbacks after it see them: put it before checkpoints and early stopping). Every rank must have the same
    metric names."""

    def __init__(self, device=""):
        super().__init__()
        self.device = device

    def _average_metrics_in_place(self, logs):
        if not logs:
            return
        names = sorted(logs)
        values = [np.asarray(_get_value(logs[n]), dtype=np.float64) for n in names]
        averaged = _core.grouped_allreduce(values, op=_core.Average, name="hvd.keras.MetricAverageCallback")
        for name, value in zip(names, averaged):
            logs[name] = float(value) if np.ndim(value) == 0 else np.asarray(value)

    def on_epoch_end(self, epoch, logs=None):
        self._average_metrics_in_place(logs)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to ``initial_lr * multiplier(epoch)`` for the epochs in [start_epoch, end_epoch):
    ``multiplier`` a function of the epoch or a constant (then ``multiplier ** (epoch - start_epoch)``); on the
    first batch of each epoch with ``staircase``, else on every batch with a fractional epoch. With
    ``momentum_correction`` an optimizer's ``momentum`` is scaled by new_lr / old_lr for that batch (Goyal et
    al.); Keras optimizers whose momentum is a Python number read it when the train step is traced, so there it
    has no effect."""

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None, *args):
        super().__init__(*args)
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.initial_lr = initial_lr
        self.restore_momentum = None
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        self.multiplier = _lr_schedule.schedule_multiplier(multiplier, start_epoch)

    def _adjust_learning_rate(self, epoch):
        optimizer = self.model.optimizer
        old_lr = _get_lr(optimizer)
        new_lr = self.initial_lr * self.multiplier(epoch)
        _set_lr(optimizer, new_lr)
        if self.momentum_correction and hasattr(optimizer, "momentum") and old_lr:
            self.restore_momentum = _get_value(optimizer.momentum)
            _set_attr(optimizer, "momentum", self.restore_momentum * new_lr / old_lr)

    def _restore_momentum_if_needed(self):
        if self.restore_momentum:
            _set_attr(self.model.optimizer, "momentum", self.restore_momentum)
            self.restore_momentum = None

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = _lr_schedule.steps_per_epoch_of(self.params or {}, type(self).__name__)

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_batch_begin(self, batch, logs=None):
        if not _lr_schedule.in_schedule(self.current_epoch, self.start_epoch, self.end_epoch):
            return
        epoch = _lr_schedule.schedule_epoch(self.current_epoch, batch, self.staircase, self.steps_per_epoch)
        if epoch is not None:
            self._adjust_learning_rate(epoch)

    def on_batch_end(self, batch, logs=None):
        self._restore_momentum_if_needed()

    on_train_batch_begin = on_batch_begin
    on_train_batch_end = on_batch_end

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _get_lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Raises the learning rate gradually from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``
    (``initial_lr`` already scaled by the number of ranks), batch by batch (Goyal et al., "Accurate, Large
    Minibatch SGD")."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            return _lr_schedule.warmup_multiplier(epoch, _core.size(), warmup_epochs, self.steps_per_epoch)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and _core.rank() == 0:
            print("\nEpoch %d: finished gradual learning rate warmup to %g." % (epoch + 1,
                                                                               _get_lr(self.model.optimizer)))


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """``ModelCheckpoint`` that keeps only the best model (``save_best_only=True``); ``filepath`` may be set later
    (Horovod's estimators set it), as in Horovod."""

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto", save_freq="epoch",
                 filepath=None):
        super().__init__(filepath=filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)


__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "BestModelCheckpoint"]
