//! The board in the segment: the [`Board`] the collectives post each operation's header on (one slot per rank and
//! sequence-number parity, holding the header, a word per peer and eager data, published by storing the sequence
//! number last).
//!
//! Each rank reads every other rank's slot, so the header check and a small allreduce take one cache line from
//! each peer instead of a ring message (head and data lines) each way. A slot is written again two operations
//! later, when every rank has posted the operation in between and so has finished reading it.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::ShmTransport;
use super::segment::{DEPOSIT_BYTES, PAIRS_AT};
use crate::board::{Board, Combine};
use crate::communicator::Staged;
use crate::error::Result;
use crate::header::{EAGER_MAX_BYTES, HEADER_LEN};

impl ShmTransport {
    /// Where rank `r`'s slot for operation `seq` starts.
    fn slot_ptr(&self, r: usize, seq: u64) -> *mut u8 {
        // SAFETY: the slot lies inside the mapping.
        unsafe { self.seg.map.ptr.add(self.seg.slot(r, seq & 1)) }
    }

    /// Whether rank `r` has posted operation `seq`.
    fn posted(&self, r: usize, seq: u64) -> bool {
        self.seg
            .word(self.seg.slot(r, seq & 1))
            .load(Ordering::Acquire)
            == seq
    }
}

impl Board for ShmTransport {
    /// Posts this rank's operation `header` (whose first 8 bytes, the sequence number, are published last, after
    /// everything else), `eager` data and, for operations that have them, `pairs[j]` for each rank `j` (on a line
    /// of their own, which readers of other operations never touch).
    unsafe fn post(&mut self, header: &[u8; HEADER_LEN], pairs: Option<&[u64]>, eager: &[u8]) {
        let n = self.seg.ranks;
        let seq = u64::from_ne_bytes(header[..8].try_into().unwrap_or_default());
        let pairs = pairs.unwrap_or(&[]);
        assert!(pairs.len() <= n && eager.len() <= EAGER_MAX_BYTES);
        let p = self.slot_ptr(self.rank, seq);
        // SAFETY: the slot lies inside the mapping, only this rank writes it, and no rank reads it now: every rank
        // has posted the previous operation (the caller's contract), so every rank is done with the one before,
        // which used this slot. Words are 8-aligned (slots are line-aligned, HEADER_LEN is a multiple of 8).
        unsafe {
            std::ptr::copy_nonoverlapping(header.as_ptr().add(8), p.add(8), HEADER_LEN - 8);
            std::ptr::copy_nonoverlapping(eager.as_ptr(), p.add(HEADER_LEN), eager.len());
            for (j, v) in pairs.iter().enumerate() {
                p.add(PAIRS_AT + 8 * j).cast::<u64>().write(*v);
            }
        }
        self.publish(self.seg.word(self.seg.slot(self.rank, seq & 1)), seq);
    }

    fn wait_posted(&mut self, seq: u64, op: &'static str, timeout: Duration) -> Result<()> {
        self.wait_ranks(op, timeout, |t, r| t.posted(r, seq))
    }

    unsafe fn header(&self, r: usize, seq: u64) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        // SAFETY: rank r published the slot (Acquire in `posted`) and does not write it again before this rank
        // posts its next operation (the caller's contract).
        unsafe { std::ptr::copy_nonoverlapping(self.slot_ptr(r, seq), h.as_mut_ptr(), HEADER_LEN) };
        h
    }

    unsafe fn pair(&self, r: usize, seq: u64) -> u64 {
        // SAFETY: as in `header`; the words area holds one word per rank.
        unsafe {
            self.slot_ptr(r, seq)
                .add(PAIRS_AT + 8 * self.rank)
                .cast::<u64>()
                .read()
        }
    }

    unsafe fn eager(&self, r: usize, seq: u64, out: &mut [u8]) {
        assert!(out.len() <= EAGER_MAX_BYTES);
        let p = self.slot_ptr(r, seq);
        // SAFETY: as in `header`; the eager area holds EAGER_MAX_BYTES.
        unsafe {
            std::ptr::copy_nonoverlapping(p.add(HEADER_LEN), out.as_mut_ptr(), out.len());
        }
    }

    /// Room when this rank waits as one of more ranks than cores: there each wait costs a handoff to a core's
    /// other rank (about 1.4 µs on a 2-core EPYC VM), and one wait instead of three pays for the copies up to about
    /// 16 KiB with 4 ranks on 2 cores, `bytes x (ranks - 1)` 48 KiB (docs/collective.md, "Deposits").
    fn deposit_room(&self) -> usize {
        if self.oversubscribed() {
            DEPOSIT_BYTES
        } else {
            0
        }
    }

    unsafe fn deposit(&mut self, seq: u64, data: &[u8]) {
        assert!(data.len() <= DEPOSIT_BYTES);
        // SAFETY: the deposit lies inside the mapping and holds DEPOSIT_BYTES; only this rank writes it, and no rank
        // reads it now (as in `post`).
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.seg.deposit(self.rank, seq & 1),
                data.len(),
            )
        };
    }

    unsafe fn deposited(&self, r: usize, seq: u64, len: usize) -> &[u8] {
        assert!(len <= DEPOSIT_BYTES);
        // SAFETY: the deposit lies inside the mapping and holds DEPOSIT_BYTES; rank r wrote it before publishing its
        // header (Acquire in `posted`) and leaves it alone until this rank posts its next operation (the caller's
        // contract).
        unsafe { std::slice::from_raw_parts(self.seg.deposit(r, seq & 1), len) }
    }

    fn allreduce_arena(&mut self, len: usize, io: &mut dyn Staged, how: Combine) -> Result<()> {
        self.arena_allreduce(len, io, how)
    }

    fn allreduce_single_copy(&mut self, buf: &mut [u8], how: Combine) -> Result<bool> {
        let min = match self.seg.ranks {
            ..=2 => super::SINGLE_COPY_MIN_BYTES,
            _ => super::SINGLE_COPY_MIN_BYTES_MANY,
        };
        if buf.len() < min {
            return Ok(false);
        }
        self.single_copy_allreduce(buf, how)
    }
}
