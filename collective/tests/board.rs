//! The shm transport's [`Board`] through the public trait (what a second shared-memory board, such as CUDA IPC,
//! must also do): every rank reads exactly what each other rank posted, operation after operation (the slots
//! alternate), the arena allreduce gives every rank the sum, and a segment that holds only part of the job offers
//! no board.

use std::time::Duration;

use hvd_collective::board::{Board, Combine};
use hvd_collective::shm::{ShmSegment, ShmTransport};
use hvd_collective::transport::Transport;
use hvd_collective::{DType, InPlace, ReduceOp};

const TIMEOUT: Duration = Duration::from_secs(20);

/// What rank `r` posts for operation `seq`: a header whose bytes after the sequence number name both, a word for
/// each rank `j`, and `r + 1` bytes of eager data.
fn post_of(r: usize, seq: u64, n: usize) -> ([u8; 40], Vec<u64>, Vec<u8>) {
    let mut h = [0u8; 40];
    h[..8].copy_from_slice(&seq.to_ne_bytes());
    for (i, b) in h[8..].iter_mut().enumerate() {
        *b = (r * 31 + seq as usize * 7 + i) as u8;
    }
    let pairs = (0..n)
        .map(|j| seq * 1000 + r as u64 * 10 + j as u64)
        .collect();
    let eager = (0..=r)
        .map(|i| (seq as usize * 13 + r * 5 + i) as u8)
        .collect();
    (h, pairs, eager)
}

/// Runs `f` on every rank of an in-process `n`-rank segment, each on its own thread, with the rank's board.
fn on_every_rank<R: Send>(n: usize, f: impl Fn(usize, &mut dyn Board) -> R + Sync) -> Vec<R> {
    let seg = ShmSegment::create_anonymous(n, 1 << 16).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let (seg, f) = (seg.clone(), &f);
                s.spawn(move || {
                    let mut t = ShmTransport::attach(seg, r).unwrap();
                    t.wait_attached(TIMEOUT).unwrap();
                    assert!(t.whole_job_in_shared_memory());
                    let board = t
                        .shared_board()
                        .expect("a whole-job segment offers its board");
                    f(r, board)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn every_rank_reads_what_each_other_rank_posted() {
    let n = 3;
    let ops = 5u64;
    let seen = on_every_rank(n, |r, board| {
        let mut seen = Vec::new();
        for seq in 1..=ops {
            let (h, pairs, eager) = post_of(r, seq, n);
            // SAFETY: operations go in order on every rank, each posted after every rank posted the previous one
            // (wait_posted below); `pairs` has a word per rank and `eager` is far below 2 KiB.
            unsafe { board.post(&h, Some(&pairs), &eager) };
            board.wait_posted(seq, "test", TIMEOUT).unwrap();
            for j in (0..n).filter(|j| *j != r) {
                let mut e = vec![0u8; j + 1];
                // SAFETY: every rank posted `seq` (wait_posted) and this rank posts `seq + 1` only after reading.
                let (hj, pj) = unsafe {
                    board.eager(j, seq, &mut e);
                    (board.header(j, seq), board.pair(j, seq))
                };
                seen.push((seq, j, hj, pj, e));
            }
        }
        seen
    });
    for (r, seen) in seen.iter().enumerate() {
        assert_eq!(seen.len(), ops as usize * (n - 1));
        for (seq, j, h, pair, eager) in seen {
            let (want_h, want_pairs, want_eager) = post_of(*j, *seq, n);
            assert_eq!(
                *h, want_h,
                "rank {r} read rank {j}'s header of operation {seq}"
            );
            assert_eq!(
                *pair, want_pairs[r],
                "rank {r} read rank {j}'s word of operation {seq}"
            );
            assert_eq!(
                *eager, want_eager,
                "rank {r} read rank {j}'s eager data of operation {seq}"
            );
        }
    }
}

#[test]
fn the_arena_allreduce_sums_every_rank_s_buffer() {
    let n = 3;
    // More than one arena chunk (a chunk is at most half of the 64 KiB ring), with an uneven last one.
    let count = 40_003;
    let value = |r: usize, i: usize| ((r * 7 + i * 3) % 19) as f32 - 9.0;
    let out = on_every_rank(n, |r, board| {
        let mut buf: Vec<u8> = (0..count).flat_map(|i| value(r, i).to_ne_bytes()).collect();
        let len = buf.len();
        board
            .allreduce_arena(
                len,
                &mut InPlace(&mut buf),
                Combine {
                    dtype: DType::F32,
                    op: ReduceOp::Sum,
                    timeout: TIMEOUT,
                },
            )
            .unwrap();
        buf
    });
    for (r, buf) in out.iter().enumerate() {
        for i in 0..count {
            let got = f32::from_ne_bytes(buf[4 * i..4 * i + 4].try_into().unwrap());
            let want: f32 = (0..n).map(|q| value(q, i)).sum();
            assert_eq!(got, want, "element {i} on rank {r}");
        }
    }
}

#[test]
fn a_segment_holding_part_of_the_job_offers_no_board() {
    // This host's two ranks are ranks 1 and 3 of the job: the board's rank numbers would not be the job's.
    let seg = ShmSegment::create_anonymous(2, 1 << 16).unwrap();
    let mut t = ShmTransport::attach_mapped(seg, 0, vec![1, 3]).unwrap();
    assert!(!t.whole_job_in_shared_memory());
    assert!(t.shared_board().is_none());
}
