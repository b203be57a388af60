#!/usr/bin/env bash
# Benchmark (not a test): lock `tensorflow-cpu==2.12.1` for python 3.11 with `hvd lock`, `uv pip compile` and
# `pip install --dry-run --report`, cold (empty cache) and warm (cache and previous result present), in the same
# run on the same machine. Prints medians, ratios (hvd / peer; <= 1.0 means hvd is as fast or faster) and
# whether the three agree on every pinned version.
#
# Usage: bench/lock.sh [RUNS]        (default 3 runs of each; needs network access to the package index)
# Env:   HVD_BIN   the hvd binary (default: target/release/hvd, else target/debug/hvd)
#        REQ       the requirement (default tensorflow-cpu==2.12.1)
#
# The index is the one pip is configured with, asked at run time (no registry host is written here).
set -euo pipefail

RUNS=${1:-3}
REQ=${REQ:-tensorflow-cpu==2.12.1}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
HVD_BIN=${HVD_BIN:-}
if [[ -z "$HVD_BIN" ]]; then
  if [[ -x "$ROOT/target/release/hvd" ]]; then HVD_BIN="$ROOT/target/release/hvd"; else HVD_BIN="$ROOT/target/debug/hvd"; fi
fi
[[ -x "$HVD_BIN" ]] || { echo "no hvd binary; run: cargo build --release -p hvd" >&2; exit 2; }

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

INDEX=${PIP_INDEX_URL:-$(python3 -m pip config get global.index-url 2>/dev/null || true)}
if [[ -z "$INDEX" ]]; then
  INDEX=$(python3 -c "from pip._internal.models.index import PyPI; print(PyPI.simple_url)")
fi
# Behind a TLS-inspecting proxy, uv needs the same CA bundle pip uses.
CERT=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
if [[ -n "$CERT" ]]; then export SSL_CERT_FILE="$CERT"; fi
# Local wheel directories would give pip an unfair head start (and different answers).
unset PIP_FIND_LINKS

echo "installing uv into a temp venv ..." >&2
python3 -m venv "$WORK/venv" >/dev/null
"$WORK/venv/bin/pip" install -q uv >/dev/null
UV="$WORK/venv/bin/uv"
echo "hvd: $HVD_BIN; $("$UV" --version); pip $(python3 -m pip --version | cut -d' ' -f2); runs: $RUNS" >&2

mkdir -p "$WORK/project"
cat > "$WORK/project/bench.hvd" <<EOF
project "bench"
env {
  python   = "3.11"
  packages = ["$REQ"]
}
EOF
echo "$REQ" > "$WORK/project/req.in"

now() { python3 -c 'import time; print(time.monotonic())'; }
TIMES="$WORK/times.txt"
: > "$TIMES"

run_timed() { # label command...
  local label=$1; shift
  local start end
  start=$(now)
  "$@" >"$WORK/last.out" 2>&1 || { echo "$label failed:" >&2; tail -20 "$WORK/last.out" >&2; exit 1; }
  end=$(now)
  echo "$label $(python3 -c "print($end - $start)")" >> "$TIMES"
}

cd "$WORK/project"
for i in $(seq "$RUNS"); do
  echo "run $i/$RUNS ..." >&2
  # hvd: cold = empty cache, no lockfile; warm = same cache, lockfile present.
  rm -rf "$WORK/hvd-cache" bench.hvd.lock
  run_timed hvd-cold env HVD_CACHE_DIR="$WORK/hvd-cache" "$HVD_BIN" lock bench.hvd
  run_timed hvd-warm env HVD_CACHE_DIR="$WORK/hvd-cache" "$HVD_BIN" lock bench.hvd
  # uv: cold = empty cache, no output file; warm = same cache, previous output present.
  rm -rf "$WORK/uv-cache" uv.txt
  run_timed uv-cold "$UV" pip compile req.in --python-version 3.11 --index-url "$INDEX" --cache-dir "$WORK/uv-cache" -q -o uv.txt
  run_timed uv-warm "$UV" pip compile req.in --python-version 3.11 --index-url "$INDEX" --cache-dir "$WORK/uv-cache" -q -o uv.txt
  # pip: cold = empty cache; warm = same cache.
  rm -rf "$WORK/pip-cache"
  run_timed pip-cold python3 -m pip install --dry-run --ignore-installed --quiet --report pip.json \
    --index-url "$INDEX" --cache-dir "$WORK/pip-cache" "$REQ"
  run_timed pip-warm python3 -m pip install --dry-run --ignore-installed --quiet --report pip.json \
    --index-url "$INDEX" --cache-dir "$WORK/pip-cache" "$REQ"
done

python3 - "$TIMES" bench.hvd.lock uv.txt pip.json <<'EOF'
import json, re, statistics, sys, tomllib
times, lock, uvtxt, pipjson = sys.argv[1:5]
runs = {}
for line in open(times):
    label, t = line.split()
    runs.setdefault(label, []).append(float(t))
med = {k: statistics.median(v) for k, v in runs.items()}
print("median seconds (%d runs each)" % len(runs["hvd-cold"]))
for tool in ("hvd", "uv", "pip"):
    print("  %-4s cold %7.2f   warm %7.2f" % (tool, med[tool + "-cold"], med[tool + "-warm"]))
for peer in ("uv", "pip"):
    print("ratio hvd/%-3s  cold %.2f   warm %.2f" % (peer, med["hvd-cold"] / med[peer + "-cold"], med["hvd-warm"] / med[peer + "-warm"]))
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
hvd = {p["name"]: p["version"] for p in tomllib.load(open(lock, "rb")).get("package", [])}
uv = {}
for line in open(uvtxt):
    m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line)
    if m:
        uv[norm(m.group(1))] = m.group(2)
pip = {norm(i["metadata"]["name"]): i["metadata"]["version"] for i in json.load(open(pipjson))["install"]}
print("packages: hvd %d, uv %d, pip %d" % (len(hvd), len(uv), len(pip)))
for peer, other in (("uv", uv), ("pip", pip)):
    diff = sorted(set(hvd.items()) ^ set(other.items()))
    print("hvd vs %s: %s" % (peer, "identical pins" if not diff else "DIFFER: %s" % diff))
EOF
