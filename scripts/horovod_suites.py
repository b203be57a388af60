#!/usr/bin/env python3
"""Runs one of Horovod's own test suites (a local copy of horovod's test/parallel) against hvd, two ways, and prints
the counts: opt-in, nothing is fetched (docs/horovod.md, "Horovod's test suites").

    HVD_HOROVOD_TESTS=/path/to/horovod/test/parallel scripts/horovod_suites.py test_torch.py \\
        [--workers 2] [--mode both|per-test|session] [--timeout 120] [--python PY] [-k EXPR] [--report out.json]

- per-test: each test in its own ``hvd run --workers N`` (a fresh job per test);
- session: one pytest session per rank over the whole file, as Horovod's CI runs it (each test's tearDown shuts
  hvd down and the next test's init joins again).

A test is ``passed`` when every rank passed it, ``failed`` when some rank failed it (or a rank never reported it),
``skipped`` when the ranks skipped it, ``hung`` when a rank was still in it after ``--timeout`` seconds: that rank
records it and exits, the job ends, and a session run starts again with the tests not yet run, so nothing stalls
the suite. The workers get this checkout's ``horovod`` and ``hvd`` packages (PYTHONPATH) and runtime library
(HVD_LIBRARY, else the newest target/debug build); ``--python`` must have the framework, pytest and the suite's
test requirements (mock, cloudpickle). The same file is the pytest plugin each rank loads (``-p horovod_suites``):
it writes one JSON line per test outcome to ``$HVD_SUITES_OUT/rank-<rank>.jsonl`` and runs the per-test watchdog.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = os.path.join(REPO, "collective", "python")
HANG_EXIT = 86
VERDICTS = ("passed", "failed", "skipped", "hung")


# ---------------------------------------------------------------------------------------------------------------
# The pytest plugin (loaded in each rank's session)

def _rank():
    for var in ("HVD_RANK", "HOROVOD_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


class _Recorder:
    def __init__(self, out_dir, timeout):
        self.path = os.path.join(out_dir, "rank-{}.jsonl".format(_rank()))
        self.timeout = timeout
        self.lock = threading.Lock()

    def write(self, record):
        with self.lock, open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


_recorder = None


def pytest_configure(config):
    global _recorder
    out = os.environ.get("HVD_SUITES_OUT")
    if out:
        _recorder = _Recorder(out, float(os.environ.get("HVD_SUITES_TIMEOUT", "120")))


try:
    import pytest as _pytest
except ImportError:  # the driver needs no pytest; the ranks' sessions have it
    _pytest = None

if _pytest is not None:

    @_pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        """The watchdog: a rank still in this test after the timeout records it as hung and leaves (a thread, so a
        rank blocked in the library is caught too)."""
        if _recorder is None:
            yield
            return

        def hang():
            _recorder.write({"test": item.nodeid, "outcome": "hung"})
            os._exit(HANG_EXIT)

        timer = threading.Timer(_recorder.timeout, hang)
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()


def pytest_runtest_logreport(report):
    if _recorder is None:
        return
    if report.when == "call" or report.outcome != "passed":
        record = {"test": report.nodeid, "when": report.when, "outcome": report.outcome}
        if report.outcome == "failed":
            lines = [line for line in str(report.longreprtext).splitlines() if line.strip()]
            record["why"] = (lines[-1] if lines else "")[:300]
        elif report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            record["why"] = str(report.longrepr[2])[:300]
        _recorder.write(record)


# ---------------------------------------------------------------------------------------------------------------
# The driver


def _library():
    if os.environ.get("HVD_LIBRARY"):
        return os.environ["HVD_LIBRARY"]
    candidates = [os.path.join(REPO, "target", "debug", p) for p in ("libhvd_runtime.so", "deps/libhvd_runtime.so")]
    found = [p for p in candidates if os.path.isfile(p)]
    if not found:
        sys.exit("horovod_suites: no runtime library: set HVD_LIBRARY or `cargo build -p hvd-runtime`")
    return max(found, key=os.path.getmtime)


def _hvd():
    for p in (shutil.which("hvd"), os.path.join(REPO, "target", "debug", "hvd")):
        if p and os.path.isfile(p):
            return p
    sys.exit("horovod_suites: no `hvd` binary: put it on PATH, pass --hvd, or `cargo build -p hvd`")


def _worker_env(args):
    path = [args.packages, os.path.dirname(os.path.abspath(__file__))]
    return ["PYTHONPATH=" + os.pathsep.join(path), "HVD_LIBRARY=" + args.library, "PYTHONUNBUFFERED=1",
            "HVD_SUITES_TIMEOUT={}".format(args.timeout)]


def collect(args):
    """The suite's test ids, as pytest collects them (in one plain process: collection runs no collective)."""
    env = dict(os.environ, PYTHONPATH=args.packages, HVD_LIBRARY=args.library)
    cmd = [args.python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", args.suite]
    if args.k:
        cmd += ["-k", args.k]
    out = subprocess.run(cmd, cwd=args.tests, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         universal_newlines=True, timeout=600)
    # Only the suite's own ids: a framework's log line may hold "::" too (TensorFlow's "absl::InitializeLog()").
    ids = [line.strip() for line in out.stdout.splitlines()
           if "::" in line and not line.startswith(" ") and line.split("::")[0].endswith(os.path.basename(args.suite))]
    if not ids:
        sys.exit("horovod_suites: collected no test from {} (pytest said:)\n{}\n{}".format(
            args.suite, out.stdout[-3000:], out.stderr[-3000:]))
    return ids


def _run_job(args, tests, out_dir, limit):
    """One ``hvd run --workers N`` whose ranks run pytest over ``tests``; returns its exit status (None: killed at
    ``limit`` seconds)."""
    sys.path.insert(0, PACKAGES)
    from horovod.runner.launch import hvd_file

    command = (["env", "HVD_SUITES_OUT=" + out_dir] + _worker_env(args)
               + [args.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "horovod_suites"] + tests)
    project = os.path.join(out_dir, "suite.hvd")
    with open(project, "w") as f:
        f.write(hvd_file(command, args.workers, args.tests))
    log = open(os.path.join(out_dir, "hvd-run.log"), "a")
    proc = subprocess.Popen([args.hvd, "run", project, "--no-build", "--workers", str(args.workers), "--grace", "2"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        return proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return None
    finally:
        log.close()


def _read(out_dir, workers):
    """{test: {rank: (outcome, why)}} from the ranks' records; a failure in any phase wins over the call's pass."""
    seen = {}
    for rank in range(workers):
        path = os.path.join(out_dir, "rank-{}.jsonl".format(rank))
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                mine = seen.setdefault(r["test"], {})
                old = mine.get(rank)
                rank_of = {"passed": 0, "skipped": 1, "failed": 2, "hung": 3}
                if old is None or rank_of[r["outcome"]] > rank_of[old[0]]:
                    mine[rank] = (r["outcome"], r.get("why", ""))
    return seen


def _verdict(per_rank, workers):
    outcomes = [per_rank.get(r, ("missing", ""))[0] for r in range(workers)]
    whys = [per_rank[r][1] for r in sorted(per_rank) if per_rank[r][1]]
    why = whys[0] if whys else ""
    if "hung" in outcomes:
        return "hung", why
    if "failed" in outcomes:
        return "failed", why
    if "missing" in outcomes:
        return "failed", "a rank did not report this test (it left the job)"
    if "skipped" in outcomes:
        return "skipped", why
    return "passed", ""


def run_per_test(args, tests, scratch):
    results = {}
    for i, test in enumerate(tests):
        out_dir = os.path.join(scratch, "per-test-{}".format(i))
        os.makedirs(out_dir)
        status = _run_job(args, [test], out_dir, args.timeout + args.startup)
        seen = _read(out_dir, args.workers).get(test, {})
        if status is None and not any(o == "hung" for o, _ in seen.values()):
            seen = dict(seen, **{0: ("hung", "the job outlived --timeout plus start-up")})
        results[test] = _verdict(seen, args.workers)
        _progress("per-test", test, results[test])
    return results


def run_session(args, tests, scratch):
    """One pytest session per rank; after a hang (or a crash) a new session runs the tests not reached."""
    results, remaining, attempt = {}, list(tests), 0
    while remaining:
        out_dir = os.path.join(scratch, "session-{}".format(attempt))
        os.makedirs(out_dir)
        attempt += 1
        status = _run_job(args, remaining, out_dir, args.timeout * len(remaining) + args.startup)
        seen = _read(out_dir, args.workers)
        reached = [t for t in remaining if t in seen]
        for t in reached:
            results[t] = _verdict(seen[t], args.workers)
            _progress("session", t, results[t])
        stuck = [t for t in reached if results[t][0] == "hung"]
        rest = [t for t in remaining if t not in seen]
        if rest and not stuck:
            # The session ended (or was killed) before these tests without a hang record: the first one is
            # counted as failed (it crashed the session or never finished), and the session goes on after it.
            why = "the session ended here (exit status {})".format(status)
            results[rest[0]] = ("failed", why)
            _progress("session", rest[0], results[rest[0]])
            rest = rest[1:]
        remaining = rest
    return results


def _progress(mode, test, verdict):
    if os.environ.get("HVD_SUITES_QUIET") != "1":
        print("[{}] {:8} {}{}".format(mode, verdict[0], test, "  -- " + verdict[1] if verdict[1] else ""), flush=True)


def counts(results):
    return {v: sum(1 for r in results.values() if r[0] == v) for v in VERDICTS}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("suite", help="the suite file in $HVD_HOROVOD_TESTS, e.g. test_torch.py")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mode", choices=("both", "per-test", "session"), default="both")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds one test may take on a rank")
    p.add_argument("--startup", type=float, default=60.0, help="seconds a job may take beyond its tests' time")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--hvd", default=None)
    p.add_argument("-k", default=None, help="pytest -k expression selecting tests")
    p.add_argument("--packages", default=PACKAGES,
                   help="the directory with the hvd and horovod packages (default: this checkout's)")
    p.add_argument("--report", default=None, help="write every test's verdict and reason to this JSON file")
    args = p.parse_args(argv)
    args.tests = os.environ.get("HVD_HOROVOD_TESTS")
    if not args.tests:
        sys.exit("horovod_suites: set HVD_HOROVOD_TESTS to a local copy of horovod's test/parallel (nothing is "
                 "fetched)")
    args.tests = os.path.abspath(args.tests)
    if not os.path.isfile(os.path.join(args.tests, args.suite)):
        sys.exit("horovod_suites: {} has no {}".format(args.tests, args.suite))
    if args.workers < 1 or args.timeout <= 0:
        sys.exit("horovod_suites: --workers and --timeout must be positive")
    args.library = _library()
    args.hvd = args.hvd or _hvd()
    tests = collect(args)
    scratch = tempfile.mkdtemp(prefix="horovod-suites-")
    report = {}
    modes = ("per-test", "session") if args.mode == "both" else (args.mode,)
    for mode in modes:
        results = (run_per_test if mode == "per-test" else run_session)(args, tests, scratch)
        report[mode] = {t: {"verdict": v, "why": w} for t, (v, w) in results.items()}
        c = counts(results)
        print("{} ({} tests, {} workers, {} mode): {passed} passed, {failed} failed, {skipped} skipped, {hung} hung"
              .format(args.suite, len(tests), args.workers, mode, **c), flush=True)
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1, sort_keys=True)
    print("logs: {}".format(scratch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
