#!/usr/bin/env python3
"""Re-form time of an elastic step (issue #19): how long from a worker's loss to the first collective of the
re-formed job, under a real `hvd run` on this machine.

For each size N (default 4 and 8), runs an elastic step `workers = { min = 2, max = N }` whose last worker SIGKILLs
itself after 20 allreduces (writing the time first). Every survivor records when its allreduce failed (the loss
detected), when `hvd.shutdown(); hvd.init()` returned (the new round joined: new ranks, new communicators) and when
the first allreduce of the new job completed. Reported per run (seconds):

    detect   kill -> the first survivor's failed collective (and the last survivor's)
    reform   the first survivor's detection -> the last survivor's first completed collective of the new job

    python3 bench/elastic.py [--hvd target/debug/hvd] [--sizes 4 8] [--repeat 3]

The launcher starts a replacement for the killed worker (docs/running.md, Elastic steps): the re-form does not wait for
it, but it could join the re-form if it asked in time (the round would then have N members, and it would run the
training loop while the survivors run their first collective). So the victim leaves a file `victim.killed` in the
working directory before it dies, and a worker that starts when the file exists (the replacement) exits 0 at once,
before it asks to join: the re-formed job is always the N - 1 survivors.

Times are wall-clock (`time.time()`), comparable across the processes of one machine.
"""

import re
import statistics
import sys

from _elastic_common import parse_args, run_elastic_step

WORKER = r"""
import os, sys, time
import numpy as np
import hvd

slot = int(os.environ["HVD_RANK"])
victim = int(os.environ["HVD_SIZE"]) - 1
if os.path.exists("victim.killed"):
    # The killed worker's replacement: not part of the measured re-form.
    sys.exit(0)
hvd.init()
x = np.ones(16, np.float32)
try:
    for step in range(1000000):
        if slot == victim and step == 20:
            open("victim.killed", "w").close()
            print("KILL %.6f" % time.time(), flush=True)
            os.kill(os.getpid(), 9)
        hvd.allreduce(x, name="x")
        if step > 20:
            time.sleep(0.001)
except hvd.HorovodInternalError:
    detect = time.time()
    hvd.shutdown()
    hvd.init()
    joined = time.time()
    hvd.allreduce(x, name="first")
    first = time.time()
    print("REFORM %d %.6f %.6f %.6f %d" % (slot, detect, joined, first, hvd.size()), flush=True)
    hvd.shutdown()
"""


def run_once(hvd, python, size):
    out = run_elastic_step(hvd, python, size, WORKER)
    if out.returncode != 0:
        sys.exit("hvd run failed (%d):\n%s\n%s" % (out.returncode, out.stdout, out.stderr))
    kill = [float(m) for m in re.findall(r"KILL ([0-9.]+)", out.stdout)]
    reforms = [tuple(float(v) for v in m) for m in re.findall(r"REFORM \d+ ([0-9.]+) ([0-9.]+) ([0-9.]+) (\d+)", out.stdout)]
    if len(kill) != 1 or len(reforms) != size - 1 or any(int(r[3]) != size - 1 for r in reforms):
        sys.exit("unexpected output:\n%s\n%s" % (out.stdout, out.stderr))
    detects = [r[0] for r in reforms]
    firsts = [r[2] for r in reforms]
    return min(detects) - kill[0], max(detects) - kill[0], max(firsts) - min(detects)


def main():
    a = parse_args(__doc__)
    print("%-6s %-22s %-22s %s" % ("ranks", "detect first/last (ms)", "reform (ms) median", "all reform (ms)"))
    for size in a.sizes:
        runs = [run_once(a.hvd, a.python, size) for _ in range(a.repeat)]
        first = statistics.median(r[0] for r in runs) * 1e3
        last = statistics.median(r[1] for r in runs) * 1e3
        reform = [r[2] * 1e3 for r in runs]
        print("%-6d %-22s %-22.0f %s" % (
            size, "%.1f / %.1f" % (first, last), statistics.median(reform), " ".join("%.0f" % r for r in reform)))


if __name__ == "__main__":
    main()
