//! Unit tests of the parser: items, numbers and units, recovery, spans, comments, nesting, interpolation.

use super::*;

fn ok(src: &str) -> File {
    let (file, errors) = parse(src);
    assert!(errors.is_empty(), "{errors:?}");
    file
}

#[test]
fn parses_the_basic_items() {
    let file = ok(
        "project \"x\"\nimport std\nlet a = 1\nstep s { run = \"a\" }\nenv { python = \"3.11\" }\n",
    );
    assert_eq!(file.items.len(), 5);
}

#[test]
fn numbers_with_units() {
    let file = ok("let a = 10GiB\nlet b = 1.5h\nlet c = -3\nlet d = 250ms\n");
    let values: Vec<Number> = file
        .items
        .iter()
        .map(|item| match &item.kind {
            ItemKind::Let {
                value:
                    Expr {
                        kind: ExprKind::Number { value, .. },
                        ..
                    },
                ..
            } => *value,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        values,
        vec![
            Number::Size(10 << 30),
            Number::Duration(5_400_000),
            Number::Int(-3),
            Number::Duration(250)
        ]
    );
}

#[test]
fn spaced_unit_is_an_error_but_a_key_named_like_a_unit_is_not() {
    let (_, errors) = parse("let a = 10 GiB\n");
    assert_eq!(errors[0].message, "space between `10` and its unit `GiB`");
    ok("let a = { x = 5 m = 3 }\n");
}

#[test]
fn bad_unit_is_an_error_with_a_hint() {
    let (_, errors) = parse("let a = 10Gb\n");
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0].message, "unknown unit `Gb`");
    assert!(
        errors[0].help.as_deref().unwrap_or("").contains("`GB`"),
        "{errors:?}"
    );
}

#[test]
fn recovers_and_reports_several_errors() {
    let (file, errors) = parse("let a = \nlet b = 2\nstep { }\nlet c = [1 2]\n");
    assert_eq!(errors.len(), 3, "{errors:?}");
    assert_eq!(file.items.len(), 1);
}

#[test]
fn recovers_inside_a_block() {
    let src = "step a {\n  run = [1 2]\n  needs = [\n    b c\n  ]\n  workers = 3\n}\nlet x = \n";
    let (file, errors) = parse(src);
    let lines: Vec<u32> = errors
        .iter()
        .map(|e| src[..e.span.start as usize].matches('\n').count() as u32 + 1)
        .collect();
    assert_eq!(lines, [2, 4, 9], "{errors:?}");
    assert_eq!(file.items.len(), 1);
}

#[test]
fn multibyte_characters_never_split() {
    for src in [
        "é",
        "let a = é",
        "ééé\nlet b = 1",
        "let a = [é",
        "step ü { run = \"x\" }",
    ] {
        let (_, errors) = parse(src);
        assert!(!errors.is_empty(), "{src}");
        for e in errors {
            assert!(
                src.is_char_boundary(e.span.start as usize)
                    && src.is_char_boundary(e.span.end as usize)
            );
        }
    }
    let deep = format!("let a = {}é", "(".repeat(300));
    let errors = parse_on_big_stack(deep.clone());
    assert!(
        errors
            .iter()
            .all(|e| deep.is_char_boundary(e.span.end as usize))
    );
}

#[test]
fn comments_are_collected() {
    let file = ok("# top\nlet a = 1 # trailing\nlet s = \"# not a comment\"\n");
    assert_eq!(file.comments.len(), 2);
}

/// Parse on a thread with the stack `load_file` gives the parser (debug builds use big frames).
fn parse_on_big_stack(src: String) -> Vec<SyntaxError> {
    std::thread::Builder::new()
        .stack_size(crate::STACK_SIZE)
        .spawn(move || parse(&src).1)
        .expect("spawn")
        .join()
        .expect("no panic")
}

#[test]
fn deep_nesting_is_an_error() {
    let errors = parse_on_big_stack(format!("let a = {}", "[".repeat(100_000)));
    assert!(errors[0].message.contains("nesting too deep"), "{errors:?}");
    let errors = parse_on_big_stack(format!("let a = 1{}", " + 1".repeat(100_000)));
    assert!(errors[0].message.contains("too long"), "{errors:?}");
    let errors = parse_on_big_stack(format!("let a = {}1", "!".repeat(100_000)));
    assert!(errors[0].message.contains("nesting too deep"), "{errors:?}");
}

#[test]
fn interpolation() {
    let file = ok("let a = \"x${b}y\\${z}\"\n");
    let ItemKind::Let { value, .. } = &file.items[0].kind else {
        panic!()
    };
    let ExprKind::Str(parts) = &value.kind else {
        panic!()
    };
    assert_eq!(parts.len(), 3);
    assert!(matches!(&parts[2], StrPart::Lit(s) if s == "y${z}"));
}
