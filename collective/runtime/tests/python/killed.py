"""Rank 1 dies in the middle of training; every other rank gets an error instead of hanging."""
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
except hvd.HvdError as e:
    print("GOT_ERROR: {}".format(e))
    sys.exit(0)
print("no error on rank {}".format(r))
sys.exit(1)
