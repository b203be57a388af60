//! A CUDA toolkit for source builds, assembled as a store path from NVIDIA's wheels among a build's locked
//! requirements (`std.cuda`): nvcc, the CUDA headers and libraries and NCCL in one `CUDA_HOME`-like tree.
//!
//! A source build gets a toolkit when one of its build requirements is `nvidia-cuda-nvcc` (CUDA 13 on; the CUDA 12
//! wheel `nvidia-cuda-nvcc-cu12` ships `ptxas` but no `nvcc`). Every build requirement named `nvidia-*` then
//! contributes its `site-packages/nvidia/cu13/` and `site-packages/nvidia/nccl/` to the tree:
//!
//! ```text
//! <store>/<hash>-cuda-13.0.88/
//!   bin/       a link to each program (nvcc.profile, ptxas, fatbinary, ...); nvcc finds its tree as `bin/..` of
//!              the path it was started as, so it sees this tree, not one wheel's
//!   bin/nvcc   a script that starts the wheel's nvcc (`bin/.nvcc-real`) with deterministic output (below)
//!   include/   the headers of every wheel (cuda_runtime.h, crt/, cccl/, nccl.h, ...)
//!   lib/       the libraries, plus the development links the wheels lack (libcudart.so -> libcudart.so.13,
//!              libnccl.so -> libnccl.so.2)
//!   lib64 -> lib
//!   nvvm/      cicc and libdevice
//! ```
//!
//! Directories at the top level are real; below, a directory only one wheel has is a link to it, one several
//! wheels have is merged the same way. When two wheels have the same file, the wheel whose name sorts first wins.
//! The links point into the wheels' store paths, which the toolkit references (gc keeps them).
//!
//! nvcc left alone compiles the same source to different bytes in two builds: the intermediate files are named
//! `tmpxft_<pid>_...` in `TMPDIR` and that name lands in the object, and the module id (in the names of kernels in
//! anonymous namespaces and `__module_id_str`) hashes the source's absolute path, which holds the build
//! directory. So `bin/nvcc` adds, unless the caller chose its own: `--objdir-as-tempdir` when it compiles
//! (`-c`/`-dc`/`-dw`: intermediate files named after the object), `-Xcudafe --orig_src_path_name=<the source
//! relative to the working directory, both with links resolved>` for a single `.cu` input (none when that path
//! cannot be worked out), and `-frandom-seed=<a checksum of the object's
//! file name and that relative path>` (nvcc's and the host compiler's own random names; a different seed per
//! file, as nvcc asks).

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use hvd_resolver::Sha256;
use hvd_resolver::names::normalize_name;

use crate::derivation::{Derivation, DerivationKind};
use crate::error::{Error, Result};
use crate::store::{BuildOutput, Store};
use crate::toolchain::Toolchain;

/// Bump when the layout changes: part of the derivation (and so of every build that uses the toolkit). The text of
/// [`NVCC_WRAPPER`] is an input of its own (its sha256), so an edit of it needs no bump.
const ASSEMBLER: &str = "hvd-cuda-2";

/// The build requirement whose presence gives a build a toolkit.
pub const NVCC_PACKAGE: &str = "nvidia-cuda-nvcc";

/// The folders of a wheel's `site-packages` that make up the toolkit.
const ROOTS: [&str; 2] = ["nvidia/cu13", "nvidia/nccl"];

/// What a recipe variable's value may contain to name the toolkit (e.g. `HOROVOD_CUDA_HOME = "@CUDA_HOME@"`);
/// replaced by the toolkit's path when the build runs. The derivation keeps the placeholder, so the hash does
/// not depend on where the store is.
pub const PLACEHOLDER: &str = "@CUDA_HOME@";

/// Files a wheel's `nvidia/` folders hold that are not part of a toolkit.
const SKIPPED: [&str; 3] = ["__init__.py", "__pycache__", ".metadata"];

/// The name under `bin/` of the wheel's nvcc, which [`NVCC_WRAPPER`] starts (nvcc reads its tree from the path it
/// was started as: `bin/..`, this toolkit).
const NVCC_REAL: &str = ".nvcc-real";

/// `bin/nvcc`: the wheel's nvcc with deterministic output (see the module's documentation); `@REAL@` is the
/// quoted path of [`NVCC_REAL`]. POSIX sh and coreutils only: it runs inside the build sandbox.
const NVCC_WRAPPER: &str = r#"#!/bin/sh
# hvd: nvcc with reproducible output (hvd's builder/src/cuda.rs). It adds what the caller did not choose:
# --objdir-as-tempdir when compiling, the source's path relative to the working directory (both physical, links
# resolved; none when that fails) as its module id path, and -frandom-seed from the object's name and that path.
real=@REAL@
seed=1 objtemp= compile= srcpath=1 out= src= sources=0 prev=
for arg in "$@"; do
  case $prev in
    -o|--output-file) out=$arg ;;
    -Xcudafe|--cudafe-options) case $arg in *orig_src_path_name*) srcpath= ;; esac ;;
  esac
  case $arg in
    -frandom-seed*|--frandom-seed*) seed= ;;
    -objtemp|--objdir-as-tempdir) objtemp=given ;;
    -c|--compile|-dc|--device-c|-dw|--device-w) compile=1 ;;
    -o=*|--output-file=*) out=${arg#*=} ;;
    -Xcudafe=*orig_src_path_name*|--cudafe-options=*orig_src_path_name*) srcpath= ;;
    -*) ;;
    *.cu) sources=$((sources + 1)); src=$arg ;;
  esac
  prev=$arg
done
if [ "$sources" -ne 1 ]; then
  srcpath= rel=
else
  case $src in
    /*) rel=$(realpath --relative-to="$(pwd -P)" -- "$src" 2>/dev/null) || rel= ;;
    *) rel=$src ;;
  esac
  # -Xcudafe splits its value at commas.
  case $rel in *,*|*" "*|"") srcpath= ;; esac
fi
if [ -n "$compile" ] && [ -z "$objtemp" ]; then
  set -- --objdir-as-tempdir "$@"
fi
if [ -n "$srcpath" ]; then
  set -- -Xcudafe "--orig_src_path_name=$rel" "$@"
fi
if [ -n "$seed" ]; then
  sum=$(printf '%s\n%s\n' "${out##*/}" "$rel" | cksum) || exit 1
  set -- "-frandom-seed=${sum%% *}" "$@"
fi
exec "$real" "$@"
"#;

/// How deep the merge of the wheels' trees goes before it is refused (the real wheels need 4).
const MAX_DEPTH: usize = 16;

/// One build requirement as the toolkit sees it.
#[derive(Debug, Clone)]
pub struct Part {
    /// Its normalized name, e.g. `nvidia-cuda-runtime`.
    pub name: String,
    pub version: String,
    /// Its derivation hash.
    pub hash: String,
}

/// The toolkit's derivation for a build with these requirements (`None`: no `nvidia-cuda-nvcc` among them): its
/// inputs are the derivation hashes of every `nvidia-*` requirement.
pub fn derivation(requirements: &[Part]) -> Option<Derivation> {
    let nvcc = requirements
        .iter()
        .find(|p| normalize_name(&p.name) == NVCC_PACKAGE)?;
    let mut derivation = Derivation::new(DerivationKind::Toolchain, "cuda", &nvcc.version)
        .input("assembler", ASSEMBLER)
        .input(
            "nvcc-wrapper",
            Sha256::of_bytes(NVCC_WRAPPER.as_bytes()).as_str(),
        );
    for part in parts(requirements) {
        derivation.input_derivations.insert(
            format!("wheel.{}", normalize_name(&part.name)),
            part.hash.clone(),
        );
    }
    Some(derivation)
}

/// The requirements that contribute to a toolkit, by name.
fn parts(requirements: &[Part]) -> Vec<&Part> {
    let mut parts: Vec<&Part> = requirements
        .iter()
        .filter(|p| normalize_name(&p.name).starts_with("nvidia-"))
        .collect();
    parts.sort_by_key(|p| normalize_name(&p.name));
    parts
}

/// A realized toolkit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaToolkit {
    /// Its store path (the `CUDA_HOME`).
    pub path: PathBuf,
    /// nvcc's wheel version, e.g. `13.0.88`.
    pub version: String,
}

impl CudaToolkit {
    /// Assemble the toolkit of a build whose requirements are `requirements`, each with its realized store path
    /// (nothing when the path exists; `None` when no requirement is `nvidia-cuda-nvcc`).
    pub fn for_build(
        store: &Store,
        requirements: &[(Part, PathBuf)],
    ) -> Result<Option<CudaToolkit>> {
        let parts_only: Vec<Part> = requirements.iter().map(|(p, _)| p.clone()).collect();
        let Some(derivation) = derivation(&parts_only) else {
            return Ok(None);
        };
        let mut sources: Vec<(&str, &Path)> = requirements
            .iter()
            .filter(|(p, _)| normalize_name(&p.name).starts_with("nvidia-"))
            .map(|(p, path)| (p.name.as_str(), path.as_path()))
            .collect();
        sources.sort_by_key(|(name, _)| normalize_name(name));
        let realized = store.realize(&derivation, false, |target| {
            assemble(&target.out, &target.final_path, &sources)?;
            Ok(BuildOutput {
                references: sources
                    .iter()
                    .filter_map(|(_, path)| path.file_name()?.to_str().map(str::to_string))
                    .collect(),
                ..BuildOutput::default()
            })
        })?;
        Ok(Some(CudaToolkit {
            path: realized.path,
            version: derivation.version,
        }))
    }

    /// `bin/` (goes on the build's `PATH`).
    pub fn bin(&self) -> PathBuf {
        self.path.join("bin")
    }

    /// The variables a build sees: `CUDA_HOME` and `CUDA_PATH` (which CMake's FindCUDAToolkit reads) are the
    /// toolkit, `CUDACXX` (CMake's CUDA compiler) its nvcc.
    pub fn variables(&self) -> Vec<(&'static str, OsString)> {
        let home = self.path.clone().into_os_string();
        vec![
            (crate::env_vars::CUDA_HOME, home.clone()),
            (crate::env_vars::CUDA_PATH, home),
            (
                crate::env_vars::CUDACXX,
                self.bin().join("nvcc").into_os_string(),
            ),
        ]
    }

    /// The largest gcc major version nvcc accepts as its host compiler, from the toolkit's
    /// `include/crt/host_config.h` (`#if __GNUC__ > 15` ... `#error -- unsupported GNU version!`); `None` when the
    /// header says nothing readable.
    pub fn max_gcc(&self) -> Option<u32> {
        let text = fs_err::read_to_string(self.path.join("include/crt/host_config.h")).ok()?;
        max_gcc_in(&text)
    }

    /// Refuses a host compiler nvcc does not accept, naming both and what to do.
    pub fn check_compiler(&self, toolchain: Option<&Toolchain>) -> Result<()> {
        let Some(toolchain) = toolchain.filter(|t| t.name == "gcc") else {
            return Ok(());
        };
        let (Some(max), Some(major)) = (self.max_gcc(), gcc_major(&toolchain.version)) else {
            return Ok(());
        };
        if major > max {
            return Err(Error::Invalid(format!(
                "nvcc {} (std.cuda) accepts gcc {max} or older as its host compiler, and this build's compiler is \
                 gcc {}; pin an older one with `toolchain = std.gcc {{ version = \"{max}\" }}`",
                self.version, toolchain.version
            )));
        }
        Ok(())
    }

    /// Whether a file (or link) under `tree` holds the toolkit's path, e.g. a RUNPATH CMake wrote for the shared
    /// NCCL: the build's output then needs the toolkit at run time and references it, so gc keeps it and a cache
    /// closure carries it.
    pub fn referenced_in(&self, tree: &Path) -> Result<bool> {
        let needle = self.path.as_os_str().as_encoded_bytes();
        for entry in walkdir::WalkDir::new(tree).follow_links(false) {
            let entry =
                entry.map_err(|e| Error::Invalid(format!("reading {}: {e}", tree.display())))?;
            let found = if entry.path_is_symlink() {
                fs_err::read_link(entry.path())?
                    .as_os_str()
                    .as_encoded_bytes()
                    .windows(needle.len())
                    .any(|w| w == needle)
            } else if entry.file_type().is_file() {
                fs_err::read(entry.path())?
                    .windows(needle.len())
                    .any(|w| w == needle)
            } else {
                false
            };
            if found {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The store path names a build's output `tree` refers to: the toolkit's when [`Self::referenced_in`].
    pub fn references(&self, tree: &Path) -> Result<BTreeSet<String>> {
        let mut references = BTreeSet::new();
        if self.referenced_in(tree)?
            && let Some(name) = self.path.file_name().and_then(|n| n.to_str())
        {
            references.insert(name.to_string());
        }
        Ok(references)
    }

    /// `value` with every [`PLACEHOLDER`] replaced by the toolkit's path.
    pub fn substitute(&self, value: &str) -> String {
        value.replace(PLACEHOLDER, &self.path.display().to_string())
    }
}

/// The recipe's variables for a build with `toolkit`: placeholders replaced; a placeholder without a toolkit is an
/// error naming the package and the variable.
pub fn substitute_variables(
    package: &str,
    variables: &BTreeMap<String, String>,
    toolkit: Option<&CudaToolkit>,
) -> Result<BTreeMap<String, String>> {
    variables
        .iter()
        .map(|(name, value)| match toolkit {
            Some(toolkit) => Ok((name.clone(), toolkit.substitute(value))),
            None if value.contains(PLACEHOLDER) => Err(Error::Invalid(format!(
                "the recipe variable {name} of `{package}` names the CUDA toolkit ({PLACEHOLDER}), but the build \
                 has no `{NVCC_PACKAGE}` among its requirements; add `std.cuda` to the recipe"
            ))),
            None => Ok((name.clone(), value.clone())),
        })
        .collect()
}

/// The major version of a gcc version (`12.2.0` -> 12, `14` -> 14).
fn gcc_major(version: &str) -> Option<u32> {
    version.split('.').next()?.parse().ok()
}

/// The `N` of the first `#if __GNUC__ > N` in host_config.h.
fn max_gcc_in(text: &str) -> Option<u32> {
    text.lines().find_map(|line| {
        let rest = line.trim().strip_prefix("#if")?.trim();
        let n = rest.strip_prefix("__GNUC__")?.trim().strip_prefix('>')?;
        n.trim().parse().ok()
    })
}

/// Fill `out` (to become the store path `final_path`) from the wheels' store paths `sources` (in priority order).
fn assemble(out: &Path, final_path: &Path, sources: &[(&str, &Path)]) -> Result<()> {
    let mut roots: Vec<PathBuf> = Vec::new();
    for (_, path) in sources {
        for root in ROOTS {
            let dir = path.join("site-packages").join(root);
            if fs_err::symlink_metadata(&dir).is_ok_and(|m| m.is_dir()) {
                roots.push(dir);
            }
        }
    }
    if !roots.iter().any(|r| r.join("bin").join("nvcc").is_file()) {
        return Err(Error::Invalid(format!(
            "the CUDA wheels have no `bin/nvcc` under `{}`: `{NVCC_PACKAGE}` of CUDA 13 or later ships it",
            ROOTS[0]
        )));
    }
    // Top-level directories are always real (so lib/ can take the development links).
    let mut top: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for root in &roots {
        for (name, path) in entries(root)? {
            top.entry(name).or_default().push(path);
        }
    }
    for (name, paths) in &top {
        let target = out.join(name);
        // A wheel's top-level folder may be a link (`lib -> lib64`): it is still merged into a real directory
        // of the toolkit, so nothing below is ever written through a link into a wheel's read-only store path.
        let mut dirs = Vec::with_capacity(paths.len());
        for path in paths {
            if let Some(dir) = top_level_dir(path)? {
                dirs.push(dir);
            }
        }
        if !dirs.is_empty() && dirs.len() == paths.len() {
            fs_err::create_dir(&target)?;
            merge(&target, &dirs, 1)?;
        } else {
            std::os::unix::fs::symlink(&paths[0], &target)?;
        }
    }
    let lib = out.join("lib");
    if is_real_dir(&lib) {
        development_links(&lib)?;
        if fs_err::symlink_metadata(out.join("lib64")).is_err() {
            std::os::unix::fs::symlink("lib", out.join("lib64"))?;
        }
    }
    wrap_nvcc(&out.join("bin"), &final_path.join("bin"))
}

/// Replace the link `bin/nvcc` by [`NVCC_WRAPPER`], which starts the wheel's nvcc as `bin/.nvcc-real` of the
/// toolkit at `final_bin` (its path once in the store).
fn wrap_nvcc(bin: &Path, final_bin: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let nvcc = bin.join("nvcc");
    let meta = fs_err::symlink_metadata(&nvcc)?;
    if !is_real_dir(bin) || !meta.file_type().is_symlink() {
        return Err(Error::Invalid(format!(
            "the CUDA wheels' `bin/nvcc` did not become a link in a directory of the toolkit at `{}`",
            nvcc.display()
        )));
    }
    let real = fs_err::read_link(&nvcc)?;
    std::os::unix::fs::symlink(&real, bin.join(NVCC_REAL))?;
    fs_err::remove_file(&nvcc)?;
    let real_path = final_bin.join(NVCC_REAL);
    let Some(real_path) = real_path.to_str() else {
        return Err(Error::Invalid(format!(
            "the store path `{}` is not UTF-8; nvcc's wrapper cannot name it",
            final_bin.display()
        )));
    };
    let quoted = format!("'{}'", real_path.replace('\'', r"'\''"));
    fs_err::write(&nvcc, NVCC_WRAPPER.replace("@REAL@", &quoted))?;
    fs_err::set_permissions(&nvcc, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// The entries of `dir` a toolkit takes, by name.
fn entries(dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let mut out = Vec::new();
    for entry in fs_err::read_dir(dir)? {
        let entry = entry?;
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if SKIPPED.contains(&name.as_str()) {
            continue;
        }
        out.push((name, entry.path()));
    }
    out.sort();
    Ok(out)
}

/// `path` (a top-level entry of a wheel's CUDA root) as the directory it is or links to, or `None` when it is not
/// a directory. A link must stay inside its root: a wheel is hostile input, and a link to `/usr/lib` would make
/// the toolkit a view of the build machine.
fn top_level_dir(path: &Path) -> Result<Option<PathBuf>> {
    let meta = fs_err::symlink_metadata(path)?;
    if meta.is_dir() {
        return Ok(Some(path.to_path_buf()));
    }
    if !meta.file_type().is_symlink() {
        return Ok(None);
    }
    let root = path.parent().unwrap_or(path);
    let (Ok(resolved), Ok(root)) = (fs_err::canonicalize(path), fs_err::canonicalize(root)) else {
        return Err(Error::Invalid(format!(
            "the CUDA wheel link `{}` does not resolve: reinstall the wheel",
            path.display()
        )));
    };
    if !resolved.starts_with(&root) {
        return Err(Error::Invalid(format!(
            "the CUDA wheel link `{}` points outside its wheel (to `{}`): refusing the wheel",
            path.display(),
            resolved.display()
        )));
    }
    Ok(resolved.is_dir().then_some(resolved))
}

fn is_real_dir(path: &Path) -> bool {
    fs_err::symlink_metadata(path).is_ok_and(|m| m.is_dir())
}

/// Link into `target` each entry of the directories `sources`: a name only one source has (or a file) as a link
/// to the first source's entry, a directory several have as a real directory merged again.
fn merge(target: &Path, sources: &[PathBuf], depth: usize) -> Result<()> {
    if depth > MAX_DEPTH {
        return Err(Error::Invalid(format!(
            "the CUDA wheels' folders nest deeper than {MAX_DEPTH} levels at `{}`",
            target.display()
        )));
    }
    let mut names: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for source in sources {
        for (name, path) in entries(source)? {
            names.entry(name).or_default().push(path);
        }
    }
    for (name, paths) in &names {
        let at = target.join(name);
        let dirs: Vec<PathBuf> = paths.iter().filter(|p| is_real_dir(p)).cloned().collect();
        if dirs.len() > 1 && dirs.len() == paths.len() {
            fs_err::create_dir(&at)?;
            merge(&at, &dirs, depth + 1)?;
        } else {
            std::os::unix::fs::symlink(&paths[0], &at)?;
        }
    }
    Ok(())
}

/// `libX.so -> libX.so.N` for each `libX.so.N...` in `lib` without a `libX.so` (the wheels ship only the runtime
/// names, and `-lX` looks for `libX.so`). The link goes to the name with the fewest version parts.
fn development_links(lib: &Path) -> Result<()> {
    let names: Vec<String> = entries(lib)?.into_iter().map(|(name, _)| name).collect();
    let mut wanted: BTreeMap<String, String> = BTreeMap::new();
    for name in &names {
        let Some((stem, version)) = name.split_once(".so.") else {
            continue;
        };
        if stem.is_empty() || !version.split('.').all(|p| p.parse::<u32>().is_ok()) {
            continue;
        }
        let dev = format!("{stem}.so");
        if names.contains(&dev) {
            continue;
        }
        let shorter = wanted
            .get(&dev)
            .is_none_or(|current| name.len() < current.len());
        if shorter {
            wanted.insert(dev, name.clone());
        }
    }
    for (dev, name) in wanted {
        std::os::unix::fs::symlink(&name, lib.join(dev))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gcc_limit_is_read_from_host_config() {
        let header = "#if defined(__GNUC__)\n\n#if __GNUC__ > 15\n\n#error -- unsupported GNU version!\n#endif\n";
        assert_eq!(max_gcc_in(header), Some(15));
        assert_eq!(max_gcc_in("#if __GNUC__ < 6\n"), None);
        assert_eq!(gcc_major("12.2.0"), Some(12));
        assert_eq!(gcc_major("14"), Some(14));
    }

    #[test]
    fn a_placeholder_without_a_toolkit_names_the_variable() {
        let vars = BTreeMap::from([("HOROVOD_CUDA_HOME".to_string(), PLACEHOLDER.to_string())]);
        let err = substitute_variables("horovod", &vars, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("HOROVOD_CUDA_HOME") && err.contains("nvidia-cuda-nvcc"),
            "{err}"
        );
        let toolkit = CudaToolkit {
            path: PathBuf::from("/s/abc-cuda-13.0.88"),
            version: "13.0.88".into(),
        };
        let done = substitute_variables("horovod", &vars, Some(&toolkit)).unwrap();
        assert_eq!(done["HOROVOD_CUDA_HOME"], "/s/abc-cuda-13.0.88");
    }

    /// A wheel's store path whose `lib` is a link to `lib64`, made read-only as the store makes it.
    fn linked_lib_wheel(dir: &Path, lib_target: &Path) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let wheel = dir.join("wheel");
        let root = wheel.join("site-packages/nvidia/cu13");
        fs_err::create_dir_all(root.join("bin")).unwrap();
        fs_err::create_dir_all(root.join("lib64")).unwrap();
        fs_err::write(root.join("bin/nvcc"), "").unwrap();
        fs_err::write(root.join("lib64/libcudart.so.13"), "").unwrap();
        std::os::unix::fs::symlink(lib_target, root.join("lib")).unwrap();
        for d in [root.join("bin"), root.join("lib64"), root.clone()] {
            fs_err::set_permissions(&d, std::fs::Permissions::from_mode(0o555)).unwrap();
        }
        wheel
    }

    #[test]
    fn a_wheel_whose_lib_is_a_link_gets_a_real_lib_and_stays_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let wheel = linked_lib_wheel(dir.path(), Path::new("lib64"));
        let out = dir.path().join("out");
        fs_err::create_dir(&out).unwrap();
        assemble(&out, &out, &[("nvidia-cuda-nvcc", &wheel)]).unwrap();
        assert!(
            is_real_dir(&out.join("lib")),
            "lib must be a real directory"
        );
        let dev = out.join("lib/libcudart.so");
        assert_eq!(
            fs_err::read_link(&dev).unwrap(),
            Path::new("libcudart.so.13")
        );
        assert!(dev.is_file(), "the development link resolves");
        let lib64 = wheel.join("site-packages/nvidia/cu13/lib64");
        assert!(
            fs_err::symlink_metadata(lib64.join("libcudart.so")).is_err(),
            "nothing may be written into the wheel"
        );
        writable(&wheel);
    }

    #[test]
    fn a_wheel_link_out_of_the_wheel_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("host-lib");
        fs_err::create_dir(&outside).unwrap();
        fs_err::write(outside.join("libhost.so.1"), "").unwrap();
        let wheel = linked_lib_wheel(dir.path(), &outside);
        let out = dir.path().join("out");
        fs_err::create_dir(&out).unwrap();
        let err = assemble(&out, &out, &[("nvidia-cuda-nvcc", &wheel)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("points outside its wheel"), "{err}");
        assert!(fs_err::symlink_metadata(outside.join("libhost.so")).is_err());
        writable(&wheel);
    }

    /// Lets the temporary directory be removed again.
    fn writable(wheel: &Path) {
        use std::os::unix::fs::PermissionsExt;
        let root = wheel.join("site-packages/nvidia/cu13");
        for d in [root.clone(), root.join("bin"), root.join("lib64")] {
            fs_err::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
    }

    /// A toolkit whose wheel's `nvcc` is a program that prints how it was started: `$0`, then each argument.
    fn echo_toolkit(dir: &Path) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let wheel = dir.join("wheel");
        let bin = wheel.join("site-packages/nvidia/cu13/bin");
        fs_err::create_dir_all(&bin).unwrap();
        fs_err::write(
            bin.join("nvcc"),
            "#!/bin/sh\nprintf '%s\\n' \"$0\"\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done\nexit \"${FIXTURE_EXIT:-0}\"\n",
        )
        .unwrap();
        fs_err::set_permissions(bin.join("nvcc"), std::fs::Permissions::from_mode(0o755)).unwrap();
        let out = dir.join("toolkit");
        fs_err::create_dir(&out).unwrap();
        assemble(&out, &out, &[("nvidia-cuda-nvcc", &wheel)]).unwrap();
        out
    }

    /// What the wheel's nvcc received when the toolkit's `bin/nvcc` ran in `cwd` with `args`.
    fn nvcc_argv(toolkit: &Path, cwd: &Path, args: &[&str]) -> Vec<String> {
        let out = std::process::Command::new(toolkit.join("bin/nvcc"))
            .args(args)
            .current_dir(cwd)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// Two builds of one project in two build directories (hvd's differ by its pid), laid out alike.
    fn build_dirs(dir: &Path) -> [(PathBuf, PathBuf); 2] {
        ["build.101.0", "build.202.0"].map(|name| {
            let src = dir.join(name).join("src/ops/cuda");
            let cwd = dir.join(name).join("src/build/temp");
            fs_err::create_dir_all(&src).unwrap();
            fs_err::create_dir_all(&cwd).unwrap();
            (cwd, src.join("cuda_kernels.cu"))
        })
    }

    #[test]
    fn the_toolkit_nvcc_makes_compiles_independent_of_the_build_directory() {
        let dir = tempfile::tempdir().unwrap();
        let toolkit = echo_toolkit(dir.path());
        let [(cwd_a, src_a), (cwd_b, src_b)] = build_dirs(dir.path());
        let compile = |cwd: &Path, src: &Path| {
            let src = src.to_str().unwrap();
            nvcc_argv(&toolkit, cwd, &["-x", "cu", "-c", src, "-o", "k.cu.o"])
        };
        let a = compile(&cwd_a, &src_a);
        // The wheel's nvcc runs as `bin/.nvcc-real` of the toolkit, so it finds the toolkit's tree as `bin/..`.
        assert_eq!(a[0], toolkit.join("bin/.nvcc-real").to_str().unwrap());
        let seed = a.iter().find(|x| x.starts_with("-frandom-seed=")).unwrap();
        assert!(
            seed["-frandom-seed=".len()..].parse::<u64>().is_ok(),
            "{seed}"
        );
        assert!(a.contains(&"--objdir-as-tempdir".to_string()), "{a:?}");
        let at = a.iter().position(|x| x == "-Xcudafe").unwrap();
        assert_eq!(
            a[at + 1],
            "--orig_src_path_name=../../ops/cuda/cuda_kernels.cu"
        );
        assert!(a.ends_with(&[
            "-x".into(),
            "cu".into(),
            "-c".into(),
            src_a.to_str().unwrap().into(),
            "-o".into(),
            "k.cu.o".into()
        ]));
        // The other build directory: only the source's absolute path differs.
        let b = compile(&cwd_b, &src_b);
        let replaced: Vec<String> = a
            .iter()
            .map(|x| x.replace("build.101.0", "build.202.0"))
            .collect();
        assert_eq!(b, replaced);
        // Another file gets another seed.
        let other = nvcc_argv(
            &toolkit,
            &cwd_a,
            &["-c", "../../ops/cuda/other.cu", "-o", "o.o"],
        );
        assert!(!other.contains(seed), "{other:?}");
        assert!(other.contains(&"--orig_src_path_name=../../ops/cuda/other.cu".to_string()));
    }

    #[test]
    fn the_toolkit_nvcc_keeps_what_the_caller_chose() {
        let dir = tempfile::tempdir().unwrap();
        let toolkit = echo_toolkit(dir.path());
        let args = [
            "-c",
            "-frandom-seed=7",
            "-objtemp",
            "-Xcudafe",
            "--orig_src_path_name=mine.cu",
            "k.cu",
        ];
        let argv = nvcc_argv(&toolkit, dir.path(), &args);
        assert_eq!(argv[1..], args.map(String::from));
        // No compile step: nothing about intermediate files; several sources: no single module id path.
        let argv = nvcc_argv(&toolkit, dir.path(), &["a.cu", "b.cu", "-o", "app"]);
        assert_eq!(argv.len(), 1 + 1 + 4, "{argv:?}");
        assert!(argv[1].starts_with("-frandom-seed="), "{argv:?}");
        // A path nvcc's -Xcudafe would split at its comma is left alone.
        let argv = nvcc_argv(&toolkit, dir.path(), &["-c", "a,b.cu"]);
        assert!(
            !argv.iter().any(|a| a.contains("orig_src_path_name")),
            "{argv:?}"
        );
    }

    #[test]
    fn the_toolkit_nvcc_passes_every_argument_intact_and_returns_the_exit_status() {
        let dir = tempfile::tempdir().unwrap();
        let toolkit = echo_toolkit(dir.path());
        let args = [
            "-DNAME=a b",
            "",
            "-DQ='x' \"y\"",
            "-DD=$HOME ${PATH} `id` $(id)",
            "-o",
            "out dir/k.o",
            "--",
            "*",
        ];
        let out = std::process::Command::new(toolkit.join("bin/nvcc"))
            .args(args)
            .env("FIXTURE_EXIT", "3")
            .current_dir(dir.path())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(3), "{out:?}");
        let argv: Vec<String> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect();
        // The seed goes first; the caller's arguments follow unchanged.
        assert!(argv[1].starts_with("-frandom-seed="), "{argv:?}");
        assert_eq!(argv[2..], args.map(String::from), "{argv:?}");
    }

    #[test]
    fn a_source_whose_physical_path_cannot_be_worked_out_gets_no_module_id_path() {
        let dir = tempfile::tempdir().unwrap();
        let toolkit = echo_toolkit(dir.path());
        // A working directory reached through a link: the relative path is computed between physical paths.
        let real = dir.path().join("real/build");
        fs_err::create_dir_all(&real).unwrap();
        std::os::unix::fs::symlink(&real, dir.path().join("via")).unwrap();
        let src = dir.path().join("real/k.cu");
        let argv = nvcc_argv(
            &toolkit,
            &dir.path().join("via"),
            &["-c", src.to_str().unwrap()],
        );
        assert!(
            argv.contains(&"--orig_src_path_name=../k.cu".to_string()),
            "{argv:?}"
        );
        // A source in a directory that does not resolve (a loop of links): realpath fails, and no bare file name
        // (which two sources of one name would share) is given instead.
        std::os::unix::fs::symlink("b", dir.path().join("a")).unwrap();
        std::os::unix::fs::symlink("a", dir.path().join("b")).unwrap();
        let src = dir.path().join("a/k.cu");
        let argv = nvcc_argv(&toolkit, dir.path(), &["-c", src.to_str().unwrap()]);
        assert!(
            !argv.iter().any(|a| a.contains("orig_src_path_name")),
            "{argv:?}"
        );
    }

    #[test]
    fn the_nvcc_wrapper_text_is_an_input_of_the_toolkit() {
        let part = |name: &str| Part {
            name: name.into(),
            version: "1".into(),
            hash: format!("h-{name}"),
        };
        let d = derivation(&[part("nvidia-cuda-nvcc")]).unwrap();
        assert_eq!(
            d.inputs.get("nvcc-wrapper").map(String::as_str),
            Some(Sha256::of_bytes(NVCC_WRAPPER.as_bytes()).as_str())
        );
    }

    #[test]
    fn no_nvcc_no_toolkit() {
        let part = |name: &str| Part {
            name: name.into(),
            version: "1".into(),
            hash: format!("h-{name}"),
        };
        assert!(derivation(&[part("nvidia-cuda-runtime"), part("cmake")]).is_none());
        let d = derivation(&[
            part("cmake"),
            part("nvidia-cuda-nvcc"),
            part("nvidia-nccl-cu13"),
        ])
        .unwrap();
        assert_eq!(
            d.input_derivations.keys().collect::<Vec<_>>(),
            ["wheel.nvidia-cuda-nvcc", "wheel.nvidia-nccl-cu13"]
        );
    }
}
