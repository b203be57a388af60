//! A planted interpreter store path (an attacker's or a stale fingerprint entry's target), shared by
//! builder/tests/interpreter_store.rs and tests/cli_interpreter_pin.rs (included with `#[path]`).

use hvd_builder::interpreter;

/// Plant `<store>/<name>` as a valid interpreter path of `version` holding one empty file (an attacker's or a
/// stale entry's target); returns its name.
pub fn plant_interpreter_path(
    store: &hvd_builder::Store,
    version: &str,
    claimed: &hvd_builder::Sha256,
) -> String {
    let derivation = interpreter::derivation(version, claimed);
    let realized = store
        .realize_known(&derivation, false, |target| {
            std::fs::write(target.out.join("marker"), b"").unwrap();
            let mut manifest = hvd_builder::unpack::Manifest::new();
            manifest.insert(
                "marker".into(),
                hvd_builder::hash::ManifestEntry::File {
                    executable: false,
                    sha256: hvd_builder::Sha256::of_bytes(b""),
                },
            );
            Ok(hvd_builder::store::KnownTree {
                manifest,
                ..Default::default()
            })
        })
        .unwrap();
    realized
        .path
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned()
}
