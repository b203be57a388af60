//! The worker runtime over `hvd-collective`: a Horovod-style engine and its C ABI (`libhvd_runtime.so`).
//!
//! Training processes submit named collectives from any thread; one background thread per process negotiates
//! with the other ranks so that every rank runs the same collectives in the same order, fuses small allreduces,
//! inspects stalls and writes a timeline. The pure-Python `hvd` package (`collective/python/hvd`) drives it through
//! the C ABI in [`ffi`] (header: `include/hvd.h`).
//!
//! ```
//! use hvd_runtime::{DType, Engine, EngineConfig, LocalTransport, ReduceOp, Request};
//! use std::time::Duration;
//!
//! let transport = LocalTransport::group(1, Duration::from_secs(5)).pop().unwrap();
//! let engine = Engine::start(Box::new(transport), EngineConfig::default()).unwrap();
//! let data: Vec<u8> = [1.0f32, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
//! let h = engine.enqueue(Request::allreduce("x", DType::F32, vec![2], ReduceOp::Sum, data.clone())).unwrap();
//! assert_eq!(engine.wait(h).unwrap().data, data);
//! ```

// A library reports through its errors and `tracing`; only the `hvd` binary writes to the terminal.
#![deny(clippy::print_stdout, clippy::print_stderr)]

pub mod cache;
pub mod collective;
pub mod config;
pub mod coordinator;
pub mod engine;
pub mod env_vars;
pub mod ffi;
mod fused;
pub mod kernels;
pub mod message;
pub mod process_set;
pub mod timeline;
pub mod transport;

pub use config::EngineConfig;
pub use engine::{
    Engine, EngineError, ErrorKind, Handle, Output, PreparedGroup, Request, Stop, meta,
};
pub use hvd_collective::{DType, ReduceOp};
pub use message::{OpKind, RequestMeta};
pub use transport::{LocalTransport, Topology};
