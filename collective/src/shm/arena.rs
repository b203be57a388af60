//! The arenas in the segment: allreduce by depositing into every rank's arena and reducing straight out of them
//! (two waits per chunk whatever the rank count).

use std::sync::atomic::Ordering;

use super::ShmTransport;
use super::segment::arena_half;
use crate::board::Combine;
use crate::communicator::Staged;
use crate::error::Result;
use crate::reduce::reduce_into;
use crate::transport::even_counts;

/// The bytes an arena allreduce moves per chunk: with 2 ranks a whole half (a 100 x 4 KiB fused group in one
/// chunk: 168 us per step against 176 us in two, medians of five interleaved runs of `bench/engine.py`'s grouped
/// step), with more ranks half a half (a whole half was slower with 4 ranks on 2 cores: 1 MiB in 483-526 us
/// against 456-460 us).
fn arena_chunk(ranks: usize, ring_bytes: usize) -> usize {
    if ranks == 2 {
        arena_half(ring_bytes)
    } else {
        arena_half(ring_bytes) / 2
    }
}

impl ShmTransport {
    /// Allreduce through the ranks' arenas, chunk by chunk: every rank reads the other ranks' blocks of its chunk
    /// from `io` into its arena; once all have, rank `r` reads its own block into its arena, reduces the others'
    /// deposits of block `r` into it and writes it out, all in one pass while it is in cache; once all have, every
    /// rank writes the other blocks to `io` straight out of the arenas that hold them. Two waits per chunk
    /// whatever the rank count, and less memory traffic per rank than a ring with three ranks or more; with `io`
    /// in the caller's tensors (a fused group) no fusion buffer is needed at all. Chunks alternate between the
    /// arenas' halves: a rank deposits chunk `c + 2` only after every rank deposited chunk `c + 1`, which each did
    /// after writing chunk `c` out.
    pub(super) fn arena_allreduce(
        &mut self,
        len: usize,
        io: &mut dyn Staged,
        how: Combine,
    ) -> Result<()> {
        let Combine { dtype, op, timeout } = how;
        let n = self.seg.ranks;
        let me = self.rank;
        let esize = dtype.size();
        let per_chunk = (arena_chunk(n, self.seg.ring_bytes) / esize).max(1) * esize;
        let mut at = 0;
        while at < len {
            let clen = per_chunk.min(len - at);
            let counts = even_counts(clen / esize, n);
            let mut offsets = Vec::with_capacity(n + 1);
            offsets.push(0);
            for c in &counts {
                offsets.push(offsets.last().copied().unwrap_or(0) + c * esize);
            }
            let number = self.arena_steps / 2;
            let mine = self.seg.arena(me, number);
            // The other ranks' blocks of this rank's input go into its arena; its own block it reads later, right
            // where it reduces it.
            for r in (0..n).filter(|r| *r != me) {
                let b = offsets[r]..offsets[r + 1];
                // SAFETY: this rank's arena half holds `per_chunk` bytes and nobody reads it now (see above).
                io.read(at + b.start, unsafe {
                    std::slice::from_raw_parts_mut(mine.add(b.start), b.len())
                });
            }
            self.arena_steps += 1;
            let deposited = self.arena_steps;
            self.publish(self.seg.arena_progress(me), deposited);
            self.wait_ranks("allreduce", timeout, |t, r| {
                t.seg.arena_progress(r).load(Ordering::Acquire) >= deposited
            })?;
            let block = offsets[me]..offsets[me + 1];
            // SAFETY: block `me` of this rank's arena is read by the others only after the publish below; they read
            // only their own blocks of it until then.
            let own = unsafe { std::slice::from_raw_parts_mut(mine.add(block.start), block.len()) };
            // Read, reduced and written out in one pass while it is in cache.
            io.read(at + block.start, own);
            for r in (0..n).filter(|r| *r != me) {
                // SAFETY: rank r published its deposit (Acquire above) and leaves it alone until every rank has
                // deposited the next chunk.
                let theirs = unsafe {
                    std::slice::from_raw_parts(
                        self.seg.arena(r, number).add(block.start),
                        block.len(),
                    )
                };
                reduce_into(own, theirs, dtype, op);
            }
            io.write(at + block.start, own);
            self.arena_steps += 1;
            let reduced = self.arena_steps;
            self.publish(self.seg.arena_progress(me), reduced);
            self.wait_ranks("allreduce", timeout, |t, r| {
                t.seg.arena_progress(r).load(Ordering::Acquire) >= reduced
            })?;
            for r in (0..n).filter(|r| *r != me) {
                let b = offsets[r]..offsets[r + 1];
                // SAFETY: rank r published its reduced block (Acquire above).
                let theirs = unsafe {
                    std::slice::from_raw_parts(self.seg.arena(r, number).add(b.start), b.len())
                };
                io.write(at + b.start, theirs);
            }
            at += clen;
        }
        Ok(())
    }
}
