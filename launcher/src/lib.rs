//! Step graph, run engines, rendezvous, log multiplexing and failure handling: everything `hvd run` does after the
//! .hvd file is evaluated.
//!
//! - [`rendezvous`]: the key-value server every job's workers meet at (protocol in docs/rendezvous.md).
//!
//! ```no_run
//! use hvd_launcher::rendezvous::{RendezvousServer, new_token};
//! let token = new_token()?;
//! let server = RendezvousServer::start("127.0.0.1:0".parse()?, &token, vec!["127.0.0.1".parse()?])?;
//! println!("HVD_RENDEZVOUS={}", server.addr());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod rendezvous;
