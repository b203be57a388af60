#!/bin/sh
# Launch latency: `hvd run --workers N` of a trivial worker that passes the rendezvous, next to `mpirun -np N` of a
# trivial MPI program (MPI_Init + barrier), measured alternately in the same run. Prints medians and the ratio
# hvd/mpirun (goal: <= 1.0). Not a test: machines are noisy, read medians and ratios only.
#
#   bench/launch.sh [N=8] [REPEATS=15]        (needs: cargo build -p hvd, cc, mpicc, mpirun)
#   HVD_RUN_ARGS=--no-build bench/launch.sh   (launcher only, without the env up-to-date check)
set -eu
N=${1:-8}
REPEATS=${2:-15}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
HVD=${HVD:-$ROOT/target/release/hvd}
[ -x "$HVD" ] || HVD=$ROOT/target/debug/hvd
[ -x "$HVD" ] || { echo "build hvd first: cargo build -p hvd --release" >&2; exit 2; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cc -O2 -o "$WORK/hvd_worker" "$ROOT/bench/launch/hvd_worker.c"
mpicc -O2 -o "$WORK/mpi_worker" "$ROOT/bench/launch/mpi_worker.c"
cat > "$WORK/bench.hvd" <<HVD
project "launch-bench"
env {
  python = "3.11"
  packages = []
}
step hello {
  workers = 1
  run = "./hvd_worker"
}
HVD
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
now() { date +%s%N; }
: > "$WORK/hvd.times"
: > "$WORK/mpi.times"
for i in $(seq "$REPEATS"); do
  t0=$(now)
  (cd "$WORK" && "$HVD" run bench.hvd --workers "$N" --force ${HVD_RUN_ARGS:-} >/dev/null 2>&1) || { echo "hvd run failed" >&2; exit 1; }
  t1=$(now)
  mpirun -np "$N" --oversubscribe "$WORK/mpi_worker" >/dev/null 2>&1 || { echo "mpirun failed" >&2; exit 1; }
  t2=$(now)
  echo $(( (t1 - t0) / 1000 )) >> "$WORK/hvd.times"
  echo $(( (t2 - t1) / 1000 )) >> "$WORK/mpi.times"
done
median() { sort -n "$1" | awk '{a[NR]=$1} END {if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }
H=$(median "$WORK/hvd.times")
M=$(median "$WORK/mpi.times")
echo "workers=$N repeats=$REPEATS (alternating, same machine)"
echo "hvd run --workers $N : median $(awk "BEGIN {printf \"%.1f\", $H/1000}") ms"
echo "mpirun -np $N        : median $(awk "BEGIN {printf \"%.1f\", $M/1000}") ms"
echo "ratio hvd/mpirun     : $(awk "BEGIN {printf \"%.2f\", $H/$M}")"
