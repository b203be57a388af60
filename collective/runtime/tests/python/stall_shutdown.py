"""Rank 1 submits too late: with HVD_STALL_SHUTDOWN_TIME, every rank gets an error instead of waiting forever."""
import time

import numpy as np

import hvd

hvd.init()
r = hvd.rank()
if r == 1:
    time.sleep(4.0)
try:
    hvd.allreduce(np.ones(1), op=hvd.Sum, name="late.tensor")
    print("no error on rank {}".format(r))
except hvd.StallError as e:
    assert isinstance(e, hvd.HorovodInternalError), type(e)
    print("GOT_ERROR rank {}: {}".format(r, e))
