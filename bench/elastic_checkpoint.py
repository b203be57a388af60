#!/usr/bin/env python3
"""Time of `hvd.elastic`'s checkpoints on disk (issue #19 §4): `state.checkpoint()` (rank 0's atomic write: encode,
write, fsync each file and the directory, rename, prune) and `state.load_checkpoint()` (verify sizes and SHA-256,
decode, copy into the state) of an `ObjectState` holding one float32 numpy array of each size, one process, no
`hvd.init()` (the allreduce that tells the other ranks is not in it).

    PYTHONPATH=collective/python python3 bench/elastic_checkpoint.py [--sizes-mb 1 100] [--repeat 5] [--dir DIR]

Prints the median and range in milliseconds. DIR (default: a fresh temporary directory) decides the file system.
"""

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

import hvd


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 100])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for mb in args.sizes_mb:
            os.environ["HVD_CHECKPOINT_DIR"] = os.path.join(root, "mb%d" % mb)
            state = hvd.elastic.ObjectState(step=0, w=np.random.rand(mb * (1 << 20) // 4).astype(np.float32))
            writes, loads = [], []
            for _ in range(args.repeat):
                state.step += 1
                state.commit()
                start = time.perf_counter()
                state.checkpoint()
                writes.append(time.perf_counter() - start)
                fresh = hvd.elastic.ObjectState(step=0, w=np.zeros(1, np.float32))
                start = time.perf_counter()
                commit = fresh.load_checkpoint()
                loads.append(time.perf_counter() - start)
                assert commit == state.step and np.array_equal(fresh.w, state.w), "loaded something else"
            print("%4d MB  checkpoint %s  load %s" % (mb, summary(writes), summary(loads)), flush=True)


def summary(times):
    ms = [1e3 * t for t in times]
    return "%.1f ms (%.1f-%.1f)" % (statistics.median(ms), min(ms), max(ms))


if __name__ == "__main__":
    main()
