"""``horovod.runner.common``: the helpers of Horovod's launcher package that its test suites import."""
