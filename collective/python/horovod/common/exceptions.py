"""Horovod's exception names, bound to hvd's classes: ``except HorovodInternalError`` catches what hvd raises when
the job cannot go on (hvd's PeerLostError, CollectiveTimeoutError and StallError are subclasses)."""

import hvd as _hvd

HorovodInternalError = _hvd.HorovodInternalError


if hasattr(_hvd, "HostsUpdatedInterrupt"):
    HostsUpdatedInterrupt = _hvd.HostsUpdatedInterrupt
else:

    class HostsUpdatedInterrupt(RuntimeError):
        """Horovod's signal that the elastic host set changed. hvd has no elastic host discovery, so it never raises
        this; the class exists so that ``except HostsUpdatedInterrupt`` in a script stays valid."""

        def __init__(self, skip_sync=False):
            super().__init__()
            self.skip_sync = skip_sync


class HorovodVersionMismatchError(ImportError):
    """Horovod's error for an extension built against another framework version; hvd compiles nothing against a
    framework, so it never raises this."""

    def __init__(self, name, version, framework_version):
        super().__init__(
            "Framework {} installed with version {} but found version {}".format(name, framework_version, version)
        )
        self.name = name
        self.version = version
        self.framework_version = framework_version


__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "HorovodVersionMismatchError"]
