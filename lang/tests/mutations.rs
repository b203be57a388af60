//! A cheap stand-in for the fuzzer that runs on stable: mutate valid files at random (delete, duplicate,
//! insert tokens) and check that loading and rendering the diagnostics never panic, and that whatever
//! `fmt` accepts it prints in a form that parses again and formats to itself.

use std::path::Path;

use proptest::prelude::*;

const TOKENS: [&str; 26] = [
    "é",
    "\u{1F600}",
    "{",
    "}",
    "[",
    "]",
    "(",
    ")",
    "\"",
    "${",
    "=",
    "==",
    "=>",
    ",",
    ":",
    "+",
    "!",
    "#",
    "\n",
    "10GiB",
    "1.5h",
    "recipe",
    "if",
    "for",
    "step",
    "std.",
];

fn seeds() -> Vec<String> {
    let mut seeds: Vec<String> = hvd_lang::stdlib::FILES
        .iter()
        .map(|(_, text)| text.to_string())
        .collect();
    for dir in ["tests/ok", "tests/fail"] {
        for entry in std::fs::read_dir(dir).expect("list seeds") {
            let path = entry.expect("entry").path();
            if path.extension().is_some_and(|e| e == "hvd") {
                seeds.push(std::fs::read_to_string(&path).expect("read seed"));
            }
        }
    }
    seeds
}

#[derive(Debug, Clone)]
enum Mutation {
    Delete(usize, usize),
    Duplicate(usize, usize),
    Insert(usize, usize),
}

fn apply(text: &str, mutations: &[Mutation]) -> String {
    let mut bytes = text.as_bytes().to_vec();
    for m in mutations {
        let len = bytes.len().max(1);
        match *m {
            Mutation::Delete(at, n) => {
                let at = at % len;
                let end = (at + n % 16).min(bytes.len());
                bytes.drain(at.min(bytes.len())..end);
            }
            Mutation::Duplicate(at, n) => {
                let at = at % len;
                let end = (at + n % 64).min(bytes.len());
                let chunk = bytes[at.min(bytes.len())..end].to_vec();
                bytes.splice(at.min(bytes.len())..at.min(bytes.len()), chunk);
            }
            Mutation::Insert(at, token) => {
                let at = (at % len).min(bytes.len());
                bytes.splice(at..at, TOKENS[token % TOKENS.len()].bytes());
            }
        }
    }
    // Mutations may split a UTF-8 sequence; the front end takes `&str`, so repair it.
    String::from_utf8_lossy(&bytes).into_owned()
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<usize>()).prop_map(|(a, n)| Mutation::Delete(a, n)),
        (any::<usize>(), any::<usize>()).prop_map(|(a, n)| Mutation::Duplicate(a, n)),
        (any::<usize>(), any::<usize>()).prop_map(|(a, t)| Mutation::Insert(a, t)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn mutated_files_never_panic(seed in any::<prop::sample::Index>(), mutations in prop::collection::vec(mutation(), 1..6)) {
        let seeds = seeds();
        let text = apply(&seeds[seed.index(seeds.len())], &mutations);
        if let Err(d) = hvd_lang::load_source(Path::new("/nonexistent/mutated.hvd"), &text) {
            // Rendering must not panic either (labels inside the text, on character boundaries).
            prop_assert!(!d.render_plain().is_empty());
            for e in d.errors() {
                let _ = e.location();
            }
        }
        if let Ok(formatted) = hvd_lang::format_source("mutated.hvd", &text) {
            let again = hvd_lang::format_source("mutated.hvd", &formatted);
            prop_assert!(again.is_ok(), "formatted output does not parse:\n{}\n---\n{}", text, formatted);
            prop_assert_eq!(again.unwrap_or_default(), formatted, "fmt not idempotent for:\n{}", text);
        }
    }
}
