#!/usr/bin/env python3
"""Benchmark of `hvd build` (not a test): installing a locked env, next to `uv pip sync` of the same pins.

    python3 bench/build.py [--package tensorflow-cpu==2.12.1] [--python 3.11] [--runs 5] [--cold-runs 3]
                           [--hvd target/release/hvd] [--compare OTHER_HVD]

Measures, in one run on one machine, each hvd binary with its own store, interleaved with uv (quote ratios, not
absolute times):
  1. warm store:          every package path exists, the env path does not  -> `hvd build --locked`
                          vs `uv pip sync` into a fresh venv with uv's cache warm
  2. warm download cache: no store paths, every artifact downloaded         -> `hvd build --locked --offline`
                          (same uv numbers: uv's warm cache already holds unpacked wheels, which hvd's store paths
                          are; here hvd unpacks, hashes and RECORD-checks every wheel again; the line "warm
                          download cache CPU" gives the CPU time of that work and the least wall time it allows on
                          this machine's cores, against uv warm)
  3. cold:                empty store and download cache, from the index    -> `hvd build --locked`
                          vs `uv pip sync` with an empty cache
  4. no-op:               nothing changed                                   -> `hvd build --locked` (goal < 100 ms)
`--compare` runs a second hvd binary (e.g. a build from before a change) through the same steps, interleaved, and
prints its ratios too. Each cold run is printed in order (they are few and noisy). Needs network for the lock and
the cold runs, and uv (installed into a scratch venv when missing). Prints the load average before and after.
"""
import argparse, os, resource, shutil, statistics, subprocess, sys, tempfile, time, tomllib
from pathlib import Path


def run(cmd, **kw):
    result = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if result.returncode != 0:
        sys.exit(f"failed: {' '.join(map(str, cmd))}\n{result.stdout}\n{result.stderr}")
    return result.stdout


def timed(cmd, **kw):
    start = time.perf_counter()
    run(cmd, **kw)
    return time.perf_counter() - start


def median(xs):
    return statistics.median(xs)


def remove(path):
    if os.path.lexists(path):
        subprocess.run(["chmod", "-R", "u+w", str(path)], check=False)
        shutil.rmtree(path)


class Subject:
    """One hvd binary with its own store and its own copy of the project."""

    def __init__(self, label, hvd, work, hvd_text, lock_text):
        self.label, self.hvd = label, hvd
        self.store = work / f"store-{label}"
        project = work / f"app-{label}"
        project.mkdir()
        self.file = project / "train.hvd"
        self.file.write_text(hvd_text)
        (project / "train.hvd.lock").write_text(lock_text)
        self.env_link = project / ".hvd/env"
        self.env = dict(os.environ, HVD_STORE=str(self.store))
        self.times = {"warm store": [], "warm download cache": [], "cold": [], "no-op": []}
        self.unpack_cpu = []  # user + system seconds of each warm-download-cache build (hvd and its children)

    def build(self, *flags):
        return timed([self.hvd, "build", str(self.file), "--locked", *flags], env=self.env)

    def store_paths(self):
        return [p for p in self.store.iterdir() if not p.name.startswith(".")]

    def warm_store(self):
        remove(Path(os.readlink(self.env_link)))
        self.times["warm store"].append(self.build())

    def warm_download_cache(self):
        for path in self.store_paths():
            remove(path)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.times["warm download cache"].append(self.build("--offline"))
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.unpack_cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)

    def cold(self):
        remove(self.store)
        self.times["cold"].append(self.build())

    def noop(self):
        self.times["no-op"].append(self.build())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--package", default="tensorflow-cpu==2.12.1")
    ap.add_argument("--python", default="3.11")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cold-runs", type=int, default=3)
    ap.add_argument("--hvd", default=str(Path(__file__).resolve().parent.parent / "target/release/hvd"))
    ap.add_argument("--compare", help="another hvd binary, measured the same way in the same run")
    args = ap.parse_args()
    print(f"# load average before: {os.getloadavg()}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="hvd-bench-build-"))
    hvd_text = f'project "bench"\nenv {{\n  python = "{args.python}"\n  packages = ["{args.package}"]\n}}\n'
    lock_dir = work / "lock"
    lock_dir.mkdir()
    (lock_dir / "train.hvd").write_text(hvd_text)
    print(f"# locking {args.package} for python {args.python}", flush=True)
    run([args.hvd, "lock", str(lock_dir / "train.hvd")], env=dict(os.environ, HVD_STORE=str(work / "lock-store")))
    lock_text = (lock_dir / "train.hvd.lock").read_text()
    lock = tomllib.loads(lock_text)
    pins = sorted(f"{p['name']}=={p['version']}" for p in lock.get("package", []))
    (work / "requirements.txt").write_text("\n".join(pins) + "\n")
    print(f"# {len(pins)} pinned packages")

    subjects = [Subject("hvd", args.hvd, work, hvd_text, lock_text)]
    if args.compare:
        subjects.append(Subject("compare", args.compare, work, hvd_text, lock_text))

    uv = shutil.which("uv")
    if not uv:
        tools = work / "tools"
        run([sys.executable, "-m", "venv", str(tools)])
        run([str(tools / "bin/pip"), "install", "-q", "uv"])
        uv = str(tools / "bin/uv")
    python = run([f"python{args.python}", "-c", "import sys; print(sys.executable)"]).strip()
    uv_cache = work / "uv-cache"
    uv_env = dict(os.environ, UV_CACHE_DIR=str(uv_cache))
    uv_times = {"warm": [], "cold": []}

    def uv_sync(kind=None):
        venv = work / "uv-venv"
        remove(venv)
        if kind == "cold":
            remove(uv_cache)
        run([uv, "venv", "-q", "--python", python, str(venv)], env=uv_env)
        took = timed([uv, "pip", "sync", "-q", "--python", str(venv / "bin/python"), str(work / "requirements.txt")],
                     env=uv_env)
        if kind:
            uv_times[kind].append(took)

    print("# cold builds (downloads; the first of each is not counted)", flush=True)
    for subject in subjects:
        subject.build()
    uv_sync()  # warms uv's cache

    for _ in range(args.runs):
        for subject in subjects:
            subject.warm_store()
            subject.warm_download_cache()
        uv_sync("warm")
    for _ in range(args.cold_runs):
        for subject in subjects:
            subject.cold()
        uv_sync("cold")
    for _ in range(max(10, args.runs)):
        for subject in subjects:
            subject.noop()

    print(f"# load average after: {os.getloadavg()}")
    warm, cold = median(uv_times["warm"]), median(uv_times["cold"])
    print(f"uv pip sync, warm cache                median {warm*1000:8.0f} ms  (best {min(uv_times['warm'])*1000:.0f})")
    print(f"uv pip sync, cold (empty cache)        median {cold*1000:8.0f} ms  (best {min(uv_times['cold'])*1000:.0f})")
    each = lambda times: " ".join(f"{t*1000:.0f}" for t in times)
    print(f"#   uv cold runs, in order: {each(uv_times['cold'])} ms")
    peers = {"warm store": warm, "warm download cache": warm, "cold": cold}
    for subject in subjects:
        for scenario, times in subject.times.items():
            line = f"{subject.label:8} {scenario:29} median {median(times)*1000:8.0f} ms  (best {min(times)*1000:.0f})"
            if scenario in peers:
                line += f"   ratio hvd/uv {median(times)/peers[scenario]:.2f} (goal <= 1.0)"
            else:
                line += "   (goal < 100 ms)"
            print(line)
            if scenario == "cold":
                print(f"#   {subject.label} cold runs, in order: {each(times)} ms")
    # Why the warm download cache cannot reach uv's warm cache (#22 §4): uv's cache holds unpacked wheels (hvd's store
    # paths, the "warm store" line), while from archives every file is inflated, hashed and written: CPU time that
    # no ordering or overlap removes, so on this machine's cores the build takes at least CPU / cores.
    cores = len(os.sched_getaffinity(0))
    for subject in subjects:
        cpu = median(subject.unpack_cpu)
        print(f"{subject.label:8} warm download cache CPU (user + system, median): {cpu*1000:.0f} ms, so at least "
              f"{cpu*1000/cores:.0f} ms on {cores} cores = {cpu/cores/warm:.2f}x uv's warm sync")
    remove(work)


if __name__ == "__main__":
    main()
