//! Progress events. The library reports through this trait; only the binary renders (e.g. with indicatif).

/// Receives progress of downloads and builds. Every method has a no-op default.
pub trait Progress: Send + Sync {
    /// A download of `name` (`size` bytes when known) starts; `id` identifies it in later calls.
    fn download_started(&self, _id: usize, _name: &str, _size: Option<u64>) {}
    /// `bytes` more bytes of download `id` arrived.
    fn download_progress(&self, _id: usize, _bytes: u64) {}
    /// Download `id` ended (successfully or not).
    fn download_finished(&self, _id: usize) {}
    /// A store path is being created (`what` is e.g. "install", "build", "env").
    fn step_started(&self, _what: &str, _name: &str, _version: &str) {}
    /// That store path is done.
    fn step_finished(&self, _what: &str, _name: &str, _version: &str) {}
    /// Something the user should know that does not stop the work (a cache not used, and why).
    fn warning(&self, _message: &str) {}
}

/// A [`Progress`] that ignores everything.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl Progress for NoProgress {}
