//! Who this rank is in its job (rank, size, host, rendezvous), read from the environment.

use crate::env_vars;
use crate::error::{Error, Result};
use crate::rendezvous::Rendezvous;

/// What the environment says about this rank's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobEnv {
    pub rank: usize,
    pub size: usize,
    /// Groups ranks into hosts.
    pub hostname: String,
    pub rendezvous: Option<Rendezvous>,
    /// Which variables gave rank and size: a [`crate::launch_env::LaunchSource::key`] (`hvd`, `openmpi`, `pmi`,
    /// `slurm`, ...).
    pub source: &'static str,
}

impl JobEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<JobEnv> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads variables through `var` (for tests and embedders).
    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Result<JobEnv> {
        let slot = crate::launch_env::slot_from_lookup(&var)
            .map_err(|e| Error::Bootstrap(e.to_string()))?;
        let (source, rank, size) = (slot.source.key(), slot.rank as usize, slot.size as usize);
        let hostname = match var(env_vars::HVD_HOSTNAME).filter(|h| !h.is_empty()) {
            Some(h) => h,
            None => machine_hostname()?,
        };
        let rendezvous = match var(env_vars::HVD_RENDEZVOUS).filter(|v| !v.is_empty()) {
            Some(v) => Some(Rendezvous::parse(
                &v,
                var(env_vars::HVD_JOB_TOKEN).filter(|t| !t.is_empty()),
            )?),
            None => None,
        };
        Ok(JobEnv {
            rank,
            size,
            hostname,
            rendezvous,
            source,
        })
    }
}

fn machine_hostname() -> Result<String> {
    let mut buf = [0u8; 256];
    // SAFETY: buf is writable for its length; gethostname NUL-terminates within it on success.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return Err(Error::io(
            "read the host name",
            std::io::Error::last_os_error(),
        ));
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: std::collections::HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn rank_families_in_order() {
        let j = JobEnv::from_lookup(env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "8"),
            ("HVD_HOSTNAME", "a"),
        ]))
        .unwrap();
        assert_eq!(
            (j.rank, j.size, j.source, j.hostname.as_str()),
            (1, 4, "openmpi", "a")
        );
        let j = JobEnv::from_lookup(env(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "8"),
            ("HVD_HOSTNAME", "a"),
        ]))
        .unwrap();
        assert_eq!((j.rank, j.size, j.source), (3, 8, "slurm"));
        let j = JobEnv::from_lookup(env(&[
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "2"),
            ("HVD_HOSTNAME", "h"),
            ("HVD_RENDEZVOUS", "127.0.0.1:9"),
            ("HVD_JOB_TOKEN", "abc"),
        ]))
        .unwrap();
        assert_eq!(j.source, "pmi");
        assert_eq!(
            j.rendezvous,
            Some(Rendezvous::Http {
                address: "127.0.0.1:9".into(),
                token: Some("abc".into())
            })
        );
    }

    /// The launch-environment fixtures shared with `hvd-launcher`'s shim give the same rank, size and source here.
    #[test]
    fn shared_launch_fixtures_give_the_same_rank() {
        use crate::launch_env::fixtures;
        let cases = fixtures::parse(include_str!("../tests/data/launch_env.txt"));
        assert!(cases.len() >= 10);
        for case in &cases {
            let got = JobEnv::from_lookup(|k| {
                case.get(k)
                    .or_else(|| (k == "HVD_HOSTNAME").then(|| "h".into()))
            });
            match (case.expect.strip_prefix("error "), got) {
                (Some(part), Err(e)) => assert!(e.to_string().contains(part), "{}: {e}", case.name),
                (None, Ok(j)) => {
                    let want: Vec<&str> = case.expect.split(' ').take(3).collect();
                    assert_eq!(
                        [j.source.to_owned(), j.rank.to_string(), j.size.to_string()],
                        [want[0], want[1], want[2]],
                        "{}",
                        case.name
                    );
                }
                (_, got) => panic!("{}: expected `{}`, got {got:?}", case.name, case.expect),
            }
        }
    }

    #[test]
    fn bad_environment_is_explained() {
        let e = JobEnv::from_lookup(env(&[("HVD_RANK", "4"), ("HVD_SIZE", "4")])).unwrap_err();
        assert!(
            e.to_string()
                .contains("`HVD_RANK=4` is not a rank of `HVD_SIZE=4`"),
            "{e}"
        );
        let e = JobEnv::from_lookup(env(&[("HVD_RANK", "x"), ("HVD_SIZE", "4")])).unwrap_err();
        assert!(e.to_string().contains("not a whole number"), "{e}");
        let e = JobEnv::from_lookup(env(&[])).unwrap_err();
        assert!(e.to_string().contains("hvd run"), "{e}");
        let e = Rendezvous::parse("nonsense", None).unwrap_err();
        assert!(e.to_string().contains("file:DIR"), "{e}");
    }
}
