//! The worker runtime (engine and C ABI) over `hvd-collective`.
