//! Rust collectives: communicators (shm, tcp, hierarchical, mpi, nccl) and their algorithms.
