"""The helpers of Horovod's ``horovod.common.util`` that scripts and tests call, answered for hvd."""

import contextlib
import os

import hvd as _hvd


def check_extension(ext_name, ext_env_var, pkg_path, *args):
    """Horovod checks that its compiled extension for a framework exists; hvd has none to check (its runtime is
    one library loaded through ctypes), so this accepts every framework."""


def gpu_available(ext_base_name, verbose=False):
    """Whether the runtime was built with GPU (CUDA or ROCm) support: hvd's ``cuda_built()`` / ``rocm_built()``."""
    return bool(_hvd.cuda_built() or _hvd.rocm_built())


def extension_available(ext_base_name, verbose=False):
    """Horovod asks whether its compiled extension for a framework loads; hvd has none: every framework's module
    is pure Python over the one runtime library, so this says whether that library loads."""
    try:
        _hvd.library_path()
        _hvd.mpi_built()
    except (OSError, ImportError):
        return False
    return True


# Horovod's module-level build questions (``horovod.common.util.mpi_built()`` ...), answered by hvd's runtime
# library as ``hvd.mpi_built()`` ... are (docs/horovod.md gives each answer's reason). ``verbose`` only made Horovod
# print why an extension failed to load; there is no extension here.


def mpi_built(verbose=False):
    return _hvd.mpi_built()


def gloo_built(verbose=False):
    return _hvd.gloo_built()


def nccl_built(verbose=False):
    """Horovod's answer is the NCCL version it was compiled against (an int such as 2708 for 2.7.8; 0 without NCCL),
    and scripts and tests compare it (``nccl_built() < 2700``). hvd's runtime loads NCCL at run time, so this is the
    version of the NCCL library the nccl backend would load here when the runtime was built with it, and 0 when it
    was not or when no NCCL library loads on this machine (its nccl backend cannot run then)."""
    if not _hvd.nccl_built():
        return 0
    return _nccl_version()


def _nccl_version():
    import ctypes

    for name in ("libnccl.so.2", "libnccl.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int(0)
        try:
            if lib.ncclGetVersion(ctypes.byref(version)) == 0:
                return version.value
        except AttributeError:
            continue
    return 0


def ddl_built(verbose=False):
    return _hvd.ddl_built()


def ccl_built(verbose=False):
    return _hvd.ccl_built()


def cuda_built(verbose=False):
    return _hvd.cuda_built()


def rocm_built(verbose=False):
    return _hvd.rocm_built()


def get_average_backwards_compatibility_fun(reduce_ops):
    """Horovod's helper that turns the old ``average=`` flag into an op: ``fn(op, average)``, refusing both."""

    def resolve(op, average):
        if op is not None:
            if average is not None:
                raise ValueError("The op parameter supersedes average. Please provide only one of them.")
            return op
        if average is not None:
            return reduce_ops.Average if average else reduce_ops.Sum
        return reduce_ops.Average

    return resolve


def check_installed_version(name, version, exception=None):
    """Horovod checks that a framework's version is the one its extension was compiled against; nothing here is
    compiled against a framework, so any version passes (``exception``, if given, is re-raised as it was)."""
    if exception is not None:
        raise exception


def is_version_greater_equal_than(ver, target):
    """``ver >= target`` for dotted release versions (``"2.15.0" >= "2.3"``); a suffix after the numbers
    (``+cpu``, ``rc1``) is ignored."""
    import re

    def parts(v):
        m = re.match(r"\s*(\d+(?:\.\d+)*)", str(v))
        if m is None:
            raise ValueError("{!r} is not a version".format(v))
        return [int(x) for x in m.group(1).split(".")]

    a, b = parts(ver), parts(target)
    n = max(len(a), len(b))
    return a + [0] * (n - len(a)) >= b + [0] * (n - len(b))


def is_iterable(x):
    try:
        iter(x)
    except TypeError:
        return False
    return True


def split_list(items, parts):
    """``items`` in ``parts`` consecutive chunks whose lengths differ by at most one."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def num_rank_is_power_2(num_rank):
    return num_rank != 0 and (num_rank & (num_rank - 1)) == 0


@contextlib.contextmanager
def env(**kwargs):
    """Sets environment variables (values made strings) for the duration of the block, then restores them."""
    saved = {k: os.environ.get(k) for k in kwargs}
    os.environ.update({k: str(v) for k, v in kwargs.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
