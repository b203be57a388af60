#!/usr/bin/env python3
"""A/B of the single 4-byte allreduce's median latency between builds of the runtime (not a test).

Usage: bench/latency_ab.py [--ranks N] [--pairs P (default 30)] [--calls C (default 3000)] NAME=LIBRARY[:PACKAGE] ...

Each NAME=LIBRARY[:PACKAGE] is a build: its libhvd_runtime.so and the directory of its `hvd` Python package (default
this checkout's collective/python; an older library may not have every symbol the newer package declares). Every
pair launches one job of N local ranks (bench/engine.py's rendezvous server) per build, in alternating order (ABBA),
each timing C allreduces of one float32 (the first 200 untimed) the way bench/engine.py's last column does, and
prints per build the median over launches, quartiles and extremes, and against the first build the median and
quartiles of the paired ratios and how many pairs were slower or faster.

Why: on the shared 2-core VM a launch's latency falls into one of two regimes, about 25 us or about 50 us (4 busy
threads on 2 cores), and the regime drifts over minutes; two bench/engine.py runs one after the other can differ by
10% or more with the same code. Only interleaved launches compare builds.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

BENCH = Path(__file__).resolve().parent
WARMUP = 200


def rendezvous():
    """bench/engine.py (its rendezvous server), imported only where no rank runs: it puts this checkout's package
    first on sys.path, and a rank must import the package of its build."""
    sys.path.insert(0, str(BENCH))
    import engine

    return engine


def worker(calls):
    import numpy as np

    import hvd

    hvd.init()
    x = np.ones(1, np.float32)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        hvd.allreduce_(x, op=hvd.Max, name="lat")
        times.append(time.perf_counter() - t0)
    rank = hvd.rank()
    hvd.shutdown()
    if rank == 0:
        print("RESULT " + json.dumps(statistics.median(times[WARMUP:])))


def launch(ranks, calls, library, package):
    """One job of `ranks` local ranks with `library` and `package`: rank 0's median latency in seconds."""
    engine = rendezvous()
    engine.KV.store = {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), engine.KV)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    procs = []
    for r in range(ranks):
        env = dict(os.environ, HVD_RANK=str(r), HVD_SIZE=str(ranks), HVD_LOCAL_RANK=str(r),
                   HVD_LOCAL_SIZE=str(ranks), HVD_CROSS_RANK="0", HVD_CROSS_SIZE="1", HVD_HOSTNAME="localhost",
                   HVD_RENDEZVOUS="127.0.0.1:{}".format(server.server_address[1]), HVD_JOB_TOKEN=engine.TOKEN,
                   HVD_LIBRARY=library, PYTHONPATH=package)
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", "--calls", str(calls)], env=env,
                                      stdout=subprocess.PIPE, text=True))
    outs = [p.communicate()[0] for p in procs]
    server.shutdown()
    if any(p.returncode for p in procs):
        raise SystemExit("a rank failed ({}): {}".format(library, [p.returncode for p in procs]))
    return json.loads(outs[0].split("RESULT ", 1)[1])


def build(spec):
    """NAME=LIBRARY[:PACKAGE] -> (name, absolute library, absolute package directory)."""
    name, _, rest = spec.partition("=")
    library, _, package = rest.partition(":")
    if not name or not library:
        raise SystemExit("a build is NAME=LIBRARY[:PACKAGE], not {!r}".format(spec))
    package = package or str(BENCH.parent / "collective" / "python")
    return name, str(Path(library).resolve()), str(Path(package).resolve())


def spread(values):
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return statistics.median(values), q[0], q[2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("builds", nargs="*", metavar="NAME=LIBRARY[:PACKAGE]")
    args = ap.parse_args()
    if args.worker:
        return worker(args.calls)
    if len(args.builds) < 2 or args.calls <= WARMUP:
        raise SystemExit("at least two builds, and more than {} calls".format(WARMUP))
    builds = [build(b) for b in args.builds]
    us = {name: [] for name, _, _ in builds}
    for i in range(args.pairs):
        for name, library, package in (builds if i % 2 == 0 else builds[::-1]):
            us[name].append(launch(args.ranks, args.calls, library, package) * 1e6)
        print("pair {}/{}: {}".format(i + 1, args.pairs, ", ".join(
            "{} {:.1f} us".format(n, v[-1]) for n, v in us.items())), file=sys.stderr)
    print("4-byte allreduce, {} ranks, median of {} calls per launch, {} launches per build:".format(
        args.ranks, args.calls - WARMUP, args.pairs))
    for name, v in us.items():
        print("  {:<16} median {:6.1f} us [{:.1f} .. {:.1f}], min {:.1f}, max {:.1f}".format(
            name, *spread(v), min(v), max(v)))
    base = builds[0][0]
    for name, v in list(us.items())[1:]:
        ratios = [b / a for a, b in zip(us[base], v)]
        print("  {}/{}: median of paired ratios {:.3f} [{:.3f} .. {:.3f}]; slower in {}, faster in {} of {} "
              "pairs".format(name, base, *spread(ratios), sum(r > 1 for r in ratios), sum(r < 1 for r in ratios),
                             len(ratios)))


if __name__ == "__main__":
    main()
