//! Hostile input gives errors, never a crash or a hang: deep nesting, huge files, runaway recursion.

use std::path::Path;

fn errors(src: &str) -> Vec<String> {
    match hvd_lang::load_source(Path::new("hostile.hvd"), src) {
        Ok(project) => panic!("expected an error, got {project:?}"),
        Err(d) => d.errors().iter().map(|e| e.message().to_string()).collect(),
    }
}

/// Some message contains `text`.
fn assert_mentions(messages: &[String], text: &str) {
    assert!(messages.iter().any(|m| m.contains(text)), "{messages:?}");
}

#[test]
fn deep_nesting_is_an_error_not_a_stack_overflow() {
    let messages = errors(&"[".repeat(100_000));
    assert_mentions(&messages, "expected `project`");
    let messages = errors(&format!("let a = {}", "[".repeat(100_000)));
    assert_mentions(&messages, "nesting too deep");
    let messages = errors(&format!(
        "let a = {}1{}",
        "{ a = ".repeat(50_000),
        " }".repeat(50_000)
    ));
    assert_mentions(&messages, "nesting too deep");
    let messages = errors(&format!("let a = \"{}\"", "${\"".repeat(50_000)));
    assert_mentions(&messages, "nesting too deep");
}

#[test]
fn a_ten_megabyte_input_is_an_error_not_a_crash() {
    // Ten megabytes of valid lets (long strings, so the test stays quick in debug builds), then one mistake.
    let mut src = String::with_capacity(11 << 20);
    let text = "x".repeat(4000);
    let mut n = 0;
    while src.len() < 10 << 20 {
        src.push_str(&format!(
            "let value_{n} = [\"{text}\", {n}, 1GiB] # {text}\n"
        ));
        n += 1;
    }
    src.push_str("let broken = value_0 +\n");
    let messages = errors(&src);
    assert_mentions(&messages, "expected an expression");
    // Ten megabytes of garbage: bounded number of errors.
    let garbage = "%$&!\n".repeat(2 << 20);
    let messages = errors(&garbage);
    assert!(
        !messages.is_empty() && messages.len() <= 101,
        "{}",
        messages.len()
    );
}

#[test]
fn recursion_is_stopped() {
    let src =
        "let f = recipe { n } => f { n = n + 1 }\nlet x = f { n = 0 }\nenv { python = \"3.11\" }\n";
    let messages = errors(src);
    assert_mentions(&messages, "evaluation too deep");
}

#[test]
fn exponential_blowup_is_stopped() {
    let mut src = String::from("let l0 = [1, 2]\n");
    for i in 1..80 {
        src.push_str(&format!("let l{i} = l{} + l{}\n", i - 1, i - 1));
    }
    let messages = errors(&src);
    assert_mentions(&messages, "evaluation takes too long");
    // Recipes calling the previous one twice: 2^60 calls without the budget.
    let mut src = String::from("let f0 = recipe { x } => x\n");
    for i in 1..60 {
        src.push_str(&format!(
            "let f{i} = recipe {{ x }} => f{p} {{ x = f{p} {{ x = x }} }}\n",
            p = i - 1
        ));
    }
    src.push_str("let y = f59 { x = 1 }\n");
    let messages = errors(&src);
    assert_mentions(&messages, "evaluation takes too long");
}

#[test]
fn many_errors_are_capped() {
    let src: String = (0..500)
        .map(|i| format!("let a{i} = missing_{i}\n"))
        .collect();
    let messages = errors(&src);
    assert_eq!(messages.len(), 101);
    // 500 unknown names and the missing `env` block.
    assert_eq!(messages[100], "401 more errors not shown");
}

#[test]
fn a_large_valid_file_is_not_cut_off_by_the_budget() {
    // About 1.5 million steps (300k elements, then 4 steps for each in the comprehension): more than the fixed
    // budget alone, well within it with the share for 0.6 MB of source.
    let items = "1,".repeat(300_000);
    let src = format!(
        "let big = [{items}]\nlet wide = [for x in big: [x, x, x]]\n\
         env {{ python = \"3.11\", variables = {{ N = len(wide) }} }}\n"
    );
    let project = hvd_lang::load_source(Path::new("large.hvd"), &src)
        .map_err(|d| d.render_plain())
        .expect("loads");
    assert_eq!(project.env.variables["N"], "300000");
}
