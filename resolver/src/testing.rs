//! A fixture package index for tests (feature `testing`): builds real wheels and sdists from a small spec and
//! serves them over real HTTP on 127.0.0.1 — PEP 691 JSON (or PEP 503 HTML), files with Range (206) support,
//! ETag / If-None-Match (304), yanked files, `requires-python`, and a request log to prove cache hits.
//!
//! ```no_run
//! use hvd_resolver::testing::{Dist, FixtureIndex, FixtureOptions};
//! let index = FixtureIndex::start(
//!     vec![Dist::wheel("a", "1.0").requires(&["b>=2"]), Dist::sdist("b", "2.0")],
//!     FixtureOptions::default(),
//! ).unwrap();
//! let url = index.url(); // "http://127.0.0.1:PORT/simple/"
//! ```
//!
//! Artifacts are deterministic (fixed timestamps), so their sha256 is the same in every run.
//!
//! Tests can also play a hostile index: list any string as a file's sha256 ([`FixtureIndex::list_sha256`]), list
//! no hash at all, serve hand-made bytes for a file ([`FixtureIndex::add_raw`]), or serve PEP 658 metadata that
//! differs from the wheel's ([`FixtureIndex::serve_metadata`]), or trickle an answer a few bytes at a time
//! ([`FixtureIndex::trickle`]).
//!
//! [`debian`] signs fixture Debian archives; [`file_server`] serves a directory as it is.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

use crate::names::normalize_name;

pub mod debian;
pub mod file_server;

/// What kind of file a fixture distribution is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DistKind {
    /// A wheel with this tag triple, e.g. `py3-none-any` or `cp311-cp311-manylinux_2_17_x86_64`.
    Wheel {
        tag: String,
    },
    Sdist,
}

/// One file on the fixture index.
#[derive(Debug, Clone)]
pub struct Dist {
    pub name: String,
    pub version: String,
    pub requires_dist: Vec<String>,
    pub requires_python: Option<String>,
    pub kind: DistKind,
    pub yanked: bool,
    /// For sdists: write `Requires-Dist` into PKG-INFO (metadata 2.2, static). When false, PKG-INFO is
    /// metadata 2.1 without `Requires-Dist`, and the requirements go to `*.egg-info/requires.txt`.
    pub static_metadata: bool,
    /// The body of the package's `<module>/__init__.py`; default `__version__ = "<version>"`.
    pub module_source: Option<String>,
    /// For sdists: write a pyproject.toml (default true). Without one, PEP 517's default build requirements apply.
    pub pyproject: bool,
    /// For sdists: pyproject.toml `[build-system] requires` (default empty, so fixture sdists need nothing to
    /// lock); `None` leaves the `[build-system]` table out.
    pub build_requires: Option<Vec<String>>,
    /// For sdists: pyproject.toml `build-backend` (default `setuptools.build_meta`).
    pub build_backend: String,
    /// For wheels: this many extra small files before `.dist-info/` (a big central directory, as in real wheels
    /// with thousands of files, which does not fit in the tail the range reader fetches first).
    pub extra_files: usize,
    /// For sdists: more files, by path below the sdist's top directory (e.g. a `setup.py`).
    pub sdist_files: Vec<(String, String)>,
}

impl Dist {
    /// A pure-python wheel (`py3-none-any`).
    pub fn wheel(name: &str, version: &str) -> Dist {
        Dist {
            name: name.to_string(),
            version: version.to_string(),
            requires_dist: Vec::new(),
            requires_python: None,
            kind: DistKind::Wheel {
                tag: "py3-none-any".into(),
            },
            yanked: false,
            static_metadata: true,
            module_source: None,
            pyproject: true,
            build_requires: Some(Vec::new()),
            build_backend: "setuptools.build_meta".into(),
            extra_files: 0,
            sdist_files: Vec::new(),
        }
    }

    /// An sdist (`.tar.gz` with PKG-INFO and pyproject.toml).
    pub fn sdist(name: &str, version: &str) -> Dist {
        Dist {
            kind: DistKind::Sdist,
            ..Dist::wheel(name, version)
        }
    }

    /// Set the wheel tag triple.
    pub fn tag(mut self, tag: &str) -> Dist {
        self.kind = DistKind::Wheel {
            tag: tag.to_string(),
        };
        self
    }

    pub fn requires(mut self, requirements: &[&str]) -> Dist {
        self.requires_dist
            .extend(requirements.iter().map(|r| r.to_string()));
        self
    }

    pub fn requires_python(mut self, spec: &str) -> Dist {
        self.requires_python = Some(spec.to_string());
        self
    }

    pub fn yanked(mut self) -> Dist {
        self.yanked = true;
        self
    }

    /// Replace the body of `<module>/__init__.py`.
    pub fn module_source(mut self, source: &str) -> Dist {
        self.module_source = Some(source.to_string());
        self
    }

    /// For sdists: pyproject.toml's `[build-system]` table.
    pub fn build_system(mut self, requires: &[&str], backend: &str) -> Dist {
        self.build_requires = Some(requires.iter().map(|r| r.to_string()).collect());
        self.build_backend = backend.to_string();
        self
    }

    /// For wheels: add `count` small files (see [`Dist::extra_files`]).
    pub fn with_extra_files(mut self, count: usize) -> Dist {
        self.extra_files = count;
        self
    }

    /// For sdists: add `body` at `path` below the sdist's top directory.
    pub fn sdist_file(mut self, path: &str, body: &str) -> Dist {
        self.sdist_files.push((path.to_string(), body.to_string()));
        self
    }

    /// For sdists: no pyproject.toml at all (a legacy setup.py-style sdist).
    pub fn without_pyproject(mut self) -> Dist {
        self.pyproject = false;
        self
    }

    fn init_py(&self) -> String {
        self.module_source
            .clone()
            .unwrap_or_else(|| format!("__version__ = \"{}\"\n", self.version))
    }

    /// For sdists: legacy metadata (requirements only in `requires.txt`).
    pub fn legacy_metadata(mut self) -> Dist {
        self.static_metadata = false;
        self
    }

    fn dist_name(&self) -> String {
        normalize_name(&self.name).replace('-', "_")
    }

    /// The file name on the index.
    pub fn filename(&self) -> String {
        match &self.kind {
            DistKind::Wheel { tag } => format!("{}-{}-{tag}.whl", self.dist_name(), self.version),
            DistKind::Sdist => format!("{}-{}.tar.gz", self.dist_name(), self.version),
        }
    }

    fn metadata(&self, with_requires: bool) -> String {
        let version = if with_requires { "2.2" } else { "2.1" };
        let mut m = format!(
            "Metadata-Version: {version}\nName: {}\nVersion: {}\n",
            self.name, self.version
        );
        if let Some(rp) = &self.requires_python {
            m.push_str(&format!("Requires-Python: {rp}\n"));
        }
        let mut extras: Vec<String> = Vec::new();
        for r in &self.requires_dist {
            if let Some(pos) = r.find("extra ==") {
                let e: String = r[pos + 8..]
                    .trim()
                    .trim_matches(|c| c == '"' || c == '\'')
                    .chars()
                    .take_while(|c| *c != '"' && *c != '\'')
                    .collect();
                if !extras.contains(&e) {
                    extras.push(e);
                }
            }
        }
        for e in extras {
            m.push_str(&format!("Provides-Extra: {e}\n"));
        }
        if with_requires {
            for r in &self.requires_dist {
                m.push_str(&format!("Requires-Dist: {r}\n"));
            }
        }
        m.push_str("\nA fixture package.\n");
        m
    }

    /// Build the file's bytes.
    pub fn build(&self) -> Vec<u8> {
        match &self.kind {
            DistKind::Wheel { tag } => self.build_wheel(tag),
            DistKind::Sdist => self.build_sdist(),
        }
    }

    fn build_wheel(&self, tag: &str) -> Vec<u8> {
        use zip::write::SimpleFileOptions;
        let dist_info = format!("{}-{}.dist-info", self.dist_name(), self.version);
        let module = self.dist_name();
        let mut files: Vec<(String, String)> =
            vec![(format!("{module}/__init__.py"), self.init_py())];
        for i in 0..self.extra_files {
            files.push((
                format!("{module}/data/file_with_a_long_name_{i:06}.txt"),
                format!("{i}\n"),
            ));
        }
        files.extend([
            (format!("{dist_info}/METADATA"), self.metadata(true)),
            (
                format!("{dist_info}/WHEEL"),
                format!(
                    "Wheel-Version: 1.0\nGenerator: hvd-fixture\nRoot-Is-Purelib: true\nTag: {tag}\n"
                ),
            ),
        ]);
        let mut record = String::new();
        for (name, body) in &files {
            let b64 = crate::Sha256::of_bytes(body.as_bytes()).record_form();
            record.push_str(&format!("{name},sha256={b64},{}\n", body.len()));
        }
        record.push_str(&format!("{dist_info}/RECORD,,\n"));
        let mut writer = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
        let options = SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated)
            .last_modified_time(zip::DateTime::default())
            .unix_permissions(0o644);
        for (name, body) in files
            .iter()
            .chain([(format!("{dist_info}/RECORD"), record)].iter())
        {
            writer
                .start_file(name.as_str(), options)
                .expect("in-memory zip");
            writer.write_all(body.as_bytes()).expect("in-memory zip");
        }
        writer.finish().expect("in-memory zip").into_inner()
    }

    fn build_sdist(&self) -> Vec<u8> {
        let root = format!("{}-{}", self.dist_name(), self.version);
        let module = self.dist_name();
        let mut files = vec![
            (
                format!("{root}/PKG-INFO"),
                self.metadata(self.static_metadata),
            ),
            (format!("{root}/{module}/__init__.py"), self.init_py()),
        ];
        for (path, body) in &self.sdist_files {
            files.push((format!("{root}/{path}"), body.clone()));
        }
        if self.pyproject {
            let build_system = match &self.build_requires {
                Some(requires) => format!(
                    "[build-system]\nrequires = [{}]\nbuild-backend = {:?}\n\n",
                    requires
                        .iter()
                        .map(|r| format!("{r:?}"))
                        .collect::<Vec<_>>()
                        .join(", "),
                    self.build_backend
                ),
                None => String::new(),
            };
            files.push((
                format!("{root}/pyproject.toml"),
                format!(
                    "{build_system}[project]\nname = \"{}\"\nversion = \"{}\"\ndependencies = [{}]\n",
                    self.name,
                    self.version,
                    self.requires_dist
                        .iter()
                        .map(|r| format!("{r:?}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        if !self.static_metadata {
            let mut txt = String::new();
            let mut sections: BTreeMap<String, Vec<String>> = BTreeMap::new();
            for r in &self.requires_dist {
                match r.split_once(';') {
                    Some((req, marker)) => {
                        let marker = marker.trim();
                        let section = match marker.strip_prefix("extra ==") {
                            Some(e) => e.trim().trim_matches(|c| c == '"' || c == '\'').to_string(),
                            None => format!(":{marker}"),
                        };
                        sections
                            .entry(section)
                            .or_default()
                            .push(req.trim().to_string());
                    }
                    None => txt.push_str(&format!("{}\n", r.trim())),
                }
            }
            for (section, reqs) in sections {
                txt.push_str(&format!("\n[{section}]\n"));
                for r in reqs {
                    txt.push_str(&format!("{r}\n"));
                }
            }
            files.push((format!("{root}/{module}.egg-info/requires.txt"), txt));
        }
        let mut tar = tar::Builder::new(Vec::new());
        for (name, body) in files {
            let mut header = tar::Header::new_gnu();
            header.set_size(body.len() as u64);
            header.set_mode(0o644);
            header.set_mtime(0);
            header.set_cksum();
            tar.append_data(&mut header, name, body.as_bytes())
                .expect("in-memory tar");
        }
        let tar = tar.into_inner().expect("in-memory tar");
        let mut gz = flate2::GzBuilder::new()
            .mtime(0)
            .write(Vec::new(), flate2::Compression::default());
        gz.write_all(&tar).expect("in-memory gzip");
        gz.finish().expect("in-memory gzip")
    }
}

/// Server behaviour switches.
#[derive(Debug, Clone, Copy)]
pub struct FixtureOptions {
    /// Serve PEP 503 HTML pages instead of PEP 691 JSON.
    pub html: bool,
    /// Answer Range requests with 206 (else the whole file with 200).
    pub ranges: bool,
    /// Offer PEP 658/714 metadata files (`<url>.metadata`).
    pub core_metadata: bool,
    /// Answer the first this-many requests with 503 (to exercise retries).
    pub fail_first: u32,
}

impl FixtureOptions {
    /// The defaults, with HTML pages or not.
    pub fn html(html: bool) -> FixtureOptions {
        FixtureOptions {
            html,
            ..FixtureOptions::default()
        }
    }

    /// The defaults, with PEP 658 metadata files or not.
    pub fn core_metadata(core_metadata: bool) -> FixtureOptions {
        FixtureOptions {
            core_metadata,
            ..FixtureOptions::default()
        }
    }

    /// The defaults, with Range support or not.
    pub fn ranges(ranges: bool) -> FixtureOptions {
        FixtureOptions {
            ranges,
            ..FixtureOptions::default()
        }
    }
}

impl Default for FixtureOptions {
    fn default() -> Self {
        FixtureOptions {
            html: false,
            ranges: true,
            core_metadata: false,
            fail_first: 0,
        }
    }
}

struct StoredFile {
    dist: Dist,
    bytes: Vec<u8>,
    sha256: String,
    /// What the page lists as the sha256 (`None`: no hash listed). Normally `Some(sha256)`.
    listed_sha256: Option<String>,
    /// PEP 658 metadata served instead of the dist's own.
    metadata: Option<String>,
    /// The PEP 658 metadata sha256 listed on the JSON page (else `core-metadata: true`).
    metadata_sha256: Option<String>,
}

struct State {
    files: Mutex<Vec<StoredFile>>,
    options: FixtureOptions,
    log: Mutex<Vec<String>>,
    stop: AtomicBool,
    failures_left: std::sync::atomic::AtomicU32,
    /// Request paths whose answer body is sent `chunk` bytes every `interval`.
    trickle: Mutex<Vec<Trickle>>,
}

#[derive(Debug, Clone)]
struct Trickle {
    path: String,
    chunk: usize,
    interval: std::time::Duration,
}

/// A running fixture index; stops when dropped.
pub struct FixtureIndex {
    addr: std::net::SocketAddr,
    state: Arc<State>,
}

impl std::fmt::Debug for FixtureIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FixtureIndex")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl FixtureIndex {
    /// Build the files and start serving on 127.0.0.1 (a free port).
    pub fn start(dists: Vec<Dist>, options: FixtureOptions) -> std::io::Result<FixtureIndex> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State {
            files: Mutex::new(Vec::new()),
            options,
            log: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            failures_left: std::sync::atomic::AtomicU32::new(options.fail_first),
            trickle: Mutex::new(Vec::new()),
        });
        let index = FixtureIndex {
            addr,
            state: state.clone(),
        };
        for d in dists {
            index.add(d);
        }
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                if state.stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                let state = state.clone();
                std::thread::spawn(move || {
                    let _ = serve_connection(stream, &state);
                });
            }
        });
        Ok(index)
    }

    /// Add (or replace, by filename) a file: a new release appears on the index.
    pub fn add(&self, dist: Dist) {
        let bytes = dist.build();
        self.add_raw(dist, bytes);
    }

    /// Add a file whose bytes are given (a hand-made, possibly malformed, wheel or sdist); `dist` names it.
    pub fn add_raw(&self, dist: Dist, bytes: Vec<u8>) {
        let sha256 = hex::encode(Sha256::digest(&bytes));
        let mut files = self.state.files.lock().unwrap_or_else(|p| p.into_inner());
        files.retain(|f| f.dist.filename() != dist.filename());
        files.push(StoredFile {
            dist,
            bytes,
            listed_sha256: Some(sha256.clone()),
            sha256,
            metadata: None,
            metadata_sha256: None,
        });
    }

    /// List `listed` as the sha256 of `filename` on its project page (any string, e.g. a path), or no hash at all
    /// with `None`. The file's bytes do not change.
    pub fn list_sha256(&self, filename: &str, listed: Option<&str>) {
        let mut files = self.state.files.lock().unwrap_or_else(|p| p.into_inner());
        for f in files.iter_mut().filter(|f| f.dist.filename() == filename) {
            f.listed_sha256 = listed.map(str::to_string);
        }
    }

    /// List `listed` as the sha256 of the PEP 658 metadata of `filename` on JSON pages (with `core_metadata` on).
    pub fn list_core_metadata_sha256(&self, filename: &str, listed: &str) {
        let mut files = self.state.files.lock().unwrap_or_else(|p| p.into_inner());
        for f in files.iter_mut().filter(|f| f.dist.filename() == filename) {
            f.metadata_sha256 = Some(listed.to_string());
        }
    }

    /// Serve `metadata` as the PEP 658 `<file>.metadata` of `filename` (with `core_metadata` on).
    pub fn serve_metadata(&self, filename: &str, metadata: &str) {
        let mut files = self.state.files.lock().unwrap_or_else(|p| p.into_inner());
        for f in files.iter_mut().filter(|f| f.dist.filename() == filename) {
            f.metadata = Some(metadata.to_string());
        }
    }

    /// Send the answer body of requests for `path` (exactly, e.g. `/simple/helper/` or `/files/<filename>`)
    /// `chunk` bytes (at least 1) every `interval`, as a host that stalls a client just inside its read timeout
    /// (a tiny `chunk`) or a slow but honest one. The head is sent at once.
    pub fn trickle(&self, path: &str, chunk: usize, interval: std::time::Duration) {
        let mut trickle = self.state.trickle.lock().unwrap_or_else(|p| p.into_inner());
        trickle.retain(|t| t.path != path);
        trickle.push(Trickle {
            path: path.to_string(),
            chunk: chunk.max(1),
            interval,
        });
    }

    /// The simple-API root, with a trailing slash.
    pub fn url(&self) -> String {
        format!("http://{}/simple/", self.addr)
    }

    /// `http://127.0.0.1:PORT`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request so far, as `"GET /path STATUS"`.
    pub fn requests(&self) -> Vec<String> {
        self.state
            .log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Forget the request log.
    pub fn clear_requests(&self) {
        self.state
            .log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// An index serving one wheel, `helper 1.0` (`helper-1.0-py3-none-any.whl`).
    pub fn helper(options: FixtureOptions) -> FixtureIndex {
        FixtureIndex::start(vec![Dist::wheel("helper", "1.0")], options)
            .expect("the fixture index starts")
    }

    /// Bytes and sha256 of a file by name.
    pub fn file(&self, filename: &str) -> Option<(Vec<u8>, String)> {
        let files = self.state.files.lock().unwrap_or_else(|p| p.into_inner());
        files
            .iter()
            .find(|f| f.dist.filename() == filename)
            .map(|f| (f.bytes.clone(), f.sha256.clone()))
    }
}

impl Drop for FixtureIndex {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(self.addr);
    }
}

/// torch 2.0.1 as the index has it, reduced to what a Horovod build shares with the env: torch, its CUDA wheel
/// `cuda` at `cuda_version`, which depends on setuptools and wheel, and its triton, which depends on cmake,
/// without versions; two of setuptools and of cmake, so the env alone would take the newest of each.
pub fn torch_2_0_1_sharing_build_tools(cuda: &str, cuda_version: &str) -> Vec<Dist> {
    let manylinux = "py3-none-manylinux_2_17_x86_64";
    vec![
        Dist::wheel("torch", "2.0.1")
            .tag("cp311-cp311-manylinux1_x86_64")
            .requires(&[&format!("{cuda}=={cuda_version}"), "triton==2.0.0"]),
        Dist::wheel(cuda, cuda_version)
            .tag("py3-none-manylinux1_x86_64")
            .requires(&["setuptools", "wheel"]),
        Dist::wheel("triton", "2.0.0")
            .tag("cp311-cp311-manylinux2014_x86_64")
            .requires(&["cmake"]),
        Dist::wheel("setuptools", "81.0.0"),
        Dist::wheel("setuptools", "84.2.1"),
        Dist::wheel("cmake", "3.31.6").tag(manylinux),
        Dist::wheel("cmake", "4.1.0").tag(manylinux),
    ]
}

/// An env on python 3.11 asking for `packages` (requirement strings), nothing else.
pub fn env_of(packages: &[&str]) -> hvd_lang::model::Env {
    hvd_lang::model::Env {
        python: "3.11".into(),
        index: None,
        toolchain: None,
        packages: packages
            .iter()
            .map(|p| hvd_lang::model::PackageRequest {
                requirement: p.to_string(),
                build: None,
            })
            .collect(),
        variables: BTreeMap::new(),
    }
}

/// Lock options against `index` with the cache in `cache`, for linux x86_64 with glibc 2.36 (so a lock means the
/// same on every machine).
pub fn lock_options(index: &FixtureIndex, cache: &std::path::Path) -> crate::LockOptions {
    lock_options_at(&index.url(), cache)
}

/// [`lock_options`] against any index URL.
pub fn lock_options_at(index_url: &str, cache: &std::path::Path) -> crate::LockOptions {
    crate::LockOptions {
        index_url: Some(index_url.to_string()),
        cache_dir: Some(cache.to_path_buf()),
        platform: Some(crate::tags::Platform {
            os: "linux".into(),
            arch: "x86_64".into(),
            glibc: Some((2, 36)),
        }),
        ..crate::LockOptions::default()
    }
}

/// The error of a lock that must fail, with its causes ([`lock_or_hang`], then
/// [`crate::index::error_chain`]).
pub fn lock_error(env: hvd_lang::model::Env, options: crate::LockOptions) -> String {
    match lock_or_hang(env, options) {
        Ok(_) => panic!("the lock succeeded; it must fail"),
        Err(err) => crate::index::error_chain(&err),
    }
}

/// [`crate::lock`] on another thread, failing the test (instead of hanging it) when the lock has not returned
/// after two minutes: a guard far above any deadline a test sets, it only tells a hang from an error.
pub fn lock_or_hang(
    env: hvd_lang::model::Env,
    options: crate::LockOptions,
) -> Result<crate::Lockfile, crate::ResolveError> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(crate::lock(&env, &options));
    });
    rx.recv_timeout(std::time::Duration::from_secs(120))
        .expect("`hvd lock` hung instead of failing")
}

struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

fn serve_connection(stream: TcpStream, state: &State) -> std::io::Result<()> {
    stream.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line)? == 0 {
            return Ok(());
        }
        let mut headers = BTreeMap::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line)? == 0 {
                return Ok(());
            }
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':') {
                headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
            }
        }
        if let Some(len) = headers
            .get("content-length")
            .and_then(|l| l.parse::<u64>().ok())
        {
            std::io::copy(&mut (&mut reader).take(len), &mut std::io::sink())?;
        }
        let mut parts = request_line.split_whitespace();
        let method = parts.next().unwrap_or("").to_string();
        let path = parts.next().unwrap_or("/").to_string();
        let fail = state
            .failures_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        let response = if fail {
            Response {
                status: 503,
                headers: vec![],
                body: b"try again".to_vec(),
            }
        } else {
            route(state, &method, &path, &headers)
        };
        state
            .log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(format!("{method} {path} {}", response.status));
        let reason = match response.status {
            200 => "OK",
            206 => "Partial Content",
            304 => "Not Modified",
            404 => "Not Found",
            416 => "Range Not Satisfiable",
            503 => "Service Unavailable",
            _ => "Other",
        };
        let mut head = format!(
            "HTTP/1.1 {} {reason}\r\nContent-Length: {}\r\n",
            response.status,
            response.body.len()
        );
        for (k, v) in &response.headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        writer.write_all(head.as_bytes())?;
        let trickle = state
            .trickle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|t| t.path == path)
            .cloned();
        if method != "HEAD" {
            match trickle {
                None => writer.write_all(&response.body)?,
                Some(t) => {
                    for piece in response.body.chunks(t.chunk) {
                        writer.flush()?;
                        std::thread::sleep(t.interval);
                        if state.stop.load(Ordering::SeqCst) {
                            return Ok(());
                        }
                        // Fails once the client gave up and closed the connection.
                        writer.write_all(piece)?;
                    }
                }
            }
        }
        writer.flush()?;
        if headers
            .get("connection")
            .is_some_and(|c| c.eq_ignore_ascii_case("close"))
        {
            return Ok(());
        }
    }
}

fn not_found() -> Response {
    Response {
        status: 404,
        headers: vec![],
        body: b"not found".to_vec(),
    }
}

fn route(state: &State, _method: &str, path: &str, headers: &BTreeMap<String, String>) -> Response {
    let files = state.files.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(project) = path.strip_prefix("/simple/") {
        let project = project.trim_end_matches('/');
        let wanted = normalize_name(project);
        let mut listed: Vec<&StoredFile> = files
            .iter()
            .filter(|f| normalize_name(&f.dist.name) == wanted)
            .collect();
        if listed.is_empty() {
            return not_found();
        }
        listed.sort_by_key(|a| a.dist.filename());
        let accept = headers.get("accept").cloned().unwrap_or_default();
        let json = !state.options.html && accept.contains("application/vnd.pypi.simple.v1+json");
        let (body, content_type) = if json {
            let files: Vec<serde_json::Value> = listed
                .iter()
                .map(|f| {
                    let hashes = match &f.listed_sha256 {
                        Some(h) => serde_json::json!({ "sha256": h }),
                        None => serde_json::json!({}),
                    };
                    let mut v = serde_json::json!({
                        "filename": f.dist.filename(),
                        "url": format!("../../files/{}", f.dist.filename()),
                        "hashes": hashes,
                        "requires-python": f.dist.requires_python,
                        "size": f.bytes.len(),
                        "yanked": f.dist.yanked,
                    });
                    if state.options.core_metadata && matches!(f.dist.kind, DistKind::Wheel { .. })
                    {
                        v["core-metadata"] = match &f.metadata_sha256 {
                            Some(h) => serde_json::json!({ "sha256": h }),
                            None => serde_json::json!(true),
                        };
                    }
                    v
                })
                .collect();
            let body =
                serde_json::json!({"meta": {"api-version": "1.1"}, "name": wanted, "files": files});
            (
                body.to_string().into_bytes(),
                "application/vnd.pypi.simple.v1+json",
            )
        } else {
            let mut html = String::from("<!DOCTYPE html>\n<html><body>\n");
            for f in &listed {
                let mut attrs = String::new();
                if let Some(rp) = &f.dist.requires_python {
                    attrs.push_str(&format!(
                        " data-requires-python=\"{}\"",
                        rp.replace('<', "&lt;").replace('>', "&gt;")
                    ));
                }
                if f.dist.yanked {
                    attrs.push_str(" data-yanked=\"\"");
                }
                let fragment = match &f.listed_sha256 {
                    Some(h) => format!("#sha256={h}"),
                    None => String::new(),
                };
                html.push_str(&format!(
                    "<a href=\"../../files/{0}{fragment}\"{attrs}>{0}</a><br/>\n",
                    f.dist.filename(),
                ));
            }
            html.push_str("</body></html>\n");
            (html.into_bytes(), "text/html")
        };
        let etag = format!("\"{}\"", &hex::encode(Sha256::digest(&body))[..16]);
        let cache = vec![
            ("ETag".to_string(), etag.clone()),
            (
                "Cache-Control".to_string(),
                "max-age=0, must-revalidate".to_string(),
            ),
            ("Content-Type".to_string(), content_type.to_string()),
        ];
        if headers.get("if-none-match") == Some(&etag) {
            return Response {
                status: 304,
                headers: cache,
                body: vec![],
            };
        }
        return Response {
            status: 200,
            headers: cache,
            body,
        };
    }
    if let Some(name) = path.strip_prefix("/files/") {
        if let Some(wheel) = name.strip_suffix(".metadata") {
            if state.options.core_metadata
                && let Some(f) = files.iter().find(|f| f.dist.filename() == wheel)
            {
                return Response {
                    status: 200,
                    headers: vec![],
                    body: f
                        .metadata
                        .clone()
                        .unwrap_or_else(|| f.dist.metadata(true))
                        .into_bytes(),
                };
            }
            return not_found();
        }
        let Some(f) = files.iter().find(|f| f.dist.filename() == name) else {
            return not_found();
        };
        let total = f.bytes.len() as u64;
        if let (true, Some(range)) = (state.options.ranges, headers.get("range")) {
            let Some((start, end)) = parse_range(range, total) else {
                return Response {
                    status: 416,
                    headers: vec![("Content-Range".into(), format!("bytes */{total}"))],
                    body: vec![],
                };
            };
            return Response {
                status: 206,
                headers: vec![
                    (
                        "Content-Range".into(),
                        format!("bytes {start}-{end}/{total}"),
                    ),
                    ("Accept-Ranges".into(), "bytes".into()),
                ],
                body: f.bytes[start as usize..=end as usize].to_vec(),
            };
        }
        return Response {
            status: 200,
            headers: vec![],
            body: f.bytes.clone(),
        };
    }
    not_found()
}

/// `bytes=a-b`, `bytes=a-`, `bytes=-n` -> inclusive (start, end) within `total`.
fn parse_range(range: &str, total: u64) -> Option<(u64, u64)> {
    let spec = range.strip_prefix("bytes=")?;
    let (a, b) = spec.split_once('-')?;
    if total == 0 {
        return None;
    }
    if a.is_empty() {
        let n: u64 = b.parse().ok()?;
        if n == 0 {
            return None;
        }
        return Some((total.saturating_sub(n), total - 1));
    }
    let start: u64 = a.parse().ok()?;
    let end: u64 = if b.is_empty() {
        total - 1
    } else {
        b.parse::<u64>().ok()?.min(total - 1)
    };
    if start > end {
        return None;
    }
    Some((start, end))
}
