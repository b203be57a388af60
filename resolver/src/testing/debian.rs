//! Fixture Debian archives for tests: a gpg key of the test's own that signs Release files as an archive does.

use std::path::PathBuf;

/// An OpenPGP key of the test's own (gpg in a temporary home) that signs Release files as an archive does, and the
/// keyring holding it. Panics when gpg is missing or fails: it is for tests.
pub struct Signer {
    home: tempfile::TempDir,
    /// The keyring with the public key: a source's `Signed-By`.
    pub keyring: PathBuf,
}

impl Signer {
    #[allow(clippy::new_without_default)] // it makes a key: not a default value
    pub fn new() -> Signer {
        let home = tempfile::tempdir().unwrap();
        std::fs::set_permissions(
            home.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        )
        .unwrap();
        let signer = Signer {
            keyring: home.path().join("keyring.gpg"),
            home,
        };
        signer.gpg(&[
            "--passphrase",
            "",
            "--quick-gen-key",
            "hvd fixture <fixture@hvd.invalid>",
            "ed25519",
            "sign",
            "never",
        ]);
        let keyring = signer.keyring.display().to_string();
        signer.gpg(&["--export", "-o", &keyring]);
        signer
    }

    fn gpg(&self, args: &[&str]) -> Vec<u8> {
        let out = std::process::Command::new("gpg")
            .arg("--homedir")
            .arg(self.home.path())
            .args(["--batch", "--quiet", "--yes"])
            .args(args)
            .output()
            .expect("gpg (the tests sign their fixture archives with it)");
        assert!(
            out.status.success(),
            "gpg {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    }

    /// `text` clearsigned: an `InRelease`.
    pub fn clearsign(&self, text: &str) -> Vec<u8> {
        let input = self.home.path().join("release");
        std::fs::write(&input, text).unwrap();
        self.gpg(&["--clearsign", "-o", "-", &input.display().to_string()])
    }
}

impl Drop for Signer {
    fn drop(&mut self) {
        // The key's agent: ended with its home.
        let _ = std::process::Command::new("gpgconf")
            .arg("--homedir")
            .arg(self.home.path())
            .args(["--kill", "gpg-agent"])
            .output();
    }
}
