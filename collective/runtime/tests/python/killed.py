"""Rank 1 dies in the middle of training; every other rank gets a PeerLostError naming it instead of hanging."""
import os
import signal
import sys

import numpy as np

import hvd

hvd.init()
r = hvd.rank()
try:
    for step in range(1000):
        if r == 1 and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        hvd.allreduce(np.ones(1000, np.float32), name="g")
except hvd.PeerLostError as e:
    # The job cannot go on: Horovod's class, and the rank that is gone.
    assert isinstance(e, hvd.HorovodInternalError), type(e)
    print("GOT_ERROR {} lost rank {}: {}".format(type(e).__name__, e.rank, e))
    # Every later operation fails the same way.
    try:
        hvd.allreduce(np.ones(1, np.float32), name="after")
    except hvd.PeerLostError as later:
        print("LATER {} lost rank {}".format(type(later).__name__, later.rank))
    sys.exit(0)
print("no error on rank {}".format(r))
sys.exit(1)
