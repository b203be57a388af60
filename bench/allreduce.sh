#!/usr/bin/env bash
# hvd's allreduce next to OpenMPI's MPI_Allreduce, measured in the same run on this machine, plus memcpy
# bandwidth as the physical limit. Prints per-size medians, bus bandwidths and ratios (hvd / OpenMPI).
#
# Usage: bench/allreduce.sh [MAX_BYTES]        (default 256 MiB)
# Env:   HVD_BIN  the hvd binary (default: target/release/hvd, else target/debug/hvd)
#        BACKEND  hvd backend (default shm); EXTRA_4 = 1 also runs hvd with 4 ranks (oversubscribed check)
set -euo pipefail
cd "$(dirname "$0")/.."
MAX=${1:-268435456}
BACKEND=${BACKEND:-shm}
HVD_BIN=${HVD_BIN:-}
if [ -z "$HVD_BIN" ]; then
  if [ -x target/release/hvd ]; then HVD_BIN=target/release/hvd; else HVD_BIN=target/debug/hvd; fi
fi
[ -x "$HVD_BIN" ] || { echo "no hvd binary: run 'cargo build -p hvd' first (or set HVD_BIN)" >&2; exit 2; }
command -v mpicc >/dev/null || { echo "mpicc not found: install OpenMPI (libopenmpi-dev)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mpicc -O2 -o "$work/allreduce_mpi" bench/allreduce_mpi.c
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
echo "# machine: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); hvd: $HVD_BIN; backend: $BACKEND" >&2
"$work/allreduce_mpi" --memcpy > "$work/memcpy.json"
mpirun -np 2 --bind-to core --oversubscribe --mca btl self,vader "$work/allreduce_mpi" "$MAX" > "$work/mpi.json"
"$HVD_BIN" bench allreduce --workers 2 --backend "$BACKEND" --max-bytes "$MAX" --json > "$work/hvd.json"
if [ "${EXTRA_4:-0}" = 1 ]; then
  "$HVD_BIN" bench allreduce --workers 4 --backend "$BACKEND" --max-bytes "$MAX" --json > "$work/hvd4.json"
else
  : > "$work/hvd4.json"
fi
python3 - "$work" <<'PY'
import json, sys, os
w = sys.argv[1]
load = lambda f: [json.loads(l) for l in open(os.path.join(w, f)) if l.strip()]
mem = load("memcpy.json")[0]["memcpy_gbps"]
mpi = {r["bytes"]: r for r in load("mpi.json")}
hvd = {r["bytes"]: r for r in load("hvd.json")}
hvd4 = {r["bytes"]: r for r in load("hvd4.json")}
print(f"memcpy (1 thread, 256 MiB): {mem:.2f} GB/s")
hdr = f"{'size':>10} {'hvd_us':>10} {'mpi_us':>10} {'lat_ratio':>9} {'hvd_busbw':>10} {'mpi_busbw':>10} {'bw_ratio':>8}"
if hvd4: hdr += f" {'hvd4_us':>10} {'4v2_per_byte':>12}"
print(hdr)
def size(b):
    for u, s in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if b >= u and b % u == 0: return f"{b // u}{s}"
    return f"{b}B"
for b in sorted(hvd):
    h, m = hvd[b], mpi.get(b)
    if not m: continue
    line = (f"{size(b):>10} {h['median_us']:>10.2f} {m['median_us']:>10.2f} {h['median_us'] / m['median_us']:>9.2f} "
            f"{h['busbw_gbps']:>10.3f} {m['busbw_gbps']:>10.3f} {h['busbw_gbps'] / max(m['busbw_gbps'], 1e-12):>8.2f}")
    if b in hvd4:
        line += f" {hvd4[b]['median_us']:>10.2f} {hvd4[b]['median_us'] / h['median_us']:>12.2f}"
    print(line)
print("lat_ratio = hvd median / OpenMPI median (lower is better); bw_ratio = hvd busbw / OpenMPI busbw (higher is better)")
if hvd4: print("4v2_per_byte = time of 4 ranks / time of 2 ranks for the same buffer (goal <= 3)")
PY
