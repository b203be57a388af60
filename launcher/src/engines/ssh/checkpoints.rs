//! The ssh engine's refusal of a checkpoint directory inside the project directory on hosts that lack it (their
//! ranks run in a copy of the project's files, so rank 0 there would keep its checkpoints on its own disk).

use std::path::{Path, PathBuf};

use super::SshSetup;
use crate::engine::Plan;

impl SshSetup {
    /// Why `host`, which lacks the project directory (its ranks would run in a work directory with a copy of the
    /// project's files), must not run a distributed step of `plan` (`only`: that step alone) whose checkpoint
    /// directory (`HVD_CHECKPOINT_DIR`) is inside the project directory: rank 0 there would create the launcher's path
    /// on that host's own disk, where neither the other hosts nor the next `hvd run` find its checkpoints. An elastic
    /// step may run on any host (replacements); another on its layout's. The host check asks as soon as it knows the
    /// host lacks the directory, before it sends files or delivers the env there.
    pub(super) fn unshared_checkpoints(
        &self,
        plan: &Plan,
        only: Option<&str>,
        host: &str,
    ) -> Option<String> {
        let project = resolved(&plan.project_dir);
        plan.steps
            .iter()
            .filter(|s| s.workers.is_some() && only.is_none_or(|name| s.name == name))
            .find_map(|step| {
                let dir = step.env.get(crate::env_vars::HVD_CHECKPOINT_DIR)?;
                if !resolved(Path::new(dir)).starts_with(&project) {
                    return None;
                }
                let on_host = match step.min_workers {
                    Some(_) => self.hosts.iter().any(|(h, _)| h == host),
                    None => step.layout.hosts().iter().any(|(h, _)| h == host),
                };
                on_host.then(|| {
                    format!(
                        "step `{}` keeps its checkpoints in {dir}, inside the project directory {}, but host `{host}` \
                         does not have the project directory (its ranks would run in a copy of the project's files): \
                         rank 0 there would write the checkpoints to that host's own disk, where neither the other \
                         hosts nor the next `hvd run` find them; give `checkpoints` (or `--checkpoints`) an absolute \
                         path on storage every host mounts at the same path, outside the project directory, or an \
                         `s3://bucket/prefix` URL",
                        step.name,
                        plan.project_dir.display(),
                    )
                })
            })
    }
}

/// `path` as the file system resolves it: its longest existing prefix canonicalized (symbolic links and `..`
/// resolved), the rest with `.` and `..` applied lexically. Two spellings of one directory (through a symbolic link,
/// or with `..`) compare equal.
fn resolved(path: &Path) -> PathBuf {
    use std::path::Component;
    let (base, rest) = path
        .ancestors()
        .find_map(|prefix| {
            let canonical = std::fs::canonicalize(prefix).ok()?;
            Some((canonical, path.strip_prefix(prefix).ok()?))
        })
        .unwrap_or_else(|| (PathBuf::new(), path));
    let mut out = base;
    for component in rest.components() {
        match component {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::PlannedStep;
    use crate::env::WorkerLayout;
    use std::sync::Arc;

    use super::super::tests::setup;

    /// A plan with steps `prep` (2 workers, no checkpoints) and `train` (elastic, checkpoints in `checkpoints`), in
    /// project directory `project`.
    fn checkpoint_plan(s: &SshSetup, project: &Path, checkpoints: &Path) -> Plan {
        let step = |name: &str, min: Option<u32>, ckpt: Option<&Path>| PlannedStep {
            name: name.into(),
            command: "true".into(),
            needs: Vec::new(),
            workers: Some(2),
            layout: WorkerLayout::spread(&s.hosts, 2),
            env: ckpt
                .map(|d| {
                    let dir = d.display().to_string();
                    (crate::env_vars::HVD_CHECKPOINT_DIR.to_owned(), dir)
                })
                .into_iter()
                .collect(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            timeout: None,
            restarts: 0,
            min_workers: min,
            elastic: Default::default(),
        };
        Plan {
            project: "p".into(),
            project_dir: project.to_path_buf(),
            state_dir: project.join(".hvd"),
            steps: vec![
                step("prep", None, None),
                step("train", Some(1), Some(checkpoints)),
            ],
            gpus_per_worker: 0,
            env_dir: None,
            caches: Vec::new(),
            trusted_keys: Vec::new(),
            engine: Arc::new(s.clone()),
            notes: Vec::new(),
        }
    }

    /// A checkpoint directory is inside the project directory as the file system sees them: through a symbolic
    /// link to the project (`/home/u` -> `/data/home/u`) it is refused, `PROJECT/../shared` is not; a host found for
    /// step `prep` (no checkpoints) is not refused for step `train`'s.
    #[test]
    fn unshared_checkpoints_compare_resolved_paths_and_only_the_growing_step() {
        let s = setup(None);
        let root = tempfile::tempdir().unwrap();
        let real = root.path().join("data/home/u/proj");
        std::fs::create_dir_all(&real).unwrap();
        let link = root.path().join("home");
        std::os::unix::fs::symlink(root.path().join("data/home"), &link).unwrap();
        let via_link = link.join("u/proj");
        for (project, ckpt) in [
            (&real, via_link.join("ckpt")),
            (&via_link, real.join("ckpt/not/yet")),
            (&real, real.join("x/../ckpt")),
        ] {
            let plan = checkpoint_plan(&s, project, &ckpt);
            let why = s.unshared_checkpoints(&plan, None, "h1");
            assert!(
                why.as_deref()
                    .is_some_and(|w| w.contains("step `train` keeps its checkpoints")),
                "{project:?} {ckpt:?}: {why:?}"
            );
            assert_eq!(s.unshared_checkpoints(&plan, Some("prep"), "h9"), None);
            assert!(s.unshared_checkpoints(&plan, Some("train"), "h1").is_some());
        }
        for ckpt in [real.join("../shared"), via_link.join("../../u2/ckpt")] {
            let plan = checkpoint_plan(&s, &real, &ckpt);
            assert_eq!(s.unshared_checkpoints(&plan, None, "h1"), None, "{ckpt:?}");
        }
        // A directory beside the project whose name starts with the project's is not inside it.
        let plan = checkpoint_plan(&s, &real, &root.path().join("data/home/u/proj2/ckpt"));
        assert_eq!(s.unshared_checkpoints(&plan, None, "h1"), None);
    }

    /// A host without the project directory that must not run the ranks (its checkpoints) is refused by the host
    /// check itself, before the project's files are sent there; one that may run them gets them.
    #[test]
    fn a_refused_host_is_refused_before_the_projects_files_are_sent() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let project = d.join("project");
        std::fs::create_dir_all(&project).unwrap();
        std::fs::write(project.join("train.py"), "print(1)\n").unwrap();
        // The host sees the project at `<project>-host` (which it lacks) and keeps its cache in `d/cache`.
        let ssh = d.join("elsewhere-ssh");
        std::fs::write(
            &ssh,
            format!(
                "#!/bin/sh\nwhile [ \"$1\" != -- ]; do shift; done; shift\nexport XDG_CACHE_HOME={}\n\
                 exec /bin/sh -c \"$(printf '%s' \"$*\" | sed \"s#{p}#{p}-host#g\")\"\n",
                d.join("cache").display(),
                p = project.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&ssh, std::fs::Permissions::from_mode(0o755)).unwrap();
        let mut s = setup(Some("lo"));
        s.hosts = vec![("a".into(), 1)];
        s.ssh = vec![ssh.display().to_string()];
        let work = d.join("cache/hvd/work");
        let err = s
            .check_hosts_refusing(&project, None, &[], &|host| {
                Some(format!("no checkpoints on `{host}`"))
            })
            .unwrap_err()
            .to_string();
        assert!(err.contains("no checkpoints on `a`"), "{err}");
        assert!(!work.exists(), "files were sent to a refused host");
        assert!(s.work_dirs.lock().unwrap().is_empty());
        s.check_hosts_refusing(&project, None, &[], &|_| None)
            .unwrap();
        assert!(work.is_dir(), "the project's files were not sent");
        assert!(s.work_dirs.lock().unwrap().contains_key("a"));
    }
}
