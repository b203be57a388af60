//! A gcc from Debian's archive as a store path: the locked `.deb`s fetched and checked against their sha256,
//! merged into one tree (`deb.rs`), and wrapped so the compiler finds its own cc1, as, ld, headers and glibc.
//!
//! Layout of the path:
//!
//! ```text
//! <store>/<hash>-gcc-10.2.1/
//!   root/        the packages' files (usr/bin/gcc-10, usr/lib/gcc/<triplet>/10/, usr/include, lib/...), for the
//!                locked Debian arch (amd64: triplet x86_64-linux-gnu; arm64: aarch64-linux-gnu), which must be
//!                this machine's
//!   run-libs/    links to the shared libraries the compiler's programs load (cc1 needs libisl, libmpc, ...);
//!                glibc's own (package `libc6`) are left out: the compiler runs on the host's glibc
//!   bin/         gcc, g++, cc, c++, cpp: shell wrappers
//! ```
//!
//! A wrapper runs `root/usr/bin/gcc-N --sysroot=root -B root/usr/bin/` with `run-libs` first on
//! `LD_LIBRARY_PATH`: the driver finds cc1 and its headers relative to itself, the assembler and linker through
//! `-B`, and glibc's headers, startup files and `libc.so` in the sysroot, i.e. the suite's, so what it builds
//! needs no newer glibc than the suite's (the host's glibc, which is at least as new, runs it).

pub mod deb;

use std::path::{Path, PathBuf};

use hvd_resolver::Sha256;
use hvd_resolver::debian::DebianArch;

use crate::derivation::{Derivation, DerivationKind};
use crate::error::{Error, Result};
use crate::fetch::{Artifact, Fetcher};
use crate::progress::Progress;
use crate::store::{BuildOutput, Store};

/// Bump when the layout or the wrappers change: part of the derivation.
const ASSEMBLER: &str = "hvd-debian-gcc-1";

/// One locked `.deb`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DebPlan {
    pub name: String,
    pub version: String,
    /// The archive's base URL joined with the package's `Filename`.
    pub url: String,
    pub sha256: Sha256,
    pub size: u64,
}

/// A gcc pinned from a Debian suite.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DebianGcc {
    /// The requested major version, e.g. `10` (names `usr/bin/gcc-10`).
    pub major: String,
    /// The upstream version, e.g. `10.2.1`.
    pub version: String,
    pub suite: String,
    /// Debian's name of the architecture the packages are for (`amd64`, `arm64`).
    pub arch: String,
    pub debs: Vec<DebPlan>,
}

impl DebianGcc {
    /// Its store derivation: every package's name, version and sha256.
    pub fn derivation(&self) -> Derivation {
        let mut derivation = Derivation::new(DerivationKind::Toolchain, "gcc", &self.version)
            .input("assembler", ASSEMBLER)
            .input("major", &self.major)
            .input("suite", &self.suite)
            .input("arch", &self.arch);
        for deb in &self.debs {
            derivation.inputs.insert(
                format!("deb.{}", deb.name),
                format!("{} sha256:{}", deb.version, deb.sha256),
            );
        }
        derivation
    }

    /// Fetch, check, unpack and wrap (nothing when the path exists); returns the store path.
    pub fn realize(
        &self,
        store: &Store,
        offline: bool,
        progress: &dyn Progress,
    ) -> Result<PathBuf> {
        let arch = self.host_arch()?;
        let derivation = self.derivation();
        let realized = store.realize(&derivation, false, |target| {
            let artifacts: Vec<Artifact> = self
                .debs
                .iter()
                .map(|deb| Artifact {
                    url: deb.url.clone(),
                    filename: format!("{}_{}.deb", deb.name, deb.version),
                    sha256: deb.sha256.clone(),
                    size: Some(deb.size).filter(|s| *s > 0),
                })
                .collect();
            let files =
                Fetcher::new(store.downloads_dir(), offline).fetch_all(&artifacts, progress)?;
            let debs: Vec<deb::Deb> = self
                .debs
                .iter()
                .zip(files)
                .map(|(plan, path)| deb::Deb {
                    name: plan.name.clone(),
                    path,
                })
                .collect();
            let scratch = target
                .out
                .parent()
                .map(|p| p.join("scratch"))
                .ok_or_else(|| Error::Invalid("a store temp directory has no parent".into()))?;
            fs_err::create_dir_all(&scratch)?;
            let root = target.out.join("root");
            let owners = deb::unpack_debs(&debs, &scratch, &root)?;
            // glibc's own libraries must not shadow the host's when the compiler's programs run.
            let glibc: Vec<String> = owners
                .iter()
                .filter(|(_, owner)| *owner == "libc6")
                .filter_map(|(path, _)| path.rsplit('/').next().map(str::to_string))
                .collect();
            link_run_libs(&root, &target.out.join("run-libs"), &glibc, arch.triplet)?;
            self.write_wrappers(&root, &target.out.join("bin"), &target.final_path)?;
            Ok(BuildOutput::default())
        })?;
        Ok(realized.path)
    }

    /// This machine's architecture, which must be the one the packages were locked for.
    fn host_arch(&self) -> Result<DebianArch> {
        let host = DebianArch::host().map_err(|e| Error::Invalid(e.to_string()))?;
        if host.name != self.arch {
            return Err(Error::Invalid(format!(
                "the lock's gcc {} from Debian {} is for {}, and this machine is {} ({}); relock on this machine \
                 (`hvd lock --upgrade`) or build on a {} one",
                self.version, self.suite, self.arch, host.name, host.rust, self.arch
            )));
        }
        Ok(host)
    }

    fn write_wrappers(&self, root: &Path, bin: &Path, final_path: &Path) -> Result<()> {
        fs_err::create_dir_all(bin)?;
        let final_root = final_path.join("root");
        let run_libs = final_path.join("run-libs");
        for (wrapper, program) in [
            ("gcc", format!("gcc-{}", self.major)),
            ("cc", format!("gcc-{}", self.major)),
            ("g++", format!("g++-{}", self.major)),
            ("c++", format!("g++-{}", self.major)),
            ("cpp", format!("cpp-{}", self.major)),
        ] {
            if !root.join("usr/bin").join(&program).is_file() {
                if wrapper == "gcc" {
                    return Err(Error::Invalid(format!(
                        "the packages of gcc {} from Debian {} have no `usr/bin/{program}`",
                        self.version, self.suite
                    )));
                }
                continue;
            }
            let script = format!(
                "#!/bin/sh\n\
                 # {wrapper}: gcc {version} from Debian {suite}, as hvd unpacked it into this store path.\n\
                 LD_LIBRARY_PATH={libs}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}\n\
                 export LD_LIBRARY_PATH\n\
                 exec {root}/usr/bin/{program} --sysroot={root} -B {root}/usr/bin/ \"$@\"\n",
                version = self.version,
                suite = self.suite,
                libs = shell_quote(&run_libs),
                root = shell_quote(&final_root),
            );
            let mut file = crate::store::create_new_file(&bin.join(wrapper), 0o755)?;
            std::io::Write::write_all(&mut file, script.as_bytes())?;
        }
        Ok(())
    }
}

/// `path` in single quotes for sh (a store root is a plain path, but quoting costs nothing).
fn shell_quote(path: &Path) -> String {
    format!("'{}'", path.display().to_string().replace('\'', "'\\''"))
}

/// `run-libs/`: a relative link to every shared library in the tree's library folders but glibc's.
fn link_run_libs(root: &Path, run_libs: &Path, glibc: &[String], triplet: &str) -> Result<()> {
    fs_err::create_dir_all(run_libs)?;
    for dir in [format!("lib/{triplet}"), format!("usr/lib/{triplet}")] {
        let Ok(entries) = fs_err::read_dir(root.join(&dir)) else {
            continue;
        };
        let mut names: Vec<String> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.file_type().is_ok_and(|t| !t.is_dir()))
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .filter(|n| n.contains(".so") && !glibc.contains(n))
            .collect();
        names.sort();
        for name in names {
            let link = run_libs.join(&name);
            if link.symlink_metadata().is_ok() {
                continue;
            }
            std::os::unix::fs::symlink(format!("../root/{dir}/{name}"), &link)?;
        }
    }
    Ok(())
}
