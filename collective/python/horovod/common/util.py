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
