//! The engine: a background thread per process that owns the transport and runs named collectives submitted from
//! any thread, in the same order on every rank.
//!
//! Each cycle: drain the submission queue; allreduce (min) one byte vector `[no-news, hit bits.., valid bits..]`;
//! run the tensors whose cache bit every rank set (the fast path, no coordinator); if any rank has new requests,
//! a stale cache entry, a join, a shutdown or an old stalled request, run a negotiation round through the
//! coordinator (rank 0) and execute its response list. Execution fuses allreduces of one dtype/op/scale into one
//! staged allreduce over the members' memory (`fused.rs`). See docs/runtime.md for the protocol.
//!
//! The modules split along the thread boundary:
//!
//! - user threads (any thread that calls the API): `api` (the [`Engine`] handle: submit, wait, poll, shut down),
//!   `fusion` (validating and fusing a grouped submission before it is queued), `request` (what a caller
//!   submits and gets back);
//! - the engine thread: `worker` (the cycle, negotiation, response fusion, completion) and its `ops` (one
//!   collective per kind of operation, and the fused allreduce);
//! - between them, `handles`: the submission queue (user -> engine) and the handle table (engine -> user), each
//!   under its own mutex with a condition variable.

mod api;
mod error;
mod fusion;
mod handles;
mod request;
mod worker;

pub use api::Engine;
pub use error::{EngineError, ErrorKind, Stop};
pub use fusion::PreparedGroup;
pub use handles::{Handle, HandleHasher, HandleMap};
pub(crate) use request::{Input, OutputBuffer};
pub use request::{Output, Request, meta};
