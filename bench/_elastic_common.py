"""What the elastic benchmarks share: running one elastic step under a real `hvd run` and their command line."""

import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_elastic_step(hvd, python, size, worker, timeout=120, env=None):
    """Runs `worker` (Python source) as an elastic step `workers = { min = 2, max = size }` under `hvd run` (with the
    variables `env` added to its environment); returns the finished process (stdout and stderr captured). Exits when
    the run does not end within `timeout` seconds."""
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "w.py"), "w") as f:
            f.write(worker)
        lib = os.environ.get("HVD_LIBRARY") or os.path.join(os.path.dirname(os.path.abspath(hvd)), "libhvd_runtime.so")
        with open(os.path.join(d, "train.hvd"), "w") as f:
            f.write(
                'project "bench"\nenv {\n  python = "3.11"\n  packages = []\n}\n'
                'step train {\n  run = "%s w.py"\n  workers = { min = 2, max = %d }\n'
                '  env = { PYTHONPATH = "%s", HVD_LIBRARY = "%s" }\n}\n'
                % (python, size, os.path.join(ROOT, "collective", "python"), lib)
            )
        try:
            return subprocess.run(
                [hvd, "run", os.path.join(d, "train.hvd"), "--no-build", "--grace", "2"],
                capture_output=True, text=True, env=dict(os.environ, NO_COLOR="1", **(env or {})), timeout=timeout,
            )
        except subprocess.TimeoutExpired as e:
            sys.exit("hvd run did not end within %d s:\n%s\n%s" % (timeout, e.stdout, e.stderr))


def parse_args(doc):
    """The benchmarks' command line: --hvd, --python, --sizes, --repeat."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--hvd", default=os.path.join(ROOT, "target", "debug", "hvd"))
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--sizes", type=int, nargs="+", default=[4, 8])
    p.add_argument("--repeat", type=int, default=3)
    return p.parse_args()
