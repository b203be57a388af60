//! What a caller submits (a [`Request`]: a description and its buffers) and gets back (an [`Output`]), and the
//! checks every request passes before it is queued.

use hvd_collective::{DType, ReduceOp};

use super::error::EngineError;
use crate::message::{OpKind, RequestMeta};

/// A tensor's input. The raw forms are private to the crate: only [`Request::in_caller_memory`] (an `unsafe fn`)
/// and the C ABI, whose callers take on its contract, put a pointer into a request.
#[derive(Clone)]
pub(crate) enum Input {
    None,
    /// Caller memory, valid and unchanged until the operation completes.
    Raw(*const u8, usize),
    Owned(Vec<u8>),
    /// The members of a group fused at submission (see [`Engine::enqueue_many`](crate::Engine::enqueue_many)), in
    /// order, and whether some member's output overlaps another member's input.
    Gather(Vec<(*const u8, usize)>, bool),
}

/// Where a result goes.
#[derive(Clone)]
pub(crate) enum OutputBuffer {
    /// Caller memory of exactly the result's size, valid until the operation completes (may equal the input).
    Raw(*mut u8, usize),
    /// The engine allocates the result and returns it in [`Output::data`].
    Engine,
    /// The members' caller memory of a group fused at submission, in order.
    Scatter(Vec<(*mut u8, usize)>),
}

// SAFETY: raw buffers are only touched by the engine thread while the operation is pending; whoever made them
// (`Request::in_caller_memory`'s caller, or a C ABI caller) promised not to free or use them until it completes.
unsafe impl Send for Input {}
// SAFETY: as for `Input`.
unsafe impl Send for OutputBuffer {}

/// A submitted operation: its description and its buffers.
///
/// Safe code submits owned buffers only; a request over caller memory takes an `unsafe` constructor, so no safe
/// code can hand the engine thread a pointer that may dangle:
///
/// ```compile_fail
/// use hvd_runtime::{DType, OpKind, ReduceOp, Request, meta};
/// let mut buf = vec![0u8; 4];
/// let r = Request {
///     meta: meta(OpKind::Allreduce, "x", DType::F32, vec![1], ReduceOp::Sum),
///     input: hvd_runtime::engine::Input::Raw(buf.as_ptr(), 4),
///     output: hvd_runtime::engine::OutputBuffer::Raw(buf.as_mut_ptr(), 4),
/// };
/// ```
#[derive(Clone)]
pub struct Request {
    pub meta: RequestMeta,
    pub(crate) input: Input,
    pub(crate) output: OutputBuffer,
}

impl Request {
    /// An operation on an owned buffer, result returned by the engine.
    pub fn new(meta: RequestMeta, data: Vec<u8>) -> Request {
        Request {
            meta,
            input: Input::Owned(data),
            output: OutputBuffer::Engine,
        }
    }

    /// An allreduce of an owned buffer, result returned by the engine (Rust callers and tests).
    pub fn allreduce(
        name: &str,
        dtype: DType,
        shape: Vec<i64>,
        op: ReduceOp,
        data: Vec<u8>,
    ) -> Request {
        Request::new(meta(OpKind::Allreduce, name, dtype, shape, op), data)
    }

    /// Any operation on an owned buffer, result returned by the engine.
    pub fn owned(
        kind: OpKind,
        name: &str,
        dtype: DType,
        shape: Vec<i64>,
        data: Vec<u8>,
    ) -> Request {
        Request::new(meta(kind, name, dtype, shape, ReduceOp::Sum), data)
    }

    /// An allreduce or broadcast over caller memory: `len` bytes read from `input`, the result written to `output`
    /// (which may equal `input`: an in-place operation). No copy in, none out: what the C ABI does for every
    /// request.
    ///
    /// ```
    /// use hvd_runtime::{DType, Engine, EngineConfig, LocalTransport, OpKind, ReduceOp, Request, meta};
    /// use std::time::Duration;
    ///
    /// let transport = LocalTransport::group(1, Duration::from_secs(5)).pop().unwrap();
    /// let engine = Engine::start(Box::new(transport), EngineConfig::default()).unwrap();
    /// let mut buf = 3.0f32.to_le_bytes();
    /// let m = meta(OpKind::Allreduce, "x", DType::F32, vec![1], ReduceOp::Sum);
    /// // SAFETY: `buf` outlives the operation, which is waited for before it is used again.
    /// let r = unsafe { Request::in_caller_memory(m, buf.as_ptr(), buf.as_mut_ptr(), buf.len()) };
    /// let h = engine.enqueue(r).unwrap();
    /// engine.wait(h).unwrap();
    /// assert_eq!(f32::from_le_bytes(buf), 3.0);
    /// ```
    ///
    /// # Safety
    ///
    /// From this call until every operation that submits this request (or a clone of it, or a
    /// [`PreparedGroup`](crate::PreparedGroup) made from it) has completed, that is until its handle has been
    /// waited for or polled as done, or the engine has been shut down or dropped:
    ///
    /// - `input` must be valid for reads of `len` bytes, and nothing may write them;
    /// - `output` must be valid for writes of `len` bytes, and nothing else may read or write them (unless it is
    ///   `input` itself).
    pub unsafe fn in_caller_memory(
        meta: RequestMeta,
        input: *const u8,
        output: *mut u8,
        len: usize,
    ) -> Request {
        Request {
            meta,
            input: Input::Raw(input, len),
            output: OutputBuffer::Raw(output, len),
        }
    }
}

/// A request description with defaults (sum, root 0, no scaling, even splits).
pub fn meta(kind: OpKind, name: &str, dtype: DType, shape: Vec<i64>, op: ReduceOp) -> RequestMeta {
    RequestMeta {
        kind,
        name: name.to_string(),
        dtype,
        shape,
        op,
        root: 0,
        prescale: 1.0,
        postscale: 1.0,
        splits: Vec::new(),
    }
}

/// A completed operation's result.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Output {
    /// Engine-allocated result (empty when the result went to caller memory).
    pub data: Vec<u8>,
    pub shape: Vec<i64>,
    /// Alltoall: rows received from each rank.
    pub splits: Vec<i64>,
    /// Join: the rank that joined last.
    pub value: i64,
}

/// The middle of the names the engine gives unnamed requests.
pub(super) const NONAME: &str = ".noname.";

pub(super) fn validate(request: &mut Request, size: usize) -> Result<(), EngineError> {
    let m = &mut request.meta;
    let bad = |s: String| {
        Err(EngineError::InvalidRequest(format!(
            "tensor `{}`: {s}",
            m.name
        )))
    };
    if m.shape.iter().any(|d| *d < 0) {
        return bad(format!("negative dimension in shape {:?}", m.shape));
    }
    let bytes = m.bytes();
    let input_len = match &request.input {
        Input::None => 0,
        Input::Raw(_, n) => *n,
        Input::Owned(v) => v.len(),
        Input::Gather(parts, _) => parts.iter().map(|(_, n)| n).sum(),
    };
    if !m.splits.is_empty() && m.kind != OpKind::Alltoall {
        return bad(format!("splits apply to alltoall, not {}", m.kind.name()));
    }
    let needs_input = !matches!(m.kind, OpKind::Barrier | OpKind::Join);
    if needs_input && input_len != bytes {
        return bad(format!(
            "buffer of {input_len} bytes does not match shape {:?} of {} ({bytes} bytes)",
            m.shape,
            crate::kernels::dtype_name(m.dtype)
        ));
    }
    let output_len = match &request.output {
        OutputBuffer::Raw(_, n) => Some(*n),
        OutputBuffer::Scatter(parts) => Some(parts.iter().map(|(_, n)| n).sum()),
        OutputBuffer::Engine => None,
    };
    if let Some(n) = output_len {
        let expect = match m.kind {
            OpKind::Allreduce | OpKind::Broadcast => bytes,
            _ => {
                return bad(format!(
                    "{} returns an engine-allocated result, not into caller memory",
                    m.kind.name()
                ));
            }
        };
        if n != expect {
            return bad(format!("output buffer of {n} bytes, expected {expect}"));
        }
    }
    match m.kind {
        OpKind::Broadcast if m.root < 0 || m.root as usize >= size => {
            return bad(format!("root rank {} is not in 0..{size}", m.root));
        }
        OpKind::Allgather | OpKind::Alltoall if m.shape.is_empty() => {
            return bad(format!("{} needs at least one dimension", m.kind.name()));
        }
        OpKind::Alltoall => {
            let dim0 = m.dim0();
            if m.splits.is_empty() {
                if dim0 % size as i64 != 0 {
                    return bad(format!(
                        "first dimension {dim0} is not divisible by {size} ranks; pass explicit splits"
                    ));
                }
                m.splits = vec![dim0 / size as i64; size];
            }
            if m.splits.len() != size
                || m.splits.iter().any(|s| *s < 0)
                || m.splits.iter().sum::<i64>() != dim0
            {
                return bad(format!(
                    "splits {:?} must be {size} non-negative counts summing to the first dimension {dim0}",
                    m.splits
                ));
            }
        }
        _ => {}
    }
    if !m.prescale.is_finite() || !m.postscale.is_finite() {
        return bad("prescale and postscale factors must be finite".into());
    }
    Ok(())
}

/// A single buffer's input (a fused group's `Gather` is copied piece by piece in `run_fused` instead).
pub(super) fn input_slice(input: &Input) -> &[u8] {
    match input {
        Input::None | Input::Gather(..) => &[],
        // An empty tensor's data pointer may be null (torch's is), which `from_raw_parts` does not allow.
        Input::Raw(_, 0) => &[],
        // SAFETY: the submitter guarantees `len` readable bytes until the operation completes.
        Input::Raw(ptr, len) => unsafe { std::slice::from_raw_parts(*ptr, *len) },
        Input::Owned(v) => v,
    }
}
