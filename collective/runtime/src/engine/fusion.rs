//! Submission-time fusion, on the user thread: a grouped submission's consecutive small allreduces in caller memory
//! become one request over the members' memory, and a [`PreparedGroup`] keeps that work for later steps.

use std::sync::Arc;

use super::error::EngineError;
use super::handles::{Handle, Submitted};
use super::request::{Input, OutputBuffer, Request, meta, validate};
use crate::message::OpKind;

/// Whether some member's output (`outputs[i]`, members back to back in a fused buffer) overlaps memory that is
/// another member's input, or its own input at another position: a transport that writes the first chunk's results
/// before it reads the next chunk would then read results as input (e.g. one array twice in an in-place group).
/// The members of an in-place group (output = input) do not count. Sorted by address, so checking a group of
/// separate arrays costs a sort and a binary search per member.
fn outputs_overlap_inputs(inputs: &[(*const u8, usize)], outputs: &[(*mut u8, usize)]) -> bool {
    // (start address, end address, start address minus position in the fused buffer), sorted by start.
    let mut ins = Vec::with_capacity(inputs.len());
    let mut at = 0usize;
    for &(p, len) in inputs {
        let a = p as usize;
        ins.push((a, a + len, a.wrapping_sub(at)));
        at += len;
    }
    ins.sort_unstable();
    // The largest end among the first i inputs: inputs before a position that end before an output starts are
    // skipped at once.
    let mut max_end = Vec::with_capacity(ins.len());
    for (i, &(_, end, _)) in ins.iter().enumerate() {
        max_end.push(if i == 0 { end } else { end.max(max_end[i - 1]) });
    }
    let mut at = 0usize;
    for &(p, len) in outputs {
        let (o, oe, shift) = (p as usize, p as usize + len, (p as usize).wrapping_sub(at));
        at += len;
        let mut i = ins.partition_point(|&(a, _, _)| a < oe);
        while i > 0 && max_end[i - 1] > o {
            i -= 1;
            let (_, end, input_shift) = ins[i];
            if end > o && input_shift != shift {
                return true;
            }
        }
    }
    false
}

/// Allreduces that a grouped submission may fuse at once: caller memory in and out, below the size that runs alone.
fn groupable(r: &Request, max_tensor_bytes: usize) -> bool {
    r.meta.kind == OpKind::Allreduce
        && matches!(r.input, Input::Raw(..))
        && matches!(r.output, OutputBuffer::Raw(..))
        && (1..max_tensor_bytes).contains(&r.meta.bytes())
}

/// One submission planned from a list of requests: a request alone, or a group fused at submission. `index` is
/// its (first) request's position in the list, so its handle is the list's first handle plus `index`.
#[derive(Clone)]
pub(super) struct Part {
    pub(super) request: Request,
    index: usize,
    members: Option<Arc<[Vec<i64>]>>,
}

impl Part {
    pub(super) fn submitted(self, base: Handle) -> Submitted {
        Submitted {
            request: self.request,
            handle: base + self.index as u64,
            members: self.members,
        }
    }
}

/// Requests validated and fused once, for repeated submission with [`Engine::enqueue_prepared`](crate::Engine::enqueue_prepared) (a training
/// loop's gradients, every step: the per-tensor work is done once, not every step).
pub struct PreparedGroup {
    pub(super) parts: Vec<Part>,
    pub(super) len: usize,
}

impl PreparedGroup {
    pub(super) fn new(parts: Vec<Part>, len: usize) -> PreparedGroup {
        PreparedGroup { parts, len }
    }

    /// Number of requests (and of handles each submission returns).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// FNV-1a over byte strings, each followed by a separator.
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn add(&mut self, bytes: &[u8]) {
        for b in bytes.iter().chain([&0xffu8]) {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// A group of allreduces being fused at submission: consecutive requests from `index`.
struct Group {
    requests: Vec<Request>,
    index: usize,
    bytes: usize,
}

impl Group {
    fn accepts(&self, r: &Request, threshold: usize) -> bool {
        let g = &self.requests[0].meta;
        let m = &r.meta;
        g.dtype == m.dtype
            && g.op == m.op
            && g.prescale.to_bits() == m.prescale.to_bits()
            && g.postscale.to_bits() == m.postscale.to_bits()
            && self.bytes + m.bytes() <= threshold
    }

    /// One part: the request itself for a group of one, else one allreduce over all members, whose name is made of
    /// the first and last member's (so every rank that submits the same group names it alike) and whose `splits`
    /// are the members' element counts followed by a digest of their names and shapes (so ranks whose groups
    /// differ inside get a mismatch, not each other's data).
    fn finish(self) -> Part {
        let mut requests = self.requests;
        let index = self.index;
        if requests.len() == 1 {
            return Part {
                request: requests.remove(0),
                index,
                members: None,
            };
        }
        let n = requests.len();
        let first = &requests[0].meta;
        let name = format!(
            "{} .. {} ({n} tensors)",
            first.name,
            requests[n - 1].meta.name
        );
        let mut meta = meta(OpKind::Allreduce, &name, first.dtype, Vec::new(), first.op);
        meta.prescale = first.prescale;
        meta.postscale = first.postscale;
        let mut inputs = Vec::with_capacity(n);
        let mut outputs = Vec::with_capacity(n);
        let mut shapes = Vec::with_capacity(n);
        let mut digest = Fnv::default();
        for r in requests {
            digest.add(r.meta.name.as_bytes());
            for d in &r.meta.shape {
                digest.add(&d.to_le_bytes());
            }
            meta.splits.push(r.meta.elements() as i64);
            if let (Input::Raw(i, len), OutputBuffer::Raw(o, _)) = (r.input, r.output) {
                inputs.push((i, len));
                outputs.push((o, len));
            }
            shapes.push(r.meta.shape);
        }
        meta.shape = vec![meta.splits.iter().sum()];
        meta.splits.push(digest.0 as i64);
        let aliased = outputs_overlap_inputs(&inputs, &outputs);
        Part {
            request: Request {
                meta,
                input: Input::Gather(inputs, aliased),
                output: OutputBuffer::Scatter(outputs),
            },
            index,
            members: Some(shapes.into()),
        }
    }
}

/// Each request's verdict, and the parts to submit: requests alone, or consecutive valid groupable ones fused.
/// `name` names an unnamed request; `size` is the number of ranks; allreduces of `max_tensor_bytes` or more run
/// alone, and a group holds at most `threshold` bytes (0: no fusion).
pub(super) fn plan(
    requests: impl IntoIterator<Item = Request>,
    mut name: impl FnMut(&mut Request),
    size: usize,
    threshold: usize,
    max_tensor_bytes: usize,
) -> (Vec<Result<(), EngineError>>, Vec<Part>) {
    let mut verdicts = Vec::new();
    let mut parts = Vec::new();
    let mut group: Option<Group> = None;
    for (index, mut request) in requests.into_iter().enumerate() {
        name(&mut request);
        let verdict = validate(&mut request, size);
        let fusable = verdict.is_ok() && threshold > 0 && groupable(&request, max_tensor_bytes);
        match &mut group {
            Some(g) if fusable && g.accepts(&request, threshold) => {
                g.bytes += request.meta.bytes();
                g.requests.push(request);
            }
            _ => {
                // A group's members have consecutive handles: anything else ends it.
                parts.extend(group.take().map(Group::finish));
                if fusable {
                    group = Some(Group {
                        bytes: request.meta.bytes(),
                        requests: vec![request],
                        index,
                    });
                } else if verdict.is_ok() {
                    parts.push(Part {
                        request,
                        index,
                        members: None,
                    });
                }
            }
        }
        verdicts.push(verdict);
    }
    parts.extend(group.take().map(Group::finish));
    (verdicts, parts)
}

#[cfg(test)]
mod tests {
    use super::outputs_overlap_inputs;

    #[test]
    fn outputs_overlapping_other_members_inputs_are_found() {
        let mut mem = vec![0u8; 64];
        let base = mem.as_mut_ptr();
        let at = |i: usize| base.wrapping_add(i);
        let ins = |v: &[(usize, usize)]| {
            v.iter()
                .map(|&(o, n)| (at(o).cast_const(), n))
                .collect::<Vec<_>>()
        };
        let outs = |v: &[(usize, usize)]| v.iter().map(|&(o, n)| (at(o), n)).collect::<Vec<_>>();
        // Separate arrays, in place (members listed out of address order).
        let g = [(16, 8), (0, 8), (40, 4)];
        assert!(!outputs_overlap_inputs(&ins(&g), &outs(&g)));
        // Out of place, the same input twice: inputs are only read.
        assert!(!outputs_overlap_inputs(
            &ins(&[(0, 8), (0, 8)]),
            &outs(&[(16, 8), (24, 8)])
        ));
        // One array twice in place.
        let g = [(0, 8), (16, 8), (0, 8)];
        assert!(outputs_overlap_inputs(&ins(&g), &outs(&g)));
        // A member's output overlapping the next member's input.
        assert!(outputs_overlap_inputs(
            &ins(&[(0, 8), (8, 8)]),
            &outs(&[(4, 8), (32, 8)])
        ));
        // Its own input, shifted.
        assert!(outputs_overlap_inputs(&ins(&[(0, 8)]), &outs(&[(4, 8)])));
        assert!(!outputs_overlap_inputs(&[], &[]));
    }
}
