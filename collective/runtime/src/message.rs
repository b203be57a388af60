//! Negotiation messages and their wire encoding.
//!
//! Every cycle that cannot take the cached fast path, each rank sends a [`RankMessage`] (its new requests and its
//! state) to the coordinator (rank 0), which answers every rank with the same [`ResponseList`]. The encoding is a
//! private little-endian format between processes of one job built from the same library: no versioning is needed,
//! but decoding never panics on bad bytes.

use hvd_collective::{DType, ReduceOp};

hvd_collective::wire_enum! {
    /// What kind of collective a request is. The codes are the wire codes and the C ABI's `enum hvd_op_kind`
    /// (hvd.h): never renumber.
    pub enum OpKind: u8 {
        Allreduce = 0,
        Allgather,
        Broadcast,
        Alltoall,
        Reducescatter,
        Barrier,
        Join,
    }
}

/// The timeline's names of each kind, indexed by code: `(activity, negotiation phase)`.
const TIMELINE_NAMES: [(&str, &str); OpKind::ALL.len()] = [
    ("ALLREDUCE", "NEGOTIATE_ALLREDUCE"),
    ("ALLGATHER", "NEGOTIATE_ALLGATHER"),
    ("BROADCAST", "NEGOTIATE_BROADCAST"),
    ("ALLTOALL", "NEGOTIATE_ALLTOALL"),
    ("REDUCESCATTER", "NEGOTIATE_REDUCESCATTER"),
    ("BARRIER", "NEGOTIATE_BARRIER"),
    ("JOIN", "NEGOTIATE_JOIN"),
];

impl OpKind {
    /// Upper-case activity name used in the timeline.
    pub fn upper(self) -> &'static str {
        TIMELINE_NAMES[self as usize].0
    }

    /// The timeline's name of this kind's negotiation phase.
    pub fn negotiate_name(self) -> &'static str {
        TIMELINE_NAMES[self as usize].1
    }

    /// Whether the response for this kind may be cached (its parameters do not change from rank to rank).
    pub fn cacheable(self) -> bool {
        matches!(
            self,
            OpKind::Allreduce | OpKind::Broadcast | OpKind::Reducescatter
        )
    }
}

/// A request without its buffers: what ranks compare during negotiation.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestMeta {
    pub kind: OpKind,
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<i64>,
    pub op: ReduceOp,
    pub root: i32,
    pub prescale: f64,
    pub postscale: f64,
    /// Alltoall: rows of dimension 0 sent to each rank (empty: split evenly). Allreduce: empty for one tensor;
    /// for a group fused at submission (`Engine::enqueue_many`), the element count of each member, then a digest
    /// of the members' names and shapes.
    pub splits: Vec<i64>,
}

impl RequestMeta {
    pub fn elements(&self) -> usize {
        self.shape.iter().map(|d| *d as usize).product()
    }

    pub fn bytes(&self) -> usize {
        self.elements() * self.dtype.size()
    }

    /// Elements per row of dimension 0 (1 for scalars).
    pub fn row_elements(&self) -> usize {
        self.shape.iter().skip(1).map(|d| *d as usize).product()
    }

    pub fn dim0(&self) -> i64 {
        self.shape.first().copied().unwrap_or(1)
    }
}

/// One rank's contribution to a negotiation round.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RankMessage {
    pub joined: bool,
    pub shutdown: bool,
    pub requests: Vec<RequestMeta>,
    /// Cache slots this rank has ready but not yet executed (for the stall inspector).
    pub cached_ready: Vec<u32>,
}

/// What every rank executes, identical on every rank.
#[derive(Debug, Clone, PartialEq)]
pub enum Response {
    /// Execute the named tensor. `dim0s` (allgather) holds each rank's rows; `splits` (alltoall) is the
    /// `size x size` matrix of rows rank i sends to rank j; `joined` lists ranks contributing no data.
    Execute {
        meta: RequestMeta,
        dim0s: Vec<i64>,
        splits: Vec<i64>,
        joined: Vec<u32>,
    },
    /// The named tensors fail with this message on every rank.
    Error { names: Vec<String>, message: String },
    /// Every rank has joined; `last_rank` joined last.
    JoinDone { last_rank: u32 },
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct ResponseList {
    pub responses: Vec<Response>,
    /// Cache slots whose names are waiting in the coordinator's table: new requests for them skip the cache.
    pub negotiating: Vec<u32>,
    /// All ranks asked to shut down: stop after this list.
    pub shutdown: bool,
    /// Stop the job with this error (stall shutdown time exceeded).
    pub abort: Option<String>,
}

/// Malformed negotiation bytes from a peer.
#[derive(Debug, thiserror::Error)]
#[error("malformed negotiation message from a peer: {0}")]
pub struct DecodeError(&'static str);

#[derive(Default)]
pub struct Encoder(pub Vec<u8>);

impl Encoder {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn i64(&mut self, v: i64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn f64(&mut self, v: f64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.0.extend_from_slice(s.as_bytes());
    }
    fn i64s(&mut self, v: &[i64]) {
        self.u32(v.len() as u32);
        for x in v {
            self.i64(*x);
        }
    }
    fn u32s(&mut self, v: &[u32]) {
        self.u32(v.len() as u32);
        for x in v {
            self.u32(*x);
        }
    }
    fn meta(&mut self, m: &RequestMeta) {
        self.u8(m.kind.code());
        self.str(&m.name);
        self.u8(m.dtype.code());
        self.i64s(&m.shape);
        self.u8(m.op.code());
        self.u32(m.root as u32);
        self.f64(m.prescale);
        self.f64(m.postscale);
        self.i64s(&m.splits);
    }
}

pub struct Decoder<'a>(&'a [u8]);

impl<'a> Decoder<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.0.len() < n {
            return Err(DecodeError("truncated"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    fn bool(&mut self) -> Result<bool, DecodeError> {
        Ok(self.u8()? != 0)
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().map_err(|_| DecodeError("u32"))?,
        ))
    }
    fn i64(&mut self) -> Result<i64, DecodeError> {
        Ok(i64::from_le_bytes(
            self.take(8)?.try_into().map_err(|_| DecodeError("i64"))?,
        ))
    }
    fn f64(&mut self) -> Result<f64, DecodeError> {
        Ok(f64::from_le_bytes(
            self.take(8)?.try_into().map_err(|_| DecodeError("f64"))?,
        ))
    }
    fn len(&mut self, elem: usize) -> Result<usize, DecodeError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(elem) > self.0.len() {
            return Err(DecodeError("length past the end"));
        }
        Ok(n)
    }
    fn str(&mut self) -> Result<String, DecodeError> {
        let n = self.len(1)?;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| DecodeError("name is not utf-8"))
    }
    fn i64s(&mut self) -> Result<Vec<i64>, DecodeError> {
        let n = self.len(8)?;
        (0..n).map(|_| self.i64()).collect()
    }
    fn u32s(&mut self) -> Result<Vec<u32>, DecodeError> {
        let n = self.len(4)?;
        (0..n).map(|_| self.u32()).collect()
    }
    fn meta(&mut self) -> Result<RequestMeta, DecodeError> {
        Ok(RequestMeta {
            kind: OpKind::from_code(self.u8()?).ok_or(DecodeError("op kind"))?,
            name: self.str()?,
            dtype: DType::from_code(self.u8()?).ok_or(DecodeError("dtype"))?,
            shape: self.i64s()?,
            op: ReduceOp::from_code(self.u8()?).ok_or(DecodeError("reduce op"))?,
            root: self.u32()? as i32,
            prescale: self.f64()?,
            postscale: self.f64()?,
            splits: self.i64s()?,
        })
    }
}

impl RankMessage {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        e.u8(self.joined as u8);
        e.u8(self.shutdown as u8);
        e.u32(self.requests.len() as u32);
        for r in &self.requests {
            e.meta(r);
        }
        e.u32s(&self.cached_ready);
        e.0
    }

    pub fn decode(bytes: &[u8]) -> Result<RankMessage, DecodeError> {
        let mut d = Decoder(bytes);
        let joined = d.bool()?;
        let shutdown = d.bool()?;
        let n = d.len(1)?;
        let requests = (0..n).map(|_| d.meta()).collect::<Result<_, _>>()?;
        let cached_ready = d.u32s()?;
        Ok(RankMessage {
            joined,
            shutdown,
            requests,
            cached_ready,
        })
    }
}

impl ResponseList {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        e.u32(self.responses.len() as u32);
        for r in &self.responses {
            match r {
                Response::Execute {
                    meta,
                    dim0s,
                    splits,
                    joined,
                } => {
                    e.u8(0);
                    e.meta(meta);
                    e.i64s(dim0s);
                    e.i64s(splits);
                    e.u32s(joined);
                }
                Response::Error { names, message } => {
                    e.u8(1);
                    e.u32(names.len() as u32);
                    for n in names {
                        e.str(n);
                    }
                    e.str(message);
                }
                Response::JoinDone { last_rank } => {
                    e.u8(2);
                    e.u32(*last_rank);
                }
            }
        }
        e.u32s(&self.negotiating);
        e.u8(self.shutdown as u8);
        match &self.abort {
            Some(m) => {
                e.u8(1);
                e.str(m);
            }
            None => e.u8(0),
        }
        e.0
    }

    pub fn decode(bytes: &[u8]) -> Result<ResponseList, DecodeError> {
        let mut d = Decoder(bytes);
        let n = d.len(1)?;
        let mut responses = Vec::with_capacity(n);
        for _ in 0..n {
            responses.push(match d.u8()? {
                0 => Response::Execute {
                    meta: d.meta()?,
                    dim0s: d.i64s()?,
                    splits: d.i64s()?,
                    joined: d.u32s()?,
                },
                1 => {
                    let k = d.len(4)?;
                    let names = (0..k).map(|_| d.str()).collect::<Result<_, _>>()?;
                    Response::Error {
                        names,
                        message: d.str()?,
                    }
                }
                2 => Response::JoinDone {
                    last_rank: d.u32()?,
                },
                _ => return Err(DecodeError("response tag")),
            });
        }
        let negotiating = d.u32s()?;
        let shutdown = d.bool()?;
        let abort = if d.bool()? { Some(d.str()?) } else { None };
        Ok(ResponseList {
            responses,
            negotiating,
            shutdown,
            abort,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(name: &str) -> RequestMeta {
        RequestMeta {
            kind: OpKind::Alltoall,
            name: name.into(),
            dtype: DType::BF16,
            shape: vec![4, 3],
            op: ReduceOp::Max,
            root: 2,
            prescale: 0.5,
            postscale: 2.0,
            splits: vec![1, 3],
        }
    }

    #[test]
    fn messages_round_trip() {
        let m = RankMessage {
            joined: true,
            shutdown: false,
            requests: vec![meta("a"), meta("ü")],
            cached_ready: vec![3, 9],
        };
        assert_eq!(RankMessage::decode(&m.encode()).unwrap(), m);
        let r = ResponseList {
            responses: vec![
                Response::Execute {
                    meta: meta("x"),
                    dim0s: vec![1, 2],
                    splits: vec![0, 1, 1, 0],
                    joined: vec![1],
                },
                Response::Error {
                    names: vec!["a".into(), "b".into()],
                    message: "bad".into(),
                },
                Response::JoinDone { last_rank: 3 },
            ],
            negotiating: vec![4],
            shutdown: true,
            abort: Some("stalled".into()),
        };
        assert_eq!(ResponseList::decode(&r.encode()).unwrap(), r);
    }

    #[test]
    fn truncated_messages_are_errors_not_panics() {
        let bytes = RankMessage {
            requests: vec![meta("abc")],
            ..Default::default()
        }
        .encode();
        for cut in 0..bytes.len() {
            assert!(RankMessage::decode(&bytes[..cut]).is_err());
        }
        assert!(ResponseList::decode(&[255, 255, 255, 255]).is_err());
    }

    /// The codes are the C ABI's, and the timeline's names sit at each kind's code.
    #[test]
    fn every_kind_sits_at_its_code() {
        assert_eq!(OpKind::ALL.map(OpKind::code), [0, 1, 2, 3, 4, 5, 6]);
        for k in OpKind::ALL {
            assert_eq!(OpKind::from_code(k.code()), Some(k));
            assert_eq!(k.upper(), k.name().to_uppercase());
            assert_eq!(k.negotiate_name(), format!("NEGOTIATE_{}", k.upper()));
        }
        assert_eq!(OpKind::from_code(7), None);
    }
}
