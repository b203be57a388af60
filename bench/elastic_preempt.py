#!/usr/bin/env python3
"""Hand-over time of a preempted worker in an elastic step (issue #19 §5): SIGTERM to one worker -> the survivors'
first completed collective of the re-formed job, under a real `hvd run` on this machine.

For each size N (default 4 and 8), runs an elastic step `workers = { min = 2, max = N }` whose workers train under
`hvd.elastic.run` with an `ObjectState` committed after every step; the last worker sends itself SIGTERM at step 20
(writing the time first). It finishes that step, commits, hands over and leaves; every survivor records when its
reset callback ran (the new round joined) and when its first allreduce of the new round completed. Reported per
run (milliseconds):

    joined    SIGTERM -> the last survivor's re-form done (new round, new communicators)
    handover  SIGTERM -> the last survivor's first completed collective of the new job

    python3 bench/elastic_preempt.py [--hvd target/debug/hvd] [--sizes 4 8] [--repeat 3]

The SIGTERM comes at the start of a step, so the time includes the rest of that step (two small allreduces and a
commit). Times are wall-clock (`time.time()`), comparable across the processes of one machine.
"""

import re
import statistics
import sys

from _elastic_common import parse_args, run_elastic_step

WORKER = r"""
import os, signal, time
import numpy as np
import hvd

slot = int(os.environ["HVD_RANK"])
victim = int(os.environ["HVD_SIZE"]) - 1
hvd.init()
state = hvd.elastic.ObjectState(step=0)
marks = {}
state.register_reset_callbacks([lambda: marks.setdefault("joined", time.time())])
x = np.ones(16, np.float32)


@hvd.elastic.run
def train(state):
    while state.step < 60:
        if slot == victim and state.step == 20:
            print("TERM %.6f" % time.time(), flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
        hvd.allreduce(x, name="x")
        if "joined" in marks and "first" not in marks:
            marks["first"] = time.time()
        state.step += 1
        state.commit()


train(state)
print("HANDOVER %d %.6f %.6f %d" % (slot, marks["joined"], marks["first"], hvd.size()), flush=True)
hvd.shutdown()
"""


def run_once(hvd, python, size):
    out = run_elastic_step(hvd, python, size, WORKER)
    if out.returncode != 0 or "preempted" not in out.stderr:
        sys.exit("hvd run failed (%d) or reported no preemption:\n%s\n%s" % (out.returncode, out.stdout, out.stderr))
    term = [float(m) for m in re.findall(r"TERM ([0-9.]+)", out.stdout)]
    done = [tuple(float(v) for v in m) for m in re.findall(r"HANDOVER \d+ ([0-9.]+) ([0-9.]+) (\d+)", out.stdout)]
    if len(term) != 1 or len(done) != size - 1 or any(int(r[2]) != size - 1 for r in done):
        sys.exit("unexpected output:\n%s\n%s" % (out.stdout, out.stderr))
    return max(r[0] for r in done) - term[0], max(r[1] for r in done) - term[0]


def main():
    a = parse_args(__doc__)
    print("%-6s %-20s %-22s %s" % ("ranks", "joined (ms) median", "handover (ms) median", "all handovers (ms)"))
    for size in a.sizes:
        runs = [run_once(a.hvd, a.python, size) for _ in range(a.repeat)]
        handover = [r[1] * 1e3 for r in runs]
        print("%-6d %-20.0f %-22.0f %s" % (
            size, statistics.median(r[0] * 1e3 for r in runs), statistics.median(handover),
            " ".join("%.0f" % h for h in handover)))


if __name__ == "__main__":
    main()
