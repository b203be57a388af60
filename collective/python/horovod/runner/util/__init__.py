"""``horovod.runner.util``: the helpers of Horovod's launcher package that scripts and test utilities import."""
