#!/usr/bin/env bash
# hvd's allreduce next to OpenMPI's MPI_Allreduce, measured in the same run on this machine, plus memcpy
# bandwidth as the physical limit. Prints per-size medians, bus bandwidths and ratios (hvd / OpenMPI), and from
# 64 KiB up the single-thread memcpy bandwidth of the same size with hvd's algorithm bandwidth as a share of it;
# hvd runs its ranks as threads, and also as worker processes on shared buffers (the table's `procs` columns).
#
# Usage: bench/allreduce.sh [MAX_BYTES]        (default 256 MiB)
# Env:   HVD_BIN  the hvd binary (default: builds and uses target/release/hvd; a debug build is refused unless
#                 ALLOW_DEBUG=1: its numbers mean nothing)
#        BACKEND  hvd backend (default shm)
#        EXTRA_4  1 (default) also runs 4 ranks on this machine, hvd and OpenMPI (`mpirun --oversubscribe -np 4`,
#                 unbound, so OpenMPI yields when idle), and prints their times against each one's 2-rank time
#                 (on a 2-core machine: ranks beyond cores); 0 skips them
#        PROCESSES 1 (default) also runs hvd's 2 ranks as worker processes on shared buffers (`--processes
#                 --shared-buffers`: like OpenMPI's ranks, separate processes, each pinned to a core) and prints
#                 them against OpenMPI too; 0 skips them
#        REPS     interleaved repetitions of every run (default 3); the table shows the median over them
#        SETTLE   seconds to pause before each run (default 1)
set -euo pipefail
cd "$(dirname "$0")/.."
MAX=${1:-268435456}
BACKEND=${BACKEND:-shm}
REPS=${REPS:-3}
. bench/lib.sh
hvd_release_bin_and_mpicc
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mpicc -O2 -pthread -o "$work/allreduce_mpi" bench/allreduce_mpi.c
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
echo "# machine: $(nproc) cores, load $load_before; hvd: $HVD_BIN; backend: $BACKEND; $REPS interleaved repetitions" >&2
: > "$work/memcpy.json"; : > "$work/mpi.json"; : > "$work/hvd.json"; : > "$work/hvd4.json"; : > "$work/mpi4.json"
: > "$work/hvdp.json"; : > "$work/handoff.json"
# Each run starts after a pause: mpirun's daemons take a moment to exit and would otherwise compete with the
# first (smallest) sizes of the next run.
settle() { sleep "${SETTLE:-1}"; }
for rep in $(seq "$REPS"); do
  "$work/allreduce_mpi" --memcpy "$MAX" >> "$work/memcpy.json"
  settle
  mpirun -np 2 --bind-to core --oversubscribe --mca btl self,vader "$work/allreduce_mpi" "$MAX" >> "$work/mpi.json"
  settle
  "$HVD_BIN" bench allreduce --workers 2 --backend "$BACKEND" --max-bytes "$MAX" --json >> "$work/hvd.json"
  if [ "${PROCESSES:-1}" = 1 ]; then
    settle
    "$HVD_BIN" bench allreduce --workers 2 --processes --shared-buffers --backend "$BACKEND" --max-bytes "$MAX" \
      --json >> "$work/hvdp.json"
  fi
  if [ "${EXTRA_4:-1}" = 1 ]; then
    "$work/allreduce_mpi" --handoff >> "$work/handoff.json"
    settle
    "$HVD_BIN" bench allreduce --workers 4 --backend "$BACKEND" --max-bytes "$MAX" --json >> "$work/hvd4.json"
    settle
    mpirun -np 4 --oversubscribe --mca btl self,vader "$work/allreduce_mpi" "$MAX" >> "$work/mpi4.json"
  fi
  echo "# repetition $rep done, load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
done
python3 - "$work" "$load_before" "$(cut -d' ' -f1-3 /proc/loadavg)" <<'PY'
import json, sys, os, statistics
w, before, after = sys.argv[1:4]
load = lambda f: [json.loads(l) for l in open(os.path.join(w, f)) if l.strip()]
def by_size(rows):
    out = {}
    for r in rows:
        out.setdefault(r["bytes"], []).append(r)
    return {b: {"median_us": statistics.median(x["median_us"] for x in rs),
                "busbw_gbps": statistics.median(x["busbw_gbps"] for x in rs), "n": len(rs)}
            for b, rs in out.items()}
mem = statistics.median(r["memcpy_gbps"] for r in load("memcpy.json") if not r.get("per_size"))
mem_at = {}
for r in load("memcpy.json"):
    if r.get("per_size"):
        mem_at.setdefault(r["memcpy_bytes"], []).append(r["memcpy_gbps"])
mem_at = {b: statistics.median(v) for b, v in mem_at.items()}
mpi, hvd = by_size(load("mpi.json")), by_size(load("hvd.json"))
hvd4, mpi4 = by_size(load("hvd4.json")), by_size(load("mpi4.json"))
hvdp = by_size(load("hvdp.json"))
print(f"load before {before}, after {after}; medians over {min(r['n'] for r in hvd.values())} repetitions")
print(f"memcpy (1 thread, 256 MiB): {mem:.2f} GB/s")
hdr = (f"{'size':>10} {'hvd_us':>10} {'mpi_us':>10} {'lat_ratio':>9} {'hvd_busbw':>10} {'mpi_busbw':>10} {'bw_ratio':>8}"
       f" {'memcpy':>8} {'hvd_%mem':>8}")
if hvdp: hdr += f" {'procs_us':>10} {'procs/mpi':>9} {'procs_%mem':>10}"
if hvd4: hdr += f" {'hvd4_us':>10} {'hvd_4v2':>8} {'mpi4_us':>10} {'mpi_4v2':>8} {'lat4_ratio':>10}"
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
    if b in mem_at:
        # hvd's algorithm bandwidth (bytes / time) against copying the same bytes once with memcpy.
        line += f" {mem_at[b]:>8.2f} {100 * b / h['median_us'] / 1e3 / mem_at[b]:>7.0f}%"
    else:
        line += f" {'':>8} {'':>8}"
    if hvdp:
        if b in hvdp:
            p = hvdp[b]["median_us"]
            share = f"{100 * b / p / 1e3 / mem_at[b]:>9.0f}%" if b in mem_at else f"{'':>10}"
            line += f" {p:>10.2f} {p / m['median_us']:>9.2f} {share}"
        else:
            line += f" {'':>10} {'':>9} {'':>10}"
    if b in hvd4 and b in mpi4:
        h4, m4 = hvd4[b]["median_us"], mpi4[b]["median_us"]
        line += f" {h4:>10.2f} {h4 / h['median_us']:>8.2f} {m4:>10.2f} {m4 / m['median_us']:>8.2f} {h4 / m4:>10.2f}"
    print(line)
print("lat_ratio = hvd median / OpenMPI median (lower is better); bw_ratio = hvd busbw / OpenMPI busbw (higher is better)")
print("memcpy = single-thread memcpy GB/s of the same size (same run); hvd_%mem = hvd algbw (bytes / median time) / memcpy")
if hvdp:
    print("procs = hvd's 2 ranks as pinned worker processes on shared buffers (--processes --shared-buffers), like "
          "OpenMPI's processes; procs/mpi = its median / OpenMPI's (lower is better); procs_%mem as hvd_%mem")
if hvd4:
    print("hvd_4v2, mpi_4v2 = time of 4 ranks / time of 2 ranks for the same buffer, each against its own 2-rank time "
          "(goal for hvd <= 3); lat4_ratio = hvd 4 ranks / OpenMPI 4 ranks")
    print(f"4 ranks on {os.cpu_count()} cores: hvd as pinned threads (2 per core), OpenMPI as unbound processes")
    handoff = statistics.median(r["handoff_us"] for r in load("handoff.json"))
    small = min(hvd)
    floor = 2 * handoff
    print(f"floor with 2 ranks per core: one handoff between two threads on a core (sched_yield) takes {handoff:.2f} us; "
          f"each core passes between its ranks at least twice an operation (between a rank's post of one operation and "
          f"of the next, its core must run the other rank, whose post completes the first, and come back), "
          f"so a 4-rank operation takes >= {floor:.2f} us: {floor / hvd[small]['median_us']:.1f}x hvd's 2-rank "
          f"{size(small)} time ({hvd[small]['median_us']:.2f} us), where the goal asks 3x; hvd 4 ranks at "
          f"{size(small)}: {hvd4[small]['median_us']:.2f} us = {hvd4[small]['median_us'] / floor:.1f}x the floor")
PY
