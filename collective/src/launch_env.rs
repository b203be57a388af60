//! The one reader of launchers' rank variables (OpenMPI, MVAPICH2, MPICH/Hydra/Intel MPI, hvd, Slurm, an Indexed
//! Kubernetes Job, the spark engine's tasks): used by the bootstrap (`job::JobEnv`) and by
//! `hvd-launcher`'s worker shim, so both always agree on which rank a process is.
//!
//! # Precedence
//!
//! A process often carries the variables of more than one launcher: each launcher passes its own environment on to
//! what it starts, so the variables of every launcher above this process are present too. The right family is that
//! of the launcher that started *this* process (the innermost one). The order below is [`FAMILIES`]:
//!
//! 1. **Spark** (`HVD_SPARK_*`): set per barrier task by the spark engine's driver, while the executors inherit the
//!    driver's own `HVD_*`; the task's variables are the innermost.
//! 2. **OpenMPI** (`OMPI_COMM_WORLD_*`), 3. **MVAPICH2** (`MV2_COMM_WORLD_*`), 4. **MPICH/Hydra, Intel MPI**
//!    (`PMI_RANK`/`PMI_SIZE`): an MPI launcher writes these freshly into every process it starts. No hvd engine
//!    starts a worker below an MPI launcher other than through the shim, which derives `HVD_*` from them (so the two
//!    agree); when they disagree with `HVD_*`, an hvd worker ran `mpirun` itself and the MPI launcher is the inner
//!    one. They also beat Slurm: under `sbatch` + `mpirun`/`mpiexec` the Slurm variables are the batch step's
//!    (`SLURM_PROCID=0`) or those of the per-node daemon that srun started, never the rank's. Under
//!    `srun --mpi=pmi2|pmix` both are set by srun and agree. OpenMPI comes before PMI: OpenMPI's own launcher sets
//!    its variables on every rank, whereas a `PMI_RANK` next to them can only be inherited.
//! 5. **hvd** (`HVD_RANK`/`HVD_SIZE`): set per worker by `hvd run`'s engines and by the shim. It beats Slurm because
//!    Slurm's variables are ambient: a batch script runs with `SLURM_PROCID=0` and `SLURM_NTASKS=N`, and `hvd run`
//!    (local engine) inside it gives each worker its own `HVD_RANK` while the stale Slurm ones are inherited.
//! 6. **Slurm** (`SLURM_PROCID`/`SLURM_NTASKS`): srun starting the process directly (the slurm engine's srun runs
//!    the shim, which reads these; the engine passes no per-rank `HVD_*` to srun).
//! 7. **Kubernetes** (`JOB_COMPLETION_INDEX` with `HVD_SIZE`): the pod's index, the outermost of all (anything that
//!    launches inside the pod is inner to it).
//!
//! What this cannot tell apart: a launcher that sets per-process variables of a family listed *later* while running
//! inside a process that already carries an *earlier* family (e.g. `hvd run` with the local engine inside
//! `mpirun`, or srun started from an hvd worker): the earlier family wins. `PMIX_RANK` is not a family of its own:
//! PMIx publishes no size variable, and every launcher that sets it (srun `--mpi=pmix`, OpenMPI) also sets one of
//! the families above.

/// Which launcher's variables gave the rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaunchSource {
    Spark,
    OpenMpi,
    Mvapich,
    Pmi,
    Hvd,
    Slurm,
    Kubernetes,
}

impl LaunchSource {
    /// A short lowercase key (`spark`, `openmpi`, `mvapich`, `pmi`, `hvd`, `slurm`, `kubernetes`).
    pub fn key(self) -> &'static str {
        match self {
            LaunchSource::Spark => "spark",
            LaunchSource::OpenMpi => "openmpi",
            LaunchSource::Mvapich => "mvapich",
            LaunchSource::Pmi => "pmi",
            LaunchSource::Hvd => "hvd",
            LaunchSource::Slurm => "slurm",
            LaunchSource::Kubernetes => "kubernetes",
        }
    }

    /// The launcher's name for messages.
    pub fn name(self) -> &'static str {
        match self {
            LaunchSource::Spark => "Spark",
            LaunchSource::OpenMpi => "OpenMPI",
            LaunchSource::Mvapich => "MVAPICH2",
            LaunchSource::Pmi => "MPICH/PMI",
            LaunchSource::Hvd => "HVD_*",
            LaunchSource::Slurm => "Slurm",
            LaunchSource::Kubernetes => "Kubernetes",
        }
    }
}

/// One family of variables: rank and size (both required), then optional local rank/size and cross rank/size.
#[derive(Debug, Clone, Copy)]
pub struct Family {
    pub source: LaunchSource,
    pub rank: &'static str,
    pub size: &'static str,
    pub local_rank: Option<&'static str>,
    pub local_size: Option<&'static str>,
    pub cross_rank: Option<&'static str>,
    pub cross_size: Option<&'static str>,
}

const fn family(
    source: LaunchSource,
    rank: &'static str,
    size: &'static str,
    local: Option<(&'static str, &'static str)>,
    cross: Option<(&'static str, &'static str)>,
) -> Family {
    let (local_rank, local_size) = match local {
        Some((r, s)) => (Some(r), Some(s)),
        None => (None, None),
    };
    let (cross_rank, cross_size) = match cross {
        Some((r, s)) => (Some(r), Some(s)),
        None => (None, None),
    };
    Family {
        source,
        rank,
        size,
        local_rank,
        local_size,
        cross_rank,
        cross_size,
    }
}

/// The families, first present wins (see the module's documentation for why this order).
pub const FAMILIES: [Family; 7] = [
    family(
        LaunchSource::Spark,
        "HVD_SPARK_RANK",
        "HVD_SPARK_SIZE",
        Some(("HVD_SPARK_LOCAL_RANK", "HVD_SPARK_LOCAL_SIZE")),
        Some(("HVD_SPARK_CROSS_RANK", "HVD_SPARK_CROSS_SIZE")),
    ),
    family(
        LaunchSource::OpenMpi,
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        Some(("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")),
        None,
    ),
    family(
        LaunchSource::Mvapich,
        "MV2_COMM_WORLD_RANK",
        "MV2_COMM_WORLD_SIZE",
        Some(("MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE")),
        None,
    ),
    family(
        LaunchSource::Pmi,
        "PMI_RANK",
        "PMI_SIZE",
        Some(("MPI_LOCALRANKID", "MPI_LOCALNRANKS")),
        None,
    ),
    family(
        LaunchSource::Hvd,
        "HVD_RANK",
        "HVD_SIZE",
        Some(("HVD_LOCAL_RANK", "HVD_LOCAL_SIZE")),
        Some(("HVD_CROSS_RANK", "HVD_CROSS_SIZE")),
    ),
    // Local size: SLURM_NTASKS_PER_NODE, else size spread over SLURM_NNODES (see `read_family`).
    family(
        LaunchSource::Slurm,
        "SLURM_PROCID",
        "SLURM_NTASKS",
        Some(("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE")),
        Some(("SLURM_NODEID", "SLURM_NNODES")),
    ),
    // One pod per rank: local 0 of 1, cross = rank of size (see `read_family`).
    family(
        LaunchSource::Kubernetes,
        "JOB_COMPLETION_INDEX",
        "HVD_SIZE",
        None,
        None,
    ),
];

/// This process's place in the job, as its launcher's variables say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchSlot {
    pub source: LaunchSource,
    pub rank: u32,
    pub size: u32,
    pub local_rank: u32,
    pub local_size: u32,
    pub cross_rank: u32,
    pub cross_size: u32,
}

/// Why the environment names no rank of a job.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LaunchEnvError {
    #[error(
        "no rank variables found: start workers with `hvd run` (HVD_RANK/HVD_SIZE), mpirun (OMPI_COMM_WORLD_RANK/\
         SIZE, MV2_COMM_WORLD_RANK/SIZE, PMI_RANK/PMI_SIZE), srun (SLURM_PROCID/SLURM_NTASKS), an Indexed Job \
         (JOB_COMPLETION_INDEX with HVD_SIZE) or the spark engine (HVD_SPARK_RANK/HVD_SPARK_SIZE)"
    )]
    NoRank,
    #[error("`{name}` is `{value}`, not a whole number (a non-negative integer)")]
    NotANumber { name: &'static str, value: String },
    #[error("`{rank_var}={rank}` is not a rank of `{size_var}={size}` (from {})", from.name())]
    RankOutOfRange {
        from: LaunchSource,
        rank_var: &'static str,
        rank: u32,
        size_var: &'static str,
        size: u32,
    },
}

/// Reads this process's slot through `get` (an environment lookup): the first family of [`FAMILIES`] whose rank and
/// size are both set. Missing local variables mean local rank 0 of 1; missing cross variables mean ranks fill hosts
/// in order, `local_size` per host (mpirun's by-slot mapping).
pub fn slot_from_lookup(
    get: &dyn Fn(&str) -> Option<String>,
) -> Result<LaunchSlot, LaunchEnvError> {
    let num = |name: &'static str| -> Result<Option<u32>, LaunchEnvError> {
        match get(name) {
            None => Ok(None),
            Some(value) => value
                .trim()
                .parse::<u32>()
                .map(Some)
                .map_err(|_| LaunchEnvError::NotANumber { name, value }),
        }
    };
    for f in &FAMILIES {
        let (Some(rank), Some(size)) = (num(f.rank)?, num(f.size)?) else {
            continue;
        };
        if rank >= size {
            return Err(LaunchEnvError::RankOutOfRange {
                from: f.source,
                rank_var: f.rank,
                rank,
                size_var: f.size,
                size,
            });
        }
        let opt = |name: Option<&'static str>| name.map(num).transpose().map(Option::flatten);
        let local_rank = opt(f.local_rank)?.unwrap_or(0);
        let (mut local_size, mut cross_rank, mut cross_size) =
            (opt(f.local_size)?, opt(f.cross_rank)?, opt(f.cross_size)?);
        match f.source {
            LaunchSource::Slurm if local_size.is_none() => {
                local_size = Some(size.div_ceil(cross_size.unwrap_or(1).max(1)));
            }
            LaunchSource::Kubernetes => {
                (local_size, cross_rank, cross_size) = (Some(1), Some(rank), Some(size));
            }
            _ => {}
        }
        let local_size = local_size.unwrap_or(1).max(1);
        return Ok(LaunchSlot {
            source: f.source,
            rank,
            size,
            local_rank,
            local_size,
            cross_rank: cross_rank.unwrap_or(rank / local_size),
            cross_size: cross_size
                .unwrap_or_else(|| size.div_ceil(local_size))
                .max(1),
        });
    }
    Err(LaunchEnvError::NoRank)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shared fixtures (`tests/data/launch_env.txt`), also run through `hvd-launcher`'s shim.
    const FIXTURES: &str = include_str!("../tests/data/launch_env.txt");

    #[test]
    fn every_fixture_gives_its_slot() {
        let cases = fixtures::parse(FIXTURES);
        assert!(cases.len() >= 10, "{} fixtures", cases.len());
        for case in &cases {
            let got = slot_from_lookup(&|k| case.get(k));
            if let Err(e) = fixtures::check(case, &got) {
                panic!("{e}");
            }
        }
    }
}

/// The fixture format shared by this crate's tests and `hvd-launcher`'s: `//` starts a comment line, one case per block: `# name`, then
/// `VAR=value` lines, then `=> source rank size local_rank local_size cross_rank cross_size` or `=> error <text>`
/// (a part of the error message). Public so the launcher's test reads the same file the same way.
pub mod fixtures {
    use super::{LaunchEnvError, LaunchSlot};

    /// One environment and what it must give.
    #[derive(Debug, Clone)]
    pub struct Case {
        pub name: String,
        pub vars: Vec<(String, String)>,
        pub expect: String,
    }

    impl Case {
        /// The environment lookup of this case.
        pub fn get(&self, name: &str) -> Option<String> {
            self.vars
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    /// Parses the fixture text (see the module's documentation); a malformed block panics naming it (test input).
    pub fn parse(text: &str) -> Vec<Case> {
        let mut cases = Vec::new();
        let mut current: Option<Case> = None;
        for line in text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with("//"))
        {
            if let Some(name) = line.strip_prefix('#') {
                assert!(
                    current.is_none(),
                    "fixture before `{name}` has no `=>` line"
                );
                current = Some(Case {
                    name: name.trim().to_owned(),
                    vars: Vec::new(),
                    expect: String::new(),
                });
            } else if let Some(expect) = line.strip_prefix("=>") {
                let mut case = current.take().expect("`=>` outside a fixture");
                case.expect = expect.trim().to_owned();
                cases.push(case);
            } else {
                let (k, v) = line.split_once('=').expect("fixture line is not VAR=value");
                let case = current.as_mut().expect("variable outside a fixture");
                case.vars.push((k.to_owned(), v.to_owned()));
            }
        }
        assert!(current.is_none(), "last fixture has no `=>` line");
        cases
    }

    /// Whether `result` is what `case` expects: the same numbers, or an error whose message contains the text.
    pub fn check(case: &Case, result: &Result<LaunchSlot, LaunchEnvError>) -> Result<(), String> {
        let got = render(result);
        let ok = match case.expect.strip_prefix("error ") {
            Some(part) => got.starts_with("error ") && got.contains(part),
            None => got == case.expect,
        };
        if ok {
            Ok(())
        } else {
            Err(format!(
                "fixture `{}`: expected `{}`, got `{got}`",
                case.name, case.expect
            ))
        }
    }

    /// What `parse`'s `=>` lines hold, for a result: the slot's numbers, or `error <message>`.
    pub fn render(result: &Result<LaunchSlot, LaunchEnvError>) -> String {
        match result {
            Ok(s) => format!(
                "{} {} {} {} {} {} {}",
                s.source.key(),
                s.rank,
                s.size,
                s.local_rank,
                s.local_size,
                s.cross_rank,
                s.cross_size
            ),
            Err(e) => format!("error {e}"),
        }
    }
}
