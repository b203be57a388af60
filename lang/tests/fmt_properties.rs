//! Property tests of the formatter against the evaluator as oracle: for random well-formed files written in
//! random layouts (spacing, line breaks, optional commas, comments), `fmt` is idempotent and the formatted
//! file evaluates to the same model as the original.

use std::path::Path;

use proptest::prelude::*;

/// A generated expression, rendered to text in a random layout.
#[derive(Debug, Clone)]
enum G {
    Str(Vec<Part>),
    Int(i64),
    Raw(&'static str),
    Bool(bool),
    None,
    List(Vec<G>),
    Attrs(Vec<(String, G)>),
    /// `a + b` (both strings or both lists).
    Add(Box<G>, Box<G>),
    /// `if a == b then x else y`
    If(i64, i64, Box<G>, Box<G>),
    Paren(Box<G>),
    /// `callee { args }`: a recipe call.
    Call(&'static str, Vec<(String, G)>),
}

#[derive(Debug, Clone)]
enum Part {
    Lit(String),
    Int(i64),
}

fn lit_string() -> impl Strategy<Value = String> {
    let chars = prop::sample::select(vec![
        'a', 'Z', '0', ' ', '"', '\\', '$', '{', '}', '\n', '\t', 'é', '#', '-',
    ]);
    prop::collection::vec(chars, 0..8).prop_map(|v| v.into_iter().collect())
}

fn str_expr() -> impl Strategy<Value = G> {
    let part = prop_oneof![
        lit_string().prop_map(Part::Lit),
        (-5i64..500).prop_map(Part::Int)
    ];
    let leaf = prop::collection::vec(part, 0..4).prop_map(G::Str);
    leaf.prop_recursive(3, 12, 2, |inner| {
        prop_oneof![
            (inner.clone(), inner.clone()).prop_map(|(a, b)| G::Add(Box::new(a), Box::new(b))),
            (0i64..3, 0i64..3, inner.clone(), inner.clone()).prop_map(|(a, b, x, y)| G::If(
                a,
                b,
                Box::new(x),
                Box::new(y)
            )),
            inner.prop_map(|x| G::Paren(Box::new(x))),
        ]
    })
}

fn key() -> impl Strategy<Value = String> {
    prop::sample::select(vec!["a", "b", "name", "x_1", "env", "in_x", "Key-2"])
        .prop_map(str::to_string)
}

fn any_expr() -> impl Strategy<Value = G> {
    let leaf = prop_oneof![
        str_expr(),
        (-1000i64..1000).prop_map(G::Int),
        prop::sample::select(vec![
            "1GiB", "512MB", "1.5TiB", "3KB", "90s", "2h", "250ms", "1.5m", "0.25", "-3.5"
        ])
        .prop_map(G::Raw),
        any::<bool>().prop_map(G::Bool),
        Just(G::None),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(G::List),
            prop::collection::btree_map(key(), inner.clone(), 0..4)
                .prop_map(|m| G::Attrs(m.into_iter().collect())),
            (
                prop::collection::vec(inner.clone(), 0..3),
                prop::collection::vec(inner, 0..3)
            )
                .prop_map(|(a, b)| G::Add(Box::new(G::List(a)), Box::new(G::List(b)))),
        ]
    })
}

#[derive(Debug, Clone)]
struct GStep {
    run: G,
    /// Indices of earlier steps, and whether to name them as a string.
    needs: Vec<(usize, bool)>,
    workers: Option<u32>,
    timeout: Option<&'static str>,
    env: Vec<(String, G)>,
}

#[derive(Debug, Clone)]
struct GFile {
    project: Option<String>,
    lets: Vec<G>,
    packages: Vec<G>,
    variables: Vec<(String, G)>,
    resources: Option<(u32, Option<&'static str>)>,
    steps: Vec<GStep>,
}

fn step() -> impl Strategy<Value = GStep> {
    (
        str_expr(),
        prop::collection::vec((0usize..8, any::<bool>()), 0..3),
        prop::option::of(1u32..64),
        prop::option::of(prop::sample::select(vec!["30m", "2h", "1500ms"])),
        prop::collection::btree_map(
            prop::sample::select(vec!["A", "B_2", "PATHS"]).prop_map(String::from),
            str_expr(),
            0..3,
        ),
    )
        .prop_map(|(run, needs, workers, timeout, env)| GStep {
            run,
            needs,
            workers,
            timeout,
            env: env.into_iter().collect(),
        })
}

fn text(s: &str) -> G {
    G::Str(vec![Part::Lit(s.to_string())])
}

/// A requirement string or a stdlib recipe call.
fn package() -> impl Strategy<Value = G> {
    prop_oneof![
        prop::sample::select(vec!["numpy<2", "pillow>=10", "requests"]).prop_map(text),
        Just(G::Call(
            "std.torch",
            vec![("version".into(), text("2.0.1"))]
        )),
        prop::sample::select(vec!["cpu", "gpu"]).prop_map(|variant| {
            let tf = G::Call(
                "std.tensorflow",
                vec![
                    ("version".into(), text("2.12.1")),
                    ("variant".into(), text(variant)),
                ],
            );
            G::Call(
                "std.horovod",
                vec![
                    ("frameworks".into(), G::List(vec![tf])),
                    ("with_mpi".into(), G::Bool(true)),
                ],
            )
        }),
    ]
}

fn file() -> impl Strategy<Value = GFile> {
    (
        prop::option::of(
            prop::sample::select(vec!["demo", "image net", "x"]).prop_map(String::from),
        ),
        prop::collection::vec(any_expr(), 0..4),
        prop::collection::vec(package(), 0..4),
        prop::collection::btree_map(
            prop::sample::select(vec!["V0", "V1", "V2"]).prop_map(String::from),
            str_expr(),
            0..3,
        ),
        prop::option::of((
            0u32..8,
            prop::option::of(prop::sample::select(vec!["1GiB", "512MB"])),
        )),
        prop::collection::vec(step(), 0..4),
    )
        .prop_map(
            |(project, lets, packages, variables, resources, steps)| GFile {
                project,
                lets,
                packages,
                variables: variables.into_iter().collect(),
                resources,
                steps,
            },
        )
}

/// Renders text, taking layout decisions from a random byte stream.
struct Out {
    choices: Vec<u8>,
    next: usize,
    s: String,
}

impl Out {
    fn pick(&mut self, n: u8) -> u8 {
        let c = self
            .choices
            .get(self.next % self.choices.len().max(1))
            .copied()
            .unwrap_or(0);
        self.next += 1;
        c % n
    }

    /// Whitespace between tokens: spaces, line breaks or a comment.
    fn ws(&mut self) {
        match self.pick(8) {
            0 => self.s.push_str("  "),
            1 => self.s.push_str("\n  "),
            2 => self.s.push_str(" # note\n"),
            3 => self.s.push_str("\n\n"),
            _ => self.s.push(' '),
        }
    }

    /// Whitespace that may also be nothing (next to punctuation).
    fn ws0(&mut self) {
        if self.pick(2) == 0 {
            return;
        }
        self.ws();
    }

    fn expr(&mut self, g: &G) {
        match g {
            G::Str(parts) => self.string(parts),
            G::Int(n) => self.s.push_str(&n.to_string()),
            G::Raw(text) => self.s.push_str(text),
            G::Bool(b) => self.s.push_str(if *b { "true" } else { "false" }),
            G::None => self.s.push_str("none"),
            G::List(items) => {
                self.s.push('[');
                for (n, item) in items.iter().enumerate() {
                    self.ws0();
                    self.expr(item);
                    self.ws0();
                    if n + 1 < items.len() || self.pick(2) == 0 {
                        self.s.push(',');
                    }
                }
                self.ws0();
                self.s.push(']');
            }
            G::Attrs(entries) => self.attrs(entries),
            G::Add(a, b) => {
                // `if` binds loosest; as an operand of `+` it needs parentheses.
                self.operand(a);
                self.ws();
                self.s.push('+');
                self.ws();
                self.operand(b);
            }
            G::If(a, b, x, y) => {
                self.s.push_str("if");
                self.ws();
                self.s.push_str(&format!("{a} == {b}"));
                self.ws();
                self.s.push_str("then");
                self.ws();
                self.expr(x);
                self.ws();
                self.s.push_str("else");
                self.ws();
                self.expr(y);
            }
            G::Call(callee, args) => {
                self.s.push_str(callee);
                self.ws0();
                self.attrs(args);
            }
            G::Paren(x) => {
                self.s.push('(');
                self.ws0();
                self.expr(x);
                self.ws0();
                self.s.push(')');
            }
        }
    }

    fn operand(&mut self, g: &G) {
        if matches!(g, G::If(..)) {
            self.s.push('(');
            self.expr(g);
            self.s.push(')');
        } else {
            self.expr(g);
        }
    }

    fn attrs(&mut self, entries: &[(String, G)]) {
        self.s.push('{');
        for (key, value) in entries {
            self.ws();
            self.s.push_str(key);
            self.ws0();
            self.s.push('=');
            self.ws0();
            self.expr(value);
            if self.pick(2) == 0 {
                self.ws0();
                self.s.push(',');
            }
        }
        self.ws();
        self.s.push('}');
    }

    fn string(&mut self, parts: &[Part]) {
        self.s.push('"');
        // Adjacent literal parts are merged first, so "$" + "{" can't turn into an interpolation.
        let mut merged: Vec<Part> = Vec::new();
        for part in parts {
            match (merged.last_mut(), part) {
                (Some(Part::Lit(prev)), Part::Lit(text)) => prev.push_str(text),
                _ => merged.push(part.clone()),
            }
        }
        for part in &merged {
            match part {
                Part::Lit(text) => {
                    let mut chars = text.chars().peekable();
                    while let Some(c) = chars.next() {
                        match c {
                            '"' => self.s.push_str("\\\""),
                            '\\' => self.s.push_str("\\\\"),
                            '\n' if self.pick(2) == 0 => self.s.push_str("\\n"),
                            '\t' if self.pick(2) == 0 => self.s.push_str("\\t"),
                            '$' if chars.peek() == Some(&'{') => self.s.push_str("\\$"),
                            c => self.s.push(c),
                        }
                    }
                }
                Part::Int(n) => {
                    self.s.push_str("${");
                    if self.pick(2) == 0 {
                        self.s.push(' ');
                    }
                    self.s.push_str(&n.to_string());
                    self.s.push('}');
                }
            }
        }
        self.s.push('"');
    }

    fn file(&mut self, f: &GFile) {
        if self.pick(2) == 0 {
            self.s.push_str("# generated\n");
        }
        if let Some(name) = &f.project {
            self.s.push_str(&format!("project \"{name}\"\n"));
        }
        self.s.push_str("import std\n");
        for (i, value) in f.lets.iter().enumerate() {
            self.s.push_str(&format!("let v{i}"));
            self.ws0();
            self.s.push('=');
            self.ws();
            self.expr(value);
            self.s.push('\n');
        }
        self.s.push_str("env");
        self.ws0();
        let mut env: Vec<(String, G)> =
            vec![("python".into(), G::Str(vec![Part::Lit("3.11".into())]))];
        env.push(("packages".into(), G::List(f.packages.clone())));
        if !f.variables.is_empty() {
            env.push(("variables".into(), G::Attrs(f.variables.clone())));
        }
        self.attrs(&env);
        self.s.push('\n');
        if let Some((gpus, mem)) = f.resources {
            self.s.push_str("resources");
            self.ws0();
            let mut entries = vec![("gpus".to_string(), G::Int(i64::from(gpus)))];
            if let Some(mem) = mem {
                entries.push(("mem".into(), G::Raw(mem)));
            }
            self.attrs(&entries);
            self.s.push('\n');
        }
        for (i, step) in f.steps.iter().enumerate() {
            self.s.push_str(&format!("step s{i}"));
            self.ws0();
            let mut entries = vec![("run".to_string(), step.run.clone())];
            let mut needs: Vec<usize> = step
                .needs
                .iter()
                .filter(|(n, _)| *n < i)
                .map(|(n, _)| *n)
                .collect();
            needs.dedup();
            if !needs.is_empty() {
                let items = step
                    .needs
                    .iter()
                    .filter(|(n, _)| *n < i)
                    .map(|(n, quoted)| {
                        if *quoted {
                            G::Str(vec![Part::Lit(format!("s{n}"))])
                        } else {
                            G::Raw(STEP_NAMES[*n])
                        }
                    })
                    .collect();
                entries.push(("needs".into(), G::List(items)));
            }
            if let Some(w) = step.workers {
                entries.push(("workers".into(), G::Int(i64::from(w))));
            }
            if let Some(t) = step.timeout {
                entries.push(("timeout".into(), G::Raw(t)));
            }
            if !step.env.is_empty() {
                entries.push(("env".into(), G::Attrs(step.env.clone())));
            }
            self.attrs(&entries);
            self.s.push('\n');
        }
    }
}

const STEP_NAMES: [&str; 8] = ["s0", "s1", "s2", "s3", "s4", "s5", "s6", "s7"];

fn load(text: &str) -> Result<hvd_lang::model::Project, String> {
    hvd_lang::load_source(Path::new("gen.hvd"), text).map_err(|d| d.render_plain())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn fmt_is_idempotent_and_keeps_the_model(f in file(), choices in prop::collection::vec(any::<u8>(), 1..64)) {
        let mut out = Out { choices, next: 0, s: String::new() };
        out.file(&f);
        let text = out.s;
        let original = load(&text);
        prop_assert!(original.is_ok(), "generated file does not evaluate:\n{}\n{}", text, original.err().unwrap_or_default());
        let once = hvd_lang::format_source("gen.hvd", &text).map_err(|d| d.render_plain());
        prop_assert!(once.is_ok(), "fmt failed:\n{}", text);
        let once = once.unwrap_or_default();
        let twice = hvd_lang::format_source("gen.hvd", &once).map_err(|d| d.render_plain()).unwrap_or_default();
        prop_assert_eq!(&twice, &once, "fmt is not idempotent for:\n{}", text);
        prop_assert_eq!(load(&once), original, "fmt changed the model of:\n{}\nformatted:\n{}", text, once);
        // Comments survive formatting.
        prop_assert_eq!(once.matches("# note").count(), text.matches("# note").count(), "comments lost:\n{}\n{}", text, once);
    }
}
