//! The header exchange and the small (direct) allreduce when ranks span hosts with the same number on each (the
//! hierarchy): first inside the host, then across hosts among ranks with the same local rank, which forward their
//! host's headers and, for a direct allreduce, their host's sum. Every rank still learns every rank's header (so
//! mismatched calls fail alike on every rank) and every rank reduces in the same order (hosts in host order, each
//! host's ranks in rank order: bitwise identical results everywhere), but each rank sends one message across
//! hosts per other host instead of one per remote rank: with 2 hosts x 2 ranks, 4 cross-host messages per operation
//! instead of 8.

use super::{P2pCommunicator, eager_len, index_of};
use crate::error::{Error, Result};
use crate::header::{self, HEADER_LEN, Header, Kind};
use crate::reduce::{accumulated, reduce_into};
use crate::transport::{RecvOp, SendOp, Transport, exchange};
use crate::types::DType;

impl<T: Transport> P2pCommunicator<T> {
    /// [`negotiate_eager`](Self::negotiate_eager) in two steps: headers (and eager data) inside the host (`local`,
    /// this host's ranks in rank order), then across hosts (`cross`, one rank per host in host order, this rank
    /// among them) this host's headers and its sum of the eager data (see [`host_payload`](Self::host_payload)).
    /// Leaves in `eager_in` the eager data of this host's ranks and the host sums the other hosts sent.
    pub(super) fn negotiate_two_level(
        &mut self,
        h: Header,
        pair: &dyn Fn(usize) -> u64,
        eager: Option<&[u8]>,
        local: &[usize],
        cross: &[usize],
    ) -> Result<Vec<Header>> {
        let n = self.world.len();
        let me = self.topology.rank;
        let mut headers = vec![h; n];
        if local.len() > 1 {
            self.swap_headers(&mut headers, pair, eager, Some(local))?;
        } else {
            self.eager_in.resize_with(n, Vec::new);
        }
        self.eager_in[me].clear();
        // What this rank forwards: its host's headers in rank order, and its host's payload.
        let mut forward = Vec::with_capacity(local.len() * HEADER_LEN);
        for &r in local {
            let hr = if r == me {
                Header {
                    pair: pair(me),
                    ..h
                }
            } else {
                headers[r]
            };
            forward.extend_from_slice(&hr.encode());
        }
        let payload = self.host_payload(&headers, local, eager);
        let li = index_of(local, me);
        let peers: Vec<usize> = cross.iter().copied().filter(|c| *c != me).collect();
        let mut incoming = vec![vec![0u8; forward.len()]; peers.len()];
        let mut sends = Vec::with_capacity(2 * peers.len());
        for &c in &peers {
            sends.push(SendOp::new(c, &forward));
            if eager.is_some() {
                sends.push(SendOp::new(c, &payload));
            }
        }
        let mut recvs: Vec<RecvOp<'_>> = peers
            .iter()
            .zip(incoming.iter_mut())
            .map(|(c, b)| RecvOp::new(*c, b, None))
            .collect();
        let name = h.kind.name();
        exchange(
            &mut self.transport,
            name,
            self.timeout,
            &mut sends,
            &mut recvs,
        )?;
        drop(recvs);
        // The forwarder's host's ranks in rank order, as `local` is for this host.
        for (&c, bytes) in peers.iter().zip(&incoming) {
            let members: Vec<usize> = (0..n).filter(|r| self.hosts[*r] == self.hosts[c]).collect();
            if members.len() != local.len() || members.get(li) != Some(&c) {
                return Err(Error::Broken(format!(
                    "rank {c} is not rank {me}'s peer on another host"
                )));
            }
            for (&r, b) in members.iter().zip(bytes.chunks_exact(HEADER_LEN)) {
                let mut raw = [0u8; HEADER_LEN];
                raw.copy_from_slice(b);
                headers[r] = Header::decode(&raw, c)?;
            }
            let len = eager_len(&headers[c], c)?;
            self.eager_in[c].clear();
            self.eager_in[c].resize(len, 0);
        }
        let mut eager_in = std::mem::take(&mut self.eager_in);
        let mut recvs: Vec<RecvOp<'_>> = eager_in
            .iter_mut()
            .enumerate()
            .filter(|(j, b)| peers.contains(j) && !b.is_empty())
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
        // Alltoall's per-destination words went to the forwarders, not to their destinations: when every rank
        // runs an alltoall (each rank sees the same headers, so all decide alike), each sends its word to each.
        if headers.iter().all(|x| x.kind == Kind::Alltoall) {
            let words: Vec<[u8; 8]> = (0..n).map(|j| pair(j).to_ne_bytes()).collect();
            let mut got = vec![[0u8; 8]; n];
            let mut sends: Vec<SendOp<'_>> = (0..n)
                .filter(|j| *j != me)
                .map(|j| SendOp::new(j, &words[j]))
                .collect();
            let mut recvs: Vec<RecvOp<'_>> = got
                .iter_mut()
                .enumerate()
                .filter(|(j, _)| *j != me)
                .map(|(j, b)| RecvOp::new(j, b, None))
                .collect();
            exchange(
                &mut self.transport,
                name,
                self.timeout,
                &mut sends,
                &mut recvs,
            )?;
            drop(recvs);
            for (j, w) in got.iter().enumerate().filter(|(j, _)| *j != me) {
                headers[j].pair = u64::from_ne_bytes(*w);
            }
        }
        Ok(headers)
    }

    /// What this rank sends across hosts behind its host's headers when it sends eager data: its host's sum (each
    /// rank's contribution in rank order, as [`reduce_hosts`](Self::reduce_hosts) expects) when every rank of the
    /// host announced the same allreduce, else its own data (the operation fails its header check everywhere, and
    /// the length is the one its header announces).
    fn host_payload(
        &mut self,
        headers: &[Header],
        local: &[usize],
        eager: Option<&[u8]>,
    ) -> Vec<u8> {
        let mut out = std::mem::take(&mut self.host_sum);
        out.clear();
        let Some(mine) = eager else {
            return out;
        };
        let me = self.topology.rank;
        let group: Vec<Header> = local.iter().map(|r| headers[*r]).collect();
        let alike = header::check(local, &group).is_ok();
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
