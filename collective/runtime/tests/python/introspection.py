"""Build and job introspection (hvd.mpi_built() ...), before and after init, in a real job.

HVD_TEST_HOSTS="a,b,b" gives rank r the host name of entry r (set before init, so the runtime's topology sees
these hosts); HVD_TEST_HOMOGENEOUS is the expected is_homogeneous() answer.
"""
import os
import sys

import hvd

r = int(os.environ["HVD_RANK"])
hosts = os.environ.get("HVD_TEST_HOSTS")
if hosts:
    os.environ["HVD_HOSTNAME"] = hosts.split(",")[r]


def expect(what, got, want):
    if got != want:
        print("rank {}: {} is {!r}, expected {!r}".format(r, what, got, want), file=sys.stderr)
        sys.exit(1)


def expect_value_error(what, fn, fragment):
    try:
        got = fn()
    except ValueError as e:
        if fragment not in str(e):
            print("rank {}: {} raised {!r} without {!r}".format(r, what, str(e), fragment), file=sys.stderr)
            sys.exit(1)
        return
    print("rank {}: {} answered {!r} instead of raising ValueError".format(r, what, got), file=sys.stderr)
    sys.exit(1)


# The build answers need no init and do not init.
expect("mpi_built", hvd.mpi_built(), os.environ["HVD_TEST_MPI_BUILT"] == "1")
expect("nccl_built", hvd.nccl_built(), os.environ["HVD_TEST_NCCL_BUILT"] == "1")
for name in ("gloo_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built"):
    expect(name, getattr(hvd, name)(), False)
expect("is_initialized before init", hvd.is_initialized(), False)
expect("mpi_enabled before init", hvd.mpi_enabled(), False)
expect("gloo_enabled before init", hvd.gloo_enabled(), False)
expect_value_error("is_homogeneous before init", hvd.is_homogeneous, "not initialized")
expect_value_error("mpi_threads_supported before init", hvd.mpi_threads_supported, "not initialized")

hvd.init()
expect("mpi_enabled", hvd.mpi_enabled(), False)
expect("gloo_enabled", hvd.gloo_enabled(), False)
expect("is_homogeneous", hvd.is_homogeneous(), os.environ["HVD_TEST_HOMOGENEOUS"] == "1")
expect_value_error("mpi_threads_supported", hvd.mpi_threads_supported, "MPI is not enabled")
# The same functions through hvd.numpy (its star import follows __all__).
import hvd.numpy as hn  # noqa: E402

expect("hvd.numpy.is_homogeneous", hn.is_homogeneous(), hvd.is_homogeneous())
expect("hvd.numpy.mpi_built", hn.mpi_built(), hvd.mpi_built())
hvd.shutdown()
expect_value_error("is_homogeneous after shutdown", hvd.is_homogeneous, "not initialized")
expect("mpi_enabled after shutdown", hvd.mpi_enabled(), False)
print("ok introspection rank {} hosts {}".format(r, hosts or "one"))
