//! `hvd bench`: benchmarks of the collective runtime.
//!
//! `hvd bench allreduce` sweeps f32 allreduce sizes on N ranks and prints, per size, the median and p99 latency
//! (the slowest rank of each iteration counts) and the algorithm and bus bandwidth (busbw = algbw x 2(n-1)/n).
//! Ranks are threads of this process unless the environment says this process is one rank of a job (`hvd run`,
//! `mpirun`, `srun`): then every rank joins the job and rank 0 prints.

use std::io::Write;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use hvd_collective::bootstrap::{self, BackendChoice, JobEnv};
use hvd_collective::testing::{Backend, LocalJob};
use hvd_collective::{Communicator, DType, ReduceOp};

use crate::exit::{CommandResult, Failure, Status};

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub what: BenchWhat,
}

#[derive(Debug, Subcommand)]
pub enum BenchWhat {
    /// Allreduce latency and bandwidth of f32 buffers, 4 B to 256 MiB.
    Allreduce(AllreduceArgs),
}

#[derive(Debug, Args)]
pub struct AllreduceArgs {
    /// Number of ranks (threads of this process; ignored when this process is one rank of a launched job).
    #[arg(long, short = 'n', default_value_t = 2)]
    pub workers: usize,
    /// Communicator: shm, tcp, hierarchical, mpi (run under mpirun) or nccl.
    #[arg(long, default_value = "shm")]
    pub backend: String,
    /// Smallest message, in bytes (suffixes KiB, MiB, GiB allowed).
    #[arg(long, default_value = "4")]
    pub min_bytes: String,
    /// Largest message, in bytes.
    #[arg(long, default_value = "256MiB")]
    pub max_bytes: String,
    /// Iterations per size (default: 1000 for small sizes down to 5 for the largest).
    #[arg(long)]
    pub iters: Option<usize>,
    /// Do not pin in-process rank threads to CPUs (pinned by default, like `mpirun --bind-to core`).
    #[arg(long)]
    pub no_pin: bool,
    /// Print one JSON object per size instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: BenchArgs) -> CommandResult {
    match args.what {
        BenchWhat::Allreduce(a) => allreduce(a),
    }
}

fn parse_size(s: &str) -> Result<usize, Failure> {
    let t = s.trim();
    let (num, mult) = [
        ("GiB", 1usize << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
        ("B", 1),
    ]
    .iter()
    .find_map(|(suf, m)| t.strip_suffix(suf).map(|n| (n, *m)))
    .unwrap_or((t, 1));
    num.trim()
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| Failure::usage(format!("`{s}` is not a size (examples: 4, 64KiB, 256MiB)")))
}

/// One size's result, the same on every rank.
struct Row {
    bytes: usize,
    iters: usize,
    median: Duration,
    p99: Duration,
}

fn sizes(min: usize, max: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = min.max(4) / 4 * 4;
    while s <= max {
        v.push(s);
        s *= 4;
    }
    v
}

fn iterations(bytes: usize, fixed: Option<usize>) -> usize {
    fixed.unwrap_or_else(|| ((512usize << 20) / bytes.max(1)).clamp(5, 1000))
}

/// Runs the sweep on one rank. Every rank returns the same rows: per iteration the slowest rank's time counts.
fn sweep(
    comm: &mut dyn Communicator,
    sizes: &[usize],
    fixed: Option<usize>,
) -> Result<Vec<Row>, hvd_collective::Error> {
    let mut rows = Vec::new();
    let n = comm.size();
    for &bytes in sizes {
        let iters = iterations(bytes, fixed);
        let mut buf = vec![0u8; bytes];
        for c in buf.chunks_exact_mut(4) {
            c.copy_from_slice(&1.0f32.to_ne_bytes());
        }
        // Warm up long enough for small sizes (the first one runs right after the ranks start).
        let warmup = (iters / 5).clamp(1, 200);
        for _ in 0..warmup {
            comm.allreduce_in_place(&mut buf, DType::F32, ReduceOp::Sum)?;
        }
        comm.barrier()?;
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            comm.allreduce_in_place(&mut buf, DType::F32, ReduceOp::Sum)?;
            times.push(t.elapsed().as_secs_f64());
        }
        // Max over ranks, per iteration.
        let mine: Vec<u8> = times.iter().flat_map(|t| t.to_ne_bytes()).collect();
        let mut all = vec![0u8; mine.len() * n];
        comm.allgather(&mine, &mut all, DType::F64)?;
        let mut worst = vec![0f64; iters];
        for rank_times in all.chunks_exact(mine.len().max(1)) {
            for (w, c) in worst.iter_mut().zip(rank_times.chunks_exact(8)) {
                *w = w.max(f64::from_ne_bytes(c.try_into().unwrap_or([0; 8])));
            }
        }
        worst.sort_by(f64::total_cmp);
        let q = |p: f64| {
            Duration::from_secs_f64(worst[((worst.len() - 1) as f64 * p).round() as usize])
        };
        rows.push(Row {
            bytes,
            iters,
            median: q(0.5),
            p99: q(0.99),
        });
    }
    Ok(rows)
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}KiB", b >> 10),
        b => format!("{b}B"),
    }
}

fn print_rows(rows: &[Row], n: usize, backend: &str, json: bool) {
    let mut out = std::io::stdout().lock();
    if !json {
        let _ = writeln!(
            out,
            "# hvd allreduce f32, backend {backend}, {n} ranks (median/p99 of the slowest rank)"
        );
        let _ = writeln!(
            out,
            "{:>10} {:>6} {:>12} {:>12} {:>12} {:>12}",
            "size", "iters", "median_us", "p99_us", "algbw_GB/s", "busbw_GB/s"
        );
    }
    for r in rows {
        let secs = r.median.as_secs_f64();
        let algbw = if secs > 0.0 {
            r.bytes as f64 / secs / 1e9
        } else {
            0.0
        };
        let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
        if json {
            let v = serde_json::json!({
                "backend": backend, "ranks": n, "bytes": r.bytes, "iters": r.iters,
                "median_us": secs * 1e6, "p99_us": r.p99.as_secs_f64() * 1e6,
                "algbw_gbps": algbw, "busbw_gbps": busbw,
            });
            let _ = writeln!(out, "{v}");
        } else {
            let _ = writeln!(
                out,
                "{:>10} {:>6} {:>12.2} {:>12.2} {:>12.3} {:>12.3}",
                human(r.bytes),
                r.iters,
                secs * 1e6,
                r.p99.as_secs_f64() * 1e6,
                algbw,
                busbw
            );
        }
    }
}

fn failed(e: hvd_collective::Error) -> Failure {
    Failure::from_error_in(Status::Failure, "allreduce benchmark failed", &e)
}

fn allreduce(a: AllreduceArgs) -> CommandResult {
    let min = parse_size(&a.min_bytes)?;
    let max = parse_size(&a.max_bytes)?;
    let sizes = sizes(min, max);
    if sizes.is_empty() {
        return Err(Failure::usage(format!(
            "no size between {min} and {max} bytes"
        )));
    }
    let choice: BackendChoice = a
        .backend
        .parse()
        .map_err(|e| Failure::from_error(Status::Usage, &e))?;
    let launched = JobEnv::from_env().is_ok();
    if launched || matches!(choice, BackendChoice::Mpi | BackendChoice::Nccl) {
        // One rank of a job: join it, measure, rank 0 prints.
        let job = JobEnv::from_env().map_err(|e| Failure::from_error(Status::Usage, &e))?;
        let mut comm = if choice == BackendChoice::Mpi {
            hvd_collective::mpi_backend::connect()
        } else {
            let timeout = hvd_collective::config::timeout_from_env()
                .map_err(|e| Failure::from_error(Status::Usage, &e))?;
            bootstrap::connect(&job, choice, timeout)
        }
        .map_err(failed)?;
        let rows = sweep(comm.as_mut(), &sizes, a.iters).map_err(failed)?;
        if comm.rank() == 0 {
            print_rows(&rows, comm.size(), comm.backend(), a.json);
        }
        return Ok(Status::Success);
    }
    let backend = match choice {
        BackendChoice::Tcp => Backend::Tcp,
        BackendChoice::Hierarchical => Backend::Hierarchical,
        _ => Backend::Shm,
    };
    if a.workers == 0 {
        return Err(Failure::usage("`--workers` must be at least 1"));
    }
    let results = LocalJob::new(a.workers, backend)
        .pin_threads(!a.no_pin)
        .run(|mut comm| sweep(comm.as_mut(), &sizes, a.iters).map(|rows| (rows, comm.backend())))
        .map_err(failed)?;
    let (rows, name) = results
        .into_iter()
        .next()
        .unwrap_or_else(|| Ok((Vec::new(), "")))
        .map_err(failed)?;
    print_rows(&rows, a.workers, name, a.json);
    Ok(Status::Success)
}
