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

Times are wall-clock (`time.time()`), comparable across the processes of one machine.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r"""
import os, sys, time
import numpy as np
import hvd

slot = int(os.environ["HVD_RANK"])
victim = int(os.environ["HVD_SIZE"]) - 1
hvd.init()
x = np.ones(16, np.float32)
try:
    for step in range(1000000):
        if slot == victim and step == 20:
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
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "w.py"), "w") as f:
            f.write(WORKER)
        lib = os.environ.get("HVD_LIBRARY") or os.path.join(os.path.dirname(os.path.abspath(hvd)), "libhvd_runtime.so")
        with open(os.path.join(d, "train.hvd"), "w") as f:
            f.write(
                'project "bench"\nenv {\n  python = "3.11"\n  packages = []\n}\n'
                'step train {\n  run = "%s w.py"\n  workers = { min = 2, max = %d }\n'
                '  env = { PYTHONPATH = "%s", HVD_LIBRARY = "%s" }\n}\n'
                % (python, size, os.path.join(ROOT, "collective", "python"), lib)
            )
        try:
            out = subprocess.run(
                [hvd, "run", os.path.join(d, "train.hvd"), "--no-build", "--grace", "2"],
                capture_output=True, text=True, env=dict(os.environ, NO_COLOR="1"), timeout=120,
            )
        except subprocess.TimeoutExpired as e:
            sys.exit("hvd run did not end within 120 s:\n%s\n%s" % (e.stdout, e.stderr))
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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hvd", default=os.path.join(ROOT, "target", "debug", "hvd"))
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--sizes", type=int, nargs="+", default=[4, 8])
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
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
