"""Locating and loading libhvd_runtime.so, and its ctypes signatures.

Search order (the first hit wins):
1. the file named by the ``HVD_LIBRARY`` environment variable;
2. ``lib/libhvd_runtime.so`` inside this package (how ``hvd build`` installs it into environments);
3. ``libhvd_runtime.so`` next to this file;
4. for development in the repository: ``$CARGO_TARGET_DIR/{release,debug}`` and ``target/{release,debug}`` in
   the directories above this package, the most recently built one.
"""

import ctypes
import os
import threading
from pathlib import Path

LIBRARY_NAME = "libhvd_runtime.so"


class HvdRequest(ctypes.Structure):
    """Mirror of ``hvd_request_t`` in hvd.h."""

    _fields_ = [
        ("kind", ctypes.c_int32),
        ("name", ctypes.c_char_p),
        ("dtype", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("input", ctypes.c_void_p),
        ("output", ctypes.c_void_p),
        ("op", ctypes.c_int32),
        ("root", ctypes.c_int32),
        ("prescale", ctypes.c_double),
        ("postscale", ctypes.c_double),
        ("splits", ctypes.POINTER(ctypes.c_int64)),
        ("nsplits", ctypes.c_int32),
    ]


def candidates():
    """Every place searched, in order (for error messages and ``hvd.library_path()``)."""
    env = os.environ.get("HVD_LIBRARY")
    if env:
        return [Path(env)]
    here = Path(__file__).resolve().parent
    found = [here / "lib" / LIBRARY_NAME, here / LIBRARY_NAME]
    dev = []
    target_dir = os.environ.get("CARGO_TARGET_DIR")
    roots = ([Path(target_dir)] if target_dir else []) + [p / "target" for p in here.parents]
    for root in roots:
        for profile in ("release", "debug"):
            dev.append(root / profile / LIBRARY_NAME)
    existing = sorted((p for p in dev if p.is_file()), key=lambda p: p.stat().st_mtime, reverse=True)
    return found + (existing or dev)


_lock = threading.Lock()
_lib = None
_path = None


def load():
    global _lib, _path
    with _lock:
        if _lib is not None:
            return _lib
        tried = candidates()
        for path in tried:
            if path.is_file():
                lib = ctypes.CDLL(str(path))
                _declare(lib)
                _lib, _path = lib, path
                return lib
        where = "\n  ".join(str(p) for p in tried)
        raise ImportError(
            "cannot find the hvd runtime library ({}); looked in:\n  {}\n"
            "Set HVD_LIBRARY to its path, or build it with `cargo build --release -p hvd-runtime`.".format(
                LIBRARY_NAME, where
            )
        )


def path():
    load()
    return _path


def _declare(lib):
    i32, i64, vp = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    sig = {
        "hvd_init": (i32, []),
        "hvd_shutdown": (i32, []),
        "hvd_is_initialized": (i32, []),
        "hvd_last_error": (ctypes.c_char_p, []),
        "hvd_last_error_kind": (i32, []),
        "hvd_last_error_rank": (i64, []),
        "hvd_version": (ctypes.c_char_p, []),
        "hvd_build_features": (i32, []),
        "hvd_is_homogeneous": (i32, []),
        "hvd_backend": (ctypes.c_char_p, []),
        "hvd_rank": (i32, []),
        "hvd_size": (i32, []),
        "hvd_local_rank": (i32, []),
        "hvd_local_size": (i32, []),
        "hvd_cross_rank": (i32, []),
        "hvd_cross_size": (i32, []),
        "hvd_enqueue": (i64, [ctypes.POINTER(HvdRequest)]),
        "hvd_enqueue_many": (i32, [ctypes.POINTER(HvdRequest), i32, ctypes.POINTER(i64)]),
        "hvd_enqueue_ps": (i64, [ctypes.POINTER(HvdRequest), i32]),
        "hvd_enqueue_many_ps": (i32, [ctypes.POINTER(HvdRequest), i32, ctypes.POINTER(i64), i32]),
        "hvd_add_process_set": (i32, [ctypes.POINTER(i64), i32]),
        "hvd_remove_process_set": (i32, [i32]),
        "hvd_process_set_rank": (i32, [i32]),
        "hvd_process_set_size": (i32, [i32]),
        "hvd_process_set_ranks": (i32, [i32, ctypes.POINTER(i64), i32]),
        "hvd_group_prepare": (i64, [ctypes.POINTER(HvdRequest), i32]),
        "hvd_group_enqueue": (i32, [i64, ctypes.POINTER(i64)]),
        "hvd_group_release": (i32, [i64]),
        "hvd_group_submit": (i64, [i64]),
        "hvd_enqueue_allreduces": (i32, [i32, vp, vp, vp, vp, ctypes.c_char_p, vp, vp, vp, ctypes.POINTER(i64)]),
        "hvd_start_timeline": (i32, [ctypes.c_char_p, i32]),
        "hvd_stop_timeline": (i32, []),
        "hvd_poll": (i32, [i64]),
        "hvd_wait": (i32, [i64]),
        "hvd_wait_and_release": (i32, [i64]),
        "hvd_wait_many": (i32, [ctypes.POINTER(i64), i32]),
        "hvd_poll_many": (i32, [ctypes.POINTER(i64), i32]),
        "hvd_wait_batch": (i32, [ctypes.POINTER(i64), i32, i32, ctypes.POINTER(ctypes.c_int8)]),
        "hvd_result_ndim": (i32, [i64]),
        "hvd_result_shape": (i32, [i64, ctypes.POINTER(i64)]),
        "hvd_result_nbytes": (i64, [i64]),
        "hvd_result_copy": (i32, [i64, vp, i64]),
        "hvd_result_splits": (i32, [i64, ctypes.POINTER(i64)]),
        "hvd_result_value": (i64, [i64]),
        "hvd_release": (None, [i64]),
    }
    for name, (restype, argtypes) in sig.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
