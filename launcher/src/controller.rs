//! Which controllers (gloo, MPI) the real Horovod of an env can talk to, and the engine a run gets from that: mpirun
//! for an MPI-only Horovod when no engine is named, a refusal naming the fix when the named engine cannot reach it.
//!
//! What a build talks to is read from its recipe and version: Horovod has a gloo controller from 0.17.0 on (before,
//! MPI is the only one and its build needs MPI), `HOROVOD_WITHOUT_GLOO`/`HOROVOD_WITH_MPI`/`HOROVOD_WITHOUT_MPI` in
//! the build's variables say the rest. Once the env is built, the version is the one its `horovod-*.dist-info`
//! names (so an unpinned `horovod` requirement is known too). Asking the build itself (`gloo_built()`) would mean
//! importing its framework, which is starting a worker; it is not done. An env without the real Horovod (the
//! `horovod` compatibility package, `hvd.*` scripts) runs under any engine.

use std::path::{Path, PathBuf};

use hvd_lang::model::{EngineKind, Env, Project};

use crate::options::RunOptions;

/// The first Horovod release with a gloo controller: `horovod/common/gloo/` and `HOROVOD_WITH_GLOO` first appear in
/// v0.17.0 ("Added Gloo controller", #1181), reading the same `HOROVOD_GLOO_RENDEZVOUS_ADDR`/`_PORT` and
/// `HOROVOD_CONTROLLER` as 0.28.1.
pub const FIRST_GLOO: Version = Version([0, 17, 0]);

/// A Horovod release number (`major.minor.patch`; missing parts are 0, anything after them is ignored).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version(pub [u32; 3]);

impl Version {
    /// `0.13.11` -> `Version([0, 13, 11])`; `None` unless it starts with a number.
    pub fn parse(text: &str) -> Option<Version> {
        let mut parts = [0; 3];
        let mut numbers = text.trim().split('.');
        for (i, part) in parts.iter_mut().enumerate() {
            let Some(number) = numbers.next() else { break };
            let digits: String = number.chars().take_while(char::is_ascii_digit).collect();
            match digits.parse() {
                Ok(n) => *part = n,
                Err(_) if i > 0 => break,
                Err(_) => return None,
            }
            if digits.len() != number.len() {
                break;
            }
        }
        Some(Version(parts))
    }
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [major, minor, patch] = self.0;
        write!(f, "{major}.{minor}.{patch}")
    }
}

/// What is known of the real Horovod an env holds; `None` in a field: not known before it is built and run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HorovodBuild {
    /// The installed version (the env's dist-info), else the recipe's `horovod==X` pin.
    pub version: Option<Version>,
    /// Whether it has the gloo controller (the rendezvous hvd serves).
    pub gloo: Option<bool>,
    /// Whether it has the MPI controller (needs mpirun).
    pub mpi: Option<bool>,
}

impl HorovodBuild {
    /// The real Horovod of `env` (`None`: the env has none), with the built env at `env_dir` when there is one.
    pub fn of(env: &Env, env_dir: Option<&Path>) -> Option<HorovodBuild> {
        let request = env
            .packages
            .iter()
            .find(|p| requirement_name(&p.requirement) == "horovod");
        let installed = env_dir.and_then(installed_version);
        if request.is_none() && installed.is_none() {
            return None;
        }
        let version = installed.or_else(|| request.and_then(|p| pinned_version(&p.requirement)));
        let flag = |name: &str| {
            request
                .and_then(|p| p.build.as_ref())
                .and_then(|b| b.env.get(name))
                .is_some_and(|v| v.trim() == "1")
        };
        let before_gloo = version.map(|v| v < FIRST_GLOO);
        let gloo = match before_gloo {
            Some(true) => Some(false),
            _ if flag("HOROVOD_WITHOUT_GLOO") => Some(false),
            _ if flag("HOROVOD_WITH_GLOO") && before_gloo.is_some() => Some(true),
            _ => None,
        };
        let mpi = if flag("HOROVOD_WITH_MPI") || before_gloo == Some(true) {
            Some(true)
        } else if flag("HOROVOD_WITHOUT_MPI") {
            Some(false)
        } else {
            None
        };
        Some(HorovodBuild { version, gloo, mpi })
    }

    /// "Horovod 0.13.11" (or "Horovod" when the version is not known).
    fn name(&self) -> String {
        match self.version {
            Some(v) => format!("Horovod {v}"),
            None => "Horovod".to_owned(),
        }
    }

    /// Only MPI: it never reads the gloo rendezvous hvd serves, so it needs mpirun (or srun) to see its world.
    pub fn mpi_only(&self) -> bool {
        self.gloo == Some(false)
    }
}

/// The engine a run gets, and the line to tell the user when it is not the one they would expect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    pub engine: EngineKind,
    pub note: Option<String>,
}

/// An engine was named that cannot reach the env's Horovod: each worker would be a world of size 1.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{named} cannot run this env's {horovod}: it has no gloo controller (gloo came with Horovod {FIRST_GLOO}), so it \
     ignores hvd's rendezvous and each worker would train alone in a world of size 1; run it under mpirun with \
     `--engine mpi` (the default for this env when no engine is named), or use Horovod >= {FIRST_GLOO} built with \
     gloo (e.g. std.horovod's default version)"
)]
pub struct Mismatch {
    /// How the engine was named, e.g. "`--engine local`" or "`cluster { engine = \"ssh\" }`".
    pub named: String,
    /// "Horovod 0.13.11".
    pub horovod: String,
}

/// The engine of `project` under `options`: the one named (`--engine`, else `cluster { engine }`) when it can reach
/// the env's Horovod, mpi for an MPI-only Horovod when none is named, else local.
pub fn choose(project: &Project, options: &RunOptions) -> Result<Choice, Mismatch> {
    let cluster = project.cluster.as_ref().and_then(|c| c.engine);
    let named = options.engine.or(cluster);
    let chosen = |engine| Choice { engine, note: None };
    let horovod = HorovodBuild::of(&project.env, options.env_dir.as_deref());
    let Some(horovod) = horovod.filter(HorovodBuild::mpi_only) else {
        return Ok(chosen(named.unwrap_or(EngineKind::Local)));
    };
    if !uses_horovod(project) {
        return Ok(chosen(named.unwrap_or(EngineKind::Local)));
    }
    match named {
        None => Ok(Choice {
            engine: EngineKind::Mpi,
            note: Some(format!(
                "this env's {} has no gloo controller (MPI only): distributed steps run under mpirun (the mpi \
                 engine); `--engine` chooses another",
                horovod.name()
            )),
        }),
        // srun starts MPI ranks too (with `--mpi=pmix`).
        Some(engine @ (EngineKind::Mpi | EngineKind::Slurm)) => Ok(chosen(engine)),
        Some(engine) => Err(Mismatch {
            named: match options.engine {
                Some(_) => format!("`--engine {engine}`"),
                None => format!("`cluster {{ engine = \"{engine}\" }}`"),
            },
            horovod: horovod.name(),
        }),
    }
}

/// Whether a distributed step of `project` may use the real Horovod (`horovod.*`): its command names Horovod, or
/// runs a Python script that imports it or that cannot be read. A step whose scripts are all read and use only
/// `hvd.*` runs under any engine. Best effort: a step that runs no `.py` file directly counts as using it.
fn uses_horovod(project: &Project) -> bool {
    let dir = project
        .file
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
    project
        .steps
        .iter()
        .filter(|step| step.workers.is_some())
        .any(|step| {
            let scripts: Vec<&str> = step
                .run
                .split_whitespace()
                .map(|word| word.trim_matches(|c| c == '"' || c == '\''))
                .filter(|word| word.ends_with(".py"))
                .collect();
            step.run.contains("horovod")
                || scripts.is_empty()
                || scripts.iter().any(|script| {
                    std::fs::read_to_string(dir.join(script)).map_or(true, |text| {
                        text.contains("import horovod") || text.contains("from horovod")
                    })
                })
        })
}

/// The name of a PEP 508 requirement, normalized (PEP 503).
fn requirement_name(requirement: &str) -> String {
    let end = requirement
        .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
        .unwrap_or(requirement.len());
    requirement[..end]
        .to_ascii_lowercase()
        .replace(['_', '.'], "-")
}

/// `X` of a `name==X` requirement (no wildcard).
fn pinned_version(requirement: &str) -> Option<Version> {
    let (_, rest) = requirement.split_once("==")?;
    let rest = rest.trim_start_matches('=').trim();
    let end = rest
        .find(|c: char| c == ';' || c == ',' || c.is_whitespace())
        .unwrap_or(rest.len());
    let version = &rest[..end];
    (!version.contains('*')).then(|| Version::parse(version))?
}

/// The version of the Horovod installed in a built env: its `lib/python*/site-packages/horovod-X.dist-info`.
fn installed_version(env_dir: &Path) -> Option<Version> {
    let lib = std::fs::read_dir(env_dir.join("lib")).ok()?;
    lib.flatten()
        .filter(|python| python.file_name().to_string_lossy().starts_with("python"))
        .filter_map(|python| std::fs::read_dir(python.path().join("site-packages")).ok())
        .flat_map(|packages| packages.flatten())
        .find_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            let version = name.strip_suffix(".dist-info")?.strip_prefix("horovod-")?;
            Version::parse(version)
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use hvd_lang::model::{PackageRequest, SourceBuild};

    fn env(requirement: &str, vars: &[&str]) -> Env {
        Env {
            python: "3.6".into(),
            index: None,
            toolchain: None,
            packages: vec![PackageRequest {
                requirement: requirement.into(),
                build: Some(SourceBuild {
                    env: vars
                        .iter()
                        .map(|v| ((*v).to_owned(), "1".to_owned()))
                        .collect(),
                    ..SourceBuild::default()
                }),
            }],
            variables: Default::default(),
        }
    }

    #[test]
    fn versions_and_requirements_are_read() {
        assert_eq!(Version::parse("0.13.11"), Some(Version([0, 13, 11])));
        assert_eq!(Version::parse("0.17"), Some(Version([0, 17, 0])));
        assert!(Version([0, 16, 4]) < FIRST_GLOO && FIRST_GLOO <= Version([0, 17, 0]));
        assert_eq!(Version::parse("0.28.1rc1"), Some(Version([0, 28, 1])));
        assert_eq!(Version::parse("x"), None);
        assert_eq!(requirement_name("Horovod[tensorflow]==0.13.11"), "horovod");
        assert_eq!(requirement_name("horovod_x>=1"), "horovod-x");
        assert_eq!(
            pinned_version("horovod == 0.13.11 ; python_version < '3.8'"),
            Some(Version([0, 13, 11]))
        );
        assert_eq!(
            pinned_version("horovod===0.19.0"),
            Some(Version([0, 19, 0]))
        );
        assert_eq!(pinned_version("horovod==0.19.*"), None);
        assert_eq!(pinned_version("horovod>=0.13"), None);
    }

    #[test]
    fn the_recipe_and_version_say_which_controllers_a_build_has() {
        // A lock from an older std.horovod (or a hand-written recipe) may pass HOROVOD_WITH_GLOO to any version;
        // before 0.17.0 Horovod has no gloo to build, whatever the variables say.
        let old = HorovodBuild::of(
            &env(
                "horovod==0.13.11",
                &["HOROVOD_WITH_GLOO", "HOROVOD_WITH_MPI"],
            ),
            None,
        );
        let old = old.unwrap();
        assert_eq!((old.gloo, old.mpi), (Some(false), Some(true)));
        assert!(old.mpi_only());
        let new = HorovodBuild::of(
            &env(
                "horovod==0.28.1",
                &["HOROVOD_WITH_GLOO", "HOROVOD_WITHOUT_MPI"],
            ),
            None,
        );
        assert_eq!(
            new,
            Some(HorovodBuild {
                version: Some(Version([0, 28, 1])),
                gloo: Some(true),
                mpi: Some(false)
            })
        );
        let no_gloo = HorovodBuild::of(&env("horovod==0.28.1", &["HOROVOD_WITHOUT_GLOO"]), None);
        assert!(no_gloo.unwrap().mpi_only());
        // Unpinned and not built: nothing is known, so nothing is changed.
        let unknown = HorovodBuild::of(&env("horovod", &[]), None).unwrap();
        assert_eq!((unknown.version, unknown.gloo), (None, None));
        assert!(!unknown.mpi_only());
        let none = HorovodBuild::of(&env("numpy==1.26.4", &[]), None);
        assert_eq!(none, None);
    }

    #[test]
    fn a_built_env_names_the_installed_version() {
        let dir = tempfile::tempdir().unwrap();
        let packages = dir.path().join("lib/python3.6/site-packages");
        std::fs::create_dir_all(packages.join("horovod-0.13.11.dist-info")).unwrap();
        std::fs::create_dir_all(packages.join("hvd_horovod_compat-0.1.0.dist-info")).unwrap();
        let built = HorovodBuild::of(&env("horovod", &[]), Some(dir.path())).unwrap();
        assert_eq!(built.version, Some(Version([0, 13, 11])));
        assert!(built.mpi_only());
        // The compatibility package alone is not the real Horovod.
        std::fs::remove_dir(packages.join("horovod-0.13.11.dist-info")).unwrap();
        let none = Env {
            packages: Vec::new(),
            ..env("numpy", &[])
        };
        assert_eq!(HorovodBuild::of(&none, Some(dir.path())), None);
    }
}
