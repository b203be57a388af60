//! Rank processes of a test: the worker side prints one `RESULT <line>` and exits; the test side collects them.

#![allow(dead_code, reason = "each test binary uses part of this module")]

use std::io::Read;
use std::process::Child;
use std::time::{Duration, Instant};

/// Waits for every worker (killing those still running after 60 s, reported as `hung`) and returns each one's
/// `RESULT` line, or `no result (killed?)` for one that printed none (its output goes to the test's stderr).
pub fn results(children: Vec<Child>) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    children
        .into_iter()
        .map(|mut c| {
            while c.try_wait().expect("wait for a worker").is_none() {
                if Instant::now() > deadline {
                    let _ = c.kill();
                    let _ = c.wait();
                    return "hung".to_string();
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let mut out = String::new();
            if let Some(mut stdout) = c.stdout.take() {
                let _ = stdout.read_to_string(&mut out);
            }
            let mut err = String::new();
            if let Some(mut stderr) = c.stderr.take() {
                let _ = stderr.read_to_string(&mut err);
            }
            out.lines()
                .find_map(|l| l.strip_prefix("RESULT ").map(|r| r.trim().to_string()))
                .unwrap_or_else(|| {
                    eprintln!("worker without result; stdout:\n{out}\nstderr:\n{err}");
                    "no result (killed?)".to_string()
                })
        })
        .collect()
}

/// The worker side, called from a `#[test] fn worker()`: nothing unless the environment variable `var` names a
/// scenario (the test started this process as a rank); then `run(scenario)`'s line, or `error: ...`, is printed as
/// `RESULT <line>` and the process exits 0.
pub fn serve<E: std::fmt::Display>(var: &str, run: impl FnOnce(&str) -> Result<String, E>) {
    let Ok(scenario) = std::env::var(var) else {
        return;
    };
    let line = match run(&scenario) {
        Ok(line) => line,
        Err(e) => format!("error: {e}"),
    };
    println!("\nRESULT {line}");
    std::process::exit(0);
}
