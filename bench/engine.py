#!/usr/bin/env python3
"""Benchmark of the hvd engine through the Python API (not a test).

Starts N local ranks of itself (default 2) around a minimal rendezvous key-value server (the `/kv/` protocol of
docs/rendezvous.md, enough for the bootstrap), once per configuration, and prints medians and ratios:

- 100 tensors of 4 KiB per step, and 100 tensors from 4 KiB to 4 MiB (geometric) per step, allreduced in place
  with the per-tensor async API (one call and one synchronize per tensor) and with the grouped API (one call and
  one synchronize per step): fusion on (HVD_FUSION_THRESHOLD default) vs off (0);
- the timeline's cost: inside the fusion-on runs, blocks of steps (about 200 ms each) with the timeline off and on
  (hvd.start_timeline before the block, hvd.stop_timeline after it, both inside the timed block, so every event
  of the block is written within it), in ABBA order; the median and quartiles of the on/off ratios;
- a single 4-byte allreduce, median latency (the engine's per-operation overhead plus the transport's latency).

Usage: bench/engine.py [--ranks N] [--steps S (default 50)] [--rounds R] [--blocks B (default 4)] [--block-ms MS] [--library PATH]
       [--env KEY=VALUE ...]
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


def launch(ranks, env_extra, steps, blocks=0, block_ms=200.0, timeline_dir=""):
    KV.store = {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), KV)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    procs = []
    for r in range(ranks):
        env = dict(os.environ, HVD_RANK=str(r), HVD_SIZE=str(ranks), HVD_LOCAL_RANK=str(r),
                   HVD_LOCAL_SIZE=str(ranks), HVD_CROSS_RANK="0", HVD_CROSS_SIZE="1", HVD_HOSTNAME="localhost",
                   HVD_RENDEZVOUS="127.0.0.1:{}".format(server.server_address[1]), HVD_JOB_TOKEN=TOKEN,
                   **env_extra)
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", "--steps", str(steps), "--blocks",
                                       str(blocks), "--block-ms", str(block_ms), "--timeline-dir", timeline_dir], env=env,
                                      stdout=subprocess.PIPE, text=True))
    outs = [p.communicate()[0] for p in procs]
    server.shutdown()
    if any(p.returncode for p in procs):
        raise SystemExit("a rank failed: {}".format([p.returncode for p in procs]))
    return json.loads(outs[0].strip().splitlines()[-1])


def worker(steps, blocks, block_ms, timeline_dir):
    import numpy as np

    import hvd

    hvd.init()
    small = [np.ones(1024, np.float32) for _ in range(100)]
    sizes = [int(1024 * (1024 ** (i / 99))) for i in range(100)]  # 4 KiB .. 4 MiB of float32
    mixed = [np.ones(n, np.float32) for n in sizes]

    def per_tensor(tensors, tag):
        hvd.barrier()
        t0 = time.perf_counter()
        hs = [hvd.allreduce_async_(t, op=hvd.Sum, name="{}.{}".format(tag, i)) for i, t in enumerate(tensors)]
        for h in hs:
            hvd.synchronize(h)
        took = time.perf_counter() - t0
        for t in tensors:
            t.fill(1.0)
        return took

    def grouped(tensors, tag):
        hvd.barrier()
        t0 = time.perf_counter()
        hvd.synchronize(hvd.grouped_allreduce_async_(tensors, op=hvd.Sum, name=tag))
        took = time.perf_counter() - t0
        for t in tensors:
            t.fill(1.0)
        return took

    def timeline_pairs(step, k):
        """Blocks of k steps with the timeline off and on (started before the block and stopped after it, both
        timed: stopping waits until the writer has written every event of the block), in ABBA order; the ratio
        on/off of each pair."""
        path = os.path.join(timeline_dir, "timeline.json")
        ratios = []
        for b in range(blocks):
            took = {}
            for on in ((False, True) if b % 2 == 0 else (True, False)):
                hvd.barrier()
                extra = 0.0
                if on:
                    t0 = time.perf_counter()
                    hvd.start_timeline(path)
                    extra += time.perf_counter() - t0
                total = sum(step() for _ in range(k))
                if on:
                    t0 = time.perf_counter()
                    hvd.stop_timeline()
                    extra += time.perf_counter() - t0
                took[on] = total + extra
            ratios.append(took[True] / took[False])
        return ratios

    def measure(step):
        for _ in range(3):
            step()
        times = [step() for _ in range(steps)]
        median = statistics.median(times)
        if not timeline_dir:
            return median, []
        # Blocks of about block_ms (rank 0's estimate, so that every rank runs the same number of steps).
        k = hvd.broadcast_object(max(3, int(block_ms / 1e3 / median)), name="k")
        return median, timeline_pairs(step, k)

    result = {}
    for key, step in (("small", lambda: per_tensor(small, "s")), ("grouped", lambda: grouped(small, "g")),
                      ("mixed", lambda: per_tensor(mixed, "m")), ("mixed_grouped", lambda: grouped(mixed, "mg"))):
        result[key], result[key + "_timeline"] = measure(step)

    x = np.ones(1, np.float32)
    times = []
    for i in range(2000):
        t0 = time.perf_counter()
        hvd.allreduce_(x, op=hvd.Max, name="lat")
        times.append(time.perf_counter() - t0)
    result["latency"] = statistics.median(times[200:])
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
    ap.add_argument("--blocks", type=int, default=4,
                    help="timeline off/on block pairs per workload and round (in the fusion-on configuration)")
    ap.add_argument("--block-ms", type=float, default=200.0, help="length of a timeline block (default 200 ms)")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--timeline-dir", default="")
    args = ap.parse_args()
    if args.worker:
        return worker(args.steps, args.blocks, args.block_ms, args.timeline_dir)
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
        }
        # The machine is shared and noisy: interleave the configurations, so that every round runs each one under
        # about the same load, and report medians over rounds and the median of the per-round (paired) ratios.
        # The timeline's cost is measured inside the fusion-on runs, in blocks with the timeline off and on
        # (`hvd.start_timeline` / `hvd.stop_timeline`), so each pair runs under the same conditions.
        rounds = {name: [] for name in configs}
        for i in range(args.rounds):
            for name, env in configs.items():
                on = name == "fusion on"
                rounds[name].append(launch(args.ranks, env, args.steps, args.blocks if on else 0, args.block_ms,
                                           tmp if on else ""))
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

    def cost(key):
        pairs = [p for r in rounds["fusion on"] for p in r[key + "_timeline"]]
        q = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else pairs * 3
        return (statistics.median(pairs) - 1) * 100, (q[0] - 1) * 100, (q[2] - 1) * 100, len(pairs)

    print("timeline cost (on/off - 1 over block pairs; median [quartiles], pairs) (goal < 5%):")
    for key, label in (("small", "100 x 4 KiB per-tensor"), ("grouped", "100 x 4 KiB grouped"),
                       ("mixed", "4 KiB..4 MiB per-tensor"), ("mixed_grouped", "4 KiB..4 MiB grouped")):
        print("  {:<26} {:+6.1f}% [{:+.1f}% .. {:+.1f}%], {} pairs".format(label, *cost(key)))
    print("single 4-byte allreduce: {:.1f} us median (goal < 100 us)".format(results["fusion on"]["latency"] * 1e6))
    try:
        import horovod.torch  # noqa: F401
        print("horovod is importable, but its comparison run is not implemented in this script")
    except ImportError:
        print("horovod: not installed here, no comparison")


if __name__ == "__main__":
    main()
