//! The PubGrub solver over an abstract [`PackageSource`], and plain-words explanations when there is no solution.
//!
//! The source is synchronous on purpose: the index-backed source bridges to async fetching (with prefetching),
//! and tests use an in-memory universe to compare the solver with brute force.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use pep440_rs::Version;
use pep508_rs::{MarkerEnvironment, Requirement, VersionOrUrl};
use pubgrub::{
    DefaultStringReporter, Dependencies, DependencyConstraints, DependencyProvider, DerivationTree,
    External, PackageResolutionStatistics, PubGrubError, Ranges, Reporter,
};

/// A version that exists on the index but cannot be used for the target, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unusable {
    pub version: Version,
    /// Plain words after "name==version ", e.g. "has no wheel for cp311 on manylinux x86_64 (it has cp27)".
    pub reason: String,
    /// Interpreter tags of its wheels (for "use python X" suggestions).
    pub python_tags: Vec<String>,
}

/// The versions of one package.
#[derive(Debug, Clone, Default)]
pub struct Candidates {
    /// Usable versions, newest first.
    pub usable: Vec<Version>,
    pub unusable: Vec<Unusable>,
    /// The index has no such project.
    pub not_found: bool,
}

/// What the solver needs from the world.
pub trait PackageSource {
    type Error: std::error::Error + Send + Sync + 'static;
    /// All versions of `name` (normalized).
    fn candidates(&self, name: &str) -> Result<Arc<Candidates>, Self::Error>;
    /// The `Requires-Dist` strings of `name==version` (markers not yet evaluated).
    fn requires(&self, name: &str, version: &Version) -> Result<Arc<Vec<String>>, Self::Error>;
}

/// A node of the PubGrub graph.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Node {
    Root,
    Package(String),
    /// `name[extra]`: depends on `name` at the same version plus the extra's requirements.
    Extra(String, String),
}

impl fmt::Display for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Node::Root => write!(f, "the env"),
            Node::Package(n) => write!(f, "{n}"),
            Node::Extra(n, e) => write!(f, "{n}[{e}]"),
        }
    }
}

/// A requirement and who asked for it, in words that finish "asked by" in a conflict's explanation ("the env's
/// packages", "`horovod`'s build requirements").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Asked {
    /// A PEP 508 requirement, e.g. `setuptools<82`.
    pub requirement: String,
    pub by: String,
}

impl Asked {
    /// Each of `requirements`, asked by `by`.
    pub fn all(requirements: &[String], by: &str) -> Vec<Asked> {
        requirements
            .iter()
            .map(|r| Asked {
                requirement: r.clone(),
                by: by.to_string(),
            })
            .collect()
    }
}

/// An edge of the resolution graph (for the lockfile).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Edge {
    pub name: String,
    pub extras: Vec<String>,
    pub marker: Option<String>,
}

/// A solved set: each package's version and its active dependency edges.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resolution {
    pub packages: BTreeMap<String, (Version, Vec<Edge>)>,
}

/// A requirement string that does not parse, with the package whose metadata lists it.
#[derive(Debug, thiserror::Error)]
#[error("invalid requirement `{requirement}`{}: {message}", context.as_ref().map(|c| format!(" (from {c})")).unwrap_or_default())]
pub struct BadRequirement {
    pub requirement: String,
    pub context: Option<String>,
    pub message: String,
}

/// Why solving failed.
#[derive(Debug, thiserror::Error)]
pub enum SolveError<E: std::error::Error + Send + Sync + 'static> {
    #[error("no set of versions satisfies the env:\n{0}")]
    NoSolution(String),
    #[error(transparent)]
    BadRequirement(BadRequirement),
    #[error(transparent)]
    Source(E),
}

type Range = Ranges<Version>;

/// One parsed, marker-filtered requirement.
#[derive(Debug, Clone)]
struct Parsed {
    /// The requirement as written.
    text: String,
    name: String,
    extras: Vec<String>,
    range: Range,
    marker: Option<String>,
}

fn parse_requirement(text: &str) -> Result<Requirement, String> {
    Requirement::from_str(text).map_err(|e| e.message.to_string())
}

/// Parse requirements and keep the ones whose marker holds for `markers` with `extras` active.
fn active_requirements(
    requirements: &[String],
    markers: &MarkerEnvironment,
    extras: &[pep508_rs::ExtraName],
    context: Option<&str>,
) -> Result<Vec<Parsed>, (String, Option<String>, String)> {
    let mut out = Vec::new();
    for text in requirements {
        let req =
            parse_requirement(text).map_err(|m| (text.clone(), context.map(str::to_string), m))?;
        if !req.marker.evaluate(markers, extras) {
            continue;
        }
        let range = match &req.version_or_url {
            None => Range::full(),
            Some(VersionOrUrl::VersionSpecifier(spec)) => Range::from(spec.clone()),
            Some(VersionOrUrl::Url(_)) => {
                return Err((
                    text.clone(),
                    context.map(str::to_string),
                    "direct URL requirements are not supported; name a version from the index"
                        .into(),
                ));
            }
        };
        let mut extras: Vec<String> = req.extras.iter().map(ToString::to_string).collect();
        extras.sort();
        out.push(Parsed {
            text: text.clone(),
            name: req.name.to_string(),
            extras,
            range,
            marker: req.marker.try_to_string(),
        });
    }
    Ok(out)
}

struct Provider<'a, S: PackageSource> {
    source: &'a S,
    markers: &'a MarkerEnvironment,
    roots: &'a [Asked],
    /// Ranges that bind a package (by name) wherever something depends on it, without making anything depend on
    /// it (pip's constraints), with who asked.
    constraints: HashMap<String, Vec<(Range, Asked)>>,
    /// Preferred versions (existing pins), used when still allowed.
    preferences: &'a HashMap<String, Version>,
    /// Edges recorded per (package, version) for the lockfile.
    edges: RefCell<HashMap<(String, Version), Vec<Edge>>>,
    bad_requirement: RefCell<Option<(String, Option<String>, String)>>,
}

#[derive(Debug, thiserror::Error)]
enum ProviderError<E: std::error::Error + 'static> {
    #[error(transparent)]
    Source(E),
    #[error("invalid requirement")]
    BadRequirement,
}

impl<S: PackageSource> Provider<'_, S> {
    fn name_of(node: &Node) -> Option<&str> {
        match node {
            Node::Root => None,
            Node::Package(n) | Node::Extra(n, _) => Some(n),
        }
    }

    /// Adds `parsed`, asked by `by`, to `out`, with the constraints on each package; returns their edges.
    fn constraints(&self, parsed: Vec<Parsed>, by: &str, out: &mut Vec<Dependency>) -> Vec<Edge> {
        let mut edges = Vec::new();
        for p in parsed {
            let asked = Asked {
                requirement: p.text.clone(),
                by: by.to_string(),
            };
            out.push((
                Node::Package(p.name.clone()),
                p.range.clone(),
                asked.clone(),
            ));
            // The extras' nodes are pinned to the package's version: constraining the package binds them too.
            for extra in &p.extras {
                out.push((
                    Node::Extra(p.name.clone(), extra.clone()),
                    p.range.clone(),
                    asked.clone(),
                ));
            }
            for (range, asked) in self.constraints.get(&p.name).into_iter().flatten() {
                out.push((Node::Package(p.name.clone()), range.clone(), asked.clone()));
            }
            edges.push(Edge {
                name: p.name,
                extras: p.extras,
                marker: p.marker,
            });
        }
        edges
    }
}

/// A dependency of a node: the package, the range asked for and who asked.
type Dependency = (Node, Range, Asked);

/// The dependencies of `own`, one range per package; or, when the requirements on some package allow no version in
/// common, the words saying which requirements those are and who asked for each.
fn merge(
    dependencies: Vec<Dependency>,
    own: &Node,
) -> Result<DependencyConstraints<Node, Range>, String> {
    let mut merged: BTreeMap<Node, (Range, Vec<Asked>)> = BTreeMap::new();
    for (node, range, asked) in dependencies {
        if &node == own {
            continue;
        }
        let (merged_range, askers) = merged
            .entry(node)
            .or_insert_with(|| (Range::full(), Vec::new()));
        *merged_range = merged_range.intersection(&range);
        if range != Range::full() && !askers.contains(&asked) {
            askers.push(asked);
        }
    }
    let conflicts: Vec<String> = merged
        .iter()
        .filter(|(node, (range, _))| matches!(node, Node::Package(_)) && range.is_empty())
        .map(|(node, (_, askers))| {
            let each: Vec<String> = askers
                .iter()
                .map(|a| format!("`{}` (asked by {})", a.requirement, a.by))
                .collect();
            format!("no version of {node} satisfies {}", join_words(&each))
        })
        .collect();
    if !conflicts.is_empty() {
        return Err(conflicts.join("; "));
    }
    Ok(merged.into_iter().map(|(n, (r, _))| (n, r)).collect())
}

/// "a", "a and b", "a, b and c".
fn join_words(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}

impl<S: PackageSource> DependencyProvider for Provider<'_, S> {
    type P = Node;
    type V = Version;
    type VS = Range;
    type M = String;
    type Priority = (u32, u8, std::cmp::Reverse<usize>);
    type Err = ProviderError<S::Error>;

    fn prioritize(
        &self,
        package: &Node,
        range: &Range,
        stats: &PackageResolutionStatistics,
    ) -> Self::Priority {
        // Packages that conflicted most first (they decide the outcome), then pinned ones (a single choice),
        // the root before everything; ties are left to PubGrub, which is deterministic for equal input.
        let pinned = u8::from(range.as_singleton().is_some());
        let order = match package {
            Node::Root => 0,
            _ => 1,
        };
        (stats.conflict_count(), pinned, std::cmp::Reverse(order))
    }

    fn choose_version(&self, package: &Node, range: &Range) -> Result<Option<Version>, Self::Err> {
        let Some(name) = Self::name_of(package) else {
            return Ok(Some(Version::new([0])));
        };
        let candidates = self
            .source
            .candidates(name)
            .map_err(ProviderError::Source)?;
        if let Some(pref) = self.preferences.get(name)
            && range.contains(pref)
            && candidates.usable.contains(pref)
        {
            return Ok(Some(pref.clone()));
        }
        // Pre-releases only when nothing final fits (PEP 440's default).
        let final_release = candidates
            .usable
            .iter()
            .find(|v| !v.any_prerelease() && range.contains(v));
        Ok(final_release
            .or_else(|| candidates.usable.iter().find(|v| range.contains(v)))
            .cloned())
    }

    fn get_dependencies(
        &self,
        package: &Node,
        version: &Version,
    ) -> Result<Dependencies<Node, Range, String>, Self::Err> {
        let mut constraints: Vec<Dependency> = Vec::new();
        let fail = |e: (String, Option<String>, String)| {
            *self.bad_requirement.borrow_mut() = Some(e);
            ProviderError::BadRequirement
        };
        match package {
            Node::Root => {
                // Each root requirement with who asked for it.
                for asked in self.roots {
                    let parsed = active_requirements(
                        std::slice::from_ref(&asked.requirement),
                        self.markers,
                        &[],
                        None,
                    )
                    .map_err(fail)?;
                    self.constraints(parsed, &asked.by, &mut constraints);
                }
            }
            Node::Package(name) => {
                let requires = self
                    .source
                    .requires(name, version)
                    .map_err(ProviderError::Source)?;
                let context = format!("{name}=={version}");
                let parsed = active_requirements(&requires, self.markers, &[], Some(&context))
                    .map_err(fail)?;
                let edges = self.constraints(parsed, &context, &mut constraints);
                self.edges
                    .borrow_mut()
                    .entry((name.clone(), version.clone()))
                    .or_default()
                    .extend(edges);
            }
            Node::Extra(name, extra) => {
                constraints.push((
                    Node::Package(name.clone()),
                    Range::singleton(version.clone()),
                    Asked {
                        requirement: format!("{name}=={version}"),
                        by: format!("{name}[{extra}]"),
                    },
                ));
                let requires = self
                    .source
                    .requires(name, version)
                    .map_err(ProviderError::Source)?;
                let context = format!("{name}[{extra}]=={version}");
                let extra_name = pep508_rs::ExtraName::from_str(extra)
                    .map_err(|e| fail((extra.clone(), Some(context.clone()), e.to_string())))?;
                let base = active_requirements(&requires, self.markers, &[], Some(&context))
                    .map_err(fail)?;
                let with =
                    active_requirements(&requires, self.markers, &[extra_name], Some(&context))
                        .map_err(fail)?;
                // Only what the extra adds: the base requirements are the base package's own edges.
                let added: Vec<Parsed> = with
                    .into_iter()
                    .filter(|p| {
                        !base.iter().any(|b| {
                            b.name == p.name && b.marker == p.marker && b.extras == p.extras
                        })
                    })
                    .collect();
                let edges = self.constraints(added, &context, &mut constraints);
                self.edges
                    .borrow_mut()
                    .entry((name.clone(), version.clone()))
                    .or_default()
                    .extend(edges);
            }
        }
        Ok(match merge(constraints, package) {
            Ok(merged) => Dependencies::Available(merged),
            // The root's conflict is the whole explanation (see `explain`); a package's reads after pubgrub's
            // "dependencies of NAME at version V are unavailable".
            Err(conflict) if package == &Node::Root => Dependencies::Unavailable(conflict),
            Err(conflict) => Dependencies::Unavailable(format!("because {conflict}")),
        })
    }
}

/// Solve `roots` for `markers`, with `constraints` binding any package that is part of the solution (a package
/// only constrained is not added).
pub fn solve<S: PackageSource>(
    source: &S,
    roots: &[Asked],
    constraints: &[Asked],
    markers: &MarkerEnvironment,
    preferences: &HashMap<String, Version>,
    target_words: &str,
) -> Result<Resolution, SolveError<S::Error>> {
    let mut by_name: HashMap<String, Vec<(Range, Asked)>> = HashMap::new();
    for asked in constraints {
        let parsed =
            active_requirements(std::slice::from_ref(&asked.requirement), markers, &[], None)
                .map_err(|(requirement, _, message)| {
                    SolveError::BadRequirement(BadRequirement {
                        requirement,
                        context: Some(asked.by.clone()),
                        message,
                    })
                })?;
        for p in parsed {
            by_name
                .entry(p.name)
                .or_default()
                .push((p.range, asked.clone()));
        }
    }
    let provider = Provider {
        source,
        markers,
        roots,
        constraints: by_name,
        preferences,
        edges: RefCell::default(),
        bad_requirement: RefCell::default(),
    };
    match pubgrub::resolve(&provider, Node::Root, Version::new([0])) {
        Ok(selected) => {
            let edges = provider.edges.into_inner();
            let mut resolution = Resolution::default();
            for (node, version) in selected {
                if let Node::Package(name) = node {
                    let mut e = edges
                        .get(&(name.clone(), version.clone()))
                        .cloned()
                        .unwrap_or_default();
                    e.sort();
                    e.dedup();
                    resolution.packages.insert(name, (version, e));
                }
            }
            Ok(resolution)
        }
        Err(PubGrubError::NoSolution(tree)) => Err(SolveError::NoSolution(explain(
            &tree,
            source,
            target_words,
            &provider.constraints,
        ))),
        Err(
            PubGrubError::ErrorRetrievingDependencies { source: e, .. }
            | PubGrubError::ErrorChoosingVersion { source: e, .. }
            | PubGrubError::ErrorInShouldCancel(e),
        ) => match e {
            ProviderError::Source(e) => Err(SolveError::Source(e)),
            ProviderError::BadRequirement => {
                let (requirement, context, message) = provider
                    .bad_requirement
                    .into_inner()
                    .unwrap_or_else(|| (String::new(), None, String::new()));
                Err(SolveError::BadRequirement(BadRequirement {
                    requirement,
                    context,
                    message,
                }))
            }
        },
    }
}

/// Whether `resolution` breaks `requirement` for `markers` on a package `in_scope` admits: its marker holds and the
/// resolution has the package at a version outside its range. A requirement that does not parse breaks nothing here
/// (solving it reports it).
pub(crate) fn breaks(
    resolution: &Resolution,
    requirement: &str,
    markers: &MarkerEnvironment,
    in_scope: impl Fn(&str) -> bool,
) -> bool {
    let Ok(parsed) = active_requirements(&[requirement.to_string()], markers, &[], None) else {
        return false;
    };
    parsed.iter().any(|p| {
        in_scope(&p.name)
            && resolution
                .packages
                .get(&p.name)
                .is_some_and(|(version, _)| !p.range.contains(version))
    })
}

fn collect_no_versions(tree: &DerivationTree<Node, Range, String>, out: &mut Vec<(String, Range)>) {
    match tree {
        DerivationTree::External(External::NoVersions(
            Node::Package(n) | Node::Extra(n, _),
            range,
        )) => {
            out.push((n.clone(), range.clone()));
        }
        DerivationTree::External(_) => {}
        DerivationTree::Derived(d) => {
            collect_no_versions(&d.cause1, out);
            collect_no_versions(&d.cause2, out);
        }
    }
}

/// The words of a conflict among the root's own requirements (from `merge`), when that is why there is no solution.
fn root_conflict(tree: &DerivationTree<Node, Range, String>) -> Option<&str> {
    match tree {
        DerivationTree::External(External::Custom(Node::Root, _, conflict)) => Some(conflict),
        DerivationTree::External(_) => None,
        DerivationTree::Derived(d) => root_conflict(&d.cause1).or_else(|| root_conflict(&d.cause2)),
    }
}

/// The PubGrub report, then plain-words notes on versions that exist but cannot be used, and suggestions; or, when
/// the root's own requirements conflict, which ones and who asked for each.
///
/// A constraint (`constraints`, e.g. a build's `setuptools<82`) narrows every requirement on its package, so PubGrub's
/// report shows it as part of whatever dependent it met first ("X depends on setuptools <82" where X asked only
/// `setuptools`): a note names the constraint and who asked, and a version is suggested only within it.
fn explain<S: PackageSource>(
    tree: &DerivationTree<Node, Range, String>,
    source: &S,
    target: &str,
    constraints: &HashMap<String, Vec<(Range, Asked)>>,
) -> String {
    if let Some(conflict) = root_conflict(tree) {
        return format!(
            "{conflict}\nhelp: change or drop one of those requirements so that one version satisfies all of them"
        );
    }
    // The root's version is an artifact of PubGrub; say "the env", not "the env 0".
    let mut text = DefaultStringReporter::report(tree).replace("the env 0", "the env");
    let mut missing = Vec::new();
    collect_no_versions(tree, &mut missing);
    let mut seen = BTreeSet::new();
    for (name, range) in missing {
        if !seen.insert((name.clone(), range.to_string())) {
            continue;
        }
        let Ok(candidates) = source.candidates(&name) else {
            continue;
        };
        if candidates.not_found {
            text.push_str(&format!(
                "\n- `{name}` does not exist on the package index; check the spelling"
            ));
            continue;
        }
        let narrowing: &[(Range, Asked)] = constraints.get(&name).map_or(&[], Vec::as_slice);
        for (_, asked) in narrowing {
            text.push_str(&format!(
                "\n- `{}` (asked by {}) narrows every requirement on {name}: a package the report shows depending \
                 on {name} in that range may have asked for less",
                asked.requirement, asked.by
            ));
        }
        let blocked: Vec<&Unusable> = candidates
            .unusable
            .iter()
            .filter(|u| range.contains(&u.version))
            .collect();
        for u in blocked.iter().take(5) {
            text.push_str(&format!("\n- {name}=={} {}", u.version, u.reason));
        }
        if blocked.len() > 5 {
            text.push_str(&format!(
                "\n- ... and {} more versions of {name} in that range",
                blocked.len() - 5
            ));
        }
        // Suggestions: a python that has wheels, and the newest version that works for this target.
        let mut tags: Vec<(u64, u64)> = blocked
            .iter()
            .flat_map(|u| u.python_tags.iter())
            .filter_map(|t| crate::tags::split_py_version(t.strip_prefix("cp")?))
            .collect();
        tags.sort();
        if let Some((major, minor)) = tags.last() {
            text.push_str(&format!(
                "\nhelp: `python = \"{major}.{minor}\"` has wheels for {name} in that range"
            ));
        }
        let allowed = |v: &&Version| narrowing.iter().all(|(r, _)| r.contains(v));
        if let Some(newest) = candidates.usable.iter().find(allowed) {
            text.push_str(&format!(
                "\nhelp: the newest {name} usable for {target} is {newest}; try `{name}=={newest}`"
            ));
        } else if !narrowing.is_empty() && !candidates.usable.is_empty() {
            let asked: Vec<String> = narrowing
                .iter()
                .map(|(_, a)| format!("`{}` (asked by {})", a.requirement, a.by))
                .collect();
            text.push_str(&format!(
                "\nhelp: no {name} usable for {target} satisfies {}; change that requirement where it is asked, or \
                 publish a {name} in its range",
                asked.join(" and ")
            ));
        } else if blocked.is_empty()
            && candidates.usable.is_empty()
            && !candidates.unusable.is_empty()
        {
            text.push_str(&format!(
                "\nhelp: no version of {name} is usable for {target}"
            ));
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, thiserror::Error)]
    #[error("never")]
    struct Never;

    /// An in-memory universe: name -> version -> requirements.
    #[derive(Debug, Clone, Default)]
    struct Universe {
        packages: BTreeMap<String, BTreeMap<u64, Vec<String>>>,
    }

    impl PackageSource for Universe {
        type Error = Never;
        fn candidates(&self, name: &str) -> Result<Arc<Candidates>, Never> {
            let mut c = Candidates::default();
            match self.packages.get(name) {
                None => c.not_found = true,
                Some(versions) => {
                    c.usable = versions.keys().rev().map(|v| Version::new([*v])).collect()
                }
            }
            Ok(Arc::new(c))
        }
        fn requires(&self, name: &str, version: &Version) -> Result<Arc<Vec<String>>, Never> {
            let v = version.release()[0];
            Ok(Arc::new(self.packages[name][&v].clone()))
        }
    }

    /// `roots` asked by the env.
    fn env(roots: &[String]) -> Vec<Asked> {
        Asked::all(roots, "the env's packages")
    }

    fn markers() -> MarkerEnvironment {
        crate::tags::TargetSpec::new(
            "3.11",
            crate::tags::Platform {
                os: "linux".into(),
                arch: "x86_64".into(),
                glibc: Some((2, 36)),
            },
        )
        .unwrap()
        .markers
    }

    fn satisfies(u: &Universe, roots: &[String], chosen: &BTreeMap<String, u64>) -> bool {
        let check = |reqs: &[String]| {
            reqs.iter().all(|r| {
                let req = parse_requirement(r).unwrap();
                let Some(v) = chosen.get(req.name.as_ref()) else {
                    return false;
                };
                match &req.version_or_url {
                    Some(VersionOrUrl::VersionSpecifier(s)) => s.contains(&Version::new([*v])),
                    _ => true,
                }
            })
        };
        check(roots)
            && chosen.iter().all(|(n, v)| {
                u.packages
                    .get(n)
                    .and_then(|vs| vs.get(v))
                    .is_some_and(|r| check(r))
            })
    }

    /// Brute force: try every assignment of a version (or absence) to every package.
    fn brute_force(u: &Universe, roots: &[String]) -> bool {
        let names: Vec<&String> = u.packages.keys().collect();
        fn go(
            u: &Universe,
            roots: &[String],
            names: &[&String],
            i: usize,
            chosen: &mut BTreeMap<String, u64>,
        ) -> bool {
            if i == names.len() {
                return satisfies(u, roots, chosen);
            }
            if go(u, roots, names, i + 1, chosen) {
                return true;
            }
            for v in u.packages[names[i]].keys() {
                chosen.insert(names[i].clone(), *v);
                if go(u, roots, names, i + 1, chosen) {
                    return true;
                }
                chosen.remove(names[i]);
            }
            false
        }
        go(u, roots, &names, 0, &mut BTreeMap::new())
    }

    fn requirement(name: usize, op: usize, v: u64) -> String {
        let ops = ["==", ">=", "<", "!=", "<="];
        format!("p{name}{}{v}", ops[op % ops.len()])
    }

    fn universe_strategy() -> impl Strategy<Value = (Universe, Vec<String>)> {
        let package = proptest::collection::btree_map(
            1u64..5,
            proptest::collection::vec((0usize..4, 0usize..5, 1u64..5), 0..3),
            1..4,
        );
        (
            proptest::collection::vec(package, 2..5),
            proptest::collection::vec((0usize..4, 0usize..5, 1u64..5), 1..3),
        )
            .prop_map(|(packages, roots)| {
                let n = packages.len();
                let mut u = Universe::default();
                for (i, versions) in packages.into_iter().enumerate() {
                    let versions = versions
                        .into_iter()
                        .map(|(v, deps)| {
                            let deps = deps
                                .into_iter()
                                .filter(|(d, _, _)| d % n != i)
                                .map(|(d, op, dv)| requirement(d % n, op, dv))
                                .collect();
                            (v, deps)
                        })
                        .collect();
                    u.packages.insert(format!("p{i}"), versions);
                }
                let roots = roots
                    .into_iter()
                    .map(|(d, op, v)| requirement(d % n, op, v))
                    .collect();
                (u, roots)
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
        #[test]
        fn solver_agrees_with_brute_force((universe, roots) in universe_strategy()) {
            let m = markers();
            let result = solve(&universe, &env(&roots), &[], &m, &HashMap::new(), "cp311");
            let exists = brute_force(&universe, &roots);
            match result {
                Ok(resolution) => {
                    let chosen: BTreeMap<String, u64> =
                        resolution.packages.iter().map(|(n, (v, _))| (n.clone(), v.release()[0])).collect();
                    prop_assert!(satisfies(&universe, &roots, &chosen), "invalid solution {chosen:?}");
                    prop_assert!(exists);
                }
                Err(SolveError::NoSolution(text)) => prop_assert!(!exists, "solver missed a solution: {text}"),
                Err(e) => prop_assert!(false, "unexpected error {e}"),
            }
        }
    }

    #[test]
    fn markers_and_extras() {
        let mut u = Universe::default();
        u.packages.insert(
            "a".into(),
            BTreeMap::from([(
                1,
                vec![
                    "b ; python_version < \"3.10\"".to_string(),
                    "c ; sys_platform == \"linux\"".to_string(),
                    "d ; extra == \"x\"".to_string(),
                ],
            )]),
        );
        for n in ["b", "c", "d"] {
            u.packages.insert(n.into(), BTreeMap::from([(1, vec![])]));
        }
        let m = markers();
        let r = solve(&u, &env(&["a".into()]), &[], &m, &HashMap::new(), "cp311").unwrap();
        assert_eq!(r.packages.keys().collect::<Vec<_>>(), ["a", "c"]);
        let r = solve(
            &u,
            &env(&["a[x]".into()]),
            &[],
            &m,
            &HashMap::new(),
            "cp311",
        )
        .unwrap();
        assert_eq!(r.packages.keys().collect::<Vec<_>>(), ["a", "c", "d"]);
        let edges: Vec<&str> = r.packages["a"].1.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(edges, ["c", "d"]);
    }

    #[test]
    fn preferences_are_kept() {
        let mut u = Universe::default();
        u.packages.insert(
            "a".into(),
            BTreeMap::from([(1, vec![]), (2, vec![]), (3, vec![])]),
        );
        let m = markers();
        let prefs = HashMap::from([("a".to_string(), Version::new([2]))]);
        let r = solve(&u, &env(&["a".into()]), &[], &m, &prefs, "cp311").unwrap();
        assert_eq!(r.packages["a"].0, Version::new([2]));
        let r = solve(&u, &env(&["a>2".into()]), &[], &m, &prefs, "cp311").unwrap();
        assert_eq!(r.packages["a"].0, Version::new([3]));
    }

    /// A universe of `(name, version, requirements)`.
    fn universe(packages: &[(&str, u64, &[&str])]) -> Universe {
        let mut u = Universe::default();
        for (name, version, requires) in packages {
            u.packages
                .entry(name.to_string())
                .or_default()
                .insert(*version, requires.iter().map(|r| r.to_string()).collect());
        }
        u
    }

    #[test]
    fn constraints_bind_only_packages_in_the_solution() {
        let u = universe(&[
            ("a", 1, &["b"]),
            ("b", 1, &[]),
            ("b", 2, &[]),
            ("b", 3, &[]),
            ("c", 1, &[]),
        ]);
        let constraints = Asked::all(&["b<3".into(), "c>5".into()], "`x`'s build requirements");
        let r = solve(
            &u,
            &env(&["a".into()]),
            &constraints,
            &markers(),
            &HashMap::new(),
            "cp311",
        )
        .unwrap();
        assert_eq!(r.packages["b"].0, Version::new([2]));
        assert_eq!(
            r.packages.keys().collect::<Vec<_>>(),
            ["a", "b"],
            "a constraint adds nothing"
        );
    }

    #[test]
    fn conflicting_requirements_name_each_and_who_asked() {
        let u = universe(&[("a", 1, &["b"]), ("b", 1, &[]), ("b", 3, &[])]);
        let constraints = Asked::all(&["b<2".into()], "`x`'s build requirements");
        let roots = env(&["a".into(), "b==3".into()]);
        let Err(SolveError::NoSolution(text)) = solve(
            &u,
            &roots,
            &constraints,
            &markers(),
            &HashMap::new(),
            "cp311",
        ) else {
            panic!("b==3 and b<2 have no solution");
        };
        assert!(
            text.contains("no version of b satisfies `b==3` (asked by the env's packages) and `b<2` (asked by `x`'s build requirements)"),
            "{text}"
        );
        assert!(
            text.contains("help: change or drop one of those requirements"),
            "{text}"
        );
        assert!(!text.contains('∅'), "{text}");

        // Two requirements of the env itself.
        let Err(SolveError::NoSolution(text)) = solve(
            &u,
            &env(&["b>2".into(), "b<2".into()]),
            &[],
            &markers(),
            &HashMap::new(),
            "cp311",
        ) else {
            panic!("b>2 and b<2 have no solution");
        };
        assert!(
            text.contains(
                "`b>2` (asked by the env's packages) and `b<2` (asked by the env's packages)"
            ),
            "{text}"
        );

        // A package version whose own requirements conflict is not chosen; asked for, the report names them.
        let u = universe(&[
            ("a", 1, &[]),
            ("a", 2, &["b>2", "b<2"]),
            ("b", 1, &[]),
            ("b", 3, &[]),
        ]);
        let r = solve(
            &u,
            &env(&["a".into()]),
            &[],
            &markers(),
            &HashMap::new(),
            "cp311",
        )
        .unwrap();
        assert_eq!(r.packages["a"].0, Version::new([1]));
        let Err(SolveError::NoSolution(text)) = solve(
            &u,
            &env(&["a==2".into()]),
            &[],
            &markers(),
            &HashMap::new(),
            "cp311",
        ) else {
            panic!("a 2's requirements conflict");
        };
        assert!(
            text.contains(
                "no version of b satisfies `b>2` (asked by a==2) and `b<2` (asked by a==2)"
            ),
            "{text}"
        );
        assert!(!text.contains('∅'), "{text}");
    }
}
