//! `hvd doctor`: what this machine offers for running jobs (CPUs, GPUs, MPI, NCCL, Slurm, Kubernetes, Spark).
//! Every probe runs external tools with a time limit and reports what it found; nothing here fails.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

/// One thing looked for.
#[derive(Debug, Clone, Serialize)]
pub struct Probe {
    /// What was looked for, e.g. `GPUs`.
    pub name: &'static str,
    /// Whether it is available.
    pub found: bool,
    /// Versions, counts, or why it is missing.
    pub detail: String,
}

const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs `program args` with a time limit; returns stdout + stderr when it ran (any exit status), `None` when it is
/// not installed or did not finish in time.
fn output(program: &str, args: &[&str]) -> Option<String> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .spawn()
        .ok()?;
    let mut stdout = child.stdout.take()?;
    let mut stderr = child.stderr.take()?;
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + PROBE_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
    let mut text = out.join().unwrap_or_default();
    text.push_str(&err.join().unwrap_or_default());
    Some(text)
}

fn first_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("")
        .to_owned()
}

fn probe(name: &'static str, found: bool, detail: impl Into<String>) -> Probe {
    Probe {
        name,
        found,
        detail: detail.into(),
    }
}

/// Runs every probe.
pub fn probes() -> Vec<Probe> {
    vec![
        cpus(),
        memory(),
        gpus(),
        mpi("mpirun"),
        nccl(),
        slurm(),
        kubectl(),
        java(),
        pyspark(),
        python(),
    ]
}

fn cpus() -> Probe {
    let n = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|r| r.trim_start_matches([' ', '\t', ':']).to_owned())
            })
        })
        .unwrap_or_default();
    probe(
        "CPUs",
        n > 0,
        if model.is_empty() {
            format!("{n} available")
        } else {
            format!("{n} available ({model})")
        },
    )
}

fn memory() -> Probe {
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| {
        t.lines().find_map(|l| {
            l.strip_prefix("MemTotal:")
                .and_then(|r| r.trim().trim_end_matches(" kB").parse::<u64>().ok())
        })
    });
    match total {
        Some(kib) => probe(
            "memory",
            true,
            format!("{:.1} GiB", kib as f64 / 1024.0 / 1024.0),
        ),
        None => probe("memory", false, "unknown (/proc/meminfo unreadable)"),
    }
}

fn gpus() -> Probe {
    match output(
        "nvidia-smi",
        &[
            "--query-gpu=index,name,driver_version,memory.total",
            "--format=csv,noheader",
        ],
    ) {
        Some(text) if text.lines().any(|l| l.contains(',')) => {
            let gpus: Vec<&str> = text.lines().filter(|l| l.contains(',')).collect();
            probe(
                "GPUs",
                true,
                format!("{} NVIDIA GPU(s): {}", gpus.len(), gpus.join("; ")),
            )
        }
        Some(text) => probe(
            "GPUs",
            false,
            format!("nvidia-smi found but reports no GPU: {}", first_line(&text)),
        ),
        None => probe("GPUs", false, "no nvidia-smi on PATH (CPU only)"),
    }
}

fn mpi(program: &str) -> Probe {
    match output(program, &["--version"]) {
        Some(text) => {
            let flavour = if text.contains("Open MPI") || text.contains("OpenRTE") {
                "OpenMPI"
            } else if text.contains("HYDRA") || text.contains("MPICH") {
                "MPICH"
            } else if text.contains("Intel") {
                "Intel MPI"
            } else {
                "unknown flavour"
            };
            probe("MPI", true, format!("{flavour}: {}", first_line(&text)))
        }
        None => probe(
            "MPI",
            false,
            "no mpirun on PATH (the mpi engine is unavailable; local and ssh work without)",
        ),
    }
}

fn nccl() -> Probe {
    let from_ldconfig = output("ldconfig", &["-p"]).and_then(|t| {
        t.lines()
            .find(|l| l.contains("libnccl.so"))
            .map(|l| l.trim().to_owned())
    });
    let from_paths = [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/local/cuda/lib64",
        "/usr/lib64",
        "/usr/local/lib",
    ]
    .iter()
    .find_map(|dir| {
        std::fs::read_dir(dir).ok()?.flatten().find_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with("libnccl.so")
                .then(|| e.path().display().to_string())
        })
    });
    match from_ldconfig.or(from_paths) {
        Some(found) => probe("NCCL", true, found),
        None => probe(
            "NCCL",
            false,
            "libnccl.so not found (GPU collectives fall back to TCP/shared memory)",
        ),
    }
}

fn slurm() -> Probe {
    match output("srun", &["--version"]) {
        Some(text) => match text.lines().find(|l| l.starts_with("slurm")) {
            Some(version) => {
                let inside = std::env::var(crate::env_vars::SLURM_JOB_ID)
                    .map(|id| format!(", inside allocation {id}"))
                    .unwrap_or_default();
                probe("Slurm", true, format!("{}{inside}", version.trim()))
            }
            None => probe(
                "Slurm",
                false,
                format!("srun is installed but not configured: {}", last_line(&text)),
            ),
        },
        None => probe("Slurm", false, "no srun on PATH"),
    }
}

fn last_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty())
        .unwrap_or("")
        .to_owned()
}

fn kubectl() -> Probe {
    match output("kubectl", &["version", "--client"]) {
        Some(text) => probe("kubectl", true, first_line(&text)),
        None => probe(
            "kubectl",
            false,
            "no kubectl on PATH (`hvd export` can still write manifests)",
        ),
    }
}

fn java() -> Probe {
    match output("java", &["-version"]) {
        Some(text) => probe("Java", true, first_line(&text)),
        None => probe(
            "Java",
            false,
            "no java on PATH (needed by the spark engine)",
        ),
    }
}

fn pyspark() -> Probe {
    match output(
        "python3",
        &["-c", "import pyspark; print(pyspark.__version__)"],
    ) {
        Some(text) if !text.contains("Error") => probe("pyspark", true, first_line(&text)),
        _ => probe("pyspark", false, "not importable by python3"),
    }
}

fn python() -> Probe {
    match output("python3", &["--version"]) {
        Some(text) => probe("python3", true, first_line(&text)),
        None => probe("python3", false, "no python3 on PATH"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_report_missing_tools_and_this_machines_cpus() {
        assert_eq!(output("hvd-no-such-program", &[]), None);
        assert_eq!(
            output("sh", &["-c", "echo out; echo err >&2; exit 3"]).as_deref(),
            Some("out\nerr\n")
        );
        let cpus = cpus();
        assert!(
            cpus.found
                && cpus
                    .detail
                    .starts_with(&std::thread::available_parallelism().unwrap().to_string())
        );
        assert_eq!(probes().len(), 10);
    }
}
