#!/usr/bin/env python3
"""Time from a worker's freeze to the survivors' re-formed job (issue #19): a worker of an elastic step that is alive to
the OS but answers nobody (it stops itself, SIGSTOP, as a frozen node's rank would), under a real `hvd run`.

For each size N (default 4), runs an elastic step `workers = { min = 2, max = N }` whose last worker stops itself
after 20 allreduces (writing the time first), twice: with heartbeats (`HVD_HEARTBEAT_TIMEOUT`, default 10 s: the
launcher finds the silent worker, and the survivors' heartbeat answer fails their collective in flight), and as
before them (`HVD_HEARTBEAT_TIMEOUT=86400`: never found silent, so the survivors wait out their collective timeout,
`HVD_COLLECTIVE_TIMEOUT` 30 s, and the round its window, `--elastic-timeout` 60 s, both the defaults). Every survivor
records when its allreduce failed and when the first allreduce of the re-formed job completed. Reported (seconds):

    detect   freeze -> the first survivor's failed collective
    reform   freeze -> the last survivor's first completed collective of the re-formed job

    python3 bench/elastic_freeze.py [--hvd target/debug/hvd] [--sizes 4] [--repeat 3]

The frozen worker's replacement (docs/running.md, Elastic steps) exits 0 at once, before it asks to join (the file
`victim.frozen` says it is one): the re-formed job is always the N - 1 survivors. Times are wall-clock (`time.time()`).
"""

import re
import statistics
import sys

from _elastic_common import parse_args, run_elastic_step

WORKER = r"""
import os, signal, sys, time
import numpy as np
import hvd

slot = int(os.environ["HVD_RANK"])
victim = int(os.environ["HVD_SIZE"]) - 1
if os.path.exists("victim.frozen"):
    sys.exit(0)
hvd.init()
x = np.ones(16, np.float32)
try:
    for step in range(1000000):
        if slot == victim and step == 20:
            open("victim.frozen", "w").close()
            print("FREEZE %.6f" % time.time(), flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        hvd.allreduce(x, name="x")
        if step > 20:
            time.sleep(0.001)
except hvd.HorovodInternalError:
    detect = time.time()
    hvd.shutdown()
    hvd.init()
    hvd.allreduce(x, name="first")
    first = time.time()
    print("REFORM %d %.6f %.6f %d" % (slot, detect, first, hvd.size()), flush=True)
    hvd.shutdown()
"""


def run_once(hvd, python, size, env):
    out = run_elastic_step(hvd, python, size, WORKER, timeout=300, env=env)
    if out.returncode != 0:
        sys.exit("hvd run failed (%d):\n%s\n%s" % (out.returncode, out.stdout, out.stderr))
    freeze = [float(m) for m in re.findall(r"FREEZE ([0-9.]+)", out.stdout)]
    reforms = [tuple(float(v) for v in m) for m in re.findall(r"REFORM \d+ ([0-9.]+) ([0-9.]+) (\d+)", out.stdout)]
    if len(freeze) != 1 or len(reforms) != size - 1 or any(int(r[2]) != size - 1 for r in reforms):
        sys.exit("unexpected output:\n%s\n%s" % (out.stdout, out.stderr))
    return min(r[0] for r in reforms) - freeze[0], max(r[1] for r in reforms) - freeze[0]


def main():
    a = parse_args(__doc__)
    print("%-6s %-38s %-11s %-11s %s" % ("ranks", "mode", "detect (s)", "reform (s)", "all reform (s)"))
    modes = [
        ("heartbeats (HVD_HEARTBEAT_TIMEOUT=10)", {}),
        ("without (HVD_HEARTBEAT_TIMEOUT=86400)", {"HVD_HEARTBEAT_TIMEOUT": "86400"}),
    ]
    for size in a.sizes:
        medians = []
        for mode, env in modes:
            runs = [run_once(a.hvd, a.python, size, env) for _ in range(a.repeat)]
            reform = [r[1] for r in runs]
            medians.append(statistics.median(reform))
            print("%-6d %-38s %-11.1f %-11.1f %s" % (
                size, mode, statistics.median(r[0] for r in runs), medians[-1], " ".join("%.1f" % r for r in reform)))
        print("%-6d ratio without / with heartbeats: %.1f" % (size, medians[1] / medians[0]))


if __name__ == "__main__":
    main()
