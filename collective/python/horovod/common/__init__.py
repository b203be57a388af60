"""``horovod.common``: exceptions, util and process sets, as Horovod's scripts import them."""
