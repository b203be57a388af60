"""Learning-rate schedule arithmetic of Horovod's Keras callbacks (framework-free, so it is tested without Keras)."""


def schedule_multiplier(multiplier, start_epoch):
    """The function of the epoch that multiplies the initial rate: ``multiplier`` itself when callable, else the
    constant ``multiplier ** (epoch - start_epoch)`` (exponential decay from ``start_epoch``)."""
    if callable(multiplier):
        return multiplier
    return lambda epoch: multiplier ** (epoch - start_epoch)


def in_schedule(epoch, start_epoch, end_epoch):
    """Whether ``epoch`` is in [start_epoch, end_epoch) (no end when ``end_epoch`` is None)."""
    return epoch >= start_epoch and (end_epoch is None or epoch < end_epoch)


def schedule_epoch(epoch, batch, staircase, steps_per_epoch):
    """The (fractional) epoch a batch adjusts the rate for: None when a staircase schedule leaves the batch alone
    (it changes the rate on the first batch of each epoch only)."""
    if staircase:
        return epoch if batch == 0 else None
    if not steps_per_epoch:
        raise ValueError("a schedule with staircase=False needs steps_per_epoch")
    return epoch + float(batch) / steps_per_epoch


def warmup_multiplier(epoch, size, warmup_epochs, steps_per_epoch):
    """Goyal et al.'s gradual warmup: from ``1/size`` of the rate at the start to the full rate after
    ``warmup_epochs`` (the rate is given already scaled by ``size``). The epoch is counted one batch ahead, so that
    the end of an epoch gives a round number."""
    if warmup_epochs <= 0:
        raise ValueError("warmup_epochs must be > 0, not {!r}".format(warmup_epochs))
    epoch = epoch + 1.0 / steps_per_epoch
    return (epoch * (size - 1) / warmup_epochs + 1) / size


def steps_per_epoch_of(params, who):
    """Keras's ``params`` (``steps``, or ``samples`` and ``batch_size``) as a number of batches per epoch."""
    if params.get("steps"):
        return params["steps"]
    if params.get("samples") and params.get("batch_size"):
        return params["samples"] // params["batch_size"]
    raise ValueError("{} cannot tell the number of batches per epoch from Keras: pass steps_per_epoch=".format(who))
