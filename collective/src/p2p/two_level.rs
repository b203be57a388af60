//! The header exchange and the small (direct) allreduce when ranks span hosts with the same number on each (the
//! hierarchy): first inside the host, then across hosts among ranks with the same local rank, which forward their
//! host's headers and, for a direct allreduce, their host's sum. Every rank still learns every rank's header (so
//! mismatched calls fail alike on every rank) and every rank reduces in the same order (hosts in host order, each
//! host's ranks in rank order: bitwise identical results everywhere), but each rank sends one message across
//! hosts per other host instead of one per remote rank: with 2 hosts x 2 ranks, 4 cross-host messages per operation
//! instead of 8 (alltoall's first round adds its per-destination counts, one 8-byte message to each remote rank).

use std::cell::Cell;

use super::{P2pCommunicator, eager_len};
use crate::error::Result;
use crate::header::{self, HEADER_LEN, Header, Kind};
use crate::reduce::{accumulated, reduce_into};
use crate::transport::{RecvOp, SendOp, Transport, exchange};
use crate::types::DType;

thread_local! {
    /// Two-level exchanges, and rounds of alltoall counts among them, run on this thread (see [`rounds`]).
    static ROUNDS: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

/// How many two-level header exchanges, and how many rounds of alltoall counts after one, the communicators driven
/// by the calling thread have run: tests tell this path from the flat one by it (`testing::two_level_rounds`).
pub(crate) fn rounds() -> (u64, u64) {
    ROUNDS.with(Cell::get)
}

/// The ranks a two-level exchange talks to, and its buffers (kept between calls so the small-message path
/// allocates little).
#[derive(Default)]
pub(super) struct TwoLevel {
    /// The rank with this rank's local rank on each other host, in host order, with that host's ranks in rank
    /// order (this rank's position among them is its own local rank).
    peers: Vec<(usize, Vec<usize>)>,
    /// The ranks on other hosts.
    remote: Vec<usize>,
    /// What this rank forwards: its host's headers in rank order.
    forward: Vec<u8>,
    /// The other hosts' headers, by peer.
    incoming: Vec<Vec<u8>>,
    /// This host's headers (`host_payload`).
    group: Vec<Header>,
    /// Alltoall's count for each remote rank, out and in.
    words: Vec<[u8; 8]>,
    got: Vec<[u8; 8]>,
}

impl TwoLevel {
    /// For rank `me`, given every rank's host and `cross` (one rank per host in host order, `me` among them).
    pub(super) fn new(me: usize, hosts: &[usize], cross: &[usize]) -> TwoLevel {
        let ranks_of = |c: usize| -> Vec<usize> {
            (0..hosts.len()).filter(|r| hosts[*r] == hosts[c]).collect()
        };
        let peers: Vec<(usize, Vec<usize>)> = cross
            .iter()
            .filter(|c| **c != me)
            .map(|&c| (c, ranks_of(c)))
            .collect();
        TwoLevel {
            incoming: vec![Vec::new(); peers.len()],
            peers,
            remote: (0..hosts.len())
                .filter(|r| hosts[*r] != hosts[me])
                .collect(),
            ..TwoLevel::default()
        }
    }
}

impl<T: Transport> P2pCommunicator<T> {
    /// [`negotiate_eager`](Self::negotiate_eager) in two steps: headers (and eager data) inside the host (`local`,
    /// this host's ranks in rank order), then across hosts (to the rank with this rank's local rank on every other
    /// host) this host's headers and its sum of the eager data (see [`host_payload`](Self::host_payload)). Leaves
    /// in `eager_in` the eager data of this host's ranks and the host sums the other hosts sent. `again`: a second
    /// round of the operation that every rank is running, with the same word for every rank (see
    /// [`negotiate`](Self::negotiate)).
    pub(super) fn negotiate_two_level(
        &mut self,
        h: Header,
        pair: &dyn Fn(usize) -> u64,
        eager: Option<&[u8]>,
        local: &[usize],
        tl: &mut TwoLevel,
        again: bool,
    ) -> Result<Vec<Header>> {
        let n = self.world.len();
        let me = self.topology.rank;
        let mut headers = vec![h; n];
        // `local` has at least two ranks (else there is no hierarchy).
        self.swap_headers(&mut headers, pair, eager, Some(local))?;
        self.eager_in[me].clear();
        tl.forward.clear();
        for &r in local {
            let hr = if r == me {
                Header {
                    pair: pair(me),
                    ..h
                }
            } else {
                headers[r]
            };
            tl.forward.extend_from_slice(&hr.encode());
        }
        let payload = self.host_payload(&headers, local, eager, &mut tl.group);
        let name = h.kind.name();
        let mut sends = Vec::with_capacity(2 * tl.peers.len());
        for (c, _) in &tl.peers {
            sends.push(SendOp::new(*c, &tl.forward));
            if eager.is_some() {
                sends.push(SendOp::new(*c, &payload));
            }
        }
        for b in &mut tl.incoming {
            b.clear();
            b.resize(tl.forward.len(), 0);
        }
        let mut recvs: Vec<RecvOp<'_>> = tl
            .peers
            .iter()
            .zip(tl.incoming.iter_mut())
            .map(|((c, _), b)| RecvOp::new(*c, b, None))
            .collect();
        exchange(
            &mut self.transport,
            name,
            self.timeout,
            &mut sends,
            &mut recvs,
        )?;
        drop(recvs);
        drop(sends);
        for ((c, members), bytes) in tl.peers.iter().zip(&tl.incoming) {
            for (&r, b) in members.iter().zip(bytes.chunks_exact(HEADER_LEN)) {
                let mut raw = [0u8; HEADER_LEN];
                raw.copy_from_slice(b);
                headers[r] = Header::decode(&raw, *c)?;
            }
            let len = eager_len(&headers[*c], *c)?;
            self.eager_in[*c].clear();
            self.eager_in[*c].resize(len, 0);
        }
        let mut eager_in = std::mem::take(&mut self.eager_in);
        let mut recvs: Vec<RecvOp<'_>> = eager_in
            .iter_mut()
            .enumerate()
            .filter(|(j, b)| !b.is_empty() && tl.peers.iter().any(|(c, _)| c == j))
            .map(|(j, b)| RecvOp::new(j, b, None))
            .collect();
        let r = match recvs.is_empty() {
            true => Ok(()),
            false => exchange(&mut self.transport, name, self.timeout, &mut [], &mut recvs),
        };
        drop(recvs);
        self.eager_in = eager_in;
        self.host_sum = payload;
        r?;
        ROUNDS.with(|c| c.set((c.get().0 + 1, c.get().1)));
        // Alltoall's per-destination words from other hosts went to the forwarders, not to their destinations
        // (those of this host came in the first step): when every rank runs an alltoall (each rank sees the same
        // headers, so all decide alike), each sends its word to each rank on another host. Not in a second round
        // (`again`): its word is the same for every rank, so the forwarded one is right.
        if !again && headers.iter().all(|x| x.kind == Kind::Alltoall) {
            tl.words.clear();
            tl.words
                .extend(tl.remote.iter().map(|j| pair(*j).to_ne_bytes()));
            tl.got.clear();
            tl.got.resize(tl.remote.len(), [0u8; 8]);
            let mut sends: Vec<SendOp<'_>> = tl
                .remote
                .iter()
                .zip(&tl.words)
                .map(|(j, w)| SendOp::new(*j, w))
                .collect();
            let mut recvs: Vec<RecvOp<'_>> = tl
                .remote
                .iter()
                .zip(tl.got.iter_mut())
                .map(|(j, b)| RecvOp::new(*j, b, None))
                .collect();
            exchange(
                &mut self.transport,
                name,
                self.timeout,
                &mut sends,
                &mut recvs,
            )?;
            drop(recvs);
            for (j, w) in tl.remote.iter().zip(&tl.got) {
                headers[*j].pair = u64::from_ne_bytes(*w);
            }
            ROUNDS.with(|c| c.set((c.get().0, c.get().1 + 1)));
        }
        Ok(headers)
    }

    /// What this rank sends across hosts behind its host's headers when it sends eager data: its host's sum (each
    /// rank's contribution in rank order, as [`reduce_hosts`](Self::reduce_hosts) expects) when every rank of the
    /// host announced the same allreduce, else its own data (the operation fails its header check everywhere, and
    /// the length is the one its header announces). `group`: a buffer for the host's headers.
    fn host_payload(
        &mut self,
        headers: &[Header],
        local: &[usize],
        eager: Option<&[u8]>,
        group: &mut Vec<Header>,
    ) -> Vec<u8> {
        let mut out = std::mem::take(&mut self.host_sum);
        out.clear();
        let Some(mine) = eager else {
            return out;
        };
        let me = self.topology.rank;
        group.clear();
        group.extend(local.iter().map(|r| headers[*r]));
        let alike = header::check(local, group).is_ok();
        match (headers[me].kind, headers[me].op) {
            (Kind::Allreduce, Some(op)) if alike => {
                for (k, &r) in local.iter().enumerate() {
                    let src: &[u8] = if r == me { mine } else { &self.eager_in[r] };
                    if k == 0 {
                        out.extend_from_slice(src);
                    } else {
                        reduce_into(&mut out, src, headers[me].dtype, accumulated(op));
                    }
                }
            }
            _ => out.extend_from_slice(mine),
        }
        out
    }

    /// The direct allreduce's result from what [`negotiate_two_level`](Self::negotiate_two_level) left: this
    /// host's sum and the other hosts' (in `eager_in`), reduced in host order into `data` (`op` accumulated).
    pub(super) fn reduce_hosts(
        &self,
        data: &mut [u8],
        dtype: DType,
        op: crate::types::ReduceOp,
        cross: &[usize],
    ) {
        let me = self.topology.rank;
        for (k, &c) in cross.iter().enumerate() {
            let src: &[u8] = if c == me {
                &self.host_sum
            } else {
                &self.eager_in[c]
            };
            if k == 0 {
                data.copy_from_slice(src);
            } else {
                reduce_into(data, src, dtype, op);
            }
        }
    }
}
