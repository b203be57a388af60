//! The C/C++ toolchain of source builds: what is on this machine, the check against the lock's pin, and a gcc
//! the lock pinned from Debian (realized into the store by [`crate::debian`]).

use std::path::PathBuf;
use std::process::Command;

use hvd_resolver::Sha256;

use crate::debian::DebianGcc;
use crate::error::{Error, Result};
use crate::progress::NoProgress;
use crate::store::Store;

/// A compiler as found on this machine or as pinned in a lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Toolchain {
    /// `gcc` (the C++ compiler is the matching `g++`).
    pub name: String,
    /// Full version, e.g. `12.2.0`.
    pub version: String,
    /// sha256 of the compiler driver binary (after resolving links).
    pub sha256: Option<Sha256>,
    /// The compiler's absolute path (host only; not part of a pin).
    pub path: Option<PathBuf>,
    /// A gcc pinned from Debian's archive instead of the host's (the host lacked the version).
    pub debian: Option<DebianGcc>,
}

impl Toolchain {
    /// Look the compiler `name` up on PATH and identify it.
    pub fn detect(name: &str) -> Result<Toolchain> {
        let not_found = || Error::ToolchainNotFound {
            name: name.to_string(),
        };
        let path = find_on_path(name).ok_or_else(not_found)?;
        let output = Command::new(&path)
            .arg("-dumpfullversion")
            .output()
            .map_err(|_| not_found())?;
        if !output.status.success() {
            return Err(not_found());
        }
        let version = String::from_utf8_lossy(&output.stdout).trim().to_string();
        let real = fs_err::canonicalize(&path)?;
        Ok(Toolchain {
            name: name.to_string(),
            version,
            sha256: Some(Sha256::of_file(&real)?),
            path: Some(path),
            debian: None,
        })
    }

    /// The compiler of source builds for `pin` (the lock's; `None`: the host's gcc): a Debian pin is realized into
    /// `store` (without the network when `offline`) and used from there; otherwise the host's compiler, checked
    /// against the pin when `locked`.
    pub fn for_build(
        store: &Store,
        pin: Option<&Toolchain>,
        offline: bool,
        locked: bool,
    ) -> Result<Toolchain> {
        if let Some(pin) = pin
            && let Some(debian) = &pin.debian
        {
            let path = debian.realize(store, offline, &NoProgress)?;
            return Ok(Toolchain {
                path: Some(path.join("bin").join(&pin.name)),
                ..pin.clone()
            });
        }
        let host = Toolchain::detect(pin.map(|t| t.name.as_str()).unwrap_or("gcc"))?;
        if let (true, Some(pin)) = (locked, pin) {
            host.check_against(pin)?;
        }
        Ok(host)
    }

    /// The identity that goes into derivations.
    pub fn identity(&self) -> String {
        if let Some(debian) = &self.debian {
            // The store path's hash covers every package's sha256.
            return format!(
                "{} {} debian {} {}",
                self.name,
                self.version,
                debian.suite,
                debian.derivation().hash()
            );
        }
        match &self.sha256 {
            Some(hash) => format!("{} {} sha256:{hash}", self.name, self.version),
            None => format!("{} {}", self.name, self.version),
        }
    }

    /// Check the host toolchain against a pin: the version must match (as a prefix for a short pin like `12`) and
    /// the sha256 when the pin has one.
    pub fn check_against(&self, pin: &Toolchain) -> Result<()> {
        let version_ok =
            self.version == pin.version || self.version.starts_with(&format!("{}.", pin.version));
        let hash_ok = pin.sha256.is_none() || pin.sha256 == self.sha256;
        if self.name == pin.name && version_ok && hash_ok {
            Ok(())
        } else {
            Err(Error::ToolchainMismatch {
                expected: pin.identity(),
                found: self.identity(),
            })
        }
    }
}

/// The first executable `name` on PATH.
pub fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pin_check_names_expected_and_found() {
        let host = Toolchain {
            name: "gcc".into(),
            version: "12.2.0".into(),
            sha256: Some(Sha256::of_bytes(b"a")),
            path: None,
            debian: None,
        };
        let pin = Toolchain {
            name: "gcc".into(),
            version: "12".into(),
            sha256: None,
            path: None,
            debian: None,
        };
        host.check_against(&pin).unwrap();
        let other = Toolchain {
            version: "13.1.0".into(),
            ..pin.clone()
        };
        let err = host.check_against(&other).unwrap_err().to_string();
        assert!(
            err.contains("expects gcc 13.1.0") && err.contains("has gcc 12.2.0"),
            "{err}"
        );
        let hashed = Toolchain {
            sha256: Some(Sha256::of_bytes(b"b")),
            ..pin
        };
        assert!(host.check_against(&hashed).is_err());
    }
}
