//! Multi-file programs evaluated from memory ([`hvd_lang::MemoryLoader`]): imports, import cycles, missing
//! and hostile import paths, and a failed binding that must not cause follow-up errors.

use std::path::Path;

use hvd_lang::{MemoryLoader, load_file_with};

/// A loader holding `files` (`(path, text)`), the first being the main file.
fn loader(files: &[(&str, &str)]) -> MemoryLoader {
    let mut loader = MemoryLoader::default();
    for (path, text) in files {
        loader.insert(path, *text);
    }
    loader
}

/// The error messages (with their file and line) of loading `files`; panics when they load.
fn errors(files: &[(&str, &str)]) -> Vec<(String, String)> {
    match load_file_with(Path::new(files[0].0), &loader(files)) {
        Ok(project) => panic!("expected errors, got {project:?}"),
        Err(d) => d
            .errors()
            .iter()
            .map(|e| {
                let at = e
                    .location()
                    .map(|(file, line, _)| format!("{file}:{line}"))
                    .unwrap_or_default();
                (at, e.message().to_string())
            })
            .collect(),
    }
}

#[test]
fn imports_resolve_relative_to_the_importing_file() {
    let files = [
        (
            "project/main.hvd",
            "import \"./lib/common.hvd\" as common\n\
             env { python = common.python, packages = common.packages }\n\
             step train { run = \"python ${common.script}\" }\n",
        ),
        (
            "project/lib/common.hvd",
            "import \"../shared/names.hvd\" as names\n\
             let python = \"3.11\"\nlet packages = [names.numpy]\nlet script = \"train.py\"\n",
        ),
        ("project/shared/names.hvd", "let numpy = \"numpy<2\"\n"),
    ];
    let project = load_file_with(Path::new(files[0].0), &loader(&files))
        .map_err(|d| d.render_plain())
        .expect("loads");
    assert_eq!(project.env.python, "3.11");
    assert_eq!(project.env.packages[0].requirement, "numpy<2");
    assert_eq!(project.steps[0].run, "python train.py");
    assert_eq!(project.file, Path::new("project/main.hvd"));
}

#[test]
fn an_import_cycle_is_reported_once_with_its_chain() {
    let errors = errors(&[
        (
            "main.hvd",
            "import \"./a.hvd\" as a\nenv { python = \"3.11\" }\n",
        ),
        ("a.hvd", "import \"./b.hvd\" as b\nlet x = 1\n"),
        ("b.hvd", "import \"./a.hvd\" as a\nlet y = 2\n"),
    ]);
    assert_eq!(
        errors,
        [(
            "b.hvd:1".to_string(),
            "import cycle: a.hvd -> b.hvd -> a.hvd".to_string()
        )]
    );
}

#[test]
fn importing_the_main_file_is_a_cycle() {
    let errors = errors(&[
        (
            "main.hvd",
            "import \"./a.hvd\" as a\nenv { python = \"3.11\" }\n",
        ),
        ("a.hvd", "import \"./main.hvd\" as main\nlet x = 1\n"),
    ]);
    assert_eq!(
        errors,
        [(
            "a.hvd:1".to_string(),
            "import cycle: main.hvd -> a.hvd -> main.hvd".to_string()
        )]
    );
}

#[test]
fn a_missing_import_is_one_error_and_its_uses_add_none() {
    let errors = errors(&[(
        "main.hvd",
        "import \"./missing.hvd\" as missing\n\
         let version = missing.python\n\
         env { python = version, packages = [missing.numpy] }\n",
    )]);
    assert_eq!(errors.len(), 1, "{errors:?}");
    let (at, message) = &errors[0];
    assert_eq!(at, "main.hvd:1");
    assert!(
        message.starts_with("cannot import `./missing.hvd`") && message.contains("missing.hvd"),
        "{message}"
    );
}

#[test]
fn hostile_import_paths_name_no_file_outside_the_loader() {
    // Import paths may climb out of the importing file's directory (as on the file system), but a loader
    // in memory has nothing above its top, nor anything at an absolute path it was not given.
    let secret = ("secret.hvd", "let token = \"s3cr3t\"\n");
    let main = |path: &str| {
        format!(
            "import \"{path}\" as s\nenv {{ python = \"3.11\", variables = {{ T = s.token }} }}\n"
        )
    };
    for path in [
        "../secret.hvd",
        "/secret.hvd",
        "./sub/../../secret.hvd",
        "../../../../etc/passwd",
    ] {
        let errors = errors(&[("main.hvd", &main(path)), secret]);
        assert_eq!(errors.len(), 1, "{path}: {errors:?}");
        assert!(
            errors[0].1.starts_with(&format!("cannot import `{path}`")),
            "{path}: {errors:?}"
        );
    }
    for path in ["./secret.hvd", "sub/../secret.hvd"] {
        let files = [("main.hvd", main(path)), (secret.0, secret.1.to_string())];
        let files: Vec<(&str, &str)> = files.iter().map(|(p, t)| (*p, t.as_str())).collect();
        let project = load_file_with(Path::new("main.hvd"), &loader(&files))
            .map_err(|d| d.render_plain())
            .expect("loads");
        assert_eq!(project.env.variables["T"], "s3cr3t", "{path}");
    }
}

#[test]
fn a_failed_let_in_an_imported_file_is_reported_once() {
    // `broken` fails in lib.hvd; every use of it in main.hvd (read, compared, interpolated, or the whole
    // module handed to a block) must add no error of its own.
    let errors = errors(&[
        (
            "main.hvd",
            "import \"./lib.hvd\" as lib\n\
             let copy = lib\n\
             let same = lib == copy\n\
             let text = \"v${lib.broken}\"\n\
             env { python = lib.python, variables = lib, packages = [lib.broken] }\n\
             cluster { settings = { port = lib.broken }, hosts = [text] }\n",
        ),
        (
            "lib.hvd",
            "let python = \"3.11\"\nlet broken = undefined_name + 1\n",
        ),
    ]);
    assert_eq!(
        errors,
        [(
            "lib.hvd:2".to_string(),
            "unknown name `undefined_name`".to_string()
        )]
    );
}

#[test]
fn a_failed_let_is_reported_once_however_often_it_is_used() {
    let errors = errors(&[(
        "main.hvd",
        "let broken = 1 + \"one\"\n\
         let twice = [broken, broken]\n\
         let inside = { a = broken }.a\n\
         env { python = broken, packages = twice, variables = { X = \"${broken}\" } }\n\
         step s { run = broken, workers = len(twice) }\n",
    )]);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].0, "main.hvd:1");
    assert!(
        errors[0]
            .1
            .starts_with("cannot add an integer and a string"),
        "{errors:?}"
    );
}

#[test]
fn a_failed_binding_next_to_shared_values_is_found_without_walking_every_path() {
    // Each list holds the previous one twice: 2^60 paths, 61 lists. The failed binding is looked for after
    // them; that must visit each list once, or this test never ends.
    let mut lists = String::from("let l0 = [\"numpy\"]\n");
    for i in 1..=60 {
        lists.push_str(&format!("let l{i} = [l{p}, l{p}]\n", p = i - 1));
    }
    let main = format!(
        "import \"./lib.hvd\" as lib\n{lists}env {{ python = \"3.11\", packages = [lib, l60] }}\n"
    );
    let failed = errors(&[("main.hvd", &main), ("lib.hvd", "let broken = missing\n")]);
    assert_eq!(
        failed,
        [(
            "lib.hvd:1".to_string(),
            "unknown name `missing`".to_string()
        )]
    );

    // Without a failure: walked once too, and lowering reports the two lists that are not packages.
    let main = format!("{lists}env {{ python = \"3.11\", packages = l60 }}\n");
    let clean = errors(&[("main.hvd", &main)]);
    assert_eq!(clean.len(), 2, "{clean:?}");
    assert!(
        clean
            .iter()
            .all(|(_, m)| m == "expected a package, found a list"),
        "{clean:?}"
    );
}
