#!/usr/bin/env python3
"""Benchmark of `hvd build` (not a test): installing a locked env, next to `uv pip sync` of the same pins.

    python3 bench/build.py [--package tensorflow-cpu==2.12.1] [--python 3.11] [--runs 5] [--hvd target/release/hvd]

Measures, in one run on one machine (quote ratios, not absolute times):
  1. warm store:          every package path exists, the env path does not  -> `hvd build --locked`
                          vs `uv pip sync` into a fresh venv with uv's cache warm
  2. warm download cache: no store paths, every artifact downloaded         -> `hvd build --locked --offline`
                          (same uv numbers: uv's warm cache already holds unpacked wheels)
  3. no-op:               nothing changed                                   -> `hvd build --locked` (goal < 100 ms)
Needs network for the first lock and downloads, and uv (installed into a scratch venv when missing).
"""
import argparse, os, shutil, statistics, subprocess, sys, tempfile, time, tomllib
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--package", default="tensorflow-cpu==2.12.1")
    ap.add_argument("--python", default="3.11")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--hvd", default=str(Path(__file__).resolve().parent.parent / "target/release/hvd"))
    args = ap.parse_args()
    hvd = args.hvd
    work = Path(tempfile.mkdtemp(prefix="hvd-bench-build-"))
    store = work / "store"
    env = dict(os.environ, HVD_STORE=str(store))
    project = work / "app"
    project.mkdir()
    hvd_file = project / "train.hvd"
    hvd_file.write_text(f'project "bench"\nenv {{\n  python = "{args.python}"\n  packages = ["{args.package}"]\n}}\n')

    print(f"# locking {args.package} for python {args.python}", flush=True)
    run([hvd, "lock", str(hvd_file)], env=env)
    lock = tomllib.loads((project / "train.hvd.lock").read_text())
    pins = sorted(f"{p['name']}=={p['version']}" for p in lock.get("package", []))
    (work / "requirements.txt").write_text("\n".join(pins) + "\n")
    print(f"# {len(pins)} pinned packages")

    uv = shutil.which("uv")
    if not uv:
        tools = work / "tools"
        run([sys.executable, "-m", "venv", str(tools)])
        run([str(tools / "bin/pip"), "install", "-q", "uv"])
        uv = str(tools / "bin/uv")
    python = run([f"python{args.python}", "-c", "import sys; print(sys.executable)"]).strip()
    uv_env = dict(os.environ, UV_CACHE_DIR=str(work / "uv-cache"))

    def uv_sync():
        venv = work / "uv-venv"
        shutil.rmtree(venv, ignore_errors=True)
        run([uv, "venv", "-q", "--python", python, str(venv)], env=uv_env)
        return timed([uv, "pip", "sync", "-q", "--python", str(venv / "bin/python"), str(work / "requirements.txt")], env=uv_env)

    def store_paths():
        return [p for p in store.iterdir() if not p.name.startswith(".")]

    def remove(path):
        subprocess.run(["chmod", "-R", "u+w", str(path)], check=False)
        shutil.rmtree(path)

    print("# cold build (downloads; not timed against uv)", flush=True)
    run([hvd, "build", str(hvd_file), "--locked"], env=env)
    uv_sync()  # warms uv's cache

    env_link = project / ".hvd/env"
    warm_store, warm_cache, uv_times, noop = [], [], [], []
    for _ in range(args.runs):
        remove(Path(os.readlink(env_link)))
        warm_store.append(timed([hvd, "build", str(hvd_file), "--locked"], env=env))
        for path in store_paths():
            remove(path)
        warm_cache.append(timed([hvd, "build", str(hvd_file), "--locked", "--offline"], env=env))
        uv_times.append(uv_sync())
    for _ in range(max(10, args.runs)):
        noop.append(timed([hvd, "build", str(hvd_file), "--locked"], env=env))

    u = median(uv_times)
    print(f"uv pip sync (warm cache)          median {u*1000:8.0f} ms")
    print(f"hvd build, warm store             median {median(warm_store)*1000:8.0f} ms   ratio hvd/uv {median(warm_store)/u:.2f} (goal <= 1.0)")
    print(f"hvd build, warm download cache    median {median(warm_cache)*1000:8.0f} ms   ratio hvd/uv {median(warm_cache)/u:.2f}")
    print(f"hvd build --locked, no-op         median {median(noop)*1000:8.0f} ms   (goal < 100 ms)")
    remove(work)


if __name__ == "__main__":
    main()
