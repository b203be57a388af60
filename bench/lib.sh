# Shared by the bench scripts that compare hvd with OpenMPI (sourced from the repository root).

# Sets HVD_BIN to the hvd binary to measure: the given one, or target/release/hvd built now. A debug build is refused
# unless ALLOW_DEBUG=1 (its numbers mean nothing); so is a machine without mpicc.
hvd_release_bin_and_mpicc() {
  HVD_BIN=${HVD_BIN:-}
  if [ -z "$HVD_BIN" ]; then
    echo "# cargo build --release -p hvd (a no-op when up to date)" >&2
    cargo build --release -p hvd >&2
    HVD_BIN=target/release/hvd
  fi
  [ -x "$HVD_BIN" ] || { echo "no hvd binary at $HVD_BIN" >&2; exit 2; }
  case "$(readlink -f "$HVD_BIN")" in
    */debug/*)
      if [ "${ALLOW_DEBUG:-0}" != 1 ]; then
        echo "$HVD_BIN is a debug build: benchmark a release build (cargo build --release -p hvd) or set ALLOW_DEBUG=1" >&2
        exit 2
      fi ;;
  esac
  command -v mpicc >/dev/null || { echo "mpicc not found: install OpenMPI (libopenmpi-dev)" >&2; exit 2; }
}
