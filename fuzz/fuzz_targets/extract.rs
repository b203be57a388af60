//! Fuzz archive extraction: any bytes, unpacked as an sdist zip, as an sdist tar.gz and installed as a wheel, must
//! give a tree or an error, never a panic; and never create, change or link to anything outside the destination.
#![no_main]

use std::io::Write;
use std::path::Path;

use libfuzzer_sys::fuzz_target;

const VICTIM: &[u8] = b"outside the destination\n";

/// Every link under `dest` that resolves at all resolves inside it.
fn links_stay_inside(dest: &Path) {
    let Ok(root) = dest.canonicalize() else {
        return;
    };
    for entry in walkdir::WalkDir::new(dest).follow_links(false) {
        let Ok(entry) = entry else { continue };
        if entry.path_is_symlink()
            && let Ok(resolved) = entry.path().canonicalize()
        {
            assert!(
                resolved.starts_with(&root),
                "`{}` resolves outside to `{}`",
                entry.path().display(),
                resolved.display()
            );
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().expect("a temp dir");
    let top = dir.path();
    // `../../../outside/victim.txt` from a destination: easy for the fuzzer to find.
    std::fs::create_dir(top.join("outside")).expect("outside");
    std::fs::write(top.join("outside/victim.txt"), VICTIM).expect("victim");
    std::fs::create_dir(top.join("archives")).expect("archives");

    let zip = top.join("archives/fuzz.zip");
    std::fs::write(&zip, data).expect("zip");
    // The tar bytes come compressed here: nearly every fuzzed input would fail gzip's checks otherwise.
    let tar_gz = top.join("archives/fuzz.tar.gz");
    let mut encoder = flate2::write::GzEncoder::new(
        std::fs::File::create(&tar_gz).expect("tar.gz"),
        flate2::Compression::fast(),
    );
    encoder.write_all(data).expect("gzip");
    encoder.finish().expect("gzip");

    let dests = [
        top.join("tree/zip/dest"),
        top.join("tree/tar/dest"),
        top.join("tree/wheel/dest"),
    ];
    let _ = hvd_builder::unpack::unpack_sdist(&zip, "fuzz.zip", &dests[0]);
    let _ = hvd_builder::unpack::unpack_sdist(&tar_gz, "fuzz.tar.gz", &dests[1]);
    std::fs::create_dir_all(&dests[2]).expect("wheel dest");
    let _ = hvd_builder::wheel::install_wheel(&zip, &dests[2]);

    // Never outside: besides the destinations' contents, exactly what the harness made is there, unchanged.
    for entry in walkdir::WalkDir::new(top).follow_links(false).min_depth(1) {
        let entry = entry.expect("walk");
        let path = entry.path();
        if dests.iter().any(|dest| path.starts_with(dest)) {
            continue;
        }
        let relative = path.strip_prefix(top).expect("below top");
        let known = [
            "outside",
            "outside/victim.txt",
            "archives",
            "archives/fuzz.zip",
            "archives/fuzz.tar.gz",
            "tree",
            "tree/zip",
            "tree/tar",
            "tree/wheel",
        ];
        assert!(
            known.iter().any(|known| relative == Path::new(known)),
            "created outside the destination: `{}`",
            relative.display()
        );
    }
    assert_eq!(
        std::fs::read(top.join("outside/victim.txt")).expect("victim"),
        VICTIM,
        "a file outside the destination changed"
    );
    for dest in &dests {
        links_stay_inside(dest);
    }
});
