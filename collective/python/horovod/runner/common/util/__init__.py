"""``horovod.runner.common.util``: see ``env``."""
