"""Gradient compressors shared by the framework layers (hvd.torch, hvd.tensorflow, hvd.keras): each has
``compress(t) -> (t, ctx)`` and ``decompress(t, ctx)``, as Horovod's ``Compression.none`` / ``.fp16`` do."""


class NoneCompressor:
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class CastCompressor:
    """Floating-point tensors travel as ``dtype`` and come back in their own dtype; others are left as they are.

    A framework's subclass gives ``is_floating(dtype)`` and ``cast(tensor, dtype)`` (static methods); a concrete
    compressor below it sets ``dtype``."""

    dtype = None

    @classmethod
    def compress(cls, tensor):
        if cls.is_floating(tensor.dtype) and tensor.dtype != cls.dtype:
            return cls.cast(tensor, cls.dtype), tensor.dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor, ctx):
        return tensor if ctx is None else cls.cast(tensor, ctx)
