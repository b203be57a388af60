//! `hvd export`: the project for another system. `hvd export k8s FILE`: Kubernetes manifests (a JobSet following
//! the step graph, or MPIJobs).

use std::io::Write as _;
use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use hvd_launcher::engines::k8s::{self, Flavour};

use crate::exit::{CommandResult, Failure, Status};

#[derive(Debug, Args)]
pub struct ExportArgs {
    #[command(subcommand)]
    pub target: ExportTarget,
}

#[derive(Debug, Subcommand)]
pub enum ExportTarget {
    /// Kubernetes manifests: a JobSet (jobset.x-k8s.io/v1alpha2) whose replicated jobs follow the step graph, or
    /// one MPIJob (kubeflow.org/v2beta1) per distributed step. Image and namespace come from the `cluster` block.
    K8s(K8sArgs),
}

#[derive(Debug, Args)]
pub struct K8sArgs {
    /// The .hvd file.
    #[arg(default_value = "train.hvd")]
    pub file: PathBuf,
    /// Directory to write the manifests to (default: `k8s/` next to the file).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// `jobset` or `mpijob`.
    #[arg(long, value_name = "FLAVOUR", default_value = "jobset")]
    pub flavour: String,
    #[command(flatten)]
    pub lock: super::build::LockMode,
    /// With a cache and a trusted key, the env is built here and the pods pull it from the caches at start (`hvd
    /// worker-env --pull`; an MPIJob's workers in an init container): the image needs only `hvd` and glibc.
    #[command(flatten)]
    pub caches: super::substitute::CacheOptions,
}

pub fn run(args: ExportArgs) -> CommandResult {
    match args.target {
        ExportTarget::K8s(args) => {
            let project = hvd_lang::load_file(&args.file)
                .map_err(|d| Failure::new(Status::Usage, miette::Report::new(d)))?;
            let flavour = Flavour::parse(&args.flavour).ok_or_else(|| {
                Failure::usage(format!(
                    "unknown flavour `{}`: use `jobset` or `mpijob`",
                    args.flavour
                ))
            })?;
            let out = args
                .out
                .clone()
                .unwrap_or_else(|| args.file.parent().unwrap_or(Path::new("")).join("k8s"));
            let delivery = delivery(&args, &project)?;
            let files = write_k8s(&project, flavour, delivery.as_ref(), &out)?;
            for file in files {
                println!("{}", file.display());
            }
            Ok(Status::Success)
        }
    }
}

/// With caches and trusted keys (flags, `HVD_CACHES`/`HVD_TRUSTED_KEYS`, the file's `cluster { caches }`): the env,
/// built here (from the caches where they have it), and where the pods pull it from. Caches without any trusted key
/// deliver nothing (the pods would trust nothing): the image must then have the env, as before.
fn delivery(
    args: &K8sArgs,
    project: &hvd_lang::model::Project,
) -> Result<Option<k8s::Delivery>, Failure> {
    let caches = args.caches.urls(Some(project));
    if caches.is_empty() {
        return Ok(None);
    }
    let trusted_keys = args.caches.trusted_key_texts()?;
    if trusted_keys.is_empty() {
        return Ok(None);
    }
    let ready = super::build::ensure_env_with(&args.file, args.lock, false, &args.caches)?;
    Ok(Some(k8s::Delivery {
        env: ready.build.env,
        caches,
        trusted_keys,
    }))
}

/// Writes the manifests of `project` into `out`; returns the files written. Notes about steps that do not fit go
/// to stderr.
fn write_k8s(
    project: &hvd_lang::model::Project,
    flavour: Flavour,
    delivery: Option<&k8s::Delivery>,
    out: &Path,
) -> Result<Vec<PathBuf>, Failure> {
    let export = k8s::export_with(project, flavour, delivery)
        .map_err(|e| Failure::from_error(Status::Usage, &e))?;
    for note in &export.notes {
        let _ = writeln!(std::io::stderr().lock(), "hvd: note: {note}");
    }
    k8s::write_manifests(&export, out).map_err(|e| Failure::from_error(Status::Failure, &e))
}
