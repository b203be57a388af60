//! The hierarchical transport: shared memory to the ranks on this host, TCP to the others.
//!
//! The collective algorithms in [`crate::p2p`] see one transport; when ranks span hosts and every host has the
//! same number of ranks, allreduce runs as reduce-scatter inside the host (shm), allreduce of each slice across
//! hosts among ranks with the same local rank (tcp), then allgather inside the host (shm).

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use crate::error::Result;
use crate::shm::{ShmSegment, ShmTransport};
use crate::tcp::{JobKey, TcpTransport};
use crate::transport::{RecvOp, SendOp, Transport};

/// Fruitless rounds a wait spins or yields (by the shm side's settings) before it may sleep; a wait on same-host
/// peers only when they outnumber the cores follows the shm side alone (see [`MixedTransport::wait`]).
const PATIENT_ROUNDS: u32 = 300;

/// Shared memory for same-host peers, TCP for the rest.
pub struct MixedTransport {
    shm: ShmTransport,
    tcp: TcpTransport,
    /// `local[r]`: rank `r` shares this rank's host.
    local: Vec<bool>,
    rank: usize,
}

impl MixedTransport {
    /// Connects rank `rank` given every rank's host index, this host's shared segment (sized for the local ranks,
    /// in rank order), this rank's listener, every rank's TCP address and the job's key (which authenticates the TCP
    /// connections).
    pub fn connect(
        rank: usize,
        hosts: &[usize],
        seg: ShmSegment,
        listener: &TcpListener,
        addrs: &[SocketAddr],
        key: &JobKey,
        timeout: Duration,
    ) -> Result<MixedTransport> {
        let local: Vec<bool> = hosts.iter().map(|h| *h == hosts[rank]).collect();
        let global: Vec<usize> = (0..hosts.len()).filter(|r| local[*r]).collect();
        let me = global.iter().position(|r| *r == rank).unwrap_or(0);
        let mut shm = ShmTransport::attach_mapped(seg, me, global)?;
        let remote: Vec<Option<SocketAddr>> = addrs
            .iter()
            .enumerate()
            .map(|(r, a)| (!local[r]).then_some(*a))
            .collect();
        let mut tcp = TcpTransport::connect_subset(rank, listener, &remote, key, timeout)?;
        tcp.poll_ms = 1;
        shm.wait_attached(timeout)?;
        Ok(MixedTransport {
            shm,
            tcp,
            local,
            rank,
        })
    }
}

impl Transport for MixedTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.local.len()
    }

    fn progress_send(&mut self, op: &mut SendOp<'_>) -> Result<bool> {
        if self.local[op.peer] {
            self.shm.progress_send(op)
        } else {
            self.tcp.progress_send(op)
        }
    }

    fn progress_recv(&mut self, op: &mut RecvOp<'_>) -> Result<bool> {
        if self.local[op.peer] {
            self.shm.progress_recv(op)
        } else {
            self.tcp.progress_recv(op)
        }
    }

    fn flush(&mut self) -> Result<bool> {
        self.tcp.flush()
    }

    fn wait(&mut self, send_peers: &[usize], recv_peers: &[usize], idle: u32) -> Result<()> {
        let split = |peers: &[usize], local: bool| -> Vec<usize> {
            peers
                .iter()
                .copied()
                .filter(|p| self.local[*p] == local)
                .collect()
        };
        let (ls, lr) = (split(send_peers, true), split(recv_peers, true));
        let (rs, rr) = (split(send_peers, false), split(recv_peers, false));
        // For the first rounds of a wait, whichever side it waits on, spin and yield as the shm side would but
        // never sleep (on a futex or in `poll`): a sleeping rank costs a wake-up per hop, and the two-level header
        // exchange (`p2p::two_level`) waits on one side, then the other, back to back. Except a wait on this host
        // alone when its ranks outnumber its cores: there the shm side's own brief yielding stands (a rank that
        // keeps yielding slows the rank sharing its core, see `shm`).
        let local_only = rs.is_empty() && rr.is_empty();
        let patient = idle < PATIENT_ROUNDS && !(local_only && self.shm.oversubscribed());
        if local_only {
            if patient {
                return self.shm.wait_inner(&ls, &lr, idle, false);
            }
            return self.shm.wait(&ls, &lr, idle);
        }
        if !ls.is_empty() || !lr.is_empty() || patient {
            self.shm.wait_inner(&ls, &lr, idle, false)?;
            if patient {
                return Ok(());
            }
        }
        self.tcp.wait(&rs, &rr, idle)
    }

    fn abort(&mut self, culprit: usize, reason: &str) {
        self.shm.abort(culprit, reason);
        self.tcp.abort(culprit, reason);
    }
}
