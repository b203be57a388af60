//! Step graph, run engines, rendezvous, log multiplexing and failure handling.
