//! Lowering: evaluated blocks -> the typed [`model`](crate::model). Checks field names ("did you mean"),
//! types, required fields and the step graph (unknown steps, cycles).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use crate::diagnostics::{Loc, Problem, suggestion};
use crate::eval::{Block, Field, MainOut, StepOut, Sv, Value, list_names, type_error};
use crate::model::{
    Cluster, EngineKind, EngineSettings, Env, PackageRequest, Project, Resources, SETTINGS,
    SettingError, SettingValue, SourceBuild, Step, Toolchain,
};
use crate::syntax::ast::BlockKind;

mod elastic;

const ENV_FIELDS: [&str; 5] = ["python", "index", "toolchain", "packages", "variables"];
const RESOURCE_FIELDS: [&str; 3] = ["gpus", "cpus", "mem"];
const STEP_FIELDS: [&str; 9] = [
    "run",
    "needs",
    "workers",
    "inputs",
    "outputs",
    "env",
    "timeout",
    "restarts",
    "checkpoints",
];
const CLUSTER_FIELDS: [&str; 7] = [
    "caches",
    "engine",
    "hosts",
    "image",
    "namespace",
    "partition",
    "settings",
];
const BUILD_FIELDS: [&str; 4] = ["requires", "env", "against", "no_build_isolation"];

pub(crate) struct Lowerer {
    pub problems: Vec<Problem>,
}

impl Lowerer {
    fn report(&mut self, p: Problem) {
        self.problems.push(p);
    }

    pub fn project(&mut self, out: MainOut, path: &Path, main_loc: Loc) -> Option<Project> {
        let name = match &out.project {
            Some((name, _)) => name.clone(),
            None => path.file_stem().map_or_else(
                || "project".to_string(),
                |s| s.to_string_lossy().into_owned(),
            ),
        };
        let mut env = None;
        let mut resources = Resources::default();
        let mut cluster = None;
        for block in &out.blocks {
            match block.kind {
                BlockKind::Env => env = self.env(block),
                BlockKind::Resources => resources = self.resources(block),
                BlockKind::Cluster => cluster = Some(self.cluster(block)),
            }
        }
        if !out.blocks.iter().any(|b| b.kind == BlockKind::Env) {
            self.report(
                Problem::new(main_loc, "missing `env` block", "the file starts here").help(
                    "add an env block, e.g. `env { python = \"3.11\", packages = [\"numpy\"] }`",
                ),
            );
        }
        let steps = self.steps(&out.steps);
        let project = Project {
            name,
            file: path.to_path_buf(),
            env: env?,
            resources,
            steps,
            cluster,
        };
        Some(project)
    }

    /// Report unknown field names; returns the fields by name.
    fn fields<'a>(
        &mut self,
        fields: &'a [Field],
        known: &[&str],
        what: &str,
    ) -> HashMap<&'a str, &'a Field> {
        let mut map = HashMap::new();
        for f in fields {
            if known.contains(&f.key.as_str()) {
                map.insert(f.key.as_str(), f);
            } else {
                let help = suggestion(&f.key, known.iter().copied())
                    .unwrap_or_else(|| format!("{what} takes {}", list_names(known)));
                self.report(
                    Problem::new(
                        f.key_loc,
                        format!("unknown attribute `{}` in {what}", f.key),
                        "unknown attribute",
                    )
                    .help(help),
                );
            }
        }
        map
    }

    fn env(&mut self, block: &Block) -> Option<Env> {
        let fields = self.fields(&block.fields, &ENV_FIELDS, "`env`");
        let python = match fields.get("python") {
            None => {
                self.report(
                    Problem::new(block.keyword, "`env` has no `python`", "in this block").help(
                        "add `python = \"3.11\"` (or `python = std.python { version = \"3.11\" }`)",
                    ),
                );
                None
            }
            Some(f) => f.value.as_ref().and_then(|v| self.python(v)),
        };
        let index = fields
            .get("index")
            .and_then(|f| f.value.as_ref())
            .and_then(|v| self.string(v, "the package index URL"));
        let toolchain = fields
            .get("toolchain")
            .and_then(|f| f.value.as_ref())
            .and_then(|v| self.toolchain(v));
        let mut packages = Vec::new();
        if let Some(list) = fields.get("packages").and_then(|f| f.value.as_ref()) {
            match &list.v {
                Value::List(items) => {
                    for item in items.iter() {
                        if let Some(p) = self.package(item) {
                            packages.push(p);
                        }
                    }
                }
                _ => self.report(type_error(
                    list,
                    "a list",
                    "`packages` is a list of requirements such as `\"numpy<2\"`",
                )),
            }
        }
        let variables = fields
            .get("variables")
            .and_then(|f| f.value.as_ref())
            .map(|v| self.string_map(v))
            .unwrap_or_default();
        Some(Env {
            python: python?,
            index,
            toolchain,
            packages,
            variables,
        })
    }

    fn python(&mut self, v: &Sv) -> Option<String> {
        let version = match &v.v {
            Value::Str(s) => Sv {
                v: Value::Str(s.clone()),
                loc: v.loc,
            },
            Value::Attrs(map) => {
                match (map.get("kind"), map.get("version")) {
                    (
                        Some(Sv {
                            v: Value::Str(kind),
                            ..
                        }),
                        Some(version),
                    ) if &**kind == "python" => version.clone(),
                    _ => {
                        self.report(type_error(v, "a version string", "write `python = \"3.11\"` or `python = std.python { version = \"3.11\" }`"));
                        return None;
                    }
                }
            }
            _ => {
                self.report(type_error(
                    v,
                    "a version string",
                    "write `python = \"3.11\"`",
                ));
                return None;
            }
        };
        let text = self.string(&version, "the python version")?;
        let parts: Vec<&str> = text.split('.').collect();
        if !(2..=3).contains(&parts.len())
            || parts
                .iter()
                .any(|p| p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()))
        {
            self.report(
                Problem::new(
                    version.loc,
                    format!("`{text}` is not a python version"),
                    "expected MAJOR.MINOR",
                )
                .help("write it like \"3.11\" or \"3.11.9\""),
            );
            return None;
        }
        Some(text)
    }

    fn toolchain(&mut self, v: &Sv) -> Option<Toolchain> {
        let Value::Attrs(map) = &v.v else {
            self.report(type_error(
                v,
                "a toolchain",
                "write `toolchain = std.gcc { version = \"12\" }`",
            ));
            return None;
        };
        let is_toolchain =
            matches!(map.get("kind"), Some(Sv { v: Value::Str(k), .. }) if &**k == "toolchain");
        if !is_toolchain {
            self.report(type_error(
                v,
                "a toolchain",
                "write `toolchain = std.gcc { version = \"12\" }`",
            ));
            return None;
        }
        let name = self.required_string(map, "name", v)?;
        let version = self.required_string(map, "version", v)?;
        Some(Toolchain { name, version })
    }

    fn required_string(
        &mut self,
        map: &BTreeMap<String, Sv>,
        key: &str,
        whole: &Sv,
    ) -> Option<String> {
        match map.get(key) {
            Some(sv) => self.string(sv, &format!("`{key}`")),
            None => {
                self.report(Problem::new(
                    whole.loc,
                    format!("missing `{key}`"),
                    format!("this has no `{key}`"),
                ));
                None
            }
        }
    }

    fn package(&mut self, item: &Sv) -> Option<PackageRequest> {
        match &item.v {
            Value::Str(s) => {
                let requirement = self.requirement(s, item)?;
                Some(PackageRequest {
                    requirement,
                    build: None,
                })
            }
            Value::Attrs(map) => {
                let Some(req) = map.get("requirement") else {
                    self.report(
                        Problem::new(item.loc, "package has no `requirement`", "this attribute set")
                            .help("a package is a requirement string or a recipe result with `requirement = \"name==1.0\"`"),
                    );
                    return None;
                };
                let text = self.string(req, "`requirement`")?;
                let requirement = self.requirement(&text, req)?;
                let build = match map.get("build") {
                    None | Some(Sv { v: Value::None, .. }) => None,
                    Some(b) => Some(self.build(b)?),
                };
                Some(PackageRequest { requirement, build })
            }
            Value::Step(name) => {
                self.report(type_error(
                    item,
                    "a package",
                    &format!("`{name}` is a step; did you mean the string \"{name}\"?"),
                ));
                None
            }
            _ => {
                self.report(type_error(
                    item,
                    "a package",
                    "a package is a requirement string like `\"numpy<2\"` or a recipe call",
                ));
                None
            }
        }
    }

    fn requirement(&mut self, text: &str, at: &Sv) -> Option<String> {
        let trimmed = text.trim();
        if !trimmed.starts_with(|c: char| c.is_ascii_alphanumeric()) {
            self.report(
                Problem::new(
                    at.loc,
                    format!("`{text}` is not a requirement"),
                    "expected a package name first",
                )
                .help("write a PEP 508 requirement such as \"numpy<2\""),
            );
            return None;
        }
        Some(trimmed.to_string())
    }

    fn build(&mut self, b: &Sv) -> Option<SourceBuild> {
        let Value::Attrs(map) = &b.v else {
            self.report(type_error(
                b,
                "an attribute set",
                "`build` describes a source build",
            ));
            return None;
        };
        for key in map.keys() {
            if !BUILD_FIELDS.contains(&key.as_str()) {
                let help = suggestion(key, BUILD_FIELDS.iter().copied())
                    .unwrap_or_else(|| format!("`build` takes {}", list_names(&BUILD_FIELDS)));
                self.report(
                    Problem::new(
                        map[key].loc,
                        format!("unknown attribute `{key}` in `build`"),
                        "unknown attribute",
                    )
                    .help(help),
                );
            }
        }
        let requires = map
            .get("requires")
            .map(|v| self.string_list(v))
            .unwrap_or_default();
        let env = map
            .get("env")
            .map(|v| self.string_map(v))
            .unwrap_or_default();
        let against = map
            .get("against")
            .map(|v| self.string_list(v))
            .unwrap_or_default();
        let no_build_isolation = match map.get("no_build_isolation") {
            None => false,
            Some(Sv {
                v: Value::Bool(b), ..
            }) => *b,
            Some(other) => {
                self.report(type_error(
                    other,
                    "a bool",
                    "`no_build_isolation` is `true` or `false`",
                ));
                false
            }
        };
        Some(SourceBuild {
            requires,
            env,
            against,
            no_build_isolation,
        })
    }

    fn resources(&mut self, block: &Block) -> Resources {
        let fields = self.fields(&block.fields, &RESOURCE_FIELDS, "`resources`");
        let gpus = fields
            .get("gpus")
            .and_then(|f| f.value.as_ref())
            .and_then(|v| self.count(v, 0))
            .unwrap_or(0);
        let cpus = fields
            .get("cpus")
            .and_then(|f| f.value.as_ref())
            .and_then(|v| self.count(v, 1));
        let mem = fields
            .get("mem")
            .and_then(|f| f.value.as_ref())
            .and_then(|v| match v.v {
                Value::Size(n) => Some(n),
                Value::Int(_) => {
                    self.report(type_error(
                        v,
                        "a size",
                        "sizes take an explicit unit, e.g. `10GiB` or `512MB`",
                    ));
                    None
                }
                _ => {
                    self.report(type_error(v, "a size", "write a size such as `10GiB`"));
                    None
                }
            });
        Resources { gpus, cpus, mem }
    }

    fn cluster(&mut self, block: &Block) -> Cluster {
        let fields = self.fields(&block.fields, &CLUSTER_FIELDS, "`cluster`");
        let get = |name: &str| fields.get(name).and_then(|f| f.value.as_ref());
        let engine = get("engine").and_then(|v| {
            let s = self.string(v, "the engine")?;
            if let Ok(engine) = s.parse::<EngineKind>() {
                Some(engine)
            } else {
                let names = EngineKind::ALL.map(EngineKind::name);
                let help = suggestion(&s, names.iter().copied())
                    .unwrap_or_else(|| format!("engines are {}", list_names(&names)));
                self.report(
                    Problem::new(v.loc, format!("unknown engine `{s}`"), "unknown engine")
                        .help(help),
                );
                None
            }
        });
        let hosts = get("hosts")
            .map(|v| self.string_list(v))
            .unwrap_or_default();
        let image = get("image").and_then(|v| self.string(v, "the image"));
        let namespace = get("namespace").and_then(|v| self.string(v, "the namespace"));
        let partition = get("partition").and_then(|v| self.string(v, "the partition"));
        let settings = get("settings")
            .map(|v| self.settings(v))
            .unwrap_or_default();
        let caches = get("caches").map(|v| self.caches(v)).unwrap_or_default();
        Cluster {
            engine,
            hosts,
            image,
            namespace,
            partition,
            settings,
            caches,
        }
    }

    fn steps(&mut self, steps: &[StepOut]) -> Vec<Step> {
        let mut out = Vec::new();
        let names: Vec<&str> = steps.iter().map(|s| s.name.as_str()).collect();
        for step in steps {
            let what = format!("step `{}`", step.name);
            let fields = self.fields(&step.fields, &STEP_FIELDS, &what);
            let get = |name: &str| fields.get(name).and_then(|f| f.value.as_ref());
            let run = match fields.get("run") {
                None => {
                    self.report(
                        Problem::new(
                            step.name_loc,
                            format!("step `{}` has no `run`", step.name),
                            "this step",
                        )
                        .help("add the command to run, e.g. `run = \"python train.py\"`"),
                    );
                    None
                }
                Some(f) => f.value.as_ref().and_then(|v| self.string(v, "the command")),
            };
            let mut needs = Vec::new();
            if let Some(v) = get("needs") {
                match &v.v {
                    Value::List(items) => {
                        for item in items.iter() {
                            match &item.v {
                                Value::Step(name) => needs.push(name.to_string()),
                                Value::Str(name) if names.contains(&&**name) => {
                                    needs.push(name.to_string())
                                }
                                Value::Str(name) => {
                                    let help = suggestion(name, names.iter().copied())
                                        .unwrap_or_else(|| {
                                            format!("the steps are {}", list_names(&names))
                                        });
                                    self.report(
                                        Problem::new(
                                            item.loc,
                                            format!("unknown step `{name}` in `needs`"),
                                            "no such step",
                                        )
                                        .help(help),
                                    );
                                }
                                _ => self.report(type_error(
                                    item,
                                    "a step",
                                    "`needs` lists steps, e.g. `needs = [prepare]`",
                                )),
                            }
                        }
                    }
                    _ => self.report(type_error(
                        v,
                        "a list of steps",
                        "write `needs = [prepare]`",
                    )),
                }
            }
            let (workers, min_workers, elastic) = match get("workers") {
                Some(v) => self.workers(v),
                None => (None, None, Default::default()),
            };
            let inputs = get("inputs")
                .map(|v| self.string_list(v))
                .unwrap_or_default();
            let outputs = get("outputs")
                .map(|v| self.string_list(v))
                .unwrap_or_default();
            let env = get("env").map(|v| self.string_map(v)).unwrap_or_default();
            let timeout_ms = get("timeout").and_then(|v| match v.v {
                Value::Duration(ms) => Some(ms),
                _ => {
                    self.report(type_error(
                        v,
                        "a duration",
                        "write a duration with its unit, e.g. `30m` or `2h`",
                    ));
                    None
                }
            });
            let restarts = get("restarts").and_then(|v| self.count(v, 0));
            let checkpoints = get("checkpoints").and_then(|v| self.checkpoints(v));
            if let Some(run) = run {
                out.push(Step {
                    name: step.name.clone(),
                    run,
                    needs,
                    workers,
                    min_workers,
                    elastic,
                    inputs,
                    outputs,
                    env,
                    timeout_ms,
                    restarts,
                    checkpoints,
                });
            }
        }
        if out.len() == steps.len() {
            self.check_cycles(steps, &out);
        }
        out
    }

    /// Report every cycle in `needs` once, naming the steps on it.
    fn check_cycles(&mut self, outs: &[StepOut], steps: &[Step]) {
        let index: HashMap<&str, usize> = steps
            .iter()
            .enumerate()
            .map(|(i, s)| (s.name.as_str(), i))
            .collect();
        // 0 = unvisited, 1 = on the stack, 2 = done. Iterative DFS: no recursion on deep graphs.
        let mut state = vec![0u8; steps.len()];
        for root in 0..steps.len() {
            if state[root] != 0 {
                continue;
            }
            let mut stack: Vec<(usize, usize)> = vec![(root, 0)];
            state[root] = 1;
            while let Some(&mut (node, ref mut next)) = stack.last_mut() {
                let needs = &steps[node].needs;
                if *next < needs.len() {
                    let dep = &needs[*next];
                    *next += 1;
                    let Some(&d) = index.get(dep.as_str()) else {
                        continue;
                    };
                    match state[d] {
                        0 => {
                            state[d] = 1;
                            stack.push((d, 0));
                        }
                        1 => {
                            let pos = stack.iter().position(|(n, _)| *n == d).unwrap_or(0);
                            let cycle: Vec<usize> = stack[pos..].iter().map(|(n, _)| *n).collect();
                            let mut names: Vec<&str> =
                                cycle.iter().map(|&n| steps[n].name.as_str()).collect();
                            names.push(&steps[d].name);
                            let message = if cycle.len() == 1 {
                                format!("step `{}` needs itself", steps[d].name)
                            } else {
                                format!("cycle in `needs`: {}", names.join(" -> "))
                            };
                            let mut problem = Problem::new(
                                outs[d].name_loc,
                                message,
                                "this step is on the cycle",
                            );
                            for &n in &cycle[1..] {
                                problem = problem.also(outs[n].name_loc.span, "and this one");
                            }
                            self.report(
                                problem.help(
                                    "remove one of these `needs` so the steps can run in order",
                                ),
                            );
                        }
                        _ => {}
                    }
                } else {
                    state[node] = 2;
                    stack.pop();
                }
            }
        }
    }

    fn string(&mut self, v: &Sv, what: &str) -> Option<String> {
        match &v.v {
            Value::Str(s) => Some(s.to_string()),
            _ => {
                self.report(type_error(v, "a string", &format!("{what} is a string")));
                None
            }
        }
    }

    /// `checkpoints = "ckpt/"`: a directory (relative to the project, or absolute), a `file://` URL of one, or an
    /// `s3://bucket/prefix` URL.
    fn checkpoints(&mut self, v: &Sv) -> Option<String> {
        let dir = self.string(v, "the checkpoint directory")?;
        let problem = if dir.trim().is_empty() {
            Some((
                "an empty path",
                "name a directory, e.g. `checkpoints = \"ckpt/\"`",
            ))
        } else if dir.contains('\0') {
            Some((
                "a path with a NUL byte",
                "name a directory, e.g. `checkpoints = \"ckpt/\"`",
            ))
        } else if let Some((scheme, _)) = dir.split_once("://")
            && scheme != "file"
            && scheme != "s3"
        {
            Some((
                "a URL hvd cannot keep checkpoints at",
                "checkpoints go to a directory, a `file://` URL (shared storage mounted on every host) or an \
                 `s3://bucket/prefix` URL; an `http(s)://` cache is read-only",
            ))
        } else if dir
            .strip_prefix("s3://")
            .is_some_and(|rest| rest.split('/').next().is_none_or(str::is_empty))
        {
            Some((
                "an `s3://` URL without a bucket",
                "write `s3://bucket/prefix`",
            ))
        } else if dir
            .strip_prefix("file://")
            .is_some_and(|p| !p.starts_with('/'))
        {
            Some((
                "a `file://` URL without an absolute path",
                "write `file:///absolute/dir`, or a plain path relative to the project",
            ))
        } else {
            None
        };
        match problem {
            Some((what, help)) => {
                self.report(
                    Problem::new(v.loc, format!("`checkpoints` is {what}"), "this value")
                        .help(help),
                );
                None
            }
            None => Some(dir),
        }
    }

    fn count(&mut self, v: &Sv, min: i64) -> Option<u32> {
        match v.v {
            Value::Int(n) if n >= min && n <= i64::from(u32::MAX) => Some(n as u32),
            Value::Int(n) => {
                self.report(Problem::new(
                    v.loc,
                    format!("`{n}` is out of range"),
                    format!("expected at least {min}"),
                ));
                None
            }
            _ => {
                self.report(type_error(v, "an integer", "counts are whole numbers"));
                None
            }
        }
    }

    /// `cluster { caches = [...] }`: strings that look like cache URLs (the builder checks the rest).
    fn caches(&mut self, v: &Sv) -> Vec<String> {
        let Value::List(items) = &v.v else {
            self.report(type_error(
                v,
                "a list of strings",
                "write `caches = [\"s3://bucket/prefix\"]`",
            ));
            return Vec::new();
        };
        let mut caches = Vec::new();
        for item in items.iter() {
            let Some(url) = self.string(item, "each cache") else {
                continue;
            };
            if ["file:///", "/", "http://", "https://", "s3://"]
                .iter()
                .any(|scheme| url.starts_with(scheme))
            {
                caches.push(url);
            } else {
                self.report(
                    Problem::new(
                        item.loc,
                        format!("`{url}` is not a cache URL"),
                        "not a cache URL",
                    )
                    .help(
                        "a cache is `file:///dir`, `/dir`, `http(s)://host/path` or `s3://bucket/prefix`",
                    ),
                );
            }
        }
        caches
    }

    fn string_list(&mut self, v: &Sv) -> Vec<String> {
        match &v.v {
            Value::List(items) => items
                .iter()
                .filter_map(|item| self.string(item, "each item"))
                .collect(),
            _ => {
                self.report(type_error(v, "a list of strings", "write `[\"a\", \"b\"]`"));
                Vec::new()
            }
        }
    }

    /// An attribute set of strings (numbers and bools are written as text).
    /// `cluster { settings = { ... } }`, each entry checked against the engine settings' schema ([`SETTINGS`]).
    fn settings(&mut self, v: &Sv) -> EngineSettings {
        let mut settings = EngineSettings::default();
        let Value::Attrs(map) = &v.v else {
            self.report(type_error(
                v,
                "an attribute set",
                "write `{ NAME = value }` (docs/engines.md lists the settings)",
            ));
            return settings;
        };
        for (key, item) in map.iter() {
            let value = match &item.v {
                Value::Str(s) => SettingValue::Str(s),
                Value::Int(n) => SettingValue::Int(*n),
                Value::Bool(b) => SettingValue::Bool(*b),
                Value::Float(f) => SettingValue::Float(*f),
                _ => {
                    self.report(type_error(
                        item,
                        "a string, number or boolean",
                        &format!("the setting `{key}` is one value"),
                    ));
                    continue;
                }
            };
            match settings.set(key, value) {
                Ok(()) => {}
                Err(SettingError::Unknown(_)) => {
                    let keys = SETTINGS.iter().map(|s| s.key);
                    let help = suggestion(key, keys).unwrap_or_else(|| {
                        let keys: Vec<&str> = SETTINGS.iter().map(|s| s.key).collect();
                        format!(
                            "the settings are {} and `spark.*` (docs/engines.md)",
                            list_names(&keys)
                        )
                    });
                    self.report(
                        Problem::new(
                            item.loc,
                            format!("unknown setting `{key}`"),
                            "unknown setting",
                        )
                        .help(help),
                    );
                }
                Err(SettingError::Type { expected, .. }) => {
                    let problem = Problem::new(
                        item.loc,
                        format!("the setting `{key}` is {expected}"),
                        format!("expected {expected}"),
                    );
                    self.report(problem.help(format!(
                        "write `{key} = ...` with {expected} (docs/engines.md)"
                    )));
                }
            }
        }
        settings
    }

    fn string_map(&mut self, v: &Sv) -> BTreeMap<String, String> {
        let Value::Attrs(map) = &v.v else {
            self.report(type_error(
                v,
                "an attribute set",
                "write `{ NAME = \"value\" }`",
            ));
            return BTreeMap::new();
        };
        let mut out = BTreeMap::new();
        for (k, item) in map.iter() {
            let text = match &item.v {
                Value::Str(s) => s.to_string(),
                Value::Int(n) => n.to_string(),
                Value::Bool(b) => b.to_string(),
                Value::Float(f) => f.to_string(),
                _ => {
                    self.report(type_error(
                        item,
                        "a string",
                        &format!("the value of `{k}` becomes an environment variable"),
                    ));
                    continue;
                }
            };
            out.insert(k.clone(), text);
        }
        out
    }
}
