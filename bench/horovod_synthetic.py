#!/usr/bin/env python3
"""Benchmark (not a test): Horovod's synthetic benchmarks, unchanged, on hvd's `horovod` package against the real
Horovod 0.28.1, 2 workers on CPU, in the same run (docs/horovod.md, "Performance against Horovod 0.28.1").

    python3 bench/horovod_synthetic.py --examples /path/to/horovod [--frameworks tf,torch] [--reps 3]
        [--library libhvd_runtime.so] [--package collective/python] [--compare-package OLD/collective/python]
        [--hvd target/debug/hvd] [--workdir DIR] [--keep]

`--examples` is a local copy of Horovod's repository at v0.28.1 (nothing is fetched here): its
examples/tensorflow2/tensorflow2_synthetic_benchmark.py and examples/pytorch/pytorch_synthetic_benchmark.py run
as they are (`--model`, `--batch-size` and the batch counts are their own flags; both get the same ones). Per
framework, two projects with the same pins are locked and built with the default store and download cache (the
first build downloads the framework and builds Horovod from source: minutes, GBs for torch):
  real: python 3.11, the framework and `std.horovod { version = "0.28.1" }` (Horovod's gloo controller);
  hvd:  the same pins without Horovod, so the env gets hvd's `horovod` package.
hvd's side runs the Python package of `--package` (PYTHONPATH) with the runtime library of `--library`
(HVD_LIBRARY; a release build: the debug one is refused unless ALLOW_DEBUG=1), so a change to the package is
measured without rebuilding hvd; `--compare-package` adds a third variant (e.g. the package of an earlier commit,
`git archive HEAD~1 collective/python | tar -x -C /tmp/old`). The variants run interleaved (the order rotates
every repetition); each run's "Total img/sec" (rank 0's line) is recorded, and the median and best of each and
their ratios to the real Horovod's are printed. A variant that fails prints its last error line instead.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPTS = {
    "tf": "examples/tensorflow2/tensorflow2_synthetic_benchmark.py",
    "torch": "examples/pytorch/pytorch_synthetic_benchmark.py",
}
# Each benchmark's framework and pins, the same in both envs (torch: cmake and setuptools as Horovod's build of
# torch 2.0.1 needs them, since the build requirements must agree with the env).
PACKAGES = {
    "tf": ('let fw = std.tensorflow { version = "2.12.1", variant = "cpu" }', '"numpy<1.24"'),
    "torch": ('let fw = std.torch { version = "2.0.1" }',
              '"torchvision==0.15.2", "numpy<2", "cmake>=3.13,<4", "setuptools<82"'),
}
MODELS = {"tf": "MobileNetV3Small", "torch": "mobilenet_v3_small"}
TOTAL = re.compile(r"Total img/sec on (\d+) CPU\(s\): ([0-9.]+)")


def project(directory, framework, real, script_args):
    lets, extra = PACKAGES[framework]
    horovod = ', std.horovod { version = "0.28.1", frameworks = [fw] }' if real else ""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "train.hvd"), "w") as f:
        f.write('project "bench-{}-{}"\nimport std\n{}\nenv {{\n  python = "3.11"\n  toolchain = std.gcc {{ version '
                '= "12" }}\n  packages = [fw, {}{}]\n}}\nstep train {{\n  workers = 2\n  run = "python bench.py {}"\n'
                '}}\n'.format(framework, "real" if real else "hvd", lets, extra, horovod, script_args))


def hvd(binary, directory, *args, env=None):
    result = subprocess.run([binary, *args], cwd=directory, capture_output=True, text=True, env=env)
    return result


def must(result, what):
    if result.returncode != 0:
        sys.exit("{} failed:\n{}\n{}".format(what, result.stdout[-3000:], result.stderr[-3000:]))


def script_for(name, examples, directory):
    source = os.path.join(examples, SCRIPTS[name])
    if not os.path.isfile(source):
        sys.exit("no {} in {}: pass a copy of Horovod's repository as --examples".format(SCRIPTS[name], examples))
    shutil.copyfile(source, os.path.join(directory, "bench.py"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", required=True, help="a local copy of Horovod's repository")
    parser.add_argument("--frameworks", default="tf,torch")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--hvd", default=os.path.join(REPO, "target", "debug", "hvd"),
                        help="the hvd binary that builds and launches (its speed is not measured)")
    parser.add_argument("--library", default=os.path.join(REPO, "target", "release", "libhvd_runtime.so"))
    parser.add_argument("--package", default=os.path.join(REPO, "collective", "python"))
    parser.add_argument("--compare-package", help="a second hvd Python package to measure too (e.g. an older one)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-warmup-batches", type=int, default=2)
    parser.add_argument("--num-batches-per-iter", type=int, default=3)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--workdir", help="where the projects go (default: a new temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()

    library = os.path.abspath(args.library)
    if not os.path.isfile(library):
        sys.exit("no runtime library at {}: build one (cargo build --release -p hvd-runtime) or pass --library"
                 .format(library))
    if "/debug/" in os.path.realpath(library) and os.environ.get("ALLOW_DEBUG") != "1":
        sys.exit("{} is a debug build: pass a release build's library or set ALLOW_DEBUG=1".format(library))
    packages = {"hvd": os.path.abspath(args.package)}
    if args.compare_package:
        packages["hvd-compare"] = os.path.abspath(args.compare_package)
    for package in packages.values():
        if not os.path.isfile(os.path.join(package, "hvd", "__init__.py")):
            sys.exit("{} holds no hvd package (hvd/__init__.py)".format(package))

    workdir = args.workdir or tempfile.mkdtemp(prefix="hvd-horovod-synthetic-")
    names = [n.strip() for n in args.frameworks.split(",") if n.strip()]
    for name in names:
        if name not in SCRIPTS:
            sys.exit("unknown benchmark {!r} (tf, torch)".format(name))
    try:
        run_all(args, names, workdir, library, packages)
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def run_all(args, names, workdir, library, packages):
    hvd_bin = os.path.abspath(args.hvd)
    print("# load average before: {}".format(open("/proc/loadavg").read().split()[:3]))
    variants = []  # (benchmark, variant, directory, env)
    for name in names:
        framework = name
        script_args = "--model {} --batch-size {} --num-warmup-batches {} --num-batches-per-iter {} " \
                      "--num-iters {}".format(MODELS[name], args.batch_size, args.num_warmup_batches,
                                              args.num_batches_per_iter, args.num_iters)
        if framework == "tf":
            script_args += " --no-cuda"
        print("# {}: python bench.py {}".format(name, script_args))
        for kind in ["real"] + list(packages):
            directory = os.path.join(workdir, name, kind)
            project(directory, framework, kind == "real", script_args)
            script_for(name, args.examples, directory)
            env = dict(os.environ)
            env.pop("PYTHONPATH", None)
            env.pop("HVD_LIBRARY", None)
            env["NO_COLOR"] = "1"
            if kind != "real":
                env["PYTHONPATH"] = packages[kind]
                env["HVD_LIBRARY"] = library
            for command in ("lock", "build"):
                started = time.monotonic()
                must(hvd(hvd_bin, directory, command, "train.hvd", env=env), "hvd {} ({} {})".format(
                    command, name, kind))
                print("# {} {}: hvd {} {:.0f} s".format(name, kind, command, time.monotonic() - started),
                      flush=True)
            variants.append((name, kind, directory, env))

    results = {(name, kind): [] for name, kind, _, _ in variants}
    failures = {}
    for rep in range(args.reps):
        for name in names:
            mine = [v for v in variants if v[0] == name]
            shift = rep % len(mine)
            for _, kind, directory, env in mine[shift:] + mine[:shift]:
                started = time.monotonic()
                result = hvd(hvd_bin, directory, "run", "train.hvd", "--workers", "2", "--force", env=env)
                found = TOTAL.findall(result.stdout)
                if result.returncode != 0 or not found:
                    lines = [l for l in (result.stdout + result.stderr).splitlines() if l.strip()]
                    errors = [l for l in lines if "Error" in l]
                    failures[(name, kind)] = (errors or lines or ["no output"])[-1].strip()
                    print("rep {} {:9} {:12} failed: {}".format(rep, name, kind, failures[(name, kind)]),
                          flush=True)
                    continue
                images = float(found[-1][1])
                results[(name, kind)].append(images)
                print("rep {} {:9} {:12} {:8.1f} img/s on 2 workers ({:.0f} s)".format(
                    rep, name, kind, images, time.monotonic() - started), flush=True)

    print("# load average after: {}".format(open("/proc/loadavg").read().split()[:3]))
    print("\n{:9} {:12} {:>4} {:>10} {:>10} {:>14} {:>12}".format(
        "benchmark", "variant", "runs", "median", "best", "median/real", "best/real"))
    for name in names:
        real = results.get((name, "real")) or []
        for kind in ["real"] + list(packages):
            xs = results[(name, kind)]
            if not xs:
                print("{:9} {:12} failed: {}".format(name, kind, failures.get((name, kind), "no runs")))
                continue
            ratio = lambda f: "{:.2f}".format(f(xs) / f(real)) if real else "-"
            print("{:9} {:12} {:>4} {:>10.1f} {:>10.1f} {:>14} {:>12}".format(
                name, kind, len(xs), statistics.median(xs), max(xs), ratio(statistics.median), ratio(max)))


if __name__ == "__main__":
    main()
