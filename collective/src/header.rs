//! The small header every rank sends every other rank before each operation, so that mismatched calls fail on
//! every rank with the same message instead of hanging or mixing up data.
//!
//! Wire format (40 bytes, native endianness: all ranks of a job share a host architecture):
//! `seq u64 | kind u8 | dtype u8 | op u8 | flags u8 (1 invalid, 2 eager, 4 deposited) | root u32 | count u64 |
//! digest u64 | pair u64`.

use crate::communicator::{Allgatherv, Alltoallv, Reducescatter, check};
use crate::error::Error;
use crate::types::{DType, ReduceOp};

pub const HEADER_LEN: usize = 40;

/// Largest eager message per peer (data that follows its header, flag 2): it must fit the smallest transport
/// buffer (a 4 KiB shm ring) with its header, because it is sent before the peer starts reading.
pub(crate) const EAGER_MAX_BYTES: usize = 2048;

crate::wire_enum! {
    /// Which collective a header announces.
    pub enum Kind: u8 {
        Allreduce = 1,
        Allgather,
        Broadcast,
        Alltoall,
        Reducescatter,
        Barrier,
    }
}

/// One rank's description of the operation it is about to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub seq: u64,
    pub kind: Kind,
    pub dtype: DType,
    pub op: Option<ReduceOp>,
    /// The caller's arguments were invalid; the rank reports its own error and every other rank a mismatch.
    pub invalid: bool,
    /// The sender's data for this operation follows the header right away (small allreduce, one round).
    pub eager: bool,
    /// The sender deposited its data for this allreduce on the shared-memory board with the header
    /// ([`Board::deposit`](crate::board::Board::deposit)); the ranks reduce straight out of the deposits only when
    /// every rank did, so unlike `eager` the ranks need not agree on it (the header check ignores it).
    pub deposited: bool,
    pub root: u32,
    /// Element count: total for allreduce/broadcast/reducescatter, this rank's block for allgather(v).
    pub count: u64,
    /// Hash of the per-rank counts vector (allgatherv, reducescatter), 0 when unused.
    pub digest: u64,
    /// Per-destination value: for alltoallv the count sent to the receiving rank.
    pub pair: u64,
}

impl Header {
    pub fn new(seq: u64, kind: Kind, dtype: DType) -> Header {
        Header {
            seq,
            kind,
            dtype,
            op: None,
            invalid: false,
            eager: false,
            deposited: false,
            root: 0,
            count: 0,
            digest: 0,
            pair: 0,
        }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&self.seq.to_ne_bytes());
        b[8] = self.kind.code();
        b[9] = self.dtype.code();
        b[10] = self.op.map_or(0, ReduceOp::code);
        b[11] =
            u8::from(self.invalid) | (u8::from(self.eager) << 1) | (u8::from(self.deposited) << 2);
        b[12..16].copy_from_slice(&self.root.to_ne_bytes());
        b[16..24].copy_from_slice(&self.count.to_ne_bytes());
        b[24..32].copy_from_slice(&self.digest.to_ne_bytes());
        b[32..40].copy_from_slice(&self.pair.to_ne_bytes());
        b
    }

    /// Decodes a peer's header; garbage means the peer is not speaking this protocol version.
    pub fn decode(b: &[u8; HEADER_LEN], from: usize) -> Result<Header, Error> {
        let u64_at = |i: usize| u64::from_ne_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        let bad = || Error::PeerLost {
            rank: from,
            reason: "it sent a malformed operation header".into(),
        };
        Ok(Header {
            seq: u64_at(0),
            kind: Kind::from_code(b[8]).ok_or_else(bad)?,
            dtype: DType::from_code(b[9]).ok_or_else(bad)?,
            op: if b[10] == 0 {
                None
            } else {
                Some(ReduceOp::from_code(b[10]).ok_or_else(bad)?)
            },
            invalid: b[11] & 1 != 0,
            eager: b[11] & 2 != 0,
            deposited: b[11] & 4 != 0,
            root: u32::from_ne_bytes(b[12..16].try_into().unwrap_or([0; 4])),
            count: u64_at(16),
            digest: u64_at(24),
            pair: u64_at(32),
        })
    }

    /// A short human description of the call, e.g. `allreduce(f32 x 10, sum)`.
    pub fn describe(&self) -> String {
        let k = self.kind.name();
        match self.kind {
            Kind::Barrier => "barrier()".into(),
            Kind::Allreduce => format!(
                "{k}({} x {}, {})",
                self.dtype,
                self.count,
                self.op.map_or("?", |o| o.name())
            ),
            Kind::Reducescatter => {
                format!(
                    "{k}({} x {}, {})",
                    self.dtype,
                    self.count,
                    self.op.map_or("?", |o| o.name())
                )
            }
            Kind::Broadcast => format!("{k}({} x {}, root {})", self.dtype, self.count, self.root),
            Kind::Allgather => format!(
                "{k}({}, {} elements from this rank)",
                self.dtype, self.count
            ),
            Kind::Alltoall => format!("{k}({})", self.dtype),
        }
    }
}

/// An operation's header and this rank's own verdict on its arguments (`Some` error when they are invalid: the
/// rank still sends the header, marked invalid, so its peers fail with a mismatch instead of waiting).
pub(crate) type Call = (Header, Option<Error>);

/// Each operation's header and argument check, alike for every backend (p2p, mpi, nccl), so the same call is
/// described and refused the same way everywhere. The sequence number is the backend's to set.
impl Header {
    pub(crate) fn allreduce(len: usize, dtype: DType, op: ReduceOp) -> Call {
        let mut h = Header::new(0, Kind::Allreduce, dtype);
        h.op = Some(op);
        h.count = (len / dtype.size()) as u64;
        (h, check::whole("allreduce", len, dtype).err())
    }

    /// Rank `me`'s allgatherv (`counts` has one entry per rank of `n`).
    pub(crate) fn allgatherv(call: &Allgatherv<'_>, n: usize, me: usize) -> Call {
        let h = Header::allgather(call.counts, me, call.dtype);
        (h, check::allgatherv(call, n, me).err())
    }

    /// The allgather(v) header of rank `me` (its own block's count, a digest of all).
    pub(crate) fn allgather(counts: &[usize], me: usize, dtype: DType) -> Header {
        let mut h = Header::new(0, Kind::Allgather, dtype);
        h.count = counts.get(me).copied().unwrap_or(0) as u64;
        h.digest = digest(counts);
        h
    }

    pub(crate) fn broadcast(len: usize, root: usize, n: usize, dtype: DType) -> Call {
        let mut h = Header::new(0, Kind::Broadcast, dtype);
        h.root = root as u32;
        h.count = (len / dtype.size()) as u64;
        (h, check::broadcast(len, root, n, dtype).err())
    }

    pub(crate) fn alltoallv(call: &Alltoallv<'_>, n: usize) -> Call {
        let dtype = call.dtype;
        let h = Header::new(0, Kind::Alltoall, dtype);
        // Each counts vector describes its buffer.
        let local = check::counts("alltoall", call.send_counts, n, call.send.len(), dtype)
            .and_then(|()| check::counts("alltoall", call.recv_counts, n, call.recv.len(), dtype))
            .err();
        (h, local)
    }

    /// Rank `me`'s reducescatter (`counts` has one entry per rank of `n`).
    pub(crate) fn reducescatter(call: &Reducescatter<'_>, n: usize, me: usize) -> Call {
        let mut h = Header::new(0, Kind::Reducescatter, call.dtype);
        h.op = Some(call.op);
        h.count = (call.send.len() / call.dtype.size()) as u64;
        h.digest = digest(call.counts);
        (h, check::reducescatter(call, n, me).err())
    }
}

/// The end of a header exchange by all-gather (mpi, nccl): decodes `all` (every rank's header, in rank order),
/// then returns this rank's own error `local` if it has one, else the verdict of [`check`] over the whole job.
#[cfg(any(feature = "mpi", feature = "nccl"))]
pub(crate) fn settle(all: &[u8], local: Option<Error>) -> Result<(), Error> {
    let headers = all
        .chunks_exact(HEADER_LEN)
        .enumerate()
        .map(|(r, c)| Header::decode(&c.try_into().unwrap_or([0; HEADER_LEN]), r))
        .collect::<Result<Vec<_>, Error>>()?;
    if let Some(e) = local {
        return Err(e);
    }
    let group: Vec<usize> = (0..headers.len()).collect();
    check(&group, &headers)
}

/// FNV-1a over a counts vector (the same on every rank when the calls match).
pub fn digest(counts: &[usize]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for c in counts.iter().flat_map(|c| (*c as u64).to_ne_bytes()) {
        h ^= u64::from(c);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h | 1
}

/// Compares every rank's header with the group's first rank's. `headers[i]` belongs to `group[i]`.
/// `counts_for` says, for ops with per-rank counts, the count rank `i` must have sent.
pub fn check(group: &[usize], headers: &[Header]) -> Result<(), Error> {
    let reference = headers[0];
    let r0 = group[0];
    for (i, h) in headers.iter().enumerate() {
        if h.invalid {
            return Err(Error::Mismatch {
                rank: group[i],
                reference: r0,
                detail: format!(
                    "rank {} passed invalid arguments to `{}` (its own error says which)",
                    group[i],
                    h.kind.name()
                ),
            });
        }
    }
    for (i, h) in headers.iter().enumerate().skip(1) {
        let r = group[i];
        let same = h.seq == reference.seq
            && h.kind == reference.kind
            && h.dtype == reference.dtype
            && h.op == reference.op
            && h.root == reference.root
            && h.digest == reference.digest
            && h.eager == reference.eager
            && (matches!(h.kind, Kind::Allgather | Kind::Alltoall) || h.count == reference.count);
        if !same {
            let mut detail = format!(
                "rank {r} called {} but rank {r0} called {}",
                h.describe(),
                reference.describe()
            );
            if h.seq != reference.seq {
                detail.push_str(&format!(
                    " (rank {r} is at its collective #{} and rank {r0} at #{})",
                    h.seq, reference.seq
                ));
            } else if h.eager != reference.eager && h.count == reference.count {
                detail.push_str(&format!(
                    " (they disagree on the small-message path: set `{}` alike on every rank)",
                    crate::env_vars::HVD_ALLREDUCE_DIRECT_BYTES
                ));
            } else if h.digest != reference.digest && h.kind == Kind::Allreduce {
                detail.push_str(&format!(
                    " (they pick allreduce algorithms differently: set `{}` and `{}` alike on every rank)",
                    crate::env_vars::HVD_ALLREDUCE_SMALL_BYTES,
                    crate::env_vars::HVD_ALLREDUCE_CHUNK_BYTES
                ));
            } else if h.digest != reference.digest && h.kind == reference.kind {
                detail.push_str(" (their per-rank counts differ)");
            }
            return Err(Error::Mismatch {
                rank: r,
                reference: r0,
                detail,
            });
        }
    }
    Ok(())
}
