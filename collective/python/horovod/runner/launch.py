"""``horovodrun``: Horovod's command line mapped onto ``hvd run``.

``hvd run`` runs the steps of a .hvd file, so ``horovodrun -np 2 python train.py`` writes a one-step file (the
command, ``workers = 2``, run in the caller's directory) into a temporary directory and runs it with
``hvd run FILE --env-dir <this env>``: the env is this interpreter's, nothing is locked or built. Flags hvd cannot
honour are refused by name; docs/horovod.md has the table.
"""

import os
import shlex
import shutil
import subprocess
import sys
import tempfile

# Flags taking a value: Horovod's spellings -> the `hvd run` option (None: handled below).
_VALUED = {
    "-np": "--workers", "--num-proc": "--workers",
    "-H": "--hosts", "--hosts": "--hosts",
    "-hostfile": "--hostfile", "--hostfile": "--hostfile",
    "--timeline-filename": "--timeline",
    "-p": "--ssh-port", "--ssh-port": "--ssh-port",
    "-i": "--ssh-identity", "--ssh-identity-file": "--ssh-identity",
    "--network-interface": "--network-interface", "--network-interfaces": "--network-interface",
    "--start-timeout": "--start-timeout",
    "--min-np": "--min-workers", "--max-np": "--max-workers", "--elastic-timeout": "--elastic-timeout",
    # Not an option of `hvd run`: the workers' HVD_ELASTIC_RESET_LIMIT (what hvd.elastic.run reads).
    "--reset-limit": "--reset-limit",
    "--host-discovery-script": "--host-discovery-script",
    # With --host-discovery-script: the slots of a host the script names alone (`--slots` is argparse's prefix of it).
    "--slots-per-host": "--slots-per-host", "--slots": "--slots-per-host",
}
# Flags taking two values: Horovod's spelling -> the `hvd run` option.
_PAIRS = {"--blacklist-cooldown-range": "--blacklist-cooldown-range"}
# Flags without a value: `--gloo` and `--disable-cache` change nothing in hvd (its runtime is one transport of its
# own, and it keeps no such cache).
_SWITCHES = {"--gloo", "--mpi", "--verbose", "-v", "--disable-cache", "--check-build"}
_LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1"}


def _digits(text):
    """Whether ``text`` is a plain ASCII number (``str.isdigit`` also takes ``"²"``, which ``int`` refuses)."""
    return bool(text) and all(c in "0123456789" for c in text)


class UsageError(Exception):
    """A command line horovodrun cannot map onto `hvd run`."""


def _local(host):
    import socket

    name = socket.gethostname()  # no DNS lookup: a machine without a resolver must not wait here
    return host in _LOCAL_HOSTS or host in (name, name.split(".")[0])


def build_report():
    """What ``horovodrun --check-build`` prints: the frameworks this env has (found, not imported) and what hvd's
    runtime library was built with, in Horovod's layout."""
    import importlib.util

    import hvd

    def box(flag):
        return "[X]" if flag else "[ ]"

    def found(module):
        return importlib.util.find_spec(module) is not None

    frameworks = [("TensorFlow", found("tensorflow")), ("PyTorch", found("torch")), ("MXNet", False),
                  ("JAX (hvd.jax)", found("jax"))]
    controllers = [("MPI", hvd.mpi_built()), ("Gloo", hvd.gloo_built()), ("hvd (tcp, shm)", True)]
    operations = [("NCCL", hvd.nccl_built()), ("DDL", hvd.ddl_built()), ("CCL", hvd.ccl_built()),
                  ("MPI", hvd.mpi_built()), ("Gloo", hvd.gloo_built()), ("hvd (tcp, shm)", True)]
    lines = ["Horovod API v0.28.1 on hvd's runtime ({}):".format(hvd.library_path()), ""]
    for title, entries in (("Available Frameworks", frameworks), ("Available Controllers", controllers),
                           ("Available Tensor Operations", operations)):
        lines.append(title + ":")
        lines.extend("    {} {}".format(box(flag), name) for name, flag in entries)
        lines.append("")
    return "\n".join(lines)


def parse(argv):
    """``(values, switches, command)``: the leading flags of a horovodrun command line (valued ones under their
    `hvd run` option name) and the command after them. Raises UsageError for a flag hvd cannot honour."""
    values, switches = {}, set()
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        flag, _, inline = argv[i].partition("=")
        i += 1
        if flag == "--":
            break
        if flag in _PAIRS:
            if inline or i + 2 > len(argv):
                raise UsageError("horovodrun: `{}` needs two values, e.g. `{} 60 300`".format(flag, flag))
            values[_PAIRS[flag]] = (argv[i], argv[i + 1])
            i += 2
        elif flag in _VALUED:
            if inline:
                value = inline
            elif i < len(argv):
                value, i = argv[i], i + 1
            else:
                raise UsageError("horovodrun: `{}` needs a value".format(flag))
            values[_VALUED[flag]] = value
        elif flag in _SWITCHES:
            switches.add(flag)
        else:
            raise UsageError(
                "horovodrun: unknown or unsupported flag `{}`; the flags hvd maps are listed in docs/horovod.md "
                "(or use `hvd run` directly)".format(flag)
            )
    return values, switches, argv[i:]


def translate(argv):
    """``(hvd run options, the command)`` for a horovodrun command line, e.g. ``["-np", "2", "python", "t.py"]`` ->
    ``(["--workers", "2"], ["python", "t.py"])``. Raises UsageError naming what cannot be mapped."""
    values, switches, command = parse(argv)
    options = []
    mpi = "--mpi" in switches
    verbose = bool(switches & {"--verbose", "-v"})
    if not command:
        raise UsageError("horovodrun: no command to run, e.g. `horovodrun -np 2 python train.py`")
    for flag, key in (("-np", "--workers"), ("--min-np", "--min-workers"), ("--max-np", "--max-workers")):
        value = values.get(key)
        if value is not None and (not _digits(value) or int(value) < 1):
            raise UsageError("horovodrun: {} takes a positive number of workers, not `{}`".format(flag, value))
    minimum, maximum = values.pop("--min-workers", None), values.pop("--max-workers", None)
    reset_limit = values.pop("--reset-limit", None)
    if reset_limit is not None:
        if not _digits(reset_limit):
            raise UsageError("horovodrun: --reset-limit takes a non-negative number of resets, not `{}`".format(
                reset_limit))
        # Every engine runs the command as written: the limit travels in it to each worker's hvd.elastic.run.
        command = ["env", "HVD_ELASTIC_RESET_LIMIT={}".format(int(reset_limit))] + command
    # Without --host-discovery-script Horovod ignores it (-H and --hostfile give their slots), and so does this.
    slots = values.pop("--slots-per-host", None)
    if slots is not None and (not _digits(slots) or int(slots) < 1):
        raise UsageError("horovodrun: --slots-per-host takes a positive number of slots, not `{}`".format(slots))
    cooldown = values.pop("--blacklist-cooldown-range", None)
    if cooldown is not None:
        if not all(_digits(v) for v in cooldown):
            raise UsageError("horovodrun: --blacklist-cooldown-range takes two whole numbers of seconds (MIN MAX), "
                             "not `{} {}`".format(*cooldown))
    discovery = values.pop("--host-discovery-script", None)
    if discovery is not None:
        # The script's slots decide how many start; the step grows up to --max-np (else -np) and goes on down to
        # --min-np (else -np, as in Horovod).
        np = values.pop("--workers", None)
        most = maximum or np
        if most is None:
            raise UsageError("horovodrun: --host-discovery-script needs --max-np (or -np): the most workers to run")
        least = minimum or np or most
        if int(least) > int(most):
            raise UsageError("horovodrun: --min-np {} is above --max-np {}".format(least, most))
        options += ["--workers", most, "--min-workers", least, "--max-workers", most,
                    "--host-discovery-script", os.path.abspath(discovery)]
        if slots is not None:
            options += ["--slots-per-host", str(int(slots))]
        minimum = None
        workers = most
    else:
        # Without discovery an elastic run starts (and stays at most) at -np, else at --max-np.
        workers = values.pop("--workers", None) or maximum
        if workers is None:
            raise UsageError("horovodrun: -np N (the number of workers) is required")
        if maximum is not None and int(maximum) < int(workers):
            raise UsageError("horovodrun: --max-np {} is below -np {}".format(maximum, workers))
        options += ["--workers", workers]
    if minimum is not None:
        if int(minimum) > int(workers):
            raise UsageError("horovodrun: --min-np {} is above the {} workers it starts".format(minimum, workers))
        options += ["--min-workers", minimum, "--max-workers", workers]
    if cooldown is not None:
        # `hvd run` checks the range itself (1 to 3600 s, MIN at most MAX) and names the flag.
        options += ["--blacklist-cooldown-range", str(int(cooldown[0])), str(int(cooldown[1]))]
    hosts = values.get("--hosts")
    if hosts is not None and all(_local(h.partition(":")[0]) for h in hosts.split(",")):
        del values["--hosts"]  # every slot is on this machine: the local engine, no ssh to ourselves
    if mpi:
        options += ["--engine", "mpi"]
    elif "--hosts" in values or "--hostfile" in values:
        options += ["--engine", "ssh"]
    for key in sorted(values):
        options += [key, values[key]]
    if verbose:
        options.append("-v")
    return options, command


def hvd_file(command, workers, cwd):
    """The one-step .hvd file that runs ``command`` (a list of words) in ``cwd`` on ``workers`` workers."""
    line = "cd {} && exec {}".format(shlex.quote(cwd), " ".join(shlex.quote(word) for word in command))
    return (
        'project "horovodrun"\n'
        "env {{\n  python = \"{}.{}\"\n  packages = []\n}}\n"
        "step horovodrun {{\n  workers = {}\n  run = {}\n}}\n"
    ).format(sys.version_info[0], sys.version_info[1], workers, _hvd_string(line))


def _hvd_string(text):
    """``text`` as a .hvd string literal."""
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r", "$": "\\$"}
    return '"' + "".join(escapes.get(c, c) for c in text) + '"'


def run_commandline(argv=None):
    """The ``horovodrun`` console script: exits with ``hvd run``'s status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\nusage: horovodrun -np N [-H host:slots,...|--hostfile FILE] [--mpi] [--timeline-filename FILE] "
              "[--verbose] COMMAND ...\n       horovodrun --check-build")
        return 0
    try:
        if "--check-build" in parse(argv)[1]:
            print(build_report())
            return 0
        options, command = translate(argv)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    hvd = shutil.which("hvd")
    if hvd is None:
        print("horovodrun: it runs `hvd run`, and no `hvd` is on PATH", file=sys.stderr)
        return 2
    workers = options[options.index("--workers") + 1]
    tmp = tempfile.mkdtemp(prefix="horovodrun-")
    path = os.path.join(tmp, "horovodrun.hvd")
    with open(path, "w") as f:
        f.write(hvd_file(command, workers, os.getcwd()))
    status = subprocess.call([hvd, "run", path, "--env-dir", sys.prefix] + options)
    if status == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        # The per-rank logs `hvd run` named are in there.
        print("horovodrun: kept {} (the generated .hvd file and the run's logs)".format(tmp), file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(run_commandline())
