//! The [`Board`] trait: what the collectives need from memory that every rank of the job shares (the shm
//! transport's board and arenas today), so another shared-memory-like transport can offer the same fast paths.
//!
//! Every operation starts with each rank posting its header (and, for small allreduces, its data) where all the
//! others can read it: one cache line from each peer instead of a message each way. A board that can also hold
//! each rank's share of a large allreduce ([`Board::allreduce_arena`]) lets the ranks reduce straight out of one
//! another's memory. A transport hands one out (`Transport::shared_board`), once per operation, when its shared
//! memory reaches the whole job.

use std::time::Duration;

use crate::communicator::Staged;
use crate::error::Result;
use crate::header::HEADER_LEN;
use crate::types::{DType, ReduceOp};

/// How a board's allreduce combines the ranks' data: the element type, the operation, and how long a rank waits
/// for the others before failing.
#[derive(Debug, Clone, Copy)]
pub struct Combine {
    pub dtype: DType,
    pub op: ReduceOp,
    pub timeout: Duration,
}

/// A board on which every rank of the job posts each operation's header, a word for each rank and eager data
/// (at most `EAGER_MAX_BYTES`, 2 KiB), and reads everyone else's.
///
/// Operations are numbered by their header's sequence number (its first 8 bytes), 1, 2, 3, ... on every rank,
/// each posted once. A board keeps two operations' posts per rank, so what a rank posted for operation `seq`
/// stays readable until it posts `seq + 2`, which it does only after every rank posted `seq + 1`.
pub trait Board {
    /// Posts this rank's `header`, its word `pairs[j]` for each rank `j` (when the operation has them) and its
    /// `eager` data; the sequence number is published last, so a rank that sees it sees the rest.
    ///
    /// # Safety
    ///
    /// Every rank must post the operations in sequence-number order, and this rank must have seen every other
    /// rank post the previous operation ([`wait_posted`](Self::wait_posted) returned `Ok` for `seq - 1`), so that
    /// no rank still reads the post this one overwrites. `pairs` holds at most one word per rank and `eager` at
    /// most `EAGER_MAX_BYTES`.
    unsafe fn post(&mut self, header: &[u8; HEADER_LEN], pairs: Option<&[u64]>, eager: &[u8]);

    /// Waits until every other rank has posted operation `seq`; a dead or departed rank, an abort, or `timeout`
    /// without progress is an error naming the ranks `op` still waits for.
    fn wait_posted(&mut self, seq: u64, op: &'static str, timeout: Duration) -> Result<()>;

    /// Rank `rank`'s header of operation `seq`.
    ///
    /// # Safety
    ///
    /// [`wait_posted`](Self::wait_posted) returned `Ok` for `seq`, and this rank has not posted `seq + 1` since
    /// (after that, rank `rank` may overwrite the slot). The same holds for [`pair`](Self::pair) and
    /// [`eager`](Self::eager).
    unsafe fn header(&self, rank: usize, seq: u64) -> [u8; HEADER_LEN];

    /// Rank `rank`'s word for this rank in operation `seq` (posted with `pairs`).
    ///
    /// # Safety
    ///
    /// As for [`header`](Self::header).
    unsafe fn pair(&self, rank: usize, seq: u64) -> u64;

    /// Copies rank `rank`'s eager data of operation `seq` into `out` (its length, at most `EAGER_MAX_BYTES`).
    ///
    /// # Safety
    ///
    /// As for [`header`](Self::header).
    unsafe fn eager(&self, rank: usize, seq: u64, out: &mut [u8]);

    /// The most bytes of an allreduce this rank deposits on the board with its header (0: none). A board offers
    /// room when a wait for the other ranks costs more than copying the data there and reading every rank's: with
    /// more ranks than cores, where a rank waits for a core's other rank to run. Ranks may see this differently;
    /// they reduce out of the deposits only when every rank deposited (the header's `deposited` flag).
    fn deposit_room(&self) -> usize {
        0
    }

    /// Copies `data` into this rank's deposit for operation `seq`, before it posts that operation's header.
    ///
    /// # Safety
    ///
    /// As for [`post`](Self::post) (the deposit of `seq` is overwritten by that of `seq + 2`); `data` holds at most
    /// [`deposit_room`](Self::deposit_room) bytes, and this board offered room.
    unsafe fn deposit(&mut self, seq: u64, data: &[u8]);

    /// The first `len` bytes of rank `rank`'s deposit of operation `seq`.
    ///
    /// # Safety
    ///
    /// As for [`header`](Self::header), and rank `rank` deposited at least `len` bytes for `seq` (its header said
    /// so, with the same count as this rank's).
    unsafe fn deposited(&self, rank: usize, seq: u64, len: usize) -> &[u8];

    /// Allreduces `len` bytes that `io` reads from and writes back to, through shared memory, with every rank
    /// of the board calling this with the same arguments (the operation's header check comes first). A rank
    /// that does not call it makes the others fail after `timeout`.
    fn allreduce_arena(&mut self, len: usize, io: &mut dyn Staged, how: Combine) -> Result<()>;

    /// Allreduces `buf` by reading the other ranks' buffers directly, with every rank of the board calling this
    /// with the same arguments (the operation's header check comes first); `Ok(false)` on every rank alike when
    /// this board does not (for this size, or at all: the ranks cannot read one another's memory), and nothing
    /// was done.
    fn allreduce_single_copy(&mut self, buf: &mut [u8], how: Combine) -> Result<bool> {
        let _ = (buf, how);
        Ok(false)
    }
}
