//! Collectives over a point-to-point [`Transport`]: the algorithms shared by the tcp, shm and hierarchical
//! communicators, and the per-operation header check.

use std::time::Duration;

use crate::board::{Board, Combine};
use crate::communicator::{
    Allgatherv, Alltoallv, Communicator, InPlace, Reducescatter, StagedAllreduce, check,
    staged_through,
};
use crate::config::Thresholds;
use crate::error::{Error, Result};
use crate::header::{self, EAGER_MAX_BYTES, HEADER_LEN, Header, Kind};
use crate::reduce::{accumulated, finish_average};
use crate::transport::{RecvOp, SendOp, Transport, disjoint, even_counts, exchange, split_blocks};
use crate::types::{DType, ReduceOp, Topology};

/// The fewest ranks that deposit an allreduce on the board (see `allreduce_in_place`): 2 ranks on one core took
/// longer that way than through recursive doubling (4 KiB: 5.1 against 4.2 µs), 3 and 4 about half the time
/// (docs/collective.md, "Deposits").
const DEPOSIT_MIN_RANKS: usize = 3;

thread_local! {
    /// Allreduces reduced out of the board's deposits on this thread (see [`deposited_allreduces`]).
    static DEPOSITED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many allreduces the communicators driven by the calling thread reduced out of the board's deposits: tests
/// tell that path from the others by it (`testing::deposited_allreduces`).
pub(crate) fn deposited_allreduces() -> u64 {
    DEPOSITED.with(std::cell::Cell::get)
}

/// Mixed into a staged allreduce's digest (see `allreduce_staged`).
const STAGED: usize = 0x5747_4544;

mod two_level;

pub(crate) use two_level::rounds as two_level_rounds;

/// A communicator built from a point-to-point transport and the collective algorithms of this module. Aligned so
/// that the state of ranks running as threads of one process never shares a cache line.
#[repr(align(128))]
pub struct P2pCommunicator<T: Transport> {
    transport: T,
    topology: Topology,
    backend: &'static str,
    /// Host index of every rank; ranks with the same value share a host.
    hosts: Vec<usize>,
    seq: u64,
    timeout: Duration,
    thresholds: Thresholds,
    /// Per-rank block of one ring segment of a large allreduce (0: the whole buffer is one segment).
    chunk_bytes: usize,
    broken: Option<String>,
    scratch: Vec<u8>,
    world: Vec<usize>,
    hierarchy: Option<(Vec<usize>, Vec<usize>)>,
    /// Data peers sent eagerly with their header, by rank.
    eager_in: Vec<Vec<u8>>,
    /// This rank's eager data (kept between calls so the small-message path allocates little).
    eager_out: Vec<u8>,
    /// Encoded outgoing and incoming headers, by rank (kept between calls).
    hdr_out: Vec<[u8; HEADER_LEN]>,
    hdr_in: Vec<[u8; HEADER_LEN]>,
    /// This rank's word for each rank on the board (kept between calls).
    pairs_out: Vec<u64>,
    /// The operation whose header last went through the board.
    board_seq: u64,
    /// This host's sum of a direct allreduce's data (two-level exchange, see `two_level`).
    host_sum: Vec<u8>,
    /// The two-level exchange's peers and buffers (empty without a hierarchy).
    two_level: two_level::TwoLevel,
}

impl<T: Transport> P2pCommunicator<T> {
    /// Wraps a connected transport. `hosts[r]` is the host index of rank `r` (all zero on one host).
    pub fn new(transport: T, backend: &'static str, hosts: Vec<usize>, timeout: Duration) -> Self {
        let rank = transport.rank();
        let size = transport.size();
        let topology = Topology::from_hosts(rank, &hosts);
        let world: Vec<usize> = (0..size).collect();
        // Hierarchical allreduce needs the same number of ranks on every host.
        let local: Vec<usize> = (0..size).filter(|r| hosts[*r] == hosts[rank]).collect();
        let uniform =
            (0..size).all(|r| hosts.iter().filter(|h| **h == hosts[r]).count() == local.len());
        let hierarchy =
            (topology.cross_size > 1 && topology.local_size > 1 && uniform).then(|| {
                let mut host_ids: Vec<usize> = hosts.clone();
                host_ids.sort_unstable();
                host_ids.dedup();
                let cross: Vec<usize> = host_ids
                    .iter()
                    .map(|h| {
                        (0..size)
                            .filter(|r| hosts[*r] == *h)
                            .nth(topology.local_rank)
                            .unwrap_or(0)
                    })
                    .collect();
                (local, cross)
            });
        let two_level = match &hierarchy {
            Some((_, cross)) => two_level::TwoLevel::new(rank, &hosts, cross),
            None => two_level::TwoLevel::default(),
        };
        P2pCommunicator {
            transport,
            topology,
            backend,
            hosts,
            seq: 0,
            timeout,
            thresholds: Thresholds::from_env(),
            chunk_bytes: crate::config::allreduce_chunk_bytes_from_env(),
            broken: None,
            scratch: Vec::new(),
            world,
            hierarchy,
            eager_in: Vec::new(),
            eager_out: Vec::new(),
            hdr_out: Vec::new(),
            hdr_in: Vec::new(),
            pairs_out: Vec::new(),
            board_seq: 0,
            host_sum: Vec::new(),
            two_level,
        }
    }

    /// Overrides the algorithm thresholds (normally read from the environment).
    pub fn set_thresholds(&mut self, thresholds: Thresholds) {
        self.thresholds = thresholds;
    }

    /// Overrides the per-rank block of one ring segment of a large allreduce (normally from
    /// `HVD_ALLREDUCE_CHUNK_BYTES`; 0 runs the ring over the whole buffer at once).
    pub fn set_allreduce_chunk_bytes(&mut self, bytes: usize) {
        self.chunk_bytes = bytes;
    }

    /// The time a pending operation waits for a silent peer before failing.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Host index of every rank.
    pub fn hosts(&self) -> &[usize] {
        &self.hosts
    }

    fn begin(&mut self) -> Result<u64> {
        if let Some(reason) = &self.broken {
            return Err(Error::Broken(reason.clone()));
        }
        self.seq += 1;
        Ok(self.seq)
    }

    /// Marks the communicator broken after a fatal error and tells the peers.
    fn fail(&mut self, e: Error) -> Error {
        if e.is_fatal() && self.broken.is_none() {
            let culprit = match &e {
                Error::PeerLost { rank, .. } => *rank,
                Error::Timeout { ranks, .. } => {
                    ranks.first().copied().unwrap_or(self.topology.rank)
                }
                _ => self.topology.rank,
            };
            tracing::warn!(rank = self.topology.rank, error = %e, "collective failed; aborting peers");
            self.transport.abort(culprit, &e.to_string());
            self.broken = Some(e.to_string());
        }
        e
    }

    /// Exchanges headers with every rank, with the same per-destination field (`h.pair`) for each. `again`: a
    /// second round of the operation that every rank is running, reached only once every rank passed the first
    /// round's check (alltoallv's verdicts), so that every rank passes the same `again`.
    fn negotiate(&mut self, h: Header, again: bool) -> Result<Vec<Header>> {
        self.negotiate_eager(h, &|_| h.pair, None, again)
    }

    /// Exchanges headers with every rank; `pair(j)` is the per-destination field for rank `j`. With `eager`, this
    /// rank's data follows its header to every peer. Data that peers sent eagerly is always received (so the
    /// streams stay aligned even when the calls do not match) and left in `self.eager_in`, indexed by rank.
    /// `again`: see [`negotiate`](Self::negotiate).
    fn negotiate_eager(
        &mut self,
        h: Header,
        pair: &dyn Fn(usize) -> u64,
        eager: Option<&[u8]>,
        again: bool,
    ) -> Result<Vec<Header>> {
        let n = self.world.len();
        if n == 1 {
            return Ok(vec![h; n]);
        }
        // One board round per operation: a second round within it (alltoall's verdicts) would overwrite the slot
        // that peers may still be reading, so it goes point to point.
        if h.seq != self.board_seq && self.transport.shared_board().is_some() {
            self.board_seq = h.seq;
            return self.negotiate_board(h, pair, eager);
        }
        if let Some((local, cross)) = self.hierarchy.take() {
            let mut tl = std::mem::take(&mut self.two_level);
            let r = self.negotiate_two_level(h, pair, eager, &local, &mut tl, again);
            self.two_level = tl;
            self.hierarchy = Some((local, cross));
            return r;
        }
        let mut headers = vec![h; n];
        self.swap_headers(&mut headers, pair, eager, None)?;
        Ok(headers)
    }

    /// The point-to-point header exchange of [`negotiate_eager`](Self::negotiate_eager) with the ranks of `group`
    /// (every rank when `None`; this rank must be in it): fills `headers` and `eager_in` for its members.
    fn swap_headers(
        &mut self,
        headers: &mut [Header],
        pair: &dyn Fn(usize) -> u64,
        eager: Option<&[u8]>,
        group: Option<&[usize]>,
    ) -> Result<()> {
        let n = self.world.len();
        let me = self.topology.rank;
        let h = headers[me];
        let peer = |j: usize| j != me && group.is_none_or(|g| g.contains(&j));
        let mut outgoing = std::mem::take(&mut self.hdr_out);
        outgoing.clear();
        outgoing.extend((0..n).map(|j| Header { pair: pair(j), ..h }.encode()));
        let mut incoming = std::mem::take(&mut self.hdr_in);
        incoming.clear();
        incoming.resize(n, [0u8; HEADER_LEN]);
        let r = if n == 2 && group.is_none() {
            // Two ranks (the common small case): the same exchange without allocating.
            let peer = 1 - me;
            let mut recv = [RecvOp::new(peer, &mut incoming[peer], None)];
            let name = h.kind.name();
            match eager {
                Some(d) => exchange(
                    &mut self.transport,
                    name,
                    self.timeout,
                    &mut [SendOp::new(peer, &outgoing[peer]), SendOp::new(peer, d)],
                    &mut recv,
                ),
                None => exchange(
                    &mut self.transport,
                    name,
                    self.timeout,
                    &mut [SendOp::new(peer, &outgoing[peer])],
                    &mut recv,
                ),
            }
        } else {
            let mut sends: Vec<SendOp<'_>> = Vec::with_capacity(2 * n);
            for j in (0..n).filter(|j| peer(*j)) {
                sends.push(SendOp::new(j, &outgoing[j]));
                if let Some(d) = eager {
                    sends.push(SendOp::new(j, d));
                }
            }
            let mut recvs: Vec<RecvOp<'_>> = incoming
                .iter_mut()
                .enumerate()
                .filter(|(j, _)| peer(*j))
                .map(|(j, b)| RecvOp::new(j, b, None))
                .collect();
            // The eager data goes out without waiting for anyone: it is small enough (see `EAGER_MAX_BYTES`) to
            // sit in the transport's buffers until the peer reads it after the headers.
            exchange(
                &mut self.transport,
                h.kind.name(),
                self.timeout,
                &mut sends,
                &mut recvs,
            )
        };
        let decoded = r.and_then(|()| {
            for (j, bytes) in incoming.iter().enumerate() {
                if peer(j) {
                    headers[j] = Header::decode(bytes, j)?;
                    eager_len(&headers[j], j)?;
                }
            }
            Ok(())
        });
        self.hdr_out = outgoing;
        self.hdr_in = incoming;
        decoded?;
        let mut eager_in = std::mem::take(&mut self.eager_in);
        eager_in.resize_with(n, Vec::new);
        for (j, hj) in headers.iter().enumerate() {
            if j == me || peer(j) {
                let len = if j == me { 0 } else { eager_len(hj, j)? };
                eager_in[j].clear();
                eager_in[j].resize(len, 0);
            }
        }
        if eager_in
            .iter()
            .enumerate()
            .all(|(j, b)| b.is_empty() || !peer(j))
        {
            self.eager_in = eager_in;
        } else {
            let mut recvs: Vec<RecvOp<'_>> = eager_in
                .iter_mut()
                .enumerate()
                .filter(|(j, b)| peer(*j) && !b.is_empty())
                .map(|(j, b)| RecvOp::new(j, b, None))
                .collect();
            let r = exchange(
                &mut self.transport,
                h.kind.name(),
                self.timeout,
                &mut [],
                &mut recvs,
            );
            drop(recvs);
            self.eager_in = eager_in;
            r?;
        }
        Ok(())
    }

    /// [`negotiate_eager`](Self::negotiate_eager) on a shared-memory board: post this rank's header, its word for
    /// each rank and its eager data in its slot, wait until every rank has posted, and read theirs.
    fn negotiate_board(
        &mut self,
        h: Header,
        pair: &dyn Fn(usize) -> u64,
        eager: Option<&[u8]>,
    ) -> Result<Vec<Header>> {
        let n = self.world.len();
        let me = self.topology.rank;
        let mut pairs = std::mem::take(&mut self.pairs_out);
        pairs.clear();
        pairs.extend((0..n).map(pair));
        let mut eager_in = std::mem::take(&mut self.eager_in);
        eager_in.resize_with(n, Vec::new);
        let timeout = self.timeout;
        let result = (|| {
            let Some(board) = self.transport.shared_board() else {
                return Err(Error::Broken("the shared-memory board went away".into()));
            };
            // Only alltoall has a word per destination (its counts); other operations leave that line alone.
            let with_pairs = h.kind == Kind::Alltoall;
            // SAFETY: every rank numbers its operations 1, 2, 3, ... and posts each one's header here first (see
            // `negotiate_eager`); this rank saw every rank post the previous one, or failed fatally and refuses
            // further operations (`begin`). `pairs` has a word per rank; `eager` is at most EAGER_MAX_BYTES
            // (`allreduce_direct`).
            unsafe {
                board.post(
                    &h.encode(),
                    with_pairs.then_some(&pairs[..]),
                    eager.unwrap_or(&[]),
                )
            };
            board.wait_posted(h.seq, h.kind.name(), timeout)?;
            let mut headers = vec![h; n];
            for j in (0..n).filter(|j| *j != me) {
                // SAFETY: every rank posted `h.seq` (just above) and this rank posts the next operation only after
                // this loop.
                let mut hj = Header::decode(&unsafe { board.header(j, h.seq) }, j)?;
                hj.pair = if hj.kind == Kind::Alltoall {
                    // SAFETY: as above.
                    unsafe { board.pair(j, h.seq) }
                } else {
                    0
                };
                let len = eager_len(&hj, j)?;
                eager_in[j].clear();
                eager_in[j].resize(len, 0);
                // SAFETY: as above; `eager_len` keeps `len` within EAGER_MAX_BYTES.
                unsafe { board.eager(j, h.seq, &mut eager_in[j]) };
                headers[j] = hj;
            }
            eager_in[me].clear();
            Ok(headers)
        })();
        self.pairs_out = pairs;
        self.eager_in = eager_in;
        result
    }

    /// Runs one operation: negotiate, check, then `body` unless this rank's own arguments were bad.
    fn run(
        &mut self,
        h: Header,
        local_error: Option<Error>,
        pair: &dyn Fn(usize) -> u64,
        body: impl FnOnce(&mut Self, &[Header]) -> Result<()>,
    ) -> Result<()> {
        self.run_eager(h, local_error, pair, None, body)
    }

    /// [`run`](Self::run), sending `eager` data right behind the header.
    fn run_eager(
        &mut self,
        mut h: Header,
        local_error: Option<Error>,
        pair: &dyn Fn(usize) -> u64,
        eager: Option<&[u8]>,
        body: impl FnOnce(&mut Self, &[Header]) -> Result<()>,
    ) -> Result<()> {
        h.invalid = local_error.is_some();
        let eager = if h.invalid { None } else { eager };
        h.eager = eager.is_some();
        let result = (|| {
            let headers = self.negotiate_eager(h, pair, eager, false)?;
            if let Some(e) = local_error {
                return Err(e);
            }
            header::check(&self.world, &headers)?;
            body(self, &headers)
        })();
        result.map_err(|e| self.fail(e))
    }

    fn ex(
        &mut self,
        op: &'static str,
        sends: &mut [SendOp<'_>],
        recvs: &mut [RecvOp<'_>],
    ) -> Result<()> {
        exchange(&mut self.transport, op, self.timeout, sends, recvs)
    }

    // ----- algorithms over a group of global ranks; `me` is this rank's index in `group` -----

    fn allreduce_group(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        group: &[usize],
    ) -> Result<()> {
        let n = group.len();
        if n <= 1 || buf.is_empty() {
            return Ok(());
        }
        let esize = dtype.size();
        let count = buf.len() / esize;
        let arena = self.thresholds.allreduce_arena_ranks;
        let how = Combine {
            dtype,
            op,
            timeout: self.timeout,
        };
        // With 3 or more ranks the single copy (when the ranks reach each other's buffers), else the arenas; with
        // 2, the ring and recursive doubling first take what they do best (docs/collective.md, "One pass").
        if arena > 0
            && n >= arena
            && group.len() == self.world.len()
            && let Some(board) = self.transport.shared_board()
        {
            if count >= n && board.allreduce_single_copy(buf, how)? {
                return Ok(());
            }
            return board.allreduce_arena(buf.len(), &mut InPlace(buf), how);
        }
        if buf.len() <= self.thresholds.allreduce_small_bytes || count < n {
            return self.allreduce_recursive_doubling(buf, dtype, op, group);
        }
        if group.len() == self.world.len()
            && let Some(board) = self.transport.shared_board()
            && board.allreduce_single_copy(buf, how)?
        {
            return Ok(());
        }
        // Ring reduce-scatter + allgather, segment by segment on one host: a segment's blocks are read, reduced
        // and sent on while they are still in cache, so each byte of `buf` crosses the memory bus about once each
        // way. Across hosts the network is the bottleneck and one segment saves synchronisations.
        let one_host = group.iter().all(|r| self.hosts[*r] == self.hosts[group[0]]);
        let per_block = (self.chunk_bytes / esize).max(1);
        let seg_elems = if self.chunk_bytes == 0 || !one_host {
            count
        } else {
            per_block.saturating_mul(n)
        };
        for seg in buf.chunks_mut(seg_elems.saturating_mul(esize)) {
            let counts = even_counts(seg.len() / esize, n);
            self.reduce_scatter_ring(seg, &counts, dtype, op, group)?;
            self.allgather_ring(seg, &counts, dtype, group)?;
        }
        Ok(())
    }

    /// The shared-memory board when this rank deposits an allreduce of `len` bytes on it (see
    /// `Board::deposit_room`): 3 ranks or more, one level, not empty, within the board's room, and `len x (ranks -
    /// 1)`, the bytes each rank reads back, within this rank's threshold (the reads grow with the ranks, the wait
    /// saved does not).
    fn deposit_board(&mut self, len: usize) -> Option<&mut dyn Board> {
        let n = self.world.len();
        let reads = len.saturating_mul(n.saturating_sub(1));
        if n < DEPOSIT_MIN_RANKS
            || self.hierarchy.is_some()
            || len == 0
            || reads > self.thresholds.allreduce_deposit_bytes
        {
            return None;
        }
        self.transport
            .shared_board()
            .filter(|b| len <= b.deposit_room())
    }

    /// Reduces every rank's deposit of operation `seq` into `data` (this rank's own on entry), once every rank's
    /// header said it deposited.
    fn reduce_deposits(
        &mut self,
        data: &mut [u8],
        seq: u64,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let me = self.topology.rank;
        let n = self.world.len();
        let Some(board) = self.transport.shared_board() else {
            return Err(Error::Broken("the shared-memory board went away".into()));
        };
        let len = data.len();
        reduce_in_rank_order(data, me, n, dtype, op, |r| {
            // SAFETY: every rank posted `seq` with a deposit of its data (its header says so, and the check found its
            // count equal to this rank's, so `len` bytes); this rank posts `seq + 1` only after this, so none is
            // overwritten meanwhile.
            unsafe { board.deposited(r, seq, len) }
        });
        DEPOSITED.with(|d| d.set(d.get() + 1));
        Ok(())
    }

    /// Whether an allreduce of `len` bytes rides with the header (the direct eager path).
    fn allreduce_direct(&self, len: usize) -> bool {
        let peers = self.world.len().saturating_sub(1);
        len <= EAGER_MAX_BYTES
            && len.saturating_mul(peers) <= self.thresholds.allreduce_direct_bytes
    }

    /// Fingerprint of the settings that pick allreduce algorithms; ranks must agree on it (header `digest`).
    fn allreduce_digest(&self) -> u64 {
        header::digest(&[
            self.thresholds.allreduce_small_bytes,
            self.chunk_bytes,
            self.thresholds.allreduce_arena_ranks,
        ])
    }

    /// Recursive doubling; ranks beyond the largest power of two fold into a partner first.
    fn allreduce_recursive_doubling(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        group: &[usize],
    ) -> Result<()> {
        let n = group.len();
        let me = index_of(group, self.topology.rank);
        let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
        let rem = n - p;
        let red = Some((dtype, op));
        let name = "allreduce";
        if me >= p {
            self.ex(name, &mut [SendOp::new(group[me - p], buf)], &mut [])?;
            return self.ex(name, &mut [], &mut [RecvOp::new(group[me - p], buf, None)]);
        }
        if me < rem {
            self.ex(name, &mut [], &mut [RecvOp::new(group[me + p], buf, red)])?;
        }
        let mut tmp = std::mem::take(&mut self.scratch);
        let mut mask = 1;
        while mask < p {
            let partner = group[me ^ mask];
            tmp.clear();
            tmp.extend_from_slice(buf);
            let r = self.ex(
                name,
                &mut [SendOp::new(partner, &tmp)],
                &mut [RecvOp::new(partner, buf, red)],
            );
            if let Err(e) = r {
                self.scratch = tmp;
                return Err(e);
            }
            mask <<= 1;
        }
        self.scratch = tmp;
        if me < rem {
            self.ex(name, &mut [SendOp::new(group[me + p], buf)], &mut [])?;
        }
        Ok(())
    }

    /// Ring reduce-scatter over blocks `counts`: afterwards block `me` of `buf` holds the full reduction.
    fn reduce_scatter_ring(
        &mut self,
        buf: &mut [u8],
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
        group: &[usize],
    ) -> Result<()> {
        self.ring_pass(buf, counts, dtype, Some(op), group)
    }

    /// Ring allgather over blocks `counts`: block `me` of `buf` is in place; afterwards all are.
    fn allgather_ring(
        &mut self,
        buf: &mut [u8],
        counts: &[usize],
        dtype: DType,
        group: &[usize],
    ) -> Result<()> {
        self.ring_pass(buf, counts, dtype, None, group)
    }

    /// One pass round the ring of `group` over blocks `counts`, `n - 1` steps: at step `s` this rank sends block
    /// `me - s - lag` to its right neighbour and receives block `me - s - lag - 1` from its left one, reduced into
    /// place with `reduce` (reduce-scatter: lag 1, so block `me` is the last to arrive and ends complete) or copied
    /// (allgather: lag 0, starting with its own block).
    fn ring_pass(
        &mut self,
        buf: &mut [u8],
        counts: &[usize],
        dtype: DType,
        reduce: Option<ReduceOp>,
        group: &[usize],
    ) -> Result<()> {
        let n = group.len();
        if n <= 1 {
            return Ok(());
        }
        let me = index_of(group, self.topology.rank);
        let offsets = check::offsets(counts, dtype.size());
        let right = group[(me + 1) % n];
        let left = group[(me + n - 1) % n];
        let lag = usize::from(reduce.is_some());
        let name = if reduce.is_some() {
            "reducescatter"
        } else {
            "allgather"
        };
        for s in 0..n - 1 {
            let send_block = (me + 2 * n - s - lag) % n;
            let recv_block = (send_block + n - 1) % n;
            let (src, dst) = disjoint(
                buf,
                offsets[send_block]..offsets[send_block + 1],
                offsets[recv_block]..offsets[recv_block + 1],
            );
            self.ex(
                name,
                &mut [SendOp::new(right, src)],
                &mut [RecvOp::new(left, dst, reduce.map(|op| (dtype, op)))],
            )?;
        }
        Ok(())
    }

    /// Every rank sends its block straight to every other rank (one round; best for small blocks).
    fn allgather_direct(
        &mut self,
        buf: &mut [u8],
        counts: &[usize],
        dtype: DType,
        group: &[usize],
    ) -> Result<()> {
        let me = index_of(group, self.topology.rank);
        let mut blocks = split_blocks(buf, counts, dtype.size());
        let mine: &mut [u8] = std::mem::take(&mut blocks[me]);
        let mine: &[u8] = mine;
        let mut sends: Vec<SendOp<'_>> = group
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != me)
            .map(|(_, r)| SendOp::new(*r, mine))
            .collect();
        let mut recvs: Vec<RecvOp<'_>> = blocks
            .into_iter()
            .enumerate()
            .filter(|(i, _)| *i != me)
            .map(|(i, b)| RecvOp::new(group[i], b, None))
            .collect();
        self.ex("allgather", &mut sends, &mut recvs)
    }

    fn allgather_group(
        &mut self,
        buf: &mut [u8],
        counts: &[usize],
        dtype: DType,
        group: &[usize],
    ) -> Result<()> {
        if group.len() <= 1 {
            return Ok(());
        }
        if buf.len() <= self.thresholds.allgather_small_bytes || group.len() == 2 {
            self.allgather_direct(buf, counts, dtype, group)
        } else {
            self.allgather_ring(buf, counts, dtype, group)
        }
    }

    /// Binomial tree rooted at `root` (an index into `group`).
    fn broadcast_tree(&mut self, buf: &mut [u8], root: usize, group: &[usize]) -> Result<()> {
        let n = group.len();
        let me = index_of(group, self.topology.rank);
        let vr = (me + n - root) % n;
        let real = |v: usize| group[(v + root) % n];
        let mut mask = 1;
        while mask < n {
            if vr & mask != 0 {
                self.ex(
                    "broadcast",
                    &mut [],
                    &mut [RecvOp::new(real(vr - mask), buf, None)],
                )?;
                break;
            }
            mask <<= 1;
        }
        mask >>= 1;
        let mut sends = Vec::new();
        while mask > 0 {
            if vr + mask < n {
                sends.push(SendOp::new(real(vr + mask), buf));
            }
            mask >>= 1;
        }
        self.ex("broadcast", &mut sends, &mut [])
    }
}

impl<T: Transport> Communicator for P2pCommunicator<T> {
    fn topology(&self) -> Topology {
        self.topology
    }

    fn backend(&self) -> &'static str {
        self.backend
    }

    fn in_shared_memory(&self) -> bool {
        self.transport.whole_job_in_shared_memory()
    }

    /// Through the arenas when the shm board serves the whole job (any rank count, unless the arenas are off):
    /// `io` reads straight into this rank's arena and writes straight out of every rank's, which saves the two
    /// copies through `scratch`. Small allreduces (the direct eager path) and Average go through `scratch`.
    fn allreduce_staged(&mut self, call: StagedAllreduce<'_>) -> Result<()> {
        let StagedAllreduce {
            len,
            dtype,
            op,
            io,
            scratch,
        } = call;
        let n = self.world.len();
        let arenas = n > 1
            && self.thresholds.allreduce_arena_ranks > 0
            && !self.allreduce_direct(len)
            && op != ReduceOp::Average
            && self.hierarchy.is_none()
            && self.transport.shared_board().is_some();
        if !arenas {
            return staged_through(len, io, scratch, |buf| {
                self.allreduce_in_place(buf, dtype, op)
            });
        }
        let (mut h, local) = Header::allreduce(len, dtype, op);
        h.seq = self.begin()?;
        // Distinct from `allreduce_in_place`'s digest: a rank staging while another does not is a mismatch.
        h.digest = header::digest(&[self.allreduce_digest() as usize, STAGED]);
        // Deposits as in `allreduce_in_place`, within the arena path that every rank chose alike: the input read
        // into `scratch` and deposited, the result written from `scratch`; the arenas when a rank did not deposit
        // (they read `io` again: `Staged` allows that).
        if local.is_none()
            && let Some(board) = self.deposit_board(len)
        {
            if scratch.len() < len {
                scratch.resize(len, 0);
            }
            io.read(0, &mut scratch[..len]);
            // SAFETY: as in `allreduce_in_place`.
            unsafe { board.deposit(h.seq, &scratch[..len]) };
            h.deposited = true;
        }
        let seq = h.seq;
        self.run(h, local, &|_| 0, |this, headers| {
            if headers.iter().all(|h| h.deposited) {
                let mine = &mut scratch[..len];
                this.reduce_deposits(mine, seq, dtype, op)?;
                io.write(0, mine);
                return Ok(());
            }
            let how = Combine {
                dtype,
                op,
                timeout: this.timeout,
            };
            match this.transport.shared_board() {
                Some(board) => board.allreduce_arena(len, io, how),
                None => Err(Error::Broken("the shared-memory board went away".into())),
            }
        })
    }

    fn allreduce_in_place(&mut self, data: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let (mut h, local) = Header::allreduce(data.len(), dtype, op);
        h.seq = self.begin()?;
        h.digest = self.allreduce_digest();
        let n = self.world.len();
        // Small messages: send the data with the header to every rank and let each reduce all contributions in
        // rank order (bitwise identical everywhere): one round trip instead of header + algorithm.
        let direct = n > 1 && local.is_none() && self.allreduce_direct(data.len());
        if direct {
            let mut mine = std::mem::take(&mut self.eager_out);
            mine.clear();
            mine.extend_from_slice(data);
            let me = self.topology.rank;
            let r = self.run_eager(h, None, &|_| 0, Some(&mine), |this, _| {
                if let Some((_, cross)) = &this.hierarchy {
                    // Two-level exchange (see `two_level`): the hosts' sums, in host order.
                    this.reduce_hosts(data, dtype, accumulated(op), cross);
                    if op == ReduceOp::Average {
                        finish_average(data, dtype, n);
                    }
                    return Ok(());
                }
                let eager_in = &this.eager_in;
                reduce_in_rank_order(data, me, n, dtype, op, |r| {
                    if r == me { &mine } else { &eager_in[r] }
                });
                Ok(())
            });
            self.eager_out = mine;
            return r;
        }
        // Past the direct size, with more ranks than cores: the data goes on the board with the header (a deposit)
        // when it fits, and the ranks reduce straight out of the deposits once every rank posted: one wait instead
        // of the algorithm's (three for the single copy or the arenas). Each rank decides for itself (the room is
        // its own verdict on the cores, the threshold its own setting); only when every rank deposited are the
        // deposits used, else the data, still in `data`, takes the usual path.
        if local.is_none()
            && let Some(board) = self.deposit_board(data.len())
        {
            // SAFETY: this rank's previous operation saw every rank post `h.seq - 1` (its board wait; a rank whose
            // wait failed is broken and `begin` refuses it), the contract of `post` too; `data` fits the room.
            unsafe { board.deposit(h.seq, data) };
            h.deposited = true;
        }
        let seq = h.seq;
        self.run(h, local, &|_| 0, |this, headers| {
            if headers.iter().all(|h| h.deposited) {
                return this.reduce_deposits(data, seq, dtype, op);
            }
            let sum_op = accumulated(op);
            match this.hierarchy.clone() {
                Some((local, cross)) if data.len() > this.thresholds.allreduce_small_bytes => {
                    let count = data.len() / dtype.size();
                    let counts = even_counts(count, local.len());
                    let li = index_of(&local, this.topology.rank);
                    this.reduce_scatter_ring(data, &counts, dtype, sum_op, &local)?;
                    let offsets = check::offsets(&counts, dtype.size());
                    this.allreduce_group(
                        &mut data[offsets[li]..offsets[li + 1]],
                        dtype,
                        sum_op,
                        &cross,
                    )?;
                    this.allgather_ring(data, &counts, dtype, &local)?;
                }
                _ => {
                    let world = this.world.clone();
                    this.allreduce_group(data, dtype, sum_op, &world)?;
                }
            }
            if op == ReduceOp::Average {
                finish_average(data, dtype, this.world.len());
            }
            Ok(())
        })
    }

    fn allgatherv(&mut self, call: Allgatherv<'_>) -> Result<()> {
        let me = self.topology.rank;
        let n = self.world.len();
        let (h, local) = Header::allgatherv(&call, n, me);
        if local.is_none() {
            call.recv[check::block(call.counts, me, call.dtype.size())].copy_from_slice(call.send);
        }
        self.gather_common(h, call.recv, call.counts, call.dtype, local)
    }

    fn broadcast(&mut self, buf: &mut [u8], dtype: DType, root: usize) -> Result<()> {
        let (mut h, local) = Header::broadcast(buf.len(), root, self.world.len(), dtype);
        h.seq = self.begin()?;
        self.run(h, local, &|_| 0, |this, _| {
            let world = this.world.clone();
            if buf.is_empty() {
                Ok(())
            } else {
                this.broadcast_tree(buf, root, &world)
            }
        })
    }

    fn alltoallv(&mut self, call: Alltoallv<'_>) -> Result<()> {
        let n = self.world.len();
        let me = self.topology.rank;
        let (mut h, local) = Header::alltoallv(&call, n);
        let seq = self.begin()?;
        h.seq = seq;
        let sc: Vec<usize> = call.send_counts.to_vec();
        let pair = move |j: usize| sc.get(j).copied().unwrap_or(0) as u64;
        self.run(h, local, &pair, |this, headers| {
            // Every pair checks the other's count; a second round shares the verdicts so that all ranks agree.
            let mut verdict = Header::new(seq, Kind::Alltoall, call.dtype);
            if let Some(j) =
                (0..n).find(|j| *j != me && headers[*j].pair != call.recv_counts[*j] as u64)
            {
                verdict.invalid = true;
                verdict.root = j as u32;
                verdict.count = headers[j].pair;
                verdict.pair = call.recv_counts[j] as u64;
            }
            let verdicts = this.negotiate(verdict, true)?;
            if let Some((i, v)) = verdicts.iter().enumerate().find(|(_, v)| v.invalid) {
                return Err(Error::Mismatch {
                    rank: v.root as usize,
                    reference: i,
                    detail: format!(
                        "in alltoallv rank {} sends {} elements to rank {i}, which expects {}",
                        v.root, v.count, v.pair
                    ),
                });
            }
            let esize = call.dtype.size();
            let soff = check::offsets(call.send_counts, esize);
            let mut blocks = split_blocks(call.recv, call.recv_counts, esize);
            blocks[me].copy_from_slice(&call.send[soff[me]..soff[me + 1]]);
            let mut sends: Vec<SendOp<'_>> = (0..n)
                .filter(|j| *j != me)
                .map(|j| SendOp::new(j, &call.send[soff[j]..soff[j + 1]]))
                .collect();
            let mut recvs: Vec<RecvOp<'_>> = blocks
                .into_iter()
                .enumerate()
                .filter(|(j, _)| *j != me)
                .map(|(j, b)| RecvOp::new(j, b, None))
                .collect();
            this.ex("alltoall", &mut sends, &mut recvs)
        })
    }

    fn reducescatter(&mut self, call: Reducescatter<'_>) -> Result<()> {
        let n = self.world.len();
        let me = self.topology.rank;
        let (mut h, local) = Header::reducescatter(&call, n, me);
        h.seq = self.begin()?;
        self.run(h, local, &|_| 0, |this, _| {
            let sum_op = accumulated(call.op);
            let mut work = std::mem::take(&mut this.scratch);
            work.clear();
            work.extend_from_slice(call.send);
            let world = this.world.clone();
            let r = this.reduce_scatter_ring(&mut work, call.counts, call.dtype, sum_op, &world);
            if r.is_ok() {
                let off = check::offsets(call.counts, call.dtype.size());
                call.recv.copy_from_slice(&work[off[me]..off[me + 1]]);
                if call.op == ReduceOp::Average {
                    finish_average(call.recv, call.dtype, n);
                }
            }
            this.scratch = work;
            r
        })
    }

    fn barrier(&mut self) -> Result<()> {
        let seq = self.begin()?;
        // The header exchange is itself an all-to-all handshake, so it is the whole barrier.
        self.run(
            Header::new(seq, Kind::Barrier, DType::U8),
            None,
            &|_| 0,
            |_, _| Ok(()),
        )
    }

    /// Takes part in the header exchange only to tell every rank that this rank's arguments were invalid.
    fn refuse(&mut self, op: &'static str, dtype: DType, error: Error) -> Error {
        let Some(kind) = Kind::named(op) else {
            return error;
        };
        let seq = match self.begin() {
            Ok(seq) => seq,
            Err(e) => return e,
        };
        let mut h = Header::new(seq, kind, dtype);
        h.invalid = true;
        match self.negotiate(h, false) {
            Ok(_) => error,
            Err(e) => self.fail(e),
        }
    }
}

impl<T: Transport> P2pCommunicator<T> {
    /// Allgather(v) of `counts` into `buf`, whose own block is in place, with header `h` and this rank's verdict
    /// `local` on its arguments.
    fn gather_common(
        &mut self,
        mut h: Header,
        buf: &mut [u8],
        counts: &[usize],
        dtype: DType,
        local: Option<Error>,
    ) -> Result<()> {
        h.seq = self.begin()?;
        self.run(h, local, &|_| 0, |this, _| {
            let world = this.world.clone();
            this.allgather_group(buf, counts, dtype, &world)
        })
    }
}

/// Reduces every rank's contribution (`contribution(r)`, this rank's `me` included) into `data`, in rank order, so
/// that every rank computes the same bits; an average is divided at the end. `data` holds this rank's on entry.
fn reduce_in_rank_order<'a>(
    data: &mut [u8],
    me: usize,
    n: usize,
    dtype: DType,
    op: ReduceOp,
    contribution: impl Fn(usize) -> &'a [u8],
) {
    let sum_op = accumulated(op);
    for r in 0..n {
        let src = contribution(r);
        if r == 0 {
            // Rank 0's own data is already in place.
            if me != 0 {
                data.copy_from_slice(src);
            }
        } else {
            crate::reduce::reduce_into(data, src, dtype, sum_op);
        }
    }
    if op == ReduceOp::Average {
        finish_average(data, dtype, n);
    }
}

/// The eager data rank `j` announced with its header `h`, in bytes; more than the protocol allows means the peer
/// does not speak it.
fn eager_len(h: &Header, j: usize) -> Result<usize> {
    if !h.eager {
        return Ok(0);
    }
    let len = h.count.saturating_mul(h.dtype.size() as u64);
    if len > EAGER_MAX_BYTES as u64 {
        return Err(Error::PeerLost {
            rank: j,
            reason: "it announced more eager data than the protocol allows".into(),
        });
    }
    Ok(len as usize)
}

fn index_of(group: &[usize], rank: usize) -> usize {
    group.iter().position(|r| *r == rank).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use crate::config::Thresholds;
    use crate::testing::{Backend, LocalJob};
    use crate::types::{DType, ReduceOp};

    fn value(rank: usize, i: usize) -> i32 {
        ((rank * 31 + i * 7) % 11) as i32 - 5
    }

    /// Large allreduces run the ring segment by segment; odd segment and block sizes (and a last segment with
    /// fewer elements than ranks) still give the reference result on every rank, in and out of place.
    #[test]
    fn segmented_ring_allreduce_matches_the_reference() {
        let count = 5003;
        let small = Thresholds {
            allreduce_direct_bytes: 0,
            allreduce_small_bytes: 64,
            ..Thresholds::default()
        };
        for (backend, n) in [
            (Backend::Shm, 2),
            (Backend::Shm, 3),
            (Backend::Tcp, 4),
            (Backend::Hierarchical, 4),
        ] {
            for (chunk, op) in [
                (1000, ReduceOp::Sum),
                (4, ReduceOp::Max),
                (0, ReduceOp::Average),
            ] {
                let results = LocalJob::new(n, backend)
                    .thresholds(small)
                    .allreduce_chunk_bytes(chunk)
                    .run(|mut comm| {
                        let r = comm.rank();
                        let f: Vec<u8> = (0..count)
                            .flat_map(|i| (value(r, i) as f32).to_ne_bytes())
                            .collect();
                        let mut out_f = vec![0u8; f.len()];
                        comm.allreduce(&f, &mut out_f, DType::F32, op).unwrap();
                        let mut ints: Vec<u8> =
                            (0..count).flat_map(|i| value(r, i).to_ne_bytes()).collect();
                        comm.allreduce_in_place(&mut ints, DType::I32, op).unwrap();
                        (out_f, ints)
                    })
                    .unwrap();
                for i in 0..count {
                    let vals: Vec<i32> = (0..n).map(|r| value(r, i)).collect();
                    let want = match op {
                        ReduceOp::Max => *vals.iter().max().unwrap(),
                        ReduceOp::Average => vals.iter().sum::<i32>() / n as i32,
                        _ => vals.iter().sum::<i32>(),
                    };
                    let want_f = match op {
                        ReduceOp::Average => vals.iter().sum::<i32>() as f32 / n as f32,
                        _ => want as f32,
                    };
                    for (rank, (f, ints)) in results.iter().enumerate() {
                        let at = 4 * i..4 * i + 4;
                        let got_f = f32::from_ne_bytes(f[at.clone()].try_into().unwrap());
                        let got_i = i32::from_ne_bytes(ints[at].try_into().unwrap());
                        assert!(
                            (got_f - want_f).abs() < 1e-5,
                            "{backend:?} {n} ranks chunk {chunk} {op:?}: f32 element {i} on rank {rank} is {got_f}, want {want_f}"
                        );
                        assert_eq!(
                            got_i, want,
                            "{backend:?} {n} ranks chunk {chunk} {op:?}: i32 element {i} on rank {rank}"
                        );
                    }
                }
            }
        }
    }

    /// Ranks that segment large allreduces differently would mix up data: every rank gets a mismatch naming the
    /// setting, and the communicators stay usable.
    #[test]
    fn different_chunk_settings_are_a_mismatch() {
        use crate::communicator::Communicator;
        use crate::error::Error;
        use crate::shm::{ShmSegment, ShmTransport};

        let seg = ShmSegment::create_anonymous(2, 1 << 16).unwrap();
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = [4096, 8192]
                .into_iter()
                .enumerate()
                .map(|(r, chunk)| {
                    let seg = seg.clone();
                    s.spawn(move || {
                        let t = ShmTransport::attach(seg, r).unwrap();
                        let mut c = super::P2pCommunicator::new(
                            t,
                            "shm",
                            vec![0, 0],
                            std::time::Duration::from_secs(20),
                        );
                        c.set_thresholds(Thresholds::default());
                        c.set_allreduce_chunk_bytes(chunk);
                        let mut buf = vec![0u8; 1 << 20];
                        let first = c.allreduce_in_place(&mut buf, DType::F32, ReduceOp::Sum);
                        c.set_allreduce_chunk_bytes(4096);
                        let second = c.allreduce_in_place(&mut buf, DType::F32, ReduceOp::Sum);
                        (first, second)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (first, second) in results {
            match first {
                Err(Error::Mismatch { detail, .. }) => {
                    assert!(detail.contains("HVD_ALLREDUCE_CHUNK_BYTES"), "{detail}")
                }
                other => panic!("expected a mismatch, got {other:?}"),
            }
            assert!(second.is_ok(), "{second:?}");
        }
    }
}
