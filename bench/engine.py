#!/usr/bin/env python3
"""Benchmark of the hvd engine through the Python API (not a test).

Starts N local ranks of itself (default 2) around a minimal rendezvous key-value server (the `/kv/` protocol of
docs/rendezvous.md, enough for the bootstrap), once per configuration, and prints medians and ratios:

- 100 tensors of 4 KiB per step, and 100 tensors from 4 KiB to 4 MiB (geometric) per step, allreduced in place
  with the per-tensor async API (one call and one synchronize per tensor) and with the grouped API (one call and
  one synchronize per step): fusion on (HVD_FUSION_THRESHOLD default) vs off (0);
- the timeline's cost: inside the fusion-on runs, blocks of steps (about 200 ms each) with the timeline off and on
  (hvd.start_timeline before the block, hvd.stop_timeline after it, both inside the timed block, so every event
  of the block is written within it; a new file per block, the previous one deleted untimed), in ABBA order; the
  median and quartiles of the on/off ratios;
- a single 4-byte allreduce, median latency (the engine's per-operation overhead plus the transport's latency).

Usage: bench/engine.py [--ranks N] [--steps S (default 50; at least half a second of steps)] [--rounds R] [--blocks B (default 4)] [--block-ms MS]
       [--library PATH] [--env KEY=VALUE ...] [--horovod-python PYTHON] [--framework numpy|torch]
Library: HVD_LIBRARY or --library, else the package's own search (target/release first if newer).
Goals (issue 6): fusion >= 5x faster than no fusion on 100 x 4 KiB; single 4-byte allreduce < 100 us median.
Issue 22 §3: the same 5x through the per-tensor API; the line "per-tensor step / grouped step" shows what the
per-tensor API costs over one call per step in the same round (1.0x: nothing), and the line "per-tensor loop alone"
times the per-tensor step's own loop with Python calls that do nothing and prints the bound this puts on any
per-tensor Python API: the unfused per-tensor step over (the fused grouped step + that loop).
With --framework torch (a python with torch), hvd's workloads use CPU torch tensors through hvd.torch
(`hvd.torch.allreduce_async_` per tensor, `hvd.torch.grouped_allreduce_async_` per step) instead of numpy arrays.
With --horovod-python PYTHON (an env with Horovod built against TensorFlow, e.g. the one `hvd build
examples/tensorflow-horovod/train.hvd` assembles), the same workloads run through Horovod in the same rounds, and
the ratios to Horovod are printed too.
"""

import argparse
import itertools
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


def launch(ranks, env_extra, steps, blocks=0, block_ms=200.0, timeline_dir="", framework="numpy"):
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
                                       str(blocks), "--block-ms", str(block_ms), "--timeline-dir", timeline_dir,
                                       "--framework", framework], env=env,
                                      stdout=subprocess.PIPE, text=True))
    outs = [p.communicate()[0] for p in procs]
    server.shutdown()
    if any(p.returncode for p in procs):
        raise SystemExit("a rank failed: {}".format([p.returncode for p in procs]))
    return json.loads(outs[0].split("RESULT ", 1)[1])


class HvdApi:
    """The workloads through this project's `hvd` package: numpy arrays, in place."""

    def __init__(self):
        import numpy as np

        import hvd

        self.np, self.hvd = np, hvd
        hvd.init()
        self.rank = hvd.rank()

    def tensors(self, sizes):
        return [self.np.ones(n, self.np.float32) for n in sizes]

    def per_tensor(self, tensors, tag):
        hvd = self.hvd
        hvd.barrier()
        t0 = time.perf_counter()
        hs = [hvd.allreduce_async_(t, op=hvd.Sum, name="{}.{}".format(tag, i)) for i, t in enumerate(tensors)]
        for h in hs:
            hvd.synchronize(h)
        took = time.perf_counter() - t0
        self.refill(tensors)
        return took

    def refill(self, tensors):
        for t in tensors:
            t.fill(1.0)

    def loop(self, tensors, tag):
        """The per-tensor step's own Python with calls that do nothing (no barrier, no library): the floor under any
        per-tensor API made of Python calls, on this machine, in this round (#22 §3)."""
        def submit(t, op=None, name=None):
            return None

        def wait(h):
            return None
        op = self.hvd.Sum
        t0 = time.perf_counter()
        hs = [submit(t, op=op, name="{}.{}".format(tag, i)) for i, t in enumerate(tensors)]
        for h in hs:
            wait(h)
        return time.perf_counter() - t0

    def grouped(self, tensors, tag):
        hvd = self.hvd
        hvd.barrier()
        t0 = time.perf_counter()
        hvd.synchronize(hvd.grouped_allreduce_async_(tensors, op=hvd.Sum, name=tag))
        took = time.perf_counter() - t0
        self.refill(tensors)
        return took

    def latency_call(self):
        x = self.np.ones(1, self.np.float32)
        return lambda: self.hvd.allreduce_(x, op=self.hvd.Max, name="lat")

    def start_timeline(self, path):
        self.hvd.start_timeline(path)

    def stop_timeline(self):
        self.hvd.stop_timeline()

    def broadcast(self, value):
        return self.hvd.broadcast_object(value, name="k")

    def shutdown(self):
        self.hvd.shutdown()


class TorchHvdApi(HvdApi):
    """The same workloads through `hvd.torch` with CPU torch tensors (float32), in place: the per-tensor step is
    `hvd.torch.allreduce_async_` + `hvd.synchronize` per tensor, as DistributedOptimizer's gradient hooks submit."""

    def __init__(self):
        import torch

        import hvd.torch as hvd

        self.torch, self.hvd = torch, hvd
        hvd.init()
        self.rank = hvd.rank()

    def tensors(self, sizes):
        return [self.torch.ones(n) for n in sizes]

    def refill(self, tensors):
        for t in tensors:
            t.fill_(1.0)

    def latency_call(self):
        x = self.torch.ones(1)
        return lambda: self.hvd.allreduce_(x, op=self.hvd.Max, name="lat")


class HorovodApi:
    """The same workloads through Horovod's TensorFlow API, the way its users run them: the per-tensor allreduces
    inside one `tf.function` (TensorFlow runs them concurrently, so Horovod can fuse them), the group with
    `hvd.grouped_allreduce`; results are new tensors (TensorFlow's tensors are immutable)."""

    def __init__(self):
        import tensorflow as tf

        import horovod.tensorflow as hvd

        self.tf, self.hvd = tf, hvd
        hvd.init()
        self.rank = hvd.rank()
        self.zero = tf.zeros([1])

        @tf.function
        def per_tensor(tensors, tag):
            return [hvd.allreduce(t, op=hvd.Sum, name="{}.{}".format(tag, i)) for i, t in enumerate(tensors)]

        @tf.function
        def grouped(tensors, tag):
            return hvd.grouped_allreduce(tensors, op=hvd.Sum, name=tag)

        @tf.function
        def latency(x):
            return hvd.allreduce(x, op=hvd.Max, name="lat")

        self._per_tensor, self._grouped, self._latency = per_tensor, grouped, latency

    def tensors(self, sizes):
        return [self.tf.ones([n], self.tf.float32) for n in sizes]

    def barrier(self):
        self.hvd.allreduce(self.zero, op=self.hvd.Sum, name="barrier").numpy()

    def _timed(self, fn, tensors, tag):
        self.barrier()
        t0 = time.perf_counter()
        out = fn(tensors, tag)
        out[-1].numpy()  # the function's results are ready when it returns; this only makes sure of it
        return time.perf_counter() - t0

    def per_tensor(self, tensors, tag):
        return self._timed(self._per_tensor, tensors, tag)

    def grouped(self, tensors, tag):
        return self._timed(self._grouped, tensors, tag)

    def latency_call(self):
        x = self.tf.ones([1], self.tf.float32)
        return lambda: self._latency(x)

    def start_timeline(self, path):
        self.hvd.start_timeline(path, mark_cycles=False)

    def stop_timeline(self):
        self.hvd.stop_timeline()

    def broadcast(self, value):
        return self.hvd.broadcast_object(value)

    def shutdown(self):
        self.hvd.shutdown()


def worker(api, steps, blocks, block_ms, timeline_dir):
    block_ids = itertools.count()
    written = []

    def remove_written():
        while written:
            try:
                os.unlink(written.pop())
            except FileNotFoundError:
                pass
    small = api.tensors([1024] * 100)
    mixed = api.tensors([int(1024 * (1024 ** (i / 99))) for i in range(100)])  # 4 KiB .. 4 MiB of float32

    def timeline_pairs(step, k):
        """Blocks of k steps with the timeline off and on (started before the block and stopped after it, both
        timed: stopping waits until the writer has written every event of the block), in ABBA order; the ratio
        on/off of each pair."""
        ratios = []
        for b in range(blocks):
            took = {}
            for on in ((False, True) if b % 2 == 0 else (True, False)):
                # A new file for every block, the previous one deleted before the clock starts: starting a timeline
                # on the path of a big one would truncate it inside the timed block, and ext4 writes a truncated
                # file's data back first (milliseconds, once per start, not per step).
                # (Rank 0 writes the timelines; its stop_timeline returns once the file is complete.)
                # (The process id too: the directory is shared by every launch of the run.)
                path = os.path.join(timeline_dir, "timeline-{}-{}.json".format(os.getpid(), next(block_ids)))
                if api.rank == 0:
                    remove_written()
                    written.append(path)
                step()  # a step that lines the ranks up (each begins with a barrier), untimed
                extra = 0.0
                if on:
                    t0 = time.perf_counter()
                    api.start_timeline(path)
                    extra += time.perf_counter() - t0
                total = sum(step() for _ in range(k))
                if on:
                    t0 = time.perf_counter()
                    api.stop_timeline()
                    extra += time.perf_counter() - t0
                took[on] = total + extra
            ratios.append(took[True] / took[False])
        return ratios

    def measure(step, timeline=True):
        for _ in range(3):
            step()
        # At least `steps` steps and about half a second of them (rank 0's estimate, shared), so that a fast step's
        # median is not taken over a few milliseconds of a noisy machine.
        estimate = statistics.median(step() for _ in range(5))
        count = api.broadcast(max(steps, int(0.5 / estimate)))
        times = [step() for _ in range(count)]
        median = statistics.median(times)
        if not timeline_dir or not timeline:
            return median, []
        # Blocks of about block_ms (rank 0's estimate, so that every rank runs the same number of steps).
        k = api.broadcast(max(3, int(block_ms / 1e3 / median)))
        return median, timeline_pairs(step, k)

    result = {}
    workloads = [("small", lambda: api.per_tensor(small, "s")), ("grouped", lambda: api.grouped(small, "g")),
                 ("mixed", lambda: api.per_tensor(mixed, "m")), ("mixed_grouped", lambda: api.grouped(mixed, "mg"))]
    for key, step in workloads:
        result[key], result[key + "_timeline"] = measure(step)
    if hasattr(api, "loop"):
        result["loop"], _ = measure(lambda: api.loop(small, "s"), timeline=False)
    remove_written()  # the last block's file

    call = api.latency_call()
    times = []
    for i in range(2000):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    result["latency"] = statistics.median(times[200:])
    api.shutdown()
    if api.rank == 0:
        print("RESULT " + json.dumps(result))


def launch_horovod(python, ranks, env_extra, steps, blocks, block_ms, timeline_dir):
    """The Horovod worker on `ranks` local processes through Horovod's own launcher (gloo), from `python`'s env."""
    horovodrun = Path(python).parent / "horovodrun"
    cmd = [str(horovodrun), "-np", str(ranks), "-H", "localhost:{}".format(ranks), "--gloo", python, __file__,
           "--horovod-worker", "--steps", str(steps), "--blocks", str(blocks), "--block-ms", str(block_ms),
           "--timeline-dir", timeline_dir]
    p = subprocess.run(cmd, env=dict(os.environ, **env_extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
    for line in p.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise SystemExit("the Horovod run failed ({}):\n{}".format(p.returncode, p.stdout[-3000:]))


def cpu_times():
    """The machine's CPU time counters (/proc/stat's first line), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def print_steal(before, after):
    """A virtual machine's CPUs can be taken away by its host ("steal"): then every number here is slower."""
    if before is None or after is None or len(before) < 8:
        return
    d = [b - a for a, b in zip(before, after)]
    total = sum(d[:8]) or 1
    print("cpu during the run: {:.0f}% busy, {:.1f}% stolen by the host (numbers from a run with a lot of steal "
          "are slower and noisier)".format(100 * (total - d[3] - d[4] - d[7]) / total, 100 * d[7] / total))


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
    ap.add_argument("--horovod-python", metavar="PYTHON",
                    help="a python whose env has Horovod with TensorFlow (and horovodrun next to it): the same "
                         "workloads through Horovod, in the same rounds")
    ap.add_argument("--framework", choices=("numpy", "torch"), default="numpy",
                    help="hvd's tensors: numpy arrays (hvd) or CPU torch tensors (hvd.torch; needs torch)")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--horovod-worker", action="store_true")
    ap.add_argument("--timeline-dir", default="")
    args = ap.parse_args()
    if args.worker or args.horovod_worker:
        api = HorovodApi() if args.horovod_worker else TorchHvdApi() if args.framework == "torch" else HvdApi()
        return worker(api, args.steps, args.blocks, args.block_ms, args.timeline_dir)
    if args.library:
        os.environ["HVD_LIBRARY"] = str(Path(args.library).resolve())
    import hvd._lib

    print("library: {}".format(hvd._lib.path()))
    print("ranks: {}, steps: {}, rounds: {} (medians), hvd's tensors: {}".format(args.ranks, args.steps, args.rounds,
                                                                               args.framework))
    extra = dict(e.split("=", 1) for e in args.env)
    if extra:
        print("extra environment: {}".format(extra))
    cpu_before = cpu_times()
    with tempfile.TemporaryDirectory() as tmp:
        configs = {
            "fusion on": dict(extra),
            "fusion off": dict(extra, HVD_FUSION_THRESHOLD="0"),
        }
        # The machine is shared and noisy: interleave the configurations, so that every round runs each one under
        # about the same load, and report medians over rounds and the median of the per-round (paired) ratios.
        # The timeline's cost is measured inside the fusion-on runs, in blocks with the timeline off and on
        # (`hvd.start_timeline` / `hvd.stop_timeline`), so each pair runs under the same conditions.
        if args.horovod_python:
            # Horovod's start_timeline needs HOROVOD_TIMELINE=DYNAMIC from the start (its timeline then stays idle
            # until started).
            configs["horovod fusion on"] = dict(extra, HOROVOD_TIMELINE="DYNAMIC")
            configs["horovod fusion off"] = dict(extra, HOROVOD_FUSION_THRESHOLD="0")
        rounds = {name: [] for name in configs}
        for i in range(args.rounds):
            for name, env in configs.items():
                on = name.endswith("fusion on")
                blocks, tl = (args.blocks, tmp) if on else (0, "")
                if name.startswith("horovod"):
                    r = launch_horovod(args.horovod_python, args.ranks, env, args.steps, blocks, args.block_ms, tl)
                else:
                    r = launch(args.ranks, env, args.steps, blocks, args.block_ms, tl, args.framework)
                rounds[name].append(r)
            print("round {}/{} done".format(i + 1, args.rounds), file=sys.stderr)
    print_steal(cpu_before, cpu_times())
    keys = ["small", "grouped", "mixed", "mixed_grouped", "latency", "loop"]
    results = {name: {k: statistics.median(r[k] for r in rs) for k in keys if k in rs[0]}
               for name, rs in rounds.items()}

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
    # What the per-tensor API costs over one call per step (its submissions and waits), whatever the fusion factor
    # of the run: the same round's per-tensor step over its grouped step, fusion on (#22 §3).
    print("per-tensor step / grouped step, fusion on (median of rounds): {:.2f}x 100 x 4 KiB, {:.2f}x 4 KiB..4 MiB"
          .format(statistics.median(r["small"] / r["grouped"] for r in rounds["fusion on"]),
                  statistics.median(r["mixed"] / r["mixed_grouped"] for r in rounds["fusion on"])))
    # The most a per-tensor API made of Python calls could give in this run (#22 §3): its fused step can be no faster
    # than the grouped step plus the benchmark's own per-tensor loop with calls that do nothing, while its unfused
    # step is taken as measured (a cheaper API would make that faster too, so the real bound is lower still).
    bound = statistics.median(off["small"] / (on["grouped"] + on["loop"])
                              for on, off in zip(rounds["fusion on"], rounds["fusion off"]))
    print("per-tensor loop alone, no-op calls: {:.3f} ms a step; bound on any per-tensor Python API's speed-up "
          "here: off / (grouped on + loop) = {:.2f}x (median of paired rounds)".format(
              results["fusion on"]["loop"] * 1e3, bound))

    def cost(config, key):
        pairs = [p for r in rounds[config] for p in r[key + "_timeline"]]
        q = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else pairs * 3
        return (statistics.median(pairs) - 1) * 100, (q[0] - 1) * 100, (q[2] - 1) * 100, len(pairs)

    labels = (("small", "100 x 4 KiB per-tensor"), ("grouped", "100 x 4 KiB grouped"),
              ("mixed", "4 KiB..4 MiB per-tensor"), ("mixed_grouped", "4 KiB..4 MiB grouped"))
    if args.blocks:
        print("timeline cost (on/off - 1 over block pairs; median [quartiles], pairs) (goal < 5%):")
        for key, label in labels:
            print("  {:<26} {:+6.1f}% [{:+.1f}% .. {:+.1f}%], {} pairs".format(label, *cost("fusion on", key)))
    else:
        print("timeline cost: not measured (--blocks 0)")
    print("single 4-byte allreduce: {:.1f} us median (goal < 100 us)".format(results["fusion on"]["latency"] * 1e6))
    if not args.horovod_python:
        print("horovod: not run (pass --horovod-python, see docs/runtime.md)")
        return
    print("horovod (TensorFlow API, gloo) against hvd, fusion on, median of paired rounds (hvd time / horovod time):")
    for key, label in labels + (("latency", "4-byte allreduce"),):
        print("  {:<26} horovod {:>9.3f} ms, hvd {:>9.3f} ms: hvd takes {:.2f}x horovod's time".format(
            label, results["horovod fusion on"][key] * 1e3, results["fusion on"][key] * 1e3,
            paired("fusion on", "horovod fusion on", key)))
    print("horovod fusion speed-up, 100 x 4 KiB: {:.2f}x per-tensor, {:.2f}x grouped".format(
        paired("horovod fusion off", "horovod fusion on", "small"),
        paired("horovod fusion off", "horovod fusion on", "grouped")))
    if args.blocks:
        print("horovod timeline cost, measured the same way:")
        for key, label in labels:
            print("  {:<26} {:+6.1f}% [{:+.1f}% .. {:+.1f}%], {} pairs".format(label, *cost("horovod fusion on", key)))


if __name__ == "__main__":
    main()
