//! Fuzz the whole front end: any input must give a model or diagnostics, never a panic, a stack overflow
//! or a hang; and whatever `fmt` prints must parse again and format to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // A path that does not exist: local imports fail cleanly instead of reading the fuzzing machine's files.
    let _ = hvd_lang::load_source(std::path::Path::new("/nonexistent/fuzz.hvd"), text);
    if let Ok(formatted) = hvd_lang::format_source("fuzz.hvd", text) {
        let again =
            hvd_lang::format_source("fuzz.hvd", &formatted).expect("formatted output must parse");
        assert_eq!(again, formatted, "fmt must be idempotent");
    }
});
