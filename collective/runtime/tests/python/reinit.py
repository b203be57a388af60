"""Horovod's setUp/tearDown: init, allreduce, shutdown, five times in a row in the same processes."""
import os
import sys

import numpy as np

import hvd

want = os.environ.get("HVD_COLLECTIVE_BACKEND", "").upper()
for round_ in range(1, 6):
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    if want and hvd._backend() != want:
        print("round {}: backend {} instead of {}".format(round_, hvd._backend(), want), file=sys.stderr)
        sys.exit(1)
    backend = hvd._backend()
    got = hvd.allreduce(np.array([r + 1.0, round_], np.float64), op=hvd.Sum, name="round.{}".format(round_))
    expect = [n * (n + 1) / 2, round_ * n]
    if not np.array_equal(got, expect):
        print("round {}: got {}, expected {}".format(round_, got, expect), file=sys.stderr)
        sys.exit(1)
    hvd.shutdown()
    if hvd.is_initialized():
        print("round {}: still initialized after shutdown".format(round_), file=sys.stderr)
        sys.exit(1)
print("ok reinit rank {} rounds 5 backend {}".format(r, backend))
