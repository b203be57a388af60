//! The lock pins the interpreter's store path (#18 §1): `hvd build` without a lock writes `[target] installation`
//! (full version and content hash) naming the path the env links; a lock whose pinned hash was changed (a pull
//! request) is refused naming the interpreter, both hashes and the fix, and relocking fixes it; a pin that is not
//! a version is refused when the lock is read.

mod common;
#[path = "../builder/tests/common/planted.rs"]
mod planted;

use std::path::Path;
use std::process::Output;

use hvd_resolver::lockfile::Lockfile;
use hvd_resolver::testing::{Dist, FixtureIndex, FixtureOptions};

fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).trim().to_string(),
        String::from_utf8_lossy(&output.stderr).to_string(),
    )
}

/// A project `app/train.hvd` with one package from a fixture index, and a store, in a fresh directory.
struct Project {
    _index: FixtureIndex,
    dir: tempfile::TempDir,
    store: std::path::PathBuf,
    file: std::path::PathBuf,
}

impl Project {
    fn new() -> Self {
        let index =
            FixtureIndex::start(vec![Dist::wheel("alpha", "1.0")], FixtureOptions::default())
                .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("store");
        let app = dir.path().join("app");
        std::fs::create_dir_all(&app).unwrap();
        let file = app.join("train.hvd");
        std::fs::write(
            &file,
            format!(
                "project \"app\"\nenv {{\n  python = \"{}\"\n  index = \"{}\"\n  packages = [\"alpha\"]\n}}\n",
                common::python_version(),
                index.url()
            ),
        )
        .unwrap();
        Project {
            _index: index,
            dir,
            store,
            file,
        }
    }

    fn hvd(&self, args: &[&str]) -> Output {
        common::hvd_with_store(self.dir.path(), &self.store, args)
            .output()
            .unwrap()
    }
}

#[test]
fn the_lock_pins_the_interpreter_and_a_changed_pin_is_refused_until_relocked() {
    let project = Project::new();
    let (store, file) = (project.store.clone(), project.file.clone());
    let file_arg = file.display().to_string();
    let hvd = |args: &[&str]| project.hvd(args);

    let built = hvd(&["build", &file_arg]);
    let (env, err) = text(&built);
    assert_eq!(built.status.code(), Some(0), "{err}");
    let lock_path = Lockfile::path_for(&file);
    let lock = Lockfile::read(&lock_path).unwrap();
    let pin = lock
        .target
        .installation
        .clone()
        .expect("the lock pins the interpreter");
    assert!(pin.version.starts_with(&format!("{}.", lock.target.python)));
    let python_path = std::fs::canonicalize(&store)
        .unwrap()
        .join(hvd_builder::interpreter::derivation(&pin.version, &pin.content_hash).path_name());
    assert_eq!(
        std::fs::read_link(Path::new(&env).join("bin/python")).unwrap(),
        python_path
            .join("bin")
            .join(format!("python{}", lock.target.python)),
        "the env's python is the pinned store path"
    );
    let recorded = hvd_builder::Store::open(&store)
        .unwrap()
        .path_info(&python_path)
        .unwrap()
        .content_hash;
    assert_eq!(recorded, pin.content_hash);
    let written = std::fs::read_to_string(&lock_path).unwrap();
    assert!(
        written.contains(&format!(
            "installation = {{ version = \"{}\", content-hash = \"{}\" }}",
            pin.version, pin.content_hash
        )),
        "{written}"
    );

    // A pull request changes the pinned hash: the build is refused naming the interpreter, both hashes and the fix.
    let forged = hvd_builder::Sha256::of_bytes(b"a python from somewhere else");
    std::fs::write(
        &lock_path,
        written.replace(pin.content_hash.as_str(), forged.as_str()),
    )
    .unwrap();
    let refused = hvd(&["build", &file_arg, "--locked"]);
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused).1);
    let message = common::unwrapped(&text(&refused).1);
    for part in [
        format!("python{}", pin.version),
        forged.to_string(),
        pin.content_hash.to_string(),
        "hvdlock".to_string(),
        "--cache".to_string(),
    ] {
        assert!(message.contains(&part), "`{part}` missing: {message}");
    }

    // Relocking pins this machine's interpreter again; the build is the same env as before.
    let relocked = hvd(&["lock", &file_arg]);
    assert_eq!(relocked.status.code(), Some(0), "{}", text(&relocked).1);
    assert_eq!(
        Lockfile::read(&lock_path).unwrap().target.installation,
        Some(pin.clone())
    );
    let again = hvd(&["build", &file_arg, "--locked"]);
    assert_eq!(text(&again).0, env, "{}", text(&again).1);

    // A pinned version that is not a version (it names the store path) is refused when the lock is read.
    std::fs::write(
        &lock_path,
        written.replace(
            &format!("version = \"{}\"", pin.version),
            "version = \"../../etc\"",
        ),
    )
    .unwrap();
    let hostile = hvd(&["build", &file_arg, "--locked"]);
    assert_eq!(hostile.status.code(), Some(2), "{}", text(&hostile).1);
    let message = common::unwrapped(&text(&hostile).1);
    assert!(message.contains("installation"), "{message}");

    // Every fingerprint entry names another version's interpreter path (stale after the host's python changed, or
    // planted): relocking ignores it, pins this machine's python again, and the lock it writes reads back.
    let planted = {
        let opened = hvd_builder::Store::open(&store).unwrap();
        let claimed = hvd_builder::Sha256::of_bytes(b"planted");
        planted::plant_interpreter_path(&opened, "2.7.18", &claimed)
    };
    let mut entries = 0;
    for entry in std::fs::read_dir(store.join(".interpreters")).unwrap() {
        let entry = entry.unwrap().path();
        if !entry
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with('.')
        {
            std::fs::write(&entry, format!("{planted}\n")).unwrap();
            entries += 1;
        }
    }
    assert!(entries > 0, "no fingerprint entry to plant");
    let relocked = hvd(&["lock", &file_arg]);
    assert_eq!(relocked.status.code(), Some(0), "{}", text(&relocked).1);
    assert_eq!(
        Lockfile::read(&lock_path).unwrap().target.installation,
        Some(pin.clone()),
        "{}",
        text(&relocked).1
    );
}

/// `hvd lock` pins the interpreter without copying it (#18): in a fresh store it leaves no interpreter path (nor any
/// other store path or temp directory), and the pin names exactly the path `hvd build` then copies in.
#[test]
fn the_lock_pins_the_interpreter_without_copying_it_and_the_build_copies_exactly_that() {
    let project = Project::new();
    let (dir, store, file) = (&project.dir, project.store.clone(), project.file.clone());
    let file_arg = file.display().to_string();
    let hvd = |args: &[&str]| project.hvd(args);
    let locked = hvd(&["lock", &file_arg]);
    assert_eq!(locked.status.code(), Some(0), "{}", text(&locked).1);
    let pin = Lockfile::read(&Lockfile::path_for(&file))
        .unwrap()
        .target
        .installation
        .expect("the lock pins the interpreter");
    let store_paths = |store: &Path| -> Vec<String> {
        std::fs::read_dir(store)
            .map(|entries| {
                entries
                    .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .filter(|name| !name.starts_with('.'))
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(
        store_paths(&store),
        Vec::<String>::new(),
        "the lock wrote a store path"
    );
    let temp: Vec<_> = std::fs::read_dir(store.join(".tmp"))
        .map(|entries| entries.collect())
        .unwrap_or_default();
    assert!(temp.is_empty(), "the lock left temp directories: {temp:?}");

    // The pin is kept as a hint for these files: the next lock takes it instead of hashing the interpreter again.
    let hints: Vec<_> = std::fs::read_dir(store.join(".interpreters"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "pin"))
        .collect();
    assert_eq!(hints.len(), 1, "{hints:?}");
    let hint = &hints[0];
    assert_eq!(
        std::fs::read_to_string(hint).unwrap(),
        format!("{}\n{}\n", pin.version, pin.content_hash)
    );
    let relock = |file_arg: &str| {
        let output = common::hvd_with_store(dir.path(), &store, &["lock", file_arg])
            .env("HVD_LOG", "hvd_builder::interpreter=debug")
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(0), "{}", text(&output).1);
        let pinned = Lockfile::read(&Lockfile::path_for(&file))
            .unwrap()
            .target
            .installation;
        (pinned, text(&output).1)
    };
    let (pinned, log) = relock(&file_arg);
    assert_eq!(pinned.as_ref(), Some(&pin));
    assert!(log.contains("interpreter pin from the hint"), "{log}");
    // A hostile hint (not a hash, another version, bytes that are not text, a FIFO) is ignored: hashed again.
    let fifo = hint.with_extension("fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    for planted in [
        format!("{}\n../../etc\n", pin.version).into_bytes(),
        format!("2.7.18\n{}\n", pin.content_hash).into_bytes(),
        vec![0xff; 100_000],
    ] {
        std::fs::write(hint, planted).unwrap();
        let (pinned, log) = relock(&file_arg);
        assert_eq!(pinned.as_ref(), Some(&pin));
        assert!(!log.contains("interpreter pin from the hint"), "{log}");
    }
    std::fs::remove_file(hint).unwrap();
    std::fs::rename(&fifo, hint).unwrap();
    let (pinned, log) = relock(&file_arg);
    assert_eq!(pinned.as_ref(), Some(&pin));
    assert!(!log.contains("interpreter pin from the hint"), "{log}");

    let built = hvd(&["build", &file_arg, "--locked"]);
    assert_eq!(built.status.code(), Some(0), "{}", text(&built).1);
    let python = hvd_builder::interpreter::derivation(&pin.version, &pin.content_hash).path_name();
    assert!(
        store_paths(&store).contains(&python),
        "the build copied the pinned interpreter {python}: {:?}",
        store_paths(&store)
    );
    let recorded = hvd_builder::Store::open(&store)
        .unwrap()
        .path_info(&store.join(&python))
        .unwrap()
        .content_hash;
    assert_eq!(
        recorded, pin.content_hash,
        "the copy has the hash the lock computed"
    );
}
