# The driver program of hvd's `spark` engine (launcher/src/engines/spark.rs writes it next to the run's state and
# runs it with a Python that has pyspark; docs/engines.md). One distributed step is one barrier-mode Spark job with one
# task per worker: task i is rank i, and the executors' addresses from BarrierTaskContext give each rank its host,
# local rank and cross rank. Every task runs `hvd worker-env -- COMMAND` (the shim reads the HVD_SPARK_* variables
# set here) and streams its output back to this driver over a TCP connection; the driver prints each line as
# `[RANK] line` on its own stdout/stderr, where `hvd run` reads the rank from the tag. The first rank to fail ends the
# job: the driver says `hvd spark: rank R failed (exit status: N); ending the job` and exits with N. With `--pull`
# (binary caches), every task first runs `hvd cache pull` on its executor and all tasks meet at a barrier before any
# rank starts: an executor that cannot get the env ends the job naming itself (its address), and no rank runs
# anywhere; each rank then starts as `hvd worker-env --pull=ENV ...`, which finds the env and roots it against `hvd gc`.
#
# Only the standard library and pyspark: this file runs in the driver and, pickled, in the executors' Python.

import argparse
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

USAGE_EXIT = 2

# The Spark settings hvd passes (`cluster { settings }`'s `spark.*`: a JSON object), kept off the command line, which
# every local user can read (`spark.authenticate.secret` may be one); out of the environment before anything starts.
ENV_CONF = os.environ.pop("HVD_SPARK_CONF", None)


def fail(message, code=USAGE_EXIT):
    sys.stderr.write(f"hvd spark: {message}\n")
    sys.stderr.flush()
    os._exit(code)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="hvd spark driver")
    p.add_argument("--master", required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--shim", required=True, help="the hvd binary (its `worker-env` subcommand)")
    p.add_argument("--state-dir", required=True)
    p.add_argument("--export", default="", help="comma-separated variables the ranks get from this process")
    p.add_argument("--conf", action="append", default=[], help="KEY=VALUE Spark settings")
    p.add_argument("--slots-timeout", type=float, help="seconds to wait for enough task slots")
    p.add_argument(
        "--pull",
        type=shlex.split,
        default=[],
        help="the shim's arguments that get the env from the binary caches on an executor (one shell-quoted line)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        fail("no command to run (give it after `--`)")
    if args.workers < 1:
        fail(f"--workers {args.workers}: use at least 1")
    return args


def known_slots(master):
    """Task slots of a local master (`local`, `local[N]`, `local[*]`, `local-cluster[W,C,M]`); None for others."""
    if master == "local":
        return 1
    inside = master[master.find("[") + 1 : -1] if master.endswith("]") else ""
    try:
        if master.startswith("local-cluster["):
            workers, cores, _memory = inside.split(",")
            return int(workers) * int(cores)
        if master.startswith("local["):
            count = inside.split(",")[0]
            return (os.cpu_count() or 1) if count == "*" else int(count)
    except ValueError:
        return None
    return None


def task_slots(sc):
    """Task slots the cluster has now (executors that registered), or None when Spark does not say."""
    try:
        jsc = sc._jsc.sc()
        return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
    except Exception:  # noqa: BLE001 - an internal API: without it, Spark's own barrier check decides
        return None


def wait_for_slots(sc, n, timeout):
    """A barrier stage needs all its tasks at once: wait until the executors that give N slots have registered
    (they start after the session does), failing clearly after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        slots = task_slots(sc)
        if slots is None or slots >= n:
            return
        if time.monotonic() > deadline:
            fail(
                f"the Spark cluster has {slots} task slot(s) for {n} ranks after {timeout:.0f} s: give it more "
                "executors or cores, or run fewer workers",
                1,
            )
        time.sleep(0.2)


def layout(hosts):
    """(local rank, local size, cross rank, cross size) of every rank, from the hosts of the tasks in rank order."""
    order = []
    for h in hosts:
        if h not in order:
            order.append(h)
    out = []
    for rank, h in enumerate(hosts):
        out.append((hosts[:rank].count(h), hosts.count(h), order.index(h), len(order)))
    return out


LINE_MAX = 64 << 10


def split_lines(buf, after_cr, data):
    """Splits at `\\n`, `\\r\\n` and lone `\\r` (as hvd run does), and a line longer than LINE_MAX bytes into pieces
    of that size (as `hvd run` caps its lines: output without newlines is not held whole); returns (lines, rest,
    after_cr)."""
    lines = []
    start = 0
    i = 0
    if after_cr and data[:1] == b"\n":
        start = i = 1
    after_cr = False
    while i < len(data):
        b = data[i]
        if b == 0x0A or b == 0x0D:
            lines.append(buf + data[start:i])
            buf = b""
            if b == 0x0D:
                if i + 1 < len(data) and data[i + 1] == 0x0A:
                    i += 1
                elif i + 1 == len(data):
                    after_cr = True
            start = i + 1
        i += 1
    rest = buf + data[start:]
    while len(rest) > LINE_MAX:
        lines.append(rest[:LINE_MAX])
        rest = rest[LINE_MAX:]
    return lines, rest, after_cr


def output_and_status(proc, send):
    """Sends `proc`'s stdout and stderr lines as `send(b"O"/b"E", line)` until both end, then returns its exit status
    (killed by a signal: 128 + the signal, the shell's convention)."""

    def pump(pipe, kind):
        buf, after_cr = b"", False
        while True:
            data = pipe.read1(65536)
            if not data:
                break
            lines, buf, after_cr = split_lines(buf, after_cr, data)
            for line in lines:
                send(kind, line)
        if buf:
            send(kind, buf)

    pumps = [
        threading.Thread(target=pump, args=(proc.stdout, b"O"), daemon=True),
        threading.Thread(target=pump, args=(proc.stderr, b"E"), daemon=True),
    ]
    for t in pumps:
        t.start()
    code = proc.wait()
    for t in pumps:
        t.join()
    return code if code >= 0 else 128 - code


def pull_env(shim, pull, env, child_setup=None):
    """Runs `SHIM PULL...` (`hvd cache pull ...`) here: None when the env is in this executor's store now, else its
    exit status and the last lines it wrote (which name the path and the reason)."""
    import subprocess

    proc = subprocess.run(
        [shim, *pull],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=child_setup,
    )
    if proc.returncode == 0:
        return None
    code = proc.returncode if proc.returncode > 0 else 128 - proc.returncode
    lines = [line for line in proc.stderr.decode("utf-8", "replace").splitlines() if line.strip()]
    return code, [line.encode() for line in lines[-20:]]


def worker_env_pull(pull):
    """The shim's `--pull=ENV --cache=URL... --trusted-key=KEY...` for the env `pull` (`cache pull --store=STORE NAME
    --cache=... --trusted-key=...`) made valid: the shim finds it there (or pulls it again) and holds a temporary gc
    root on it for as long as the rank runs, so an `hvd gc` on the executor between the pull and the rank cannot
    remove it."""
    store = next(a[len("--store=") :] for a in pull if a.startswith("--store="))
    name = pull[pull.index("pull") + 2]
    return [f"--pull={store}/{name}", *(a for a in pull if a.startswith(("--cache=", "--trusted-key=")))]


def make_task(command, shim, exported, cwd, driver_addr, token, pull):
    """The barrier task (pickled to the executors): gets the env from the caches when `pull` is given, waits for
    every task to have it, then runs one rank and reports its output and exit status."""

    def task(_partition):
        import ctypes
        import subprocess
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        infos = ctx.getTaskInfos()
        hosts = [info.address.rsplit(":", 1)[0] for info in infos]
        local_rank, local_size, cross_rank, cross_size = layout(hosts)[rank]
        env = dict(os.environ)
        env.update(exported)
        env.update(
            {
                "HVD_SPARK_RANK": str(rank),
                "HVD_SPARK_SIZE": str(len(infos)),
                "HVD_SPARK_LOCAL_RANK": str(local_rank),
                "HVD_SPARK_LOCAL_SIZE": str(local_size),
                "HVD_SPARK_CROSS_RANK": str(cross_rank),
                "HVD_SPARK_CROSS_SIZE": str(cross_size),
                "HVD_SPARK_HOST": hosts[rank],
            }
        )
        conn = socket.create_connection(driver_addr, timeout=60)
        conn.settimeout(None)
        lock = threading.Lock()

        def send(kind, text):
            with lock:
                conn.sendall(b"%s %d " % (kind, rank) + text + b"\n")

        send(b"T", token.encode())

        def child_setup():
            # The worker ends with this task (a killed task must not leave its rank running), and gets default
            # signal dispositions (pyspark's daemon ignores SIGCHLD and SIGHUP, which children would inherit).
            for s in (signal.SIGCHLD, signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
                signal.signal(s, signal.SIG_DFL)
            try:
                ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
            except (OSError, AttributeError):
                pass

        if pull:
            failure = pull_env(shim, pull, env, child_setup)
            if failure is not None:
                code, tail = failure
                for line in tail:
                    send(b"E", line)
                # The executor's address (host:port): several executors may share a host.
                host = f"{infos[rank].address} ({socket.gethostname()})"
                send(b"F", b"%d " % code + host.encode())
                conn.close()
                raise RuntimeError(f"hvd spark: executor {host} could not get the env from the binary caches")
            # No rank starts before every executor has the env (a failed pull above fails this barrier).
            ctx.barrier()

        proc = subprocess.Popen(
            [shim, "worker-env", *(worker_env_pull(pull) if pull else []), "--", *command],
            cwd=cwd if os.path.isdir(cwd) else None,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=child_setup,
        )

        code = output_and_status(proc, send)
        send(b"X", str(code).encode())
        conn.close()
        if code != 0:
            # Fails the barrier stage at once: Spark kills the other ranks' tasks.
            raise RuntimeError(f"hvd spark: rank {rank} failed (exit status: {code})")
        yield (rank, code)

    return task


class Collector:
    """The driver's end of the tasks' connections: prints `[RANK] line`, remembers the first failure."""

    def __init__(self, host, token):
        self.token = token
        self.lock = threading.Lock()
        self.failed = None  # (rank, code)
        self.pull_failed = None  # (rank, code, host): an executor that could not get the env
        self.done = threading.Event()
        self.failure = threading.Event()
        self.readers = []
        self.listener = socket.create_server((host, 0))
        self.addr = (host, self.listener.getsockname()[1])
        serve_hellos(self.listener, token, self.read)

    def read(self, _rank, conn):
        """A task's connection past its hello (`serve_hellos`): its frames until it ends."""
        self.readers.append(threading.current_thread())
        with conn, conn.makefile("rb") as stream:
            for line in stream:
                parts = line[:-1].split(b" ", 2)
                if not line.endswith(b"\n") or len(parts) != 3 or not parts[1].isdigit():
                    break  # cut off mid-frame, or not a frame: the task is gone
                kind, rank, text = parts
                rank = int(rank)
                if kind == b"F":
                    code, _, host = text.partition(b" ")
                    with self.lock:
                        if self.failed is None and self.pull_failed is None and code.isdigit():
                            self.pull_failed = (rank, int(code), host.decode("utf-8", "replace"))
                            self.failure.set()
                            self.done.set()
                    continue
                if kind == b"X":
                    code = int(text) if text.isdigit() else 1
                    if code != 0:
                        with self.lock:
                            if self.failed is None and self.pull_failed is None:
                                self.failed = (rank, code)
                                self.failure.set()
                                self.done.set()
                    continue
                out = sys.stdout.buffer if kind == b"O" else sys.stderr.buffer
                with self.lock:
                    out.write(b"[%d] " % rank + text + b"\n")
                    out.flush()

    def drain(self, timeout):
        for t in list(self.readers):
            t.join(timeout)


def spark_home(state_dir, home=None):
    """A SPARK_HOME of links to the pyspark package's `bin` and `jars` (local-cluster writes its executors' work
    folders and logs under SPARK_HOME: they go with the run's logs, not into the package), at `home` when given."""
    import pyspark

    package = os.path.dirname(os.path.abspath(pyspark.__file__))
    # The launcher's step marker is `<run id>/<step>/<start counter>`; the run's logs are in `runs/<run id>/<step>`.
    run_step = "/".join(os.environ.get("HVD_RUN_STEP", "").split("/")[:2])
    if home:
        pass
    elif run_step:
        home = os.path.join(state_dir, "runs", run_step, "spark")
    else:
        home = os.path.join(state_dir, "spark", f"home-{os.getpid()}")
    os.makedirs(home, exist_ok=True)
    for name in ("bin", "jars", "python"):
        src, dst = os.path.join(package, name), os.path.join(home, name)
        if os.path.exists(src) and not os.path.lexists(dst):
            os.symlink(src, dst)
    conf = os.path.join(home, "conf")
    os.makedirs(conf, exist_ok=True)
    with open(os.path.join(conf, "log4j2.properties"), "w", encoding="utf-8") as f:
        # Spark's own warnings only (the default also prints INFO lines at start).
        f.write(
            "rootLogger.level = warn\nrootLogger.appenderRef.stderr.ref = console\n"
            "appender.console.type = Console\nappender.console.name = console\nappender.console.target = SYSTEM_ERR\n"
            "appender.console.layout.type = PatternLayout\n"
            "appender.console.layout.pattern = spark: %p %c{1}: %m%n%ex\n"
            "logger.native.name = org.apache.hadoop.util.NativeCodeLoader\nlogger.native.level = error\n"
        )
    return home


# Elastic steps: the relay. An elastic step's ranks are not the tasks of one barrier job, which Spark fails whole when
# one task fails: the launcher starts each rank (and each replacement) as a process of its own on its machine,
# `DRIVER --relay SOCKET --slot N -- ARGV...`, which asks the step's relay server (`DRIVER --serve SOCKET ...`: a
# SparkContext of the step's own, started before it and stopped after it) to run ARGV as a job of one task, on
# whichever executor Spark gives it. ARGV is the ssh engine's remote wrapper: the relay passes the rank's stdin on to
# it (the job token and the rank's variables, then the launcher's stop and hand-over requests), its output back as the rank's, and exits with its status, or 255 when Spark lost the
# task (its executor gone) or the server is gone. The launcher does the rest as for ssh ranks: a lost rank is
# replaced by a new relay, the survivors re-form.

RELAY_LOST = 255


def log(message):
    sys.stderr.write(f"hvd spark relay: {message}\n")
    sys.stderr.flush()


def relay_client(argv):
    """`--relay SOCKET [--slot N] -- ARGV...`: runs ARGV through the relay server at SOCKET and exits with its status
    (N, the rank's slot, names it in the server's log: the rank's variables are on its stdin, not in ARGV)."""
    import json

    slot = "?"
    if argv[1:2] == ["--slot"] and len(argv) > 2:
        slot, argv = argv[2], argv[:1] + argv[3:]
    if len(argv) < 3 or argv[1] != "--":
        fail("usage: --relay SOCKET [--slot N] -- ARGV...")
    path, command = argv[0], argv[2:]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError as e:
        fail(f"cannot reach the relay server at {path} ({e}): did `hvd run` end?", RELAY_LOST)
    conn.sendall(json.dumps({"argv": command, "cwd": os.getcwd(), "slot": slot}).encode() + b"\n")

    def forward_stdin():
        try:
            while True:
                data = os.read(0, 65536)
                if not data:
                    break
                conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    threading.Thread(target=forward_stdin, daemon=True).start()
    code = None
    with conn.makefile("rb") as stream:
        for line in stream:
            if not line.endswith(b"\n"):
                break  # cut off: the server went away mid-frame
            kind, _, text = line[:-1].partition(b" ")
            if kind == b"X":
                code = int(text)
                break
            out = sys.stdout.buffer if kind == b"O" else sys.stderr.buffer
            out.write(text + b"\n")
            out.flush()
    if code is None:
        fail("the relay server ended before the rank did", RELAY_LOST)
    os._exit(code)


def job_failure(error):
    """The line of a failed job's error that says why (py4j's first line only names the Java call)."""
    lines = [line.strip() for line in str(error or "").splitlines() if line.strip()]
    if not lines:
        return "the task ended without the rank's status"
    telling = next((line for line in lines if "stage failure" in line or "Lost task" in line), lines[0])
    # Past the first exception's class name: the job's failure, with the task's own reason after it.
    _, found, rest = telling.partition("SparkException: ")
    return (rest if found else telling)[:400]


def make_relay_task(command, cwd, driver_addr, token, ident):
    """The task of one relayed rank (pickled to an executor): runs `command` with the executor's address as its host
    (`HVD_HOSTNAME`), its stdin from the driver, its output and status back to it."""

    def task(_partition):
        import subprocess

        conn = socket.create_connection(driver_addr, timeout=60)
        conn.settimeout(None)
        keep_alive(conn)
        # The address this executor reaches the driver from: the same for every executor on one machine.
        host = conn.getsockname()[0]
        lock = threading.Lock()

        def send(kind, text):
            with lock:
                conn.sendall(kind + b" " + text + b"\n")

        conn.sendall(b"T %d %s\n" % (ident, token.encode()))
        env = dict(os.environ, HVD_HOSTNAME=host, HOROVOD_HOSTNAME=host)

        def child_setup():
            # Default dispositions (pyspark's daemon ignores SIGCHLD and SIGHUP, which children would inherit). No
            # death signal: when this task ends the wrapper's stdin closes, and the wrapper stops the rank itself.
            for sig in (signal.SIGCHLD, signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
                signal.signal(sig, signal.SIG_DFL)

        proc = subprocess.Popen(
            command,
            cwd=cwd if os.path.isdir(cwd) else None,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=child_setup,
        )

        def feed():
            try:
                while True:
                    data = conn.recv(65536)
                    if not data:
                        break
                    proc.stdin.write(data)
                    proc.stdin.flush()
            except OSError:
                pass
            try:
                proc.stdin.close()
            except OSError:
                pass

        threading.Thread(target=feed, daemon=True).start()
        code = output_and_status(proc, send)
        send(b"X", str(code).encode())
        conn.close()
        yield code

    return task


HELLO_WITHIN = 2.0
HELLO_MAX = 200
PENDING_MAX = 256


def serve_hellos(listener, token, take):
    """Accepts the tasks' connections on `listener`: each must say `T NUMBER TOKEN` (the token `token`) as its first
    line, within HELLO_WITHIN seconds (a task says it as it connects) and HELLO_MAX bytes; then `take(number, conn)`
    runs on that connection's thread and returns whether it took it. Anything else is closed. At most PENDING_MAX
    connections are heard at once (others are closed at once): a peer that floods the port can make tasks fail to
    connect, and so ranks fail, but never be taken for one."""
    pending = threading.BoundedSemaphore(PENDING_MAX)
    expected = token.encode()

    def hello(conn):
        try:
            line = read_line(conn, HELLO_MAX, time.monotonic() + HELLO_WITHIN)
        finally:
            pending.release()
        parts = (line or b"").split(b" ")
        if (
            len(parts) == 3
            and parts[0] == b"T"
            and parts[1].isdigit()
            and len(parts[1]) < 19
            and secrets.compare_digest(parts[2], expected)
        ):
            conn.settimeout(None)
            keep_alive(conn)
            if take(int(parts[1]), conn):
                return
        conn.close()

    def accept():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            if not pending.acquire(blocking=False):
                conn.close()
                continue
            try:
                threading.Thread(target=hello, args=(conn,), daemon=True).start()
            except Exception:  # noqa: BLE001 - no thread for this one: it alone is dropped
                pending.release()
                conn.close()

    threading.Thread(target=accept, daemon=True).start()


def keep_alive(conn):
    """TCP keepalive on `conn`, probing after 30 s of silence every 10 s, given up after 3: a peer that vanished
    without a reset (a host frozen or cut off) ends the connection in about a minute."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class TaskPorts:
    """The relay server's end of the tasks' connections (`serve_hellos`): a connection is taken only for the number
    of a job that waits for its task, and only once."""

    def __init__(self, host, token):
        self.changed = threading.Condition()
        self.expected = set()  # numbers of jobs waiting for their task
        self.arrived = {}  # number -> connection
        self.listener = socket.create_server((host, 0))
        self.addr = (host, self.listener.getsockname()[1])
        serve_hellos(self.listener, token, self.take)

    def take(self, ident, conn):
        with self.changed:
            if ident not in self.expected or ident in self.arrived:
                return False
            self.arrived[ident] = conn
            self.changed.notify_all()
            return True

    def expect(self, ident):
        with self.changed:
            self.expected.add(ident)

    def wait(self, ident, given_up):
        """The connection of task `ident`, or None once `given_up()` (its job ended without it, or its relay left)."""
        with self.changed:
            while ident not in self.arrived:
                if given_up():
                    self.expected.discard(ident)
                    return None
                self.changed.wait(0.2)
            self.expected.discard(ident)
            return self.arrived.pop(ident)


def read_line(conn, most, deadline):
    """One line from `conn` without its newline, read a byte at a time (nothing after it is taken), or None: no
    newline within `most` bytes, by `deadline` (monotonic), or the connection ended."""
    line = b""
    try:
        while len(line) < most:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            conn.settimeout(left)
            byte = conn.recv(1)
            if not byte:
                return None
            if byte == b"\n":
                return line
            line += byte
    except OSError:
        return None
    return None


def hung_up(conn):
    """Whether the peer of `conn` closed its end (or the connection broke), without reading anything."""
    import select

    poll = select.poll()
    poll.register(conn, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(poll.poll(0))


def serve(argv):
    """`--serve SOCKET --master M --workers N --state-dir D [--home DIR] [--slots-timeout S] [--conf K=V]...`: the
    relay server of an elastic step, until its stdin ends (the launcher's end of the step)."""
    import itertools
    import json

    p = argparse.ArgumentParser(prog="hvd spark relay server")
    p.add_argument("socket")
    p.add_argument("--master", required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--state-dir", required=True)
    p.add_argument("--conf", action="append", default=[])
    p.add_argument("--slots-timeout", type=float)
    p.add_argument("--home", help="the SPARK_HOME folder (the step's logs)")
    p.add_argument("--private-dir", help="a folder only this user reads, removed by the launcher (the settings' file)")
    args = p.parse_args(argv)
    # A failed task is a lost rank, which the launcher replaces: Spark never runs a rank's task twice (a retry, or a
    # speculative copy, would start the rank again beside its replacement).
    pinned = {"spark.task.maxFailures": "1", "spark.speculation": "false"}
    # No wait for slots: a rank's job waits for one itself (a replacement may wait for an executor to come back).
    sc = start_spark(
        args.master, None, args.state_dir, args.conf, args.slots_timeout, pinned, args.home, args.private_dir
    )
    token = secrets.token_hex(16)
    ports = TaskPorts(sc.getConf().get("spark.driver.host", "127.0.0.1"), token)
    numbers = itertools.count()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(args.socket)
    os.chmod(args.socket, 0o600)
    server.listen(64)

    def relay(client):
        with client:
            try:
                # Unbuffered: what follows the header line is the rank's stdin, read below.
                header = json.loads(client.makefile("rb", buffering=0).readline(1 << 20))
                command, cwd = [str(a) for a in header["argv"]], str(header["cwd"])
                rank = str(header.get("slot", "?"))[:20]
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return
            ident = next(numbers)
            group = f"hvd-rank-{ident}"
            # In the server's log (`relay.log` in the step's log folder): which job ran which rank, how it ended.
            log(f"job {group}: slot {rank}")
            done = threading.Event()
            stopped = threading.Event()
            outcome = {}

            def run_job():
                try:
                    sc.setJobGroup(group, "an hvd rank", interruptOnCancel=True)
                    if not stopped.is_set():
                        task = make_relay_task(command, cwd, ports.addr, token, ident)
                        sc.parallelize([0], 1).mapPartitions(task).collect()
                except Exception as e:  # noqa: BLE001 - reported to the rank's relay below
                    outcome["error"] = e
                finally:
                    done.set()

            ports.expect(ident)
            threading.Thread(target=run_job, daemon=True).start()
            conn = ports.wait(ident, lambda: done.is_set() or hung_up(client))
            code = None
            if conn is None and not done.is_set():
                # The launcher stopped the rank (or its relay died) while its job waited for a task slot: the job is
                # cancelled (again until it has ended: it may be submitted just after a cancel), so its task never
                # runs later; a task that still did would not be taken (no longer expected) and get no token.
                stopped.set()
                for _ in range(60):
                    sc.cancelJobGroup(group)
                    if done.wait(0.5):
                        break
                log(f"job {group}: slot {rank} stopped before its task started")
                try:
                    client.sendall(b"E hvd spark: the rank was stopped before Spark started it\nX %d\n" % RELAY_LOST)
                except OSError:
                    pass
                return
            left = False
            if conn is not None:
                finished = threading.Event()

                def watch():
                    # A job Spark failed (the task lost with its executor) ends the task's connection at once: the
                    # rank is lost to Spark, and if its process lives on (an executor killed, its Python worker not),
                    # its wrapper's stdin ends and it is stopped. A job that succeeded has sent its status: 10 s to
                    # read it, then the same (a host frozen or cut off sends no reset).
                    done.wait()
                    if "error" in outcome or not finished.wait(10):
                        try:
                            conn.shutdown(socket.SHUT_RDWR)
                        except OSError:
                            pass

                threading.Thread(target=watch, daemon=True).start()

                def feed():
                    # The rank's stdin after the header: the token and the launcher's requests. Its end (the launcher
                    # closed it, or the relay process died) closes the wrapper's stdin, which stops the rank.
                    try:
                        while True:
                            data = client.recv(65536)
                            if not data:
                                break
                            conn.sendall(data)
                    except OSError:
                        pass
                    try:
                        conn.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass

                threading.Thread(target=feed, daemon=True).start()
                with conn, conn.makefile("rb") as stream:
                    for line in stream:
                        if not line.endswith(b"\n"):
                            break  # cut off mid-frame: the task is gone
                        if line.startswith(b"X "):
                            # Logged before the relay hears it (and `hvd run`, perhaps, ends).
                            code = line
                            log(f"job {group}: slot {rank} exited with {code[2:].decode().strip()}")
                        try:
                            client.sendall(line)
                        except OSError:
                            left = True
                            break
                        if code is not None:
                            break
                finished.set()
            if code is None and left:
                # The relay went away (the launcher stopped it): its task is stopped with the job.
                sc.cancelJobGroup(group)
                log(f"job {group}: slot {rank} ended: its relay went away")
            elif code is None:
                done.wait(30)
                sc.cancelJobGroup(group)
                why = job_failure(outcome.get("error"))
                log(f"job {group}: slot {rank} lost: {why}")
                try:
                    client.sendall(
                        b"E hvd spark: Spark lost the task of this rank: "
                        + why.encode("utf-8", "replace")
                        + b"\nX %d\n" % RELAY_LOST
                    )
                except OSError:
                    pass

    def accept():
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=relay, args=(client,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    log("listening")
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    # Until the launcher ends (or closes this stdin): then the relays still running lose their ranks.
    while sys.stdin.buffer.read(65536):
        pass
    sc.setLogLevel("OFF")
    sc.cancelAllJobs()
    stop(sc)
    os._exit(0)


def write_properties(path, conf):
    """Writes `conf` as a Java properties file at `path`, readable by this user only (a file left by an earlier run,
    or a link planted there, is replaced, never followed)."""

    def escape(text, key):
        out = []
        for i, c in enumerate(text):
            if c == "\\":
                out.append("\\\\")
            elif c == "\n":
                out.append("\\n")
            elif c == "\r":
                out.append("\\r")
            elif c == "\t":
                out.append("\\t")
            elif c == "\f":
                out.append("\\f")
            elif c in "=:#! " and (key or (c == " " and i == 0) or (c in "#!" and i == 0)):
                out.append("\\" + c)
            else:
                out.append(c)
        return "".join(out)

    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for key, value in conf.items():
            f.write(f"{escape(key, True)}={escape(value, False)}\n")


def env_conf():
    """The settings of `HVD_SPARK_CONF` (a JSON object of strings), if set."""
    if not ENV_CONF:
        return {}
    try:
        conf = json.loads(ENV_CONF)
    except ValueError as e:
        fail(f"HVD_SPARK_CONF is not JSON: {e}")
    if not isinstance(conf, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in conf.items()):
        fail("HVD_SPARK_CONF is not a JSON object of strings")
    return conf


def start_spark(master, workers, state_dir, conf_items, slots_timeout, pinned, home=None, private_dir=None):
    """Checks pyspark and Java, starts the SparkContext on `master` and waits for `workers` task slots (`None`: not
    at all). `pinned`: settings the user's `--conf` may not change."""
    try:
        import pyspark  # noqa: F401
    except ImportError:
        fail(
            f"`{sys.executable}` has no pyspark: install it (scripts/install-deps does), or name a Python that has "
            "it with `--spark-python` or `cluster { settings = { python = \"...\" } }`"
        )
    if not (os.environ.get("JAVA_HOME") or shutil.which("java")):
        fail("Spark needs Java (17 or newer): `java` is not on PATH and JAVA_HOME is not set")
    os.environ["SPARK_HOME"] = spark_home(state_dir, home)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

    from pyspark import SparkConf, SparkContext

    # The JVMs only schedule the tasks (the ranks run in their own processes): the quick JIT and the serial GC start
    # them in a fraction of the CPU time (a setting of the user's replaces these).
    quick_jvm = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
    conf = {
        "spark.master": master,
        "spark.app.name": f"hvd {os.environ.get('HVD_RUN_STEP', '')}".strip(),
        # More ranks than task slots: fail in seconds, not after the default 10 minutes.
        "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "1s",
        "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "3",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.extraJavaOptions": quick_jvm,
        "spark.executor.extraJavaOptions": quick_jvm,
    }
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        conf["spark.driver.host"] = "127.0.0.1"
        conf["spark.driver.bindAddress"] = "127.0.0.1"
    for item in conf_items:
        key, sep, value = item.partition("=")
        if not sep:
            fail(f"--conf `{item}` is not KEY=VALUE")
        conf[key] = value
    conf.update(env_conf())
    for key in pinned:
        conf.pop(key, None)
    # pyspark starts its JVM with every SparkConf entry as `--conf KEY=VALUE` on spark-submit's command line, which
    # every local user can read: the settings go in a properties file only this user reads instead (in the
    # launcher's private folder, which it removes, else a private temporary one), removed once the JVM has read it,
    # or on SIGTERM meanwhile; only hvd's pinned settings (no secret) stay SparkConf's.
    folder = private_dir or tempfile.mkdtemp(prefix="hvd-spark-")
    properties = os.path.join(folder, "hvd-spark.properties")

    def forget():
        for path, remove in ((properties, os.unlink), (folder, os.rmdir)):
            if path == folder and private_dir:
                continue
            try:
                remove(path)
            except OSError:
                pass

    def on_term(_signum, _frame):
        forget()
        os._exit(143)

    write_properties(properties, conf)
    submit = ["--properties-file", properties]
    import pyspark

    if int(pyspark.__version__.split(".")[0]) >= 4:
        # Spark 4 reads spark-defaults.conf beside a properties file only when asked.
        submit.append("--load-spark-defaults")
    user = os.environ.get("PYSPARK_SUBMIT_ARGS", "pyspark-shell")
    os.environ["PYSPARK_SUBMIT_ARGS"] = " ".join(shlex.quote(a) for a in submit) + " " + user
    try:
        previous = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        previous = None
    try:
        sc = SparkContext.getOrCreate(SparkConf().setAll(list(pinned.items())))
    finally:
        forget()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if user == "pyspark-shell":
            os.environ.pop("PYSPARK_SUBMIT_ARGS", None)
        else:
            os.environ["PYSPARK_SUBMIT_ARGS"] = user
    sc.setLogLevel("WARN")
    if workers is not None:
        # local-cluster's executors are JVMs starting on this machine (slow when it is busy); others may never come.
        default_timeout = 300.0 if master.startswith("local-cluster") else 120.0
        wait_for_slots(sc, workers, slots_timeout or default_timeout)
    return sc


def main():
    if sys.argv[1:2] == ["--relay"]:
        relay_client(sys.argv[2:])
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2:])
    args = parse_args(sys.argv[1:])
    slots = known_slots(args.master)
    if slots is not None and slots < args.workers:
        fail(
            f"the master `{args.master}` has {slots} task slot(s), fewer than the {args.workers} workers: a barrier "
            "job runs every rank at once (use more slots, e.g. `local[N]`, or fewer workers)"
        )
    # A rank that fails is not retried: the job fails with it.
    sc = start_spark(
        args.master, args.workers, args.state_dir, args.conf, args.slots_timeout, {"spark.task.maxFailures": "1"}
    )

    token = secrets.token_hex(16)
    collector = Collector(sc.getConf().get("spark.driver.host", "127.0.0.1"), token)
    names = [n for n in args.export.split(",") if n]
    exported = {n: os.environ[n] for n in names if n in os.environ}
    task = make_task(args.command, args.shim, exported, os.getcwd(), collector.addr, token, args.pull)

    outcome = {}

    def run_job():
        try:
            rdd = sc.parallelize(range(args.workers), args.workers)
            outcome["results"] = rdd.barrier().mapPartitions(task).collect()
        except Exception as e:  # noqa: BLE001 - any job failure is reported below
            outcome["error"] = e
        collector.done.set()

    job = threading.Thread(target=run_job, daemon=True)
    job.start()
    collector.done.wait()
    if "error" in outcome:
        # A failing rank's task reports its code, then raises: the job's failure can arrive first.
        collector.failure.wait(5)
    if collector.pull_failed is not None:
        rank, code, host = collector.pull_failed
        name = os.path.basename(args.pull[args.pull.index("pull") + 2]) if "pull" in args.pull else "?"
        sys.stderr.write(
            f"hvd spark: executor {host} (the task of rank {rank}) could not get the env {name} from the binary "
            f"caches (`hvd cache pull` exit status {code}; its last lines above); no rank started, ending the job\n"
        )
        end_job(sc, job, collector, 1)
    failed = collector.failed
    if failed is not None:
        rank, code = failed
        sys.stderr.write(f"[{rank}] hvd spark: rank {rank} failed (exit status: {code}); ending the job\n")
        end_job(sc, job, collector, code if 0 < code < 256 else 1)
    if "error" in outcome:
        message = str(outcome["error"]).strip().splitlines()
        sys.stderr.write("hvd spark: the Spark job failed: " + (message[0] if message else "") + "\n")
        for line in message[1:20]:
            sys.stderr.write(f"  {line}\n")
        sys.stderr.flush()
        stop(sc)
        os._exit(1)
    collector.drain(30)
    stop(sc)
    os._exit(0)


def end_job(sc, job, collector, code):
    """Cancels the job (Spark kills the other tasks, and with them their ranks), stops Spark and exits with `code`."""
    sys.stderr.flush()
    # What Spark says while the job is torn down (killed tasks, executors leaving) is noise after this.
    sc.setLogLevel("OFF")
    sc.cancelAllJobs()
    job.join(30)
    collector.drain(5)
    stop(sc)
    os._exit(code)


def stop(sc):
    """Stops Spark (executors end their Python workers), giving up after a while: hvd run ends what is left."""
    sys.stdout.flush()
    sys.stderr.flush()
    t = threading.Thread(target=sc.stop, daemon=True)
    t.start()
    t.join(20)


if __name__ == "__main__":
    main()
