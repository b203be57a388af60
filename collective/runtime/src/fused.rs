//! A fused allreduce's input and output left in its members' own memory: a [`Staged`] io over the pieces (caller
//! tensors, a joined rank's missing members), so the transport reads them straight into its own buffers and writes
//! the result straight back (shm: the arenas), or goes through the fusion buffer (every other transport). It also
//! marks the timeline's fusion phases as the reads and writes happen.

use hvd_collective::{DType, ReduceOp, Staged};

use crate::kernels::{fill_identity, scale};
use crate::timeline::{EventName, Lanes, Phase, Timeline};

/// One piece of the fused buffer at `at`: `len` bytes of caller memory at `ptr`, or (a null `ptr`) bytes the
/// input fills with the reduction's identity or the output drops.
#[derive(Clone, Copy)]
struct Piece {
    at: usize,
    ptr: *mut u8,
    len: usize,
    /// Input: the member's prescale factor.
    factor: f64,
}

/// Where the fused phases stand (see [`FusedIo::phases`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    Reading,
    Reducing,
    Writing,
}

struct Phases<'a> {
    timeline: &'a mut Timeline,
    lanes: Lanes,
    activity: EventName,
    state: State,
}

impl Phases<'_> {
    fn enter(&mut self, state: State, name: EventName) {
        self.timeline
            .mark(Phase::End, EventName::Static(""), &self.lanes);
        self.timeline.mark(Phase::Begin, name, &self.lanes);
        self.state = state;
    }
}

/// The members of one fused allreduce, in buffer order.
pub(crate) struct FusedIo<'a> {
    inputs: Vec<Piece>,
    outputs: Vec<Piece>,
    input_end: usize,
    output_end: usize,
    dtype: DType,
    /// The reduction whose identity stands in for missing members.
    op: ReduceOp,
    postscale: f64,
    phases: Option<Phases<'a>>,
    /// The input read up front ([`snapshot_inputs`](Self::snapshot_inputs)), when results may overwrite it.
    snapshot: Vec<u8>,
}

// The pieces' pointers are caller memory that the engine thread alone touches while the operation is pending.
impl<'a> FusedIo<'a> {
    pub(crate) fn new(dtype: DType, op: ReduceOp, postscale: f64) -> FusedIo<'a> {
        FusedIo {
            inputs: Vec::new(),
            outputs: Vec::new(),
            input_end: 0,
            output_end: 0,
            dtype,
            op,
            postscale,
            phases: None,
            snapshot: Vec::new(),
        }
    }

    /// The next `len` input bytes: caller memory at `ptr` (valid until the operation completes), scaled by
    /// `prescale`; a null `ptr` reads as the reduction's identity.
    pub(crate) fn input(&mut self, ptr: *const u8, len: usize, prescale: f64) {
        if len > 0 {
            self.inputs.push(Piece {
                at: self.input_end,
                ptr: ptr.cast_mut(),
                len,
                factor: prescale,
            });
        }
        self.input_end += len;
    }

    /// The next `len` output bytes: caller memory at `ptr` (valid and writable until the operation completes);
    /// null drops them.
    pub(crate) fn output(&mut self, ptr: *mut u8, len: usize) {
        if len > 0 && !ptr.is_null() {
            self.outputs.push(Piece {
                at: self.output_end,
                ptr,
                len,
                factor: 1.0,
            });
        }
        self.output_end += len;
    }

    /// Reads the whole input now (prescaled) into a buffer of its own and serves reads from there: for members
    /// whose outputs overlap other members' inputs, which a transport that writes chunk c before it reads chunk
    /// c + 1 would otherwise read back already reduced.
    pub(crate) fn snapshot_inputs(&mut self) {
        let mut copy = vec![0u8; self.input_end];
        self.copy_in(0, &mut copy);
        self.snapshot = copy;
        self.inputs = vec![Piece {
            at: 0,
            ptr: self.snapshot.as_mut_ptr(),
            len: self.input_end,
            factor: 1.0,
        }];
        self.inputs.retain(|p| p.len > 0);
    }

    fn copy_in(&self, offset: usize, dst: &mut [u8]) {
        for (piece, inner, outer) in Self::overlaps(&self.inputs, offset, dst.len()) {
            let d = &mut dst[outer];
            if piece.ptr.is_null() {
                fill_identity(d, self.dtype, self.op);
                continue;
            }
            // SAFETY: the piece is `len` readable bytes of caller memory (or of the snapshot), valid until the
            // operation completes.
            let src =
                unsafe { std::slice::from_raw_parts(piece.ptr.add(inner.start), inner.len()) };
            d.copy_from_slice(src);
            scale(d, self.dtype, piece.factor);
        }
    }

    /// Marks the phases on `lanes` as the transport reads and writes: `MEMCPY_IN_FUSION_BUFFER` is open when
    /// this is called and lasts until the last byte is read, then `activity` until the first write after it, then
    /// `MEMCPY_OUT_FUSION_BUFFER` until [`finish`](Self::finish). Through one buffer these are exactly the three
    /// steps; through several chunks (the shm arenas beyond one arena chunk) the earlier chunks' whole round trips
    /// fall into the first phase.
    pub(crate) fn phases(&mut self, timeline: &'a mut Timeline, lanes: Lanes, activity: EventName) {
        self.phases = Some(Phases {
            timeline,
            lanes,
            activity,
            state: State::Reading,
        });
    }

    /// Ends the open phase.
    pub(crate) fn finish(mut self) {
        if let Some(p) = &mut self.phases {
            p.timeline.mark(Phase::End, EventName::Static(""), &p.lanes);
        }
    }

    /// The pieces of `pieces` that overlap `offset..offset + len`, with the overlap's range within the piece and
    /// within the caller's slice.
    fn overlaps(
        pieces: &[Piece],
        offset: usize,
        len: usize,
    ) -> impl Iterator<Item = (Piece, std::ops::Range<usize>, std::ops::Range<usize>)> + '_ {
        let end = offset + len;
        let first = pieces.partition_point(|p| p.at + p.len <= offset);
        pieces[first..]
            .iter()
            .take_while(move |p| p.at < end)
            .map(move |p| {
                let from = p.at.max(offset);
                let to = (p.at + p.len).min(end);
                (*p, from - p.at..to - p.at, from - offset..to - offset)
            })
    }
}

impl Staged for FusedIo<'_> {
    fn read(&mut self, offset: usize, dst: &mut [u8]) {
        self.copy_in(offset, dst);
        if offset + dst.len() == self.input_end
            && let Some(p) = &mut self.phases
            && p.state == State::Reading
        {
            let activity = p.activity.clone();
            p.enter(State::Reducing, activity);
        }
    }

    fn write(&mut self, offset: usize, src: &[u8]) {
        if let Some(p) = &mut self.phases
            && p.state == State::Reducing
        {
            p.enter(
                State::Writing,
                EventName::Static("MEMCPY_OUT_FUSION_BUFFER"),
            );
        }
        for (piece, inner, outer) in Self::overlaps(&self.outputs, offset, src.len()) {
            // SAFETY: the piece is `len` writable bytes of caller memory, valid until the operation completes,
            // which nothing else touches meanwhile.
            let d =
                unsafe { std::slice::from_raw_parts_mut(piece.ptr.add(inner.start), inner.len()) };
            d.copy_from_slice(&src[outer]);
            scale(d, self.dtype, self.postscale);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn reads_and_writes_cross_pieces_with_scales_and_gaps() {
        let a = f32s(&[1.0, 2.0]);
        let b = f32s(&[3.0]);
        let mut out_a = vec![0u8; 8];
        let mut out_c = vec![0u8; 4];
        let mut io = FusedIo::new(DType::F32, ReduceOp::Min, 2.0);
        io.input(a.as_ptr(), 8, 1.0);
        io.input(std::ptr::null(), 4, 1.0); // a missing member
        io.input(b.as_ptr(), 4, 10.0);
        io.output(out_a.as_mut_ptr(), 8);
        io.output(std::ptr::null_mut(), 4);
        io.output(out_c.as_mut_ptr(), 4);
        // Ranges (whole elements) that start and end inside pieces.
        let mut got = vec![0u8; 16];
        io.read(0, &mut got[..4]);
        io.read(4, &mut got[4..]);
        let want = f32s(&[1.0, 2.0, f32::INFINITY, 30.0]);
        assert_eq!(got, want);
        io.write(0, &got[..12]);
        io.write(12, &got[12..]);
        assert_eq!(out_a, f32s(&[2.0, 4.0]));
        assert_eq!(out_c, f32s(&[60.0]));
    }

    #[test]
    fn a_snapshot_keeps_inputs_that_earlier_results_overwrite() {
        // One array twice in place: member 1 reads what member 0 writes.
        let mut x = f32s(&[1.0, 2.0]);
        let p = x.as_mut_ptr();
        let mut io = FusedIo::new(DType::F32, ReduceOp::Sum, 1.0);
        io.input(p, 8, 1.0);
        io.input(p, 8, 3.0);
        io.output(p, 8);
        io.output(p, 8);
        io.snapshot_inputs();
        let mut chunk = vec![0u8; 8];
        io.read(0, &mut chunk);
        chunk.iter_mut().for_each(|b| *b = 0); // "reduced" to zeros, written before the next chunk is read
        io.write(0, &chunk);
        io.read(8, &mut chunk);
        assert_eq!(
            chunk,
            f32s(&[3.0, 6.0]),
            "member 1 read its input, not member 0's result"
        );
    }
}
