#!/usr/bin/env python3
"""Benchmark of the hvd engine through the Python API (not a test).

Starts N local ranks of itself (default 2) around a minimal rendezvous key-value server (the `/kv/` protocol of
docs/rendezvous.md, enough for the bootstrap), once per configuration, and prints medians and ratios:

- 100 tensors of 4 KiB per step, and 100 tensors from 4 KiB to 4 MiB (geometric) per step, allreduced in place
  with the per-tensor async API (one call and one synchronize per tensor) and with the grouped API (one call and
  one synchronize per step): fusion on (HVD_FUSION_THRESHOLD default) vs off (0), timeline off vs on;
- a single 4-byte allreduce, median latency (the engine's per-operation overhead plus the transport's latency).

Usage: bench/engine.py [--ranks N] [--steps S (default 50)] [--rounds R] [--library PATH] [--env KEY=VALUE ...]
Library: HVD_LIBRARY or --library, else the package's own search (target/release first if newer).
Goals (issue 6): fusion >= 5x faster than no fusion on 100 x 4 KiB; single 4-byte allreduce < 100 us median.
If Horovod is importable (horovod.torch), its numbers for the same workloads are printed too.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "collective" / "python"))
TOKEN = "benchtoken"


class KV(BaseHTTPRequestHandler):
    store = {}
    cond = threading.Condition()

    def log_message(self, *args):
        pass

    def _reply(self, code, body=b""):
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with KV.cond:
            KV.store[self.path.split("?")[0]] = body
            KV.cond.notify_all()
        self._reply(200)

    def do_GET(self):
        path, _, query = self.path.partition("?")
        wait = int(query.split("wait_ms=")[1]) / 1000 if "wait_ms=" in query else 0
        deadline = time.time() + wait
        with KV.cond:
            while path not in KV.store and time.time() < deadline:
                KV.cond.wait(deadline - time.time())
            value = KV.store.get(path)
        self._reply(200, value) if value is not None else self._reply(404)


def launch(ranks, env_extra, steps):
    KV.store = {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), KV)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    procs = []
    for r in range(ranks):
        env = dict(os.environ, HVD_RANK=str(r), HVD_SIZE=str(ranks), HVD_LOCAL_RANK=str(r),
                   HVD_LOCAL_SIZE=str(ranks), HVD_CROSS_RANK="0", HVD_CROSS_SIZE="1", HVD_HOSTNAME="localhost",
                   HVD_RENDEZVOUS="127.0.0.1:{}".format(server.server_address[1]), HVD_JOB_TOKEN=TOKEN,
                   **env_extra)
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", "--steps", str(steps)], env=env,
                                      stdout=subprocess.PIPE, text=True))
    outs = [p.communicate()[0] for p in procs]
    server.shutdown()
    if any(p.returncode for p in procs):
        raise SystemExit("a rank failed: {}".format([p.returncode for p in procs]))
    return json.loads(outs[0].strip().splitlines()[-1])


def worker(steps):
    import numpy as np

    import hvd

    hvd.init()
    small = [np.ones(1024, np.float32) for _ in range(100)]
    sizes = [int(1024 * (1024 ** (i / 99))) for i in range(100)]  # 4 KiB .. 4 MiB of float32
    mixed = [np.ones(n, np.float32) for n in sizes]

    def step_time(tensors, tag):
        times = []
        for s in range(steps + 3):
            hvd.barrier()
            t0 = time.perf_counter()
            hs = [hvd.allreduce_async_(t, op=hvd.Sum, name="{}.{}".format(tag, i)) for i, t in enumerate(tensors)]
            for h in hs:
                hvd.synchronize(h)
            if s >= 3:
                times.append(time.perf_counter() - t0)
            for t in tensors:
                t.fill(1.0)
        return statistics.median(times)

    def grouped_time(tensors, tag):
        times = []
        for s in range(steps + 3):
            hvd.barrier()
            t0 = time.perf_counter()
            hvd.synchronize(hvd.grouped_allreduce_async_(tensors, op=hvd.Sum, name=tag))
            if s >= 3:
                times.append(time.perf_counter() - t0)
            for t in tensors:
                t.fill(1.0)
        return statistics.median(times)

    def latency():
        x = np.ones(1, np.float32)
        times = []
        for i in range(2000):
            t0 = time.perf_counter()
            hvd.allreduce_(x, op=hvd.Max, name="lat")
            times.append(time.perf_counter() - t0)
        return statistics.median(times[200:])

    result = {"small": step_time(small, "s"), "grouped": grouped_time(small, "g"), "mixed": step_time(mixed, "m"),
              "mixed_grouped": grouped_time(mixed, "mg"), "latency": latency()}
    rank = hvd.rank()
    hvd.shutdown()
    if rank == 0:
        print(json.dumps(result))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--library")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra variable for every rank of every configuration (e.g. a collective threshold)")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        return worker(args.steps)
    if args.library:
        os.environ["HVD_LIBRARY"] = str(Path(args.library).resolve())
    import hvd._lib

    print("library: {}".format(hvd._lib.path()))
    print("ranks: {}, steps: {}, rounds: {} (medians)".format(args.ranks, args.steps, args.rounds))
    extra = dict(e.split("=", 1) for e in args.env)
    if extra:
        print("extra environment: {}".format(extra))
    with tempfile.TemporaryDirectory() as tmp:
        configs = {
            "fusion on": dict(extra),
            "fusion off": dict(extra, HVD_FUSION_THRESHOLD="0"),
            "fusion on + timeline": dict(extra, HVD_TIMELINE=os.path.join(tmp, "timeline.json")),
        }
        # The machine is shared and noisy: interleave the configurations, so that every round runs each one under
        # about the same load, and report medians over rounds and the median of the per-round (paired) ratios.
        rounds = {name: [] for name in configs}
        for i in range(args.rounds):
            for name, env in configs.items():
                rounds[name].append(launch(args.ranks, env, args.steps))
            print("round {}/{} done".format(i + 1, args.rounds), file=sys.stderr)
    keys = ["small", "grouped", "mixed", "mixed_grouped", "latency"]
    results = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in rounds.items()}

    def paired(a, b, key):
        return statistics.median(x[key] / y[key] for x, y in zip(rounds[a], rounds[b]))

    print("{:<22} {:>12} {:>12} {:>14} {:>14} {:>12}".format(
        "median ms per step", "100x4KiB", "grouped", "4KiB..4MiB", "grouped", "4 B lat us"))
    for name, r in results.items():
        print("{:<22} {:>12.3f} {:>12.3f} {:>14.3f} {:>14.3f} {:>12.1f}".format(
            name, r["small"] * 1e3, r["grouped"] * 1e3, r["mixed"] * 1e3, r["mixed_grouped"] * 1e3,
            r["latency"] * 1e6))
    print("fusion speed-up (off/on, median of paired rounds), 100 x 4 KiB: {:.2f}x per-tensor async API, "
          "{:.2f}x grouped API (goal >= 5x)".format(
              paired("fusion off", "fusion on", "small"), paired("fusion off", "fusion on", "grouped")))
    print("fusion speed-up, 100 x 4 KiB..4 MiB: {:.2f}x per-tensor, {:.2f}x grouped".format(
        paired("fusion off", "fusion on", "mixed"), paired("fusion off", "fusion on", "mixed_grouped")))
    print("timeline cost (timeline/no timeline - 1, median of paired rounds): {:+.1f}% per-tensor, "
          "{:+.1f}% grouped (100 x 4 KiB); {:+.1f}% per-tensor, {:+.1f}% grouped (mixed) (goal < 5%)".format(
              *[(paired("fusion on + timeline", "fusion on", k) - 1) * 100
                for k in ("small", "grouped", "mixed", "mixed_grouped")]))
    print("single 4-byte allreduce: {:.1f} us median (goal < 100 us)".format(results["fusion on"]["latency"] * 1e6))
    try:
        import horovod.torch  # noqa: F401
        print("horovod is importable, but its comparison run is not implemented in this script")
    except ImportError:
        print("horovod: not installed here, no comparison")


if __name__ == "__main__":
    main()
