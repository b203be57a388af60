//! Collecting what rank processes of a test printed: each worker ends with one `RESULT <line>`.

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
