"""``horovod.torch.sync_batch_norm``: Horovod's module path of ``SyncBatchNorm`` (hvd.torch's)."""

from hvd.torch import SyncBatchNorm  # noqa: F401
