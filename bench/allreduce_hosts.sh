#!/usr/bin/env bash
# hvd's allreduce over TCP next to OpenMPI's tcp btl, measured in the same run (#18 §4), in two settings:
#   loopback  hvd's tcp backend, 2 pinned rank threads, against `mpirun -np 2 --bind-to core --mca btl tcp,self`
#             over lo, every size from 4 B to MAX_BYTES;
#   hosts     two hosts made of network namespaces joined by a veth pair, 2 ranks on each: hvd's hierarchical
#             backend (4 processes started with `ip netns exec`, a `file:` rendezvous) against `mpirun -np 4 --mca
#             btl tcp,self` started in the first namespace, its daemon on the second started through an rsh agent
#             that enters that namespace (no ssh needed).
# Prints per-size medians over the repetitions and the ratios (hvd / OpenMPI).
#
# Usage: bench/allreduce_hosts.sh [MAX_BYTES]   (default 256 MiB on loopback; hosts stop at HOSTS_MAX)
# Env:   HVD_BIN    the hvd binary (default: builds and uses target/release/hvd; a debug build is refused unless
#                   ALLOW_DEBUG=1)
#        REPS       interleaved repetitions (default 3)
#        HOSTS_MAX  largest size across the namespaces (default 64 MiB)
#        WHAT       `loopback hosts` (default), or one of them
#        SETTLE     seconds to pause before each run (default 1)
#        MPI_HOSTS_ARGS  extra mpirun arguments across the namespaces (default `--mca mpi_yield_when_idle 1`: 4 ranks
#                   on a 2-core machine, where OpenMPI's default busy polling costs it milliseconds per operation)
#        HVD_HOSTS_ENV  extra environment of hvd's ranks across the namespaces (default, when this machine has fewer
#                   than 4 cores, `HVD_SHM_SPIN=4 HVD_SHM_YIELDS=2`: hvd's own setting for ranks beyond cores, which it
#                   cannot detect here because each namespace host holds only 2 of the 4 ranks; else empty)
# Needs root (network namespaces), ip(8), mpicc and mpirun (OpenMPI).
set -euo pipefail
cd "$(dirname "$0")/.."
MAX=${1:-268435456}
HOSTS_MAX=${HOSTS_MAX:-67108864}
REPS=${REPS:-3}
WHAT=${WHAT:-loopback hosts}
. bench/lib.sh
hvd_release_bin_and_mpicc
HVD_BIN=$(readlink -f "$HVD_BIN")
work=$(mktemp -d)
chmod 700 "$work"
ns_a=hvdb$$a ns_b=hvdb$$b
cleanup() {
  for ns in "$ns_a" "$ns_b"; do
    if ip netns list 2>/dev/null | grep -qw "$ns"; then
      for pid in $(ip netns pids "$ns" 2>/dev/null); do kill "$pid" 2>/dev/null || true; done
      ip netns del "$ns" 2>/dev/null || true
    fi
  done
  rm -rf "$work"
}
trap cleanup EXIT
mpicc -O2 -o "$work/allreduce_mpi" bench/allreduce_mpi.c
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
settle() { sleep "${SETTLE:-1}"; }
case " $WHAT " in *" hosts "*) hosts=1 ;; *) hosts=0 ;; esac
case " $WHAT " in *" loopback "*) loopback=1 ;; *) loopback=0 ;; esac

if [ "$hosts" = 1 ]; then
  [ "$(id -u)" = 0 ] || { echo "the hosts measurement needs root (network namespaces); WHAT=loopback skips it" >&2; exit 2; }
  ip netns add "$ns_a"
  ip netns add "$ns_b"
  ip link add "v$$a" netns "$ns_a" type veth peer name "v$$b" netns "$ns_b"
  ip -n "$ns_a" addr add 10.231.0.1/24 dev "v$$a"
  ip -n "$ns_b" addr add 10.231.0.2/24 dev "v$$b"
  for ns in "$ns_a" "$ns_b"; do
    ip -n "$ns" link set lo up
  done
  ip -n "$ns_a" link set "v$$a" up
  ip -n "$ns_b" link set "v$$b" up
  # mpirun's "ssh": run the daemon's command line in the namespace of the host named by its address, under a host
  # name of its own (with one name for both, OpenMPI's tcp btl fails to connect some pairs).
  cat > "$work/agent" <<EOF
#!/bin/sh
while [ "\${1#-}" != "\$1" ]; do shift; done
case "\$1" in
  10.231.0.1) ns=$ns_a ;;
  10.231.0.2) ns=$ns_b ;;
  *) echo "agent: unknown host \$1" >&2; exit 1 ;;
esac
shift
exec ip netns exec "\$ns" unshare --uts /bin/sh -c "hostname \$ns; \$*"
EOF
  chmod +x "$work/agent"
  printf '10.231.0.1 slots=2\n10.231.0.2 slots=2\n' > "$work/hostfile"
fi

hvd_hosts_env=
[ "$(nproc)" -lt 4 ] && hvd_hosts_env="HVD_SHM_SPIN=4 HVD_SHM_YIELDS=2"
hvd_hosts_env=${HVD_HOSTS_ENV-$hvd_hosts_env}
# hvd's hierarchical backend, 2 ranks on each namespace host; rank 0 prints.
hvd_hosts() {
  local rdv job pids=() r host
  rdv=$(mktemp -d "$work/rdv.XXXX")
  job=bench$RANDOM
  for r in 0 1 2 3; do
    host=$((r / 2))
    local ns=$ns_a
    [ "$host" = 1 ] && ns=$ns_b
    # shellcheck disable=SC2086
    ip netns exec "$ns" env $hvd_hosts_env HVD_RANK=$r HVD_SIZE=4 HVD_LOCAL_RANK=$((r % 2)) HVD_LOCAL_SIZE=2 \
      HVD_CROSS_RANK=$host HVD_CROSS_SIZE=2 HVD_HOSTNAME=host$host HVD_JOB_ID=$job \
      HVD_RENDEZVOUS="file:$rdv" HVD_TCP_ADDRESS=10.231.0.$((host + 1)) \
      "$HVD_BIN" bench allreduce --backend hierarchical --max-bytes "$HOSTS_MAX" --json \
      > "$work/out.$r" &
    pids+=($!)
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  [ "$rc" = 0 ] || { echo "hvd across the namespaces failed" >&2; cat "$work"/out.* >&2; exit 1; }
  cat "$work/out.0"
}

mpi_hosts() {
  # shellcheck disable=SC2086
  ip netns exec "$ns_a" unshare --uts sh -c 'hostname "$0"; exec "$@"' "$ns_a" \
    mpirun -np 4 --hostfile "$work/hostfile" --mca plm_rsh_agent "$work/agent" \
    ${MPI_HOSTS_ARGS---mca mpi_yield_when_idle 1} \
    --mca btl tcp,self --mca btl_tcp_if_include 10.231.0.0/24 --mca oob_tcp_if_include 10.231.0.0/24 \
    "$work/allreduce_mpi" "$HOSTS_MAX"
}

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
echo "# machine: $(nproc) cores, load $load_before; hvd: $HVD_BIN; $REPS interleaved repetitions; $WHAT" >&2
[ "$hosts" = 1 ] && echo "# across the namespaces: hvd env '$hvd_hosts_env'; mpirun '${MPI_HOSTS_ARGS---mca mpi_yield_when_idle 1}'" >&2
: > "$work/lo_hvd.json"; : > "$work/lo_mpi.json"; : > "$work/ns_hvd.json"; : > "$work/ns_mpi.json"
for rep in $(seq "$REPS"); do
  if [ "$loopback" = 1 ]; then
    settle
    mpirun -np 2 --bind-to core --oversubscribe --mca btl tcp,self --mca btl_tcp_if_include lo \
      "$work/allreduce_mpi" "$MAX" >> "$work/lo_mpi.json"
    settle
    "$HVD_BIN" bench allreduce --workers 2 --backend tcp --max-bytes "$MAX" --json >> "$work/lo_hvd.json"
  fi
  if [ "$hosts" = 1 ]; then
    settle
    mpi_hosts >> "$work/ns_mpi.json"
    settle
    hvd_hosts >> "$work/ns_hvd.json"
  fi
  echo "# repetition $rep done, load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
done
python3 - "$work" "$load_before" "$(cut -d' ' -f1-3 /proc/loadavg)" <<'PY'
import json, sys, os, statistics
w, before, after = sys.argv[1:4]
def by_size(f):
    out = {}
    for l in open(os.path.join(w, f)):
        if l.strip().startswith("{"):
            r = json.loads(l)
            out.setdefault(r["bytes"], []).append(r)
    return {b: (statistics.median(x["median_us"] for x in rs), min(x["median_us"] for x in rs),
                statistics.median(x["busbw_gbps"] for x in rs), len(rs)) for b, rs in out.items()}
def size(b):
    for u, s in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if b >= u and b % u == 0: return f"{b // u}{s}"
    return f"{b}B"
print(f"load before {before}, after {after}")
for title, hf, mf in (("loopback: hvd tcp, 2 ranks | OpenMPI btl tcp,self over lo, 2 ranks", "lo_hvd.json", "lo_mpi.json"),
                      ("2 namespace hosts x 2 ranks: hvd hierarchical | OpenMPI btl tcp,self", "ns_hvd.json", "ns_mpi.json")):
    hvd, mpi = by_size(hf), by_size(mf)
    if not hvd or not mpi: continue
    print(f"\n{title}; median (and best) of {min(v[3] for v in hvd.values())} repetitions")
    print(f"{'size':>8} {'hvd_us':>10} {'(best)':>10} {'mpi_us':>10} {'(best)':>10} {'lat_ratio':>9} {'hvd_busbw':>9} {'mpi_busbw':>9} {'bw_ratio':>8}")
    for b in sorted(hvd):
        if b not in mpi: continue
        h, m = hvd[b], mpi[b]
        print(f"{size(b):>8} {h[0]:>10.2f} {h[1]:>10.2f} {m[0]:>10.2f} {m[1]:>10.2f} {h[0] / m[0]:>9.2f} "
              f"{h[2]:>9.3f} {m[2]:>9.3f} {h[2] / max(m[2], 1e-12):>8.2f}")
print("\nlat_ratio = hvd median / OpenMPI median (goal <= 1); bw_ratio = hvd busbw / OpenMPI busbw (goal >= 1)")
PY
