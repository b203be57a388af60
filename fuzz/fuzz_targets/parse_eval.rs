//! Fuzz the whole front end: any input must give a model or diagnostics, never a panic, a stack overflow
//! or a hang; and whatever `fmt` prints must parse again and format to itself.
//!
//! The input is several files separated by NUL bytes: the first is `main.hvd`, the next `a.hvd`, `b.hvd`
//! and `c.hvd`, all in memory (a [`hvd_lang::MemoryLoader`]), so imports, import cycles and missing
//! imports are fuzzed too, and the fuzzing machine's own files are never read.
#![no_main]

use libfuzzer_sys::fuzz_target;

const NAMES: [&str; 4] = ["main.hvd", "a.hvd", "b.hvd", "c.hvd"];

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut loader = hvd_lang::MemoryLoader::default();
    for (name, file) in NAMES.iter().zip(text.splitn(NAMES.len(), '\0')) {
        loader.insert(name, file);
    }
    let _ = hvd_lang::load_file_with(std::path::Path::new(NAMES[0]), &loader);
    for file in text.split('\0') {
        if let Ok(formatted) = hvd_lang::format_source("fuzz.hvd", file) {
            let again = hvd_lang::format_source("fuzz.hvd", &formatted)
                .expect("formatted output must parse");
            assert_eq!(again, formatted, "fmt must be idempotent");
        }
    }
});
