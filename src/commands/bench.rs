//! `hvd bench`: benchmarks of the collective runtime.
//!
//! `hvd bench allreduce` sweeps f32 allreduce sizes on N ranks and prints, per size, the median and p99 latency
//! (the slowest rank of each iteration counts) and the algorithm and bus bandwidth (busbw = algbw x 2(n-1)/n).
//! Ranks are threads of this process unless the environment says this process is one rank of a job (`hvd run`,
//! `mpirun`, `srun`): then every rank joins the job and rank 0 prints. `--processes` starts the ranks as worker
//! processes of this binary instead (joined through a rendezvous server of its own, each pinned to a CPU), and
//! `--shared-buffers` allocates every rank's buffers as shared buffers (`hvd_collective::shm::SharedBuffer`, what
//! `hvd_alloc` and `hvd.empty` return), which ranks in several processes read one another's with plain loads.
//! `--tensors N` splits each size into N tensors of private memory allreduced as one fused group (what the
//! engine does with a group of small gradients: `Communicator::allreduce_staged`).

use std::io::Write;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use hvd_collective::bootstrap::{self, BackendChoice, JobEnv};
use hvd_collective::env_vars as cenv;
use hvd_collective::shm::SharedBuffer;
use hvd_collective::testing::{Backend, LocalJob, pin_to_cpu};
use hvd_collective::{Communicator, DType, ReduceOp, StagedAllreduce};

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
    /// Run the ranks as worker processes of this binary on this host (each pinned to a CPU unless `--no-pin`)
    /// instead of threads.
    #[arg(long)]
    pub processes: bool,
    /// Allocate the buffers as shared buffers (`hvd_alloc`, `hvd.empty`): between processes the single copy then
    /// reads the peers' buffers with plain loads.
    #[arg(long)]
    pub shared_buffers: bool,
    /// Split each size into this many tensors (of private memory) allreduced as one fused group, as the engine
    /// fuses a group of small gradients (1: one buffer).
    #[arg(long, default_value_t = 1)]
    pub tensors: usize,
    /// (Set by `--processes` for its workers) the CPU index to pin this process to.
    #[arg(long, hide = true)]
    pub pin_cpu: Option<usize>,
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
    mode: &Mode,
) -> Result<Vec<Row>, hvd_collective::Error> {
    let mut rows = Vec::new();
    for &bytes in sizes {
        let iters = iterations(bytes, fixed);
        if mode.tensors > 1 {
            rows.push(sweep_group(comm, bytes, iters, mode.tensors)?);
            continue;
        }
        let (mut own, mut in_shared);
        let buf: &mut [u8] = match mode.shared {
            true => {
                in_shared = SharedBuffer::new(bytes)?;
                &mut in_shared
            }
            false => {
                own = vec![0u8; bytes];
                &mut own
            }
        };
        for c in buf.chunks_exact_mut(4) {
            c.copy_from_slice(&1.0f32.to_ne_bytes());
        }
        // Warm up long enough for small sizes (the first one runs right after the ranks start).
        let warmup = (iters / 5).clamp(1, 200);
        for _ in 0..warmup {
            comm.allreduce_in_place(buf, DType::F32, ReduceOp::Sum)?;
        }
        comm.barrier()?;
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            comm.allreduce_in_place(buf, DType::F32, ReduceOp::Sum)?;
            times.push(t.elapsed().as_secs_f64());
        }
        rows.push(slowest(comm, bytes, times)?);
    }
    Ok(rows)
}

/// The row of one size from this rank's times: per iteration the slowest rank's time counts.
fn slowest(
    comm: &mut dyn Communicator,
    bytes: usize,
    times: Vec<f64>,
) -> Result<Row, hvd_collective::Error> {
    let n = comm.size();
    let iters = times.len();
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
    let q =
        |p: f64| Duration::from_secs_f64(worst[((worst.len() - 1) as f64 * p).round() as usize]);
    Ok(Row {
        bytes,
        iters,
        median: q(0.5),
        p99: q(0.99),
    })
}

/// Tensors of one fused group, in place (their own memory, back to back in the group's order).
struct Group(Vec<Vec<u8>>);

impl Group {
    /// Calls `f` with each tensor's part of the group's bytes `offset..offset + len` and that part's range in the
    /// caller's slice.
    fn each(
        &mut self,
        offset: usize,
        len: usize,
        mut f: impl FnMut(&mut [u8], std::ops::Range<usize>),
    ) {
        let mut at = 0;
        for t in &mut self.0 {
            let (start, end) = (offset.max(at), (offset + len).min(at + t.len()));
            if start < end {
                f(&mut t[start - at..end - at], start - offset..end - offset);
            }
            at += t.len();
        }
    }
}

impl hvd_collective::Staged for Group {
    fn read(&mut self, offset: usize, dst: &mut [u8]) {
        self.each(offset, dst.len(), |t, r| dst[r].copy_from_slice(t));
    }

    fn write(&mut self, offset: usize, src: &[u8]) {
        self.each(offset, src.len(), |t, r| t.copy_from_slice(&src[r]));
    }
}

/// One size as `tensors` f32 tensors (the last takes the remainder) allreduced as one fused group.
fn sweep_group(
    comm: &mut dyn Communicator,
    bytes: usize,
    iters: usize,
    tensors: usize,
) -> Result<Row, hvd_collective::Error> {
    let elems = bytes / 4;
    let per = (elems / tensors).max(1);
    let mut group = Group(Vec::with_capacity(tensors.min(elems.max(1))));
    let mut left = elems;
    while left > 0 {
        let take = if group.0.len() + 1 == tensors {
            left
        } else {
            per.min(left)
        };
        group.0.push(1.0f32.to_ne_bytes().repeat(take));
        left -= take;
    }
    let mut scratch = Vec::new();
    let mut once = |comm: &mut dyn Communicator| {
        comm.allreduce_staged(StagedAllreduce {
            len: elems * 4,
            dtype: DType::F32,
            op: ReduceOp::Sum,
            io: &mut group,
            scratch: &mut scratch,
        })
    };
    for _ in 0..(iters / 5).clamp(1, 200) {
        once(comm)?;
    }
    comm.barrier()?;
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        once(comm)?;
        times.push(t.elapsed().as_secs_f64());
    }
    slowest(comm, elems * 4, times)
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}KiB", b >> 10),
        b => format!("{b}B"),
    }
}

/// How the ranks ran, for the output.
struct Mode {
    processes: bool,
    shared: bool,
    tensors: usize,
}

fn print_rows(rows: &[Row], n: usize, backend: &str, json: bool, mode: &Mode) {
    let mut out = std::io::stdout().lock();
    let ranks_are = if mode.processes {
        "processes"
    } else {
        "threads"
    };
    let buffers = match (mode.tensors, mode.shared) {
        (t, _) if t > 1 => format!("{t} tensors fused"),
        (_, true) => "shared buffers".into(),
        (_, false) => "private buffers".into(),
    };
    if !json {
        let _ = writeln!(
            out,
            "# hvd allreduce f32, backend {backend}, {n} ranks as {ranks_are}, {buffers} (median/p99 of the slowest rank)"
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
                "backend": backend, "ranks": n, "ranks_are": ranks_are,
                "buffers": if mode.shared { "shared" } else { "private" }, "tensors": mode.tensors,
                "bytes": r.bytes, "iters": r.iters,
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
    if a.tensors == 0 {
        return Err(Failure::usage("`--tensors` must be at least 1"));
    }
    if a.processes && JobEnv::from_env().is_err() {
        return run_processes(&a);
    }
    if let Some(cpu) = a.pin_cpu {
        pin_to_cpu(cpu);
    }
    let mode = Mode {
        processes: a.processes || JobEnv::from_env().is_ok(),
        shared: a.shared_buffers,
        tensors: a.tensors,
    };
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
        let rows = sweep(comm.as_mut(), &sizes, a.iters, &mode).map_err(failed)?;
        if comm.rank() == 0 {
            print_rows(&rows, comm.size(), comm.backend(), a.json, &mode);
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
        .run(|mut comm| {
            sweep(comm.as_mut(), &sizes, a.iters, &mode).map(|rows| (rows, comm.backend()))
        })
        .map_err(failed)?;
    let (rows, name) = results
        .into_iter()
        .next()
        .unwrap_or_else(|| Ok((Vec::new(), "")))
        .map_err(failed)?;
    print_rows(&rows, a.workers, name, a.json, &mode);
    Ok(Status::Success)
}

/// `--processes`: starts `workers` copies of this command as the ranks of a one-host job (a rendezvous server of
/// this process on loopback, a fresh token), waits for all and fails when one did. Rank 0 prints.
fn run_processes(a: &AllreduceArgs) -> CommandResult {
    if a.workers == 0 {
        return Err(Failure::usage("`--workers` must be at least 1"));
    }
    let mut secret = [0u8; 16];
    std::io::Read::read_exact(
        &mut std::fs::File::open("/dev/urandom")
            .map_err(|e| Failure::from_error_in(Status::Failure, "open /dev/urandom", &e))?,
        &mut secret,
    )
    .map_err(|e| Failure::from_error_in(Status::Failure, "read /dev/urandom", &e))?;
    let token: String = secret.iter().map(|b| format!("{b:02x}")).collect();
    let server =
        hvd_launcher::rendezvous::RendezvousServer::start_on_loopback(&token).map_err(|e| {
            Failure::from_error_in(
                Status::Failure,
                "start the benchmark's rendezvous server",
                &e,
            )
        })?;
    let exe = std::env::current_exe()
        .map_err(|e| Failure::from_error_in(Status::Failure, "find this program", &e))?;
    let mut args: Vec<String> = vec![
        "bench".into(),
        "allreduce".into(),
        "--backend".into(),
        a.backend.clone(),
        "--min-bytes".into(),
        a.min_bytes.clone(),
        "--max-bytes".into(),
        a.max_bytes.clone(),
        "--processes".into(),
    ];
    if let Some(i) = a.iters {
        args.extend(["--iters".into(), i.to_string()]);
    }
    if a.json {
        args.push("--json".into());
    }
    if a.shared_buffers {
        args.push("--shared-buffers".into());
    }
    args.extend(["--tensors".into(), a.tensors.to_string()]);
    let mut children = Vec::with_capacity(a.workers);
    for rank in 0..a.workers {
        let mut cmd = std::process::Command::new(&exe);
        cmd.args(&args)
            .env(cenv::HVD_RANK, rank.to_string())
            .env(cenv::HVD_SIZE, a.workers.to_string())
            .env(cenv::HVD_RENDEZVOUS, server.addr().to_string())
            .env(cenv::HVD_JOB_TOKEN, &token)
            .env(cenv::HVD_HOSTNAME, "bench");
        if !a.no_pin {
            cmd.args(["--pin-cpu", &rank.to_string()]);
        }
        let child = cmd
            .spawn()
            .map_err(|e| Failure::from_error_in(Status::Failure, "start a benchmark worker", &e))?;
        children.push(child);
    }
    let mut failed_ranks = Vec::new();
    for (rank, mut c) in children.into_iter().enumerate() {
        match c.wait() {
            Ok(s) if s.success() => {}
            _ => failed_ranks.push(rank),
        }
    }
    drop(server);
    match failed_ranks.is_empty() {
        true => Ok(Status::Success),
        false => Err(Failure::new(
            Status::Failure,
            miette::miette!("benchmark workers {failed_ranks:?} failed (their errors are above)"),
        )),
    }
}
