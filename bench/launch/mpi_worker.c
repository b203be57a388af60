/* Trivial MPI program for bench/launch.sh: every rank passes MPI_Init (mpirun's wire-up) and a barrier. */
#include <mpi.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Finalize();
    return 0;
}
