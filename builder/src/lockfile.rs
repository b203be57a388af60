//! Mapping the resolver's [`Lockfile`] onto the builder's [`EnvPlan`].

use std::collections::BTreeMap;

use hvd_resolver::lockfile::{ArtifactKind, LockedBuild, LockedPackage, Lockfile, ToolchainPin};

use crate::debian::{DebPlan, DebianGcc};
use crate::error::Result;
use crate::fetch::Artifact;
use crate::plan::{EnvPlan, PackagePlan, SourceBuildPlan};
use crate::toolchain::Toolchain;

/// The plan for a lockfile's env; `name` is the project name (it names the env's store path).
pub fn plan_from_lockfile(lock: &Lockfile, name: &str) -> Result<EnvPlan> {
    let builds: BTreeMap<&str, &LockedBuild> = lock
        .builds
        .iter()
        .map(|b| (b.package.as_str(), b))
        .collect();
    let packages = lock
        .packages
        .iter()
        .map(|package| package_plan(package, builds.get(package.name.as_str()).copied()))
        .collect::<Result<Vec<_>>>()?;
    let toolchain = lock.toolchain.as_ref().map(toolchain_from_pin);
    Ok(EnvPlan {
        name: name.to_string(),
        python: lock.target.python.clone(),
        interpreter: lock.target.installation.as_ref().map(|pin| {
            crate::interpreter::InterpreterPin {
                version: pin.version.clone(),
                content_hash: pin.content_hash.clone(),
            }
        }),
        packages,
        toolchain,
        local_packages: Vec::new(),
    })
}

/// The builder's toolchain for a lock's pin: the host's compiler as identified at lock time, or a gcc from Debian
/// (its `.deb` URLs are the archive joined with each `Filename`).
pub fn toolchain_from_pin(pin: &ToolchainPin) -> Toolchain {
    let tool = pin
        .tools
        .iter()
        .find(|t| t.command == pin.name)
        .or(pin.tools.first());
    let debian = pin.debian.as_ref().map(|source| DebianGcc {
        major: pin.requested.clone(),
        version: source.version.clone(),
        suite: source.suite.clone(),
        arch: source.arch().to_string(),
        debs: pin
            .debs
            .iter()
            .map(|deb| DebPlan {
                name: deb.name.clone(),
                version: deb.version.clone(),
                url: format!("{}/{}", source.archive.trim_end_matches('/'), deb.filename),
                sha256: deb.sha256.clone(),
                size: deb.size,
            })
            .collect(),
    });
    Toolchain {
        name: pin.name.clone(),
        version: match (&debian, tool) {
            (Some(gcc), _) => gcc.version.clone(),
            (None, Some(t)) => t.version.clone(),
            (None, None) => pin.requested.clone(),
        },
        sha256: tool.map(|t| t.sha256.clone()),
        path: None,
        debian,
    }
}

pub(crate) fn package_plan(
    package: &LockedPackage,
    build: Option<&LockedBuild>,
) -> Result<PackagePlan> {
    let artifact = Artifact {
        url: package.artifact.url.clone(),
        filename: package.artifact.filename.clone(),
        sha256: package.artifact.sha256.clone(),
        size: (package.artifact.size > 0).then_some(package.artifact.size),
    };
    let build = match (package.artifact.kind, build) {
        (ArtifactKind::Wheel, _) => None,
        (ArtifactKind::Sdist, Some(build)) => Some(SourceBuildPlan {
            requires: build
                .packages
                .iter()
                .map(|p| package_plan(p, None))
                .collect::<Result<_>>()?,
            env: build.env.clone(),
            against: build.against.clone(),
        }),
        // An sdist without a `[[build]]` (a lock from before plain sdists got theirs): built with its own
        // backend and no extra requirements.
        (ArtifactKind::Sdist, None) => Some(SourceBuildPlan::default()),
    };
    Ok(PackagePlan {
        name: package.name.clone(),
        version: package.version.clone(),
        artifact,
        dependencies: package
            .dependencies
            .iter()
            .map(|d| d.name.clone())
            .collect(),
        build,
    })
}

/// The shortest dependency chain from a requested package to `target` over the lock's edges, e.g.
/// `["tensorflow-cpu", "keras", "numpy"]`; `None` when nothing requested reaches it.
pub fn why_depends(lock: &Lockfile, target: &str) -> Option<Vec<String>> {
    let target = hvd_resolver::names::normalize_name(target);
    let edges: BTreeMap<&str, Vec<&str>> = lock
        .packages
        .iter()
        .map(|p| {
            (
                p.name.as_str(),
                p.dependencies.iter().map(|d| d.name.as_str()).collect(),
            )
        })
        .collect();
    let roots: Vec<String> = lock
        .request
        .packages
        .iter()
        .map(|r| {
            let name: String = r
                .requirement
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                .collect();
            hvd_resolver::names::normalize_name(&name)
        })
        .collect();
    let mut previous: BTreeMap<String, Option<String>> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::new();
    for root in roots {
        if previous.insert(root.clone(), None).is_none() {
            queue.push_back(root);
        }
    }
    while let Some(name) = queue.pop_front() {
        if name == target {
            let mut chain = vec![name.clone()];
            let mut current = name;
            while let Some(Some(parent)) = previous.get(&current) {
                chain.push(parent.clone());
                current = parent.clone();
            }
            chain.reverse();
            return Some(chain);
        }
        for next in edges.get(name.as_str()).into_iter().flatten() {
            if !previous.contains_key(*next) {
                previous.insert(next.to_string(), Some(name.clone()));
                queue.push_back(next.to_string());
            }
        }
    }
    None
}
