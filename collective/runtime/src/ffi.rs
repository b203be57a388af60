//! The C ABI (`include/hvd.h`): a process-wide engine driven through plain functions, integer handles and
//! thread-local error strings. Every function catches panics, so none unwinds into C.
//!
//! Buffer contract: `input` and `output` of a request must stay valid and untouched until `hvd_wait` (or a
//! `hvd_poll` returning 1) on its handle; results of allgather, alltoall and reducescatter are owned by the library
//! and copied out with `hvd_result_copy` before `hvd_release`.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_void};
use std::os::unix::ffi::OsStrExt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::collective::connect_from_env;
use crate::config::EngineConfig;
use crate::engine::{
    Engine, EngineError, ErrorKind, Input, Output, OutputBuffer, PreparedGroup, Request,
};
use crate::env_vars;
use crate::message::{OpKind, RequestMeta};
use crate::process_set::{ProcessSetError, ProcessSets};
use hvd_collective::{DType, ReduceOp};

mod completion;
mod process_sets;
mod shared_buffers;

static ENGINE: Mutex<Option<Arc<Engine>>> = Mutex::new(None);
/// Results waited for one by one, until `hvd_release` (keys are handles, so they hash like the engine's).
static RESULTS: Mutex<Option<ResultMap>> = Mutex::new(None);
type ResultMap = HashMap<i64, Output, std::hash::BuildHasherDefault<crate::engine::HandleHasher>>;
/// Groups from `hvd_group_prepare` by id, until `hvd_group_release` or `hvd_shutdown`. Ids are never reused, so
/// one from before a shutdown is refused afterwards instead of naming another group.
static GROUPS: Mutex<Option<HashMap<i64, PreparedGroup>>> = Mutex::new(None);
static NEXT_GROUP: AtomicI64 = AtomicI64::new(1);
/// What `hvd_init` learned about the job besides the topology, until `hvd_shutdown`.
static JOB: Mutex<Option<JobInfo>> = Mutex::new(None);
/// The job's process sets besides the global one, until `hvd_shutdown`.
static SETS: Mutex<Option<Arc<ProcessSets>>> = Mutex::new(None);

/// A C handle carries its set's id above this bit (the job's own set is 0) and, below it, the engine's handle plus
/// [`HANDLE_BASE`].
const SET_SHIFT: u32 = 40;
/// What this `hvd_init`'s handles are offset by (below the set bits): the highest handle issued before it, so a
/// handle from before a shutdown never names an operation of the engines started since.
static HANDLE_BASE: AtomicU64 = AtomicU64::new(0);
/// The highest handle (below the set bits) issued so far, by any engine of any `hvd_init`.
static HANDLE_HIGH: AtomicU64 = AtomicU64::new(0);

struct JobInfo {
    /// The communicator's name as the transport gives it (`SHM`, `TCP`, `HIERARCHICAL`, `MPI`, `NCCL`, `LOCAL`).
    backend: CString,
    /// Every host runs the same number of ranks (from every rank's local size, gathered at init).
    homogeneous: bool,
    /// The engine's settings, which the engines of process sets share.
    config: EngineConfig,
}

/// `hvd_build_features` bits (hvd.h `HVD_BUILT_*`). Never renumber.
pub const BUILT_MPI: i32 = 1;
pub const BUILT_NCCL: i32 = 2;

thread_local! {
    static LAST_ERROR: RefCell<LastError> = RefCell::new(LastError::default());
}

/// The last failure of a call on this thread, for `hvd_last_error`, `hvd_last_error_kind` and
/// `hvd_last_error_rank`.
struct LastError {
    message: CString,
    /// hvd.h `enum hvd_error_kind` (0: no failure yet).
    kind: i32,
    /// The rank a lost peer names, else -1.
    rank: i64,
}

impl Default for LastError {
    fn default() -> LastError {
        LastError {
            message: CString::default(),
            kind: 0,
            rank: -1,
        }
    }
}

/// A failed call: what kind of failure it is (hvd.h `enum hvd_error_kind`), the peer it names (a lost peer) and
/// its message.
#[derive(Debug)]
struct Failure {
    kind: ErrorKind,
    rank: Option<usize>,
    message: String,
}

impl Failure {
    fn new(kind: ErrorKind, message: impl Into<String>) -> Failure {
        Failure {
            kind,
            rank: None,
            message: message.into(),
        }
    }

    /// A collective's failure, after `context` ("failed to ...").
    fn collective(context: &str, e: &hvd_collective::Error) -> Failure {
        Failure {
            kind: ErrorKind::of_collective(e),
            rank: lost_peer(e),
            message: format!("{context}: {}", chain(e)),
        }
    }
}

/// The rank a lost peer names.
fn lost_peer(e: &hvd_collective::Error) -> Option<usize> {
    match e {
        hvd_collective::Error::PeerLost { rank, .. } => Some(*rank),
        _ => None,
    }
}

/// A bad argument (the caller's pointers, codes, handles).
impl From<String> for Failure {
    fn from(message: String) -> Failure {
        Failure::new(ErrorKind::InvalidArgument, message)
    }
}

impl From<&str> for Failure {
    fn from(message: &str) -> Failure {
        Failure::new(ErrorKind::InvalidArgument, message)
    }
}

impl From<ProcessSetError> for Failure {
    fn from(e: ProcessSetError) -> Failure {
        Failure {
            kind: e.kind(),
            rank: e.collective().and_then(lost_peer),
            message: chain(&e),
        }
    }
}

impl From<EngineError> for Failure {
    fn from(e: EngineError) -> Failure {
        Failure {
            kind: e.kind(),
            rank: e.collective().and_then(lost_peer),
            message: chain(&e),
        }
    }
}

/// `e` and its causes, each after a colon: "the hvd engine has stopped: a collective failed: ...". A cause whose
/// text its error already ends with (an error that prints its source too) is not repeated.
fn chain(e: &dyn std::error::Error) -> String {
    let mut message = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !message.ends_with(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        cause = c.source();
    }
    message
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn set_error(failure: Failure) {
    let mut m = failure.message;
    m.retain(|c| c != '\0');
    // Also runs outside `catch_unwind` (in `guard`): `try_with`/`try_borrow_mut` cannot panic.
    let _ = LAST_ERROR.try_with(|e| {
        if let Ok(mut slot) = e.try_borrow_mut() {
            *slot = LastError {
                message: CString::new(m).unwrap_or_default(),
                kind: failure.kind as i32,
                rank: failure.rank.map_or(-1, |r| r as i64),
            };
        }
    });
}

/// Runs `f`, turning an error or a panic into `fallback` and the thread's last error.
fn guard<T>(fallback: T, f: impl FnOnce() -> Result<T, Failure>) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            set_error(e);
            fallback
        }
        Err(_) => {
            set_error(Failure::new(
                ErrorKind::Internal,
                "internal error: a panic in the hvd runtime (please report it)",
            ));
            fallback
        }
    }
}

fn not_initialized() -> Failure {
    Failure::new(
        ErrorKind::NotInitialized,
        "hvd is not initialized: call hvd_init() (hvd.init()) first",
    )
}

fn engine() -> Result<Arc<Engine>, Failure> {
    lock(&ENGINE).clone().ok_or_else(not_initialized)
}

/// The engine of process set `set` (0: the job's); a set this rank is not a member of is refused.
fn engine_of(set: i32) -> Result<Arc<Engine>, Failure> {
    if set == crate::process_set::GLOBAL {
        return engine();
    }
    let ps = sets()?.get(set)?;
    match ps.engine() {
        Some(e) => Ok(e.clone()),
        None => {
            let rank = engine()?.topology().rank;
            Err(ProcessSetError::NotMember {
                rank,
                id: set,
                ranks: ps.ranks().to_vec(),
            }
            .into())
        }
    }
}

/// The job's process sets (the table locks itself; this lock is held only to take it).
fn sets() -> Result<Arc<ProcessSets>, Failure> {
    lock(&SETS).clone().ok_or_else(not_initialized)
}

/// The C handle of handle `h` of set `set`'s engine (ids stay below `process_set::MAX_ID`: handles are positive).
/// Refused, rather than read back as another set's, once the handles of this process reach 2^40.
fn set_handle(set: i32, h: u64) -> Result<i64, Failure> {
    let low = HANDLE_BASE
        .load(Ordering::SeqCst)
        .checked_add(h)
        .filter(|low| *low < 1u64 << SET_SHIFT)
        .ok_or_else(|| {
            Failure::new(
                ErrorKind::Internal,
                "this process has issued 2^40 operation handles, more than a handle can carry: restart it",
            )
        })?;
    HANDLE_HIGH.fetch_max(low, Ordering::SeqCst);
    Ok((i64::from(set) << SET_SHIFT) | low as i64)
}

/// A C handle's set and the handle of that set's engine; a handle from before the last `hvd_init` is refused.
fn split_handle(handle: i64) -> Result<(i32, u64), Failure> {
    let set = (handle >> SET_SHIFT) as i32;
    let low = (handle as u64) & ((1u64 << SET_SHIFT) - 1);
    let base = HANDLE_BASE.load(Ordering::SeqCst);
    if handle > 0 && low <= base {
        return Err(Failure::new(
            ErrorKind::InvalidArgument,
            format!(
                "handle {handle} is from before the last hvd_shutdown (an earlier hvd_init's): its operation is gone"
            ),
        ));
    }
    Ok((set, low.saturating_sub(base)))
}

fn init_logging() {
    let level = std::env::var(env_vars::HVD_LOG_LEVEL).unwrap_or_else(|_| "warn".to_string());
    let filter = tracing_subscriber::EnvFilter::try_new(format!(
        "hvd={level},hvd_runtime={level},hvd_collective={level}"
    ))
    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // The library is the application's only Rust code: it owns the subscriber. Another one being set is fine.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Starts the engine from the environment. 0 on success (also when already initialized), -1 on error.
#[unsafe(no_mangle)]
pub extern "C" fn hvd_init() -> i32 {
    guard(-1, || {
        let mut slot = lock(&ENGINE);
        if slot.is_some() {
            return Ok(0);
        }
        init_logging();
        let config = EngineConfig::from_env().map_err(|e| EngineError::Config(Arc::new(e)))?;
        let mut transport =
            connect_from_env().map_err(|e| Failure::collective("failed to join the job", &e))?;
        let info = job_info(transport.as_mut(), config.clone())?;
        let engine = Engine::start(transport, config)?;
        // This init's handles start above every earlier one's (a stale handle is refused, not another operation).
        HANDLE_BASE.store(HANDLE_HIGH.load(Ordering::SeqCst), Ordering::SeqCst);
        *slot = Some(Arc::new(engine));
        *lock(&JOB) = Some(info);
        *lock(&SETS) = Some(Arc::new(ProcessSets::new()));
        Ok(0)
    })
}

/// The backend's name and whether the job is homogeneous: one allgather of every rank's local size, the first
/// collective of the job (every rank runs it in `hvd_init`, before the engine owns the transport).
fn job_info(
    transport: &mut dyn hvd_collective::Communicator,
    config: EngineConfig,
) -> Result<JobInfo, Failure> {
    let topology = transport.topology();
    let sizes =
        crate::transport::allgather_bytes(transport, &(topology.local_size as u64).to_le_bytes())
            .map_err(|e| {
            Failure::collective("failed to exchange the ranks' local sizes at init", &e)
        })?;
    let mut homogeneous = true;
    for (rank, bytes) in sizes.iter().enumerate() {
        let Ok(b) = <[u8; 8]>::try_from(bytes.as_slice()) else {
            return Err(Failure::new(
                ErrorKind::Internal,
                format!(
                    "rank {rank} sent a malformed local size at init ({} bytes, expected 8)",
                    bytes.len()
                ),
            ));
        };
        homogeneous &= u64::from_le_bytes(b) == topology.local_size as u64;
    }
    let mut name = crate::transport::display_name(transport);
    name.retain(|c| c != '\0');
    Ok(JobInfo {
        backend: CString::new(name).unwrap_or_default(),
        homogeneous,
        config,
    })
}

/// What this library was compiled with: `HVD_BUILT_MPI` | `HVD_BUILT_NCCL` (hvd.h). Needs no `hvd_init`.
#[unsafe(no_mangle)]
pub extern "C" fn hvd_build_features() -> i32 {
    let mut bits = 0;
    if hvd_collective::BUILT_WITH_MPI {
        bits |= BUILT_MPI;
    }
    if hvd_collective::BUILT_WITH_NCCL {
        bits |= BUILT_NCCL;
    }
    bits
}

/// 1 when every host runs the same number of ranks, 0 when not, -1 when not initialized.
#[unsafe(no_mangle)]
pub extern "C" fn hvd_is_homogeneous() -> i32 {
    guard(-1, || {
        let job = lock(&JOB);
        let info = job.as_ref().ok_or_else(not_initialized)?;
        Ok(i32::from(info.homogeneous))
    })
}

/// The communicator in use (`SHM`, `TCP`, `HIERARCHICAL`, `MPI`, `NCCL`; `LOCAL` for a job of one rank), or NULL
/// when not initialized. Valid until `hvd_shutdown`.
#[unsafe(no_mangle)]
pub extern "C" fn hvd_backend() -> *const c_char {
    guard(std::ptr::null(), || {
        let job = lock(&JOB);
        let info = job.as_ref().ok_or_else(not_initialized)?;
        Ok(info.backend.as_ptr())
    })
}

/// Stops the engine after every rank has called it (meanwhile this rank takes part as a joined rank).
/// 0 on success or when not initialized.
#[unsafe(no_mangle)]
pub extern "C" fn hvd_shutdown() -> i32 {
    guard(-1, || {
        // The sets first, in id order on every rank: each shutdown waits for the set's other members.
        // A set whose engine does not stop in time is reported, after the job's engine has stopped.
        let sets = lock(&SETS).take();
        let stopped = sets.map_or(Ok(()), |sets| sets.shutdown());
        let engine = lock(&ENGINE).take();
        if let Some(e) = engine {
            e.shutdown();
        }
        lock(&RESULTS).take();
        lock(&GROUPS).take();
        lock(&JOB).take();
        stopped?;
        Ok(0)
    })
}

/// A worker of an elastic step leaves the job on its own (preempted, after its last commit and `hvd_shutdown`): the
/// launcher's rendezvous stops waiting for it in the next round and reports it as preempted, not lost. Only the
/// process that joined as its slot is heard (its join identity). Returns how many workers are left alive, or -1 (not
/// started by `hvd run`, or refused: `hvd_last_error` says why). Needs no `hvd_init`.
#[unsafe(no_mangle)]
pub extern "C" fn hvd_elastic_leave() -> i32 {
    guard(-1, || {
        let job = hvd_collective::bootstrap::JobEnv::from_env()
            .map_err(|e| Failure::collective("cannot leave the elastic job", &e))?;
        let Some(rendezvous) = &job.rendezvous else {
            return Err(Failure::new(
                ErrorKind::InvalidArgument,
                "cannot leave the elastic job: no rendezvous (`HVD_RENDEZVOUS`); run under `hvd run`",
            ));
        };
        let alive = rendezvous
            .client(job.rank)
            .elastic_leave()
            .map_err(|e| Failure::collective("failed to leave the elastic job", &e))?;
        Ok(i32::try_from(alive).unwrap_or(i32::MAX))
    })
}

/// Starts writing a Chrome-trace timeline to `path` (rank 0 writes it; `{rank}` in the path: every rank its own
/// file), replacing one being written; `mark_cycles` != 0 marks engine cycles. Every rank calls it. 0, or -1 (not
/// initialized, the file cannot be created).
///
/// # Safety
/// `path` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hvd_start_timeline(path: *const c_char, mark_cycles: i32) -> i32 {
    guard(-1, || {
        if path.is_null() {
            return Err("the timeline path is a null pointer".into());
        }
        // SAFETY: a NUL-terminated string per the contract. Paths are bytes (any encoding), as the OS takes them.
        let bytes = unsafe { CStr::from_ptr(path) }.to_bytes();
        if bytes.is_empty() {
            return Err("the timeline path is empty".into());
        }
        let path = std::path::Path::new(std::ffi::OsStr::from_bytes(bytes));
        engine()?.start_timeline(path, mark_cycles != 0)?;
        Ok(0)
    })
}

/// Stops writing the timeline; when it returns the file is complete. 0 (also with no timeline), or -1.
#[unsafe(no_mangle)]
pub extern "C" fn hvd_stop_timeline() -> i32 {
    guard(-1, || {
        engine()?.stop_timeline()?;
        Ok(0)
    })
}

/// 1 when initialized, else 0.
#[unsafe(no_mangle)]
pub extern "C" fn hvd_is_initialized() -> i32 {
    guard(0, || Ok(i32::from(lock(&ENGINE).is_some())))
}

fn topology_field(f: impl Fn(crate::transport::Topology) -> usize) -> i32 {
    guard(-1, || Ok(f(engine()?.topology()) as i32))
}

/// Global rank, or -1 when not initialized.
#[unsafe(no_mangle)]
pub extern "C" fn hvd_rank() -> i32 {
    topology_field(|t| t.rank)
}
/// Number of ranks, or -1.
#[unsafe(no_mangle)]
pub extern "C" fn hvd_size() -> i32 {
    topology_field(|t| t.size)
}
/// Rank on this host, or -1.
#[unsafe(no_mangle)]
pub extern "C" fn hvd_local_rank() -> i32 {
    topology_field(|t| t.local_rank)
}
/// Ranks on this host, or -1.
#[unsafe(no_mangle)]
pub extern "C" fn hvd_local_size() -> i32 {
    topology_field(|t| t.local_size)
}
/// Index of this host, or -1.
#[unsafe(no_mangle)]
pub extern "C" fn hvd_cross_rank() -> i32 {
    topology_field(|t| t.cross_rank)
}
/// Number of hosts, or -1.
#[unsafe(no_mangle)]
pub extern "C" fn hvd_cross_size() -> i32 {
    topology_field(|t| t.cross_size)
}

/// The last error of a failed call on this thread (empty if none). Valid until the next failing call.
#[unsafe(no_mangle)]
pub extern "C" fn hvd_last_error() -> *const c_char {
    // `try_with`: during thread teardown the slot may be gone; never panic across the boundary.
    LAST_ERROR
        .try_with(|e| e.try_borrow().map_or(c"".as_ptr(), |m| m.message.as_ptr()))
        .unwrap_or(c"".as_ptr())
}

/// The kind of the last error of a failed call on this thread: hvd.h `enum hvd_error_kind` (`HVD_ERROR_NONE`, 0,
/// before any failure).
#[unsafe(no_mangle)]
pub extern "C" fn hvd_last_error_kind() -> i32 {
    LAST_ERROR
        .try_with(|e| e.try_borrow().map_or(0, |m| m.kind))
        .unwrap_or(0)
}

/// The rank that the last error of a failed call on this thread names as lost (`HVD_ERROR_PEER_LOST`), or -1.
#[unsafe(no_mangle)]
pub extern "C" fn hvd_last_error_rank() -> i64 {
    LAST_ERROR
        .try_with(|e| e.try_borrow().map_or(-1, |m| m.rank))
        .unwrap_or(-1)
}

/// The library version, e.g. "0.1.0".
#[unsafe(no_mangle)]
pub extern "C" fn hvd_version() -> *const c_char {
    static VERSION: &CStr =
        match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
            Ok(v) => v,
            Err(_) => c"unknown",
        };
    VERSION.as_ptr()
}

/// The C ABI's `enum hvd_dtype` (hvd.h), indexed by code. Never renumber: compiled callers and the Python package
/// use them.
const DTYPES: [DType; 8] = [
    DType::U8,
    DType::I8,
    DType::I32,
    DType::I64,
    DType::F16,
    DType::F32,
    DType::F64,
    DType::BF16,
];

/// The C ABI's `enum hvd_reduce_op` (hvd.h), indexed by code.
const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Average,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::Product,
];

/// The entry of `table` at C ABI code `code`.
fn from_code<T: Copy>(table: &[T], code: i32) -> Option<T> {
    table.get(usize::try_from(code).ok()?).copied()
}

/// One operation, as laid out in `hvd_request_t`.
#[repr(C)]
pub struct HvdRequest {
    pub kind: i32,
    pub name: *const c_char,
    pub dtype: i32,
    pub ndim: i32,
    pub shape: *const i64,
    pub input: *const c_void,
    pub output: *mut c_void,
    pub op: i32,
    pub root: i32,
    pub prescale: f64,
    pub postscale: f64,
    pub splits: *const i64,
    pub nsplits: i32,
}

/// # Safety
/// `r` follows the contract of `hvd_request_t` in hvd.h.
unsafe fn convert(r: &HvdRequest) -> Result<Request, String> {
    let kind = from_code(&OpKind::ALL, r.kind)
        .ok_or_else(|| format!("unknown operation code {}", r.kind))?;
    let dtype =
        from_code(&DTYPES, r.dtype).ok_or_else(|| format!("unknown dtype code {}", r.dtype))?;
    let op = from_code(&OPS, r.op).ok_or_else(|| format!("unknown reduce op code {}", r.op))?;
    let name = if r.name.is_null() {
        String::new()
    } else {
        // SAFETY: the caller passes a NUL-terminated string.
        unsafe { CStr::from_ptr(r.name) }
            .to_str()
            .map_err(|_| "tensor name is not UTF-8".to_string())?
            .to_string()
    };
    let array = |ptr: *const i64, n: i32, what: &str| -> Result<Vec<i64>, String> {
        if n < 0 || (n > 0 && ptr.is_null()) {
            return Err(format!("invalid {what}: {n} entries at a null pointer"));
        }
        if n == 0 {
            return Ok(Vec::new());
        }
        // SAFETY: the caller passes `n` readable i64 values.
        Ok(unsafe { std::slice::from_raw_parts(ptr, n as usize) }.to_vec())
    };
    let shape = array(r.shape, r.ndim, "shape")?;
    let splits = array(r.splits, r.nsplits, "splits")?;
    let meta = RequestMeta {
        kind,
        name,
        dtype,
        shape,
        op,
        root: r.root,
        prescale: r.prescale,
        postscale: r.postscale,
        splits,
    };
    let bytes = shape_bytes(&meta)?;
    let input = if matches!(kind, OpKind::Barrier | OpKind::Join) {
        Input::None
    } else if r.input.is_null() && bytes > 0 {
        return Err(format!("tensor `{}`: input is a null pointer", meta.name));
    } else {
        Input::Raw(r.input as *const u8, bytes)
    };
    let output = match kind {
        OpKind::Allreduce | OpKind::Broadcast if !r.output.is_null() => {
            OutputBuffer::Raw(r.output as *mut u8, bytes)
        }
        OpKind::Allreduce | OpKind::Broadcast if bytes > 0 => {
            return Err(format!(
                "tensor `{}`: {} needs an output buffer",
                meta.name,
                kind.name()
            ));
        }
        _ => OutputBuffer::Engine,
    };
    Ok(Request {
        meta,
        input,
        output,
    })
}

/// The byte size of `meta`'s tensor, with checked arithmetic: a shape whose element count or byte size does not
/// fit (a caller's garbage `ndim`/`shape`) is refused, never wrapped into a small buffer length. A negative
/// dimension counts as 0 here; the engine's validation names it. Split counts must sum without overflow.
fn shape_bytes(meta: &RequestMeta) -> Result<usize, String> {
    let too_large = |what: &str| {
        format!(
            "tensor `{}`: {what} {:?} is too large: its size in bytes overflows",
            meta.name, meta.shape
        )
    };
    if meta
        .splits
        .iter()
        .try_fold(0i64, |acc, s| acc.checked_add(*s))
        .is_none()
    {
        return Err(format!(
            "tensor `{}`: splits {:?} overflow when summed",
            meta.name, meta.splits
        ));
    }
    if meta.shape.iter().any(|d| *d < 0) {
        return Ok(0);
    }
    // Left to right, as the engine multiplies them, so no intermediate product overflows there either.
    let elements = meta
        .shape
        .iter()
        .try_fold(1usize, |acc, d| acc.checked_mul(usize::try_from(*d).ok()?))
        .ok_or_else(|| too_large("shape"))?;
    elements
        .checked_mul(meta.dtype.size())
        .filter(|b| isize::try_from(*b).is_ok())
        .ok_or_else(|| too_large("shape"))
}

/// Submits one operation. Returns a handle (> 0) or -1 (see `hvd_last_error`).
///
/// # Safety
/// `request` points to a valid `hvd_request_t` whose buffers follow the module's buffer contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hvd_enqueue(request: *const HvdRequest) -> i64 {
    // SAFETY: per the function contract.
    unsafe { hvd_enqueue_ps(request, crate::process_set::GLOBAL) }
}

/// `hvd_enqueue` over process set `process_set` (0: every rank; else an id from `hvd_add_process_set`, of which
/// this rank must be a member). A broadcast's `root` is the root's rank in the set.
///
/// # Safety
/// As `hvd_enqueue`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hvd_enqueue_ps(request: *const HvdRequest, process_set: i32) -> i64 {
    guard(-1, || {
        if request.is_null() {
            return Err("request is a null pointer".into());
        }
        // SAFETY: non-null and valid per the function contract.
        let r = unsafe { convert(&*request) }?;
        engine_of(process_set)?
            .enqueue(r)
            .map_err(Failure::from)
            .and_then(|h| set_handle(process_set, h))
    })
}

/// Writes a batch's submission results to `handles`: result k belongs to request `slots[k]`, which gets its handle,
/// or -1 with the error in `hvd_last_error`. Returns how many succeeded.
fn record_handles(
    handles: &mut [i64],
    slots: Vec<usize>,
    results: Vec<Result<u64, EngineError>>,
    set: i32,
) -> i32 {
    let mut ok = 0;
    for (i, result) in slots.into_iter().zip(results) {
        handles[i] = match result {
            Ok(h) => match set_handle(set, h) {
                Ok(h) => {
                    ok += 1;
                    h
                }
                Err(f) => {
                    set_error(f);
                    -1
                }
            },
            Err(err) => {
                set_error(err.into());
                -1
            }
        };
    }
    ok
}

/// Submits `n` operations with one call (one entry of `handles` each, -1 for those that failed). They reach the
/// engine together (one lock round, one wake-up), so they run in the same cycle and fuse.
/// Returns the number submitted successfully; `hvd_last_error` holds the last failure.
///
/// # Safety
/// `requests` and `handles` point to `n` valid elements.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hvd_enqueue_many(
    requests: *const HvdRequest,
    n: i32,
    handles: *mut i64,
) -> i32 {
    // SAFETY: per the function contract.
    unsafe { hvd_enqueue_many_ps(requests, n, handles, crate::process_set::GLOBAL) }
}

/// `hvd_enqueue_many` over process set `process_set` (as `hvd_enqueue_ps`).
///
/// # Safety
/// As `hvd_enqueue_many`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hvd_enqueue_many_ps(
    requests: *const HvdRequest,
    n: i32,
    handles: *mut i64,
    process_set: i32,
) -> i32 {
    guard(-1, || {
        if n < 0 || (n > 0 && (requests.is_null() || handles.is_null())) {
            return Err("invalid request array".into());
        }
        let e = engine_of(process_set)?;
        let n = n as usize;
        // SAFETY: `n` elements of both arrays are valid per the contract.
        let (requests, handles) = unsafe {
            (
                std::slice::from_raw_parts(requests, n),
                std::slice::from_raw_parts_mut(handles, n),
            )
        };
        let mut converted = Vec::with_capacity(n);
        let mut slots = Vec::with_capacity(n);
        for (i, r) in requests.iter().enumerate() {
            // SAFETY: as above.
            match unsafe { convert(r) } {
                Ok(r) => {
                    converted.push(r);
                    slots.push(i);
                }
                Err(msg) => {
                    set_error(msg.into());
                    handles[i] = -1;
                }
            }
        }
        Ok(record_handles(
            handles,
            slots,
            e.enqueue_many(converted),
            process_set,
        ))
    })
}

/// Submits `n` in-place allreduces given in columns with one call: `data[i]` is request i's buffer (input and
/// output), `dtypes[i]`, `ops[i]`, `prescale[i]` and `postscale[i]` its codes and factors, `ndims[i]` the number of
/// its dimensions, which follow one another in `dims` (request after request), and `names` holds the `n` names as
/// NUL-terminated strings back to back (an empty one: unnamed). Unlike `hvd_enqueue_many`, nothing is fused at
/// submission: each request is negotiated on its own and fused by the engine, so ranks may batch the same tensors
/// differently. Writes one handle (or -1) per request to `handles` and returns how many succeeded (-1 for bad
/// arrays); `hvd_last_error` holds the last failure.
///
/// # Safety
/// Each column has `n` valid elements (`dims` the sum of `ndims`), `names` holds `n` NUL-terminated strings, and
/// the buffers follow the module's buffer contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hvd_enqueue_allreduces(
    n: i32,
    data: *const *mut c_void,
    dtypes: *const i32,
    ndims: *const i32,
    dims: *const i64,
    names: *const c_char,
    ops: *const i32,
    prescale: *const f64,
    postscale: *const f64,
    handles: *mut i64,
) -> i32 {
    guard(-1, || {
        let columns = [
            data.cast::<u8>(),
            dtypes.cast(),
            ndims.cast(),
            names.cast(),
            ops.cast(),
            prescale.cast(),
            postscale.cast(),
            handles.cast_const().cast(),
        ];
        if n < 0 || (n > 0 && columns.iter().any(|p| p.is_null())) {
            return Err("invalid allreduce columns".into());
        }
        let e = engine()?;
        let n = n as usize;
        // SAFETY: `n` valid elements in every column per the contract.
        let handles = unsafe { std::slice::from_raw_parts_mut(handles, n) };
        let mut name = names;
        let mut dim = 0usize;
        let mut converted = Vec::with_capacity(n);
        let mut slots = Vec::with_capacity(n);
        for (i, slot) in handles.iter_mut().enumerate() {
            // SAFETY: `i < n`, within every column; `name` points to the i-th of `n` NUL-terminated strings.
            let (ndim, this_name) = unsafe { (*ndims.add(i), name) };
            // SAFETY: as above; the next name starts after this one's NUL.
            name = unsafe { name.add(CStr::from_ptr(name).to_bytes().len() + 1) };
            let Ok(rank_count) = usize::try_from(ndim) else {
                return Err(format!("request {i}: negative number of dimensions {ndim}").into());
            };
            if rank_count > 0 && dims.is_null() {
                return Err("invalid allreduce columns: dims is a null pointer".into());
            }
            // SAFETY: as above; `dims` holds the sum of `ndims` values, of which these are request i's.
            let request = unsafe {
                let buffer = *data.add(i);
                HvdRequest {
                    kind: OpKind::Allreduce as i32,
                    name: this_name,
                    dtype: *dtypes.add(i),
                    ndim,
                    shape: if rank_count == 0 { dims } else { dims.add(dim) },
                    input: buffer.cast_const(),
                    output: buffer,
                    op: *ops.add(i),
                    root: 0,
                    prescale: *prescale.add(i),
                    postscale: *postscale.add(i),
                    splits: std::ptr::null(),
                    nsplits: 0,
                }
            };
            dim += rank_count;
            // SAFETY: the request's pointers come from the caller's columns, valid per the contract.
            match unsafe { convert(&request) } {
                Ok(r) => {
                    converted.push(r);
                    slots.push(i);
                }
                Err(msg) => {
                    set_error(msg.into());
                    *slot = -1;
                }
            }
        }
        Ok(record_handles(
            handles,
            slots,
            e.enqueue_each(converted),
            crate::process_set::GLOBAL,
        ))
    })
}

/// Prepares `n` requests for repeated submission with `hvd_group_enqueue` (a training loop's gradients): they are
/// checked and fused once (as `hvd_enqueue_many` does on every call). Returns a group id > 0, or -1 when a request
/// is invalid (`hvd_last_error` names it). The buffers must stay valid until the group is released.
///
/// # Safety
/// `requests` points to `n` valid elements whose buffers follow the module's buffer contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hvd_group_prepare(requests: *const HvdRequest, n: i32) -> i64 {
    guard(-1, || {
        if n < 0 || (n > 0 && requests.is_null()) {
            return Err("invalid request array".into());
        }
        let e = engine()?;
        let requests: &[HvdRequest] = if n == 0 {
            &[]
        } else {
            // SAFETY: `n` valid elements per the contract.
            unsafe { std::slice::from_raw_parts(requests, n as usize) }
        };
        let converted = requests
            .iter()
            // SAFETY: as above.
            .map(|r| unsafe { convert(r) })
            .collect::<Result<Vec<_>, _>>()?;
        let group = e.prepare(converted)?;
        let id = NEXT_GROUP.fetch_add(1, Ordering::Relaxed);
        lock(&GROUPS)
            .get_or_insert_with(HashMap::new)
            .insert(id, group);
        Ok(id)
    })
}

/// The prepared group `group` among `groups`.
fn prepared(
    groups: &Option<HashMap<i64, PreparedGroup>>,
    group: i64,
) -> Result<&PreparedGroup, String> {
    groups.as_ref().and_then(|m| m.get(&group)).ok_or_else(|| {
        format!("unknown tensor group {group} (released, or prepared before a shutdown)")
    })
}

/// Submits a prepared group: writes its handles (one per request, in order) to `handles` and returns how many,
/// or -1 (an unknown group, or the engine stopped). Wait for them like those of `hvd_enqueue_many`.
///
/// # Safety
/// `handles` has room for the group's number of requests.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hvd_group_enqueue(group: i64, handles: *mut i64) -> i32 {
    guard(-1, || {
        let e = engine()?;
        let groups = lock(&GROUPS);
        let g = prepared(&groups, group)?;
        if !g.is_empty() && handles.is_null() {
            return Err("handles is a null pointer".into());
        }
        let base = e.enqueue_prepared(g)?;
        for i in 0..g.len() {
            let h = set_handle(crate::process_set::GLOBAL, base + i as u64)?;
            // SAFETY: room for `g.len()` values per the contract.
            unsafe { *handles.add(i) = h };
        }
        Ok(g.len() as i32)
    })
}

/// Submits a prepared group as one operation: returns one handle (> 0) that completes when all of its requests
/// have (wait with `hvd_wait_and_release`), 0 when the group was not fused into one operation (submit it with
/// `hvd_group_enqueue`), or -1 (an unknown group, or the engine stopped).
#[unsafe(no_mangle)]
pub extern "C" fn hvd_group_submit(group: i64) -> i64 {
    guard(-1, || {
        let e = engine()?;
        let groups = lock(&GROUPS);
        let g = prepared(&groups, group)?;
        match e.enqueue_prepared_whole(g).map_err(Failure::from)? {
            Some(h) => set_handle(crate::process_set::GLOBAL, h),
            None => Ok(0),
        }
    })
}

/// Releases a prepared group (operations in flight are not affected). 0, or -1 for an unknown group.
#[unsafe(no_mangle)]
pub extern "C" fn hvd_group_release(group: i64) -> i32 {
    guard(-1, || {
        match lock(&GROUPS).as_mut().and_then(|m| m.remove(&group)) {
            Some(_) => Ok(0),
            None => Err(format!("unknown tensor group {group}").into()),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enqueue_shape(shape: &[i64], splits: &[i64]) -> (i64, String) {
        let data = [0u8; 16];
        let mut out = [0u8; 16];
        let r = HvdRequest {
            kind: OpKind::Allreduce as i32,
            name: c"grad".as_ptr(),
            dtype: 5,
            ndim: shape.len() as i32,
            shape: shape.as_ptr(),
            input: data.as_ptr().cast(),
            output: out.as_mut_ptr().cast(),
            op: 0,
            root: 0,
            prescale: 1.0,
            postscale: 1.0,
            splits: splits.as_ptr(),
            nsplits: splits.len() as i32,
        };
        // SAFETY: every pointer is valid for the lengths given.
        let h = unsafe { hvd_enqueue(&r) };
        // SAFETY: hvd_last_error returns a NUL-terminated string owned by this thread.
        let msg = unsafe { CStr::from_ptr(hvd_last_error()) }
            .to_string_lossy()
            .into_owned();
        (h, msg)
    }

    /// A shape whose element count or byte size overflows is refused with its name, before anything reads the
    /// buffers (and before the engine is even needed); it neither wraps into a small length nor panics.
    #[test]
    fn handles_past_the_set_bits_are_refused_not_read_as_a_set() {
        // A handle of the job's engine past 2^40 would read as set 1's: refused instead.
        let e = set_handle(crate::process_set::GLOBAL, 1 << SET_SHIFT).unwrap_err();
        assert!(e.message.contains("2^40"), "{}", e.message);
        assert_eq!(e.kind, ErrorKind::Internal);
        let e = set_handle(7, u64::MAX).unwrap_err();
        assert!(e.message.contains("2^40"), "{}", e.message);
        // Below it, the set and the engine's handle come back as they went in.
        let h = set_handle(3, 5).unwrap();
        let (set, local) = split_handle(h).unwrap();
        assert_eq!((set, local), (3, 5));
    }

    #[test]
    fn an_overflowing_shape_is_refused() {
        for shape in [
            &[1i64 << 62, 1 << 62][..],
            &[i64::MAX / 2, 4],
            &[i64::MAX, 4, 0],
        ] {
            let (h, msg) = enqueue_shape(shape, &[]);
            assert_eq!(h, -1);
            assert!(
                msg.contains("tensor `grad`") && msg.contains("too large"),
                "{shape:?}: {msg}"
            );
        }
        let (h, msg) = enqueue_shape(&[4], &[i64::MAX, 1]);
        assert_eq!(h, -1);
        assert!(msg.contains("overflow when summed"), "{msg}");
        // A sane shape gets past the check (and stops at the missing engine).
        let (h, msg) = enqueue_shape(&[2, 2], &[]);
        assert_eq!(h, -1);
        assert!(msg.contains("not initialized"), "{msg}");
    }

    /// The build bits are exactly the collective crate's compiled backends, and nothing else is set.
    #[test]
    fn build_features_report_the_compiled_backends() {
        let bits = hvd_build_features();
        assert_eq!(bits & !(BUILT_MPI | BUILT_NCCL), 0, "{bits:#x}");
        assert_eq!(bits & BUILT_MPI != 0, hvd_collective::BUILT_WITH_MPI);
        assert_eq!(bits & BUILT_NCCL != 0, hvd_collective::BUILT_WITH_NCCL);
        // Before init (no test here initializes the process-wide engine): no job, so no answer.
        assert_eq!(hvd_is_homogeneous(), -1);
        // SAFETY: NUL-terminated, owned by this thread.
        let msg = unsafe { CStr::from_ptr(hvd_last_error()) }
            .to_string_lossy()
            .into_owned();
        assert!(msg.contains("not initialized"), "{msg}");
        assert!(hvd_backend().is_null());
    }

    /// Homogeneity comes from every rank's local size: equal hosts are homogeneous, 2 + 1 ranks are not. With
    /// 1 + 2 + 3 ranks the middle host's own view (local size 2 x 3 hosts = 6 ranks) looks homogeneous: only
    /// the exchange tells.
    #[test]
    fn homogeneity_is_gathered_from_every_rank() {
        use hvd_collective::testing::{Backend, LocalJob};
        for (hosts, expected) in [
            (vec![0, 0, 1, 1], true),
            (vec![0, 0, 1], false),
            (vec![0, 1, 1, 1], false),
            (vec![0, 1, 2], true),
            (vec![0, 1, 1, 2, 2, 2], false),
        ] {
            let comms = LocalJob::new(hosts.len(), Backend::Hierarchical)
                .hosts(hosts.clone())
                .communicators()
                .unwrap();
            let answers: Vec<(bool, String)> = std::thread::scope(|s| {
                let threads: Vec<_> = comms
                    .into_iter()
                    .map(|c| {
                        s.spawn(move || {
                            let mut t = c;
                            let info = job_info(&mut *t, EngineConfig::default()).unwrap();
                            (
                                info.homogeneous,
                                info.backend.to_string_lossy().into_owned(),
                            )
                        })
                    })
                    .collect();
                threads.into_iter().map(|t| t.join().unwrap()).collect()
            });
            for (homogeneous, backend) in answers {
                assert_eq!(homogeneous, expected, "{hosts:?}");
                assert_eq!(backend, "HIERARCHICAL");
            }
        }
    }

    /// The C ABI's message is the whole chain: the engine's word, its reason and the collective's own error, each
    /// once.
    #[test]
    fn a_failure_message_carries_every_cause_once() {
        let lost = hvd_collective::Error::PeerLost {
            rank: 3,
            reason: "its connection closed".into(),
        };
        let e = EngineError::Stopped(Arc::new(crate::engine::Stop::Collective(lost)));
        let f = Failure::from(e);
        assert_eq!(f.kind, ErrorKind::PeerLost);
        assert_eq!(f.rank, Some(3));
        assert!(
            f.message
                .starts_with("the hvd engine has stopped: a collective failed: ")
                && f.message.contains("rank 3 is gone (its connection closed)"),
            "{}",
            f.message
        );
        let io = hvd_collective::Error::Io {
            context: "read from rank 1".into(),
            source: std::io::Error::other("reset"),
        };
        let f = Failure::collective("failed to join the job", &io);
        assert_eq!(f.message, "failed to join the job: read from rank 1: reset");
        assert_eq!(f.kind, ErrorKind::Internal);
    }
}
