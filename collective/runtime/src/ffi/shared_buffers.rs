//! The C ABI of shared buffers (hvd.h): `hvd_alloc` / `hvd_free`, memory the other ranks on this host can map, so
//! that a large allreduce in it between worker processes copies each byte once (docs/collective.md, "Single-copy
//! allreduce").

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};

use super::{Failure, guard, init_logging};
use hvd_collective::shm::SharedBuffer;

/// Whether the fallback to private memory was logged already (once per process).
static FALLBACK_LOGGED: AtomicBool = AtomicBool::new(false);

/// `bytes` zeroed bytes, page-aligned, in a shared buffer (a 0600 file under /dev/shm of this process); when that
/// fails (no /dev/shm, its size limit, a sandbox), private memory instead, with the reason logged once (allreduces
/// in it take the ring). NULL only when no memory could be had at all (`hvd_last_error`). Needs no `hvd_init`.
#[unsafe(no_mangle)]
pub extern "C" fn hvd_alloc(bytes: usize) -> *mut c_void {
    guard(std::ptr::null_mut(), || {
        init_logging();
        let buf = match SharedBuffer::new(bytes) {
            Ok(b) => b,
            Err(e) => {
                if !FALLBACK_LOGGED.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        error = %e,
                        "hvd_alloc: no shared buffer, using private memory (large allreduces in it take the ring)"
                    );
                }
                SharedBuffer::private(bytes)
                    .map_err(|e| Failure::collective("cannot allocate memory", &e))?
            }
        };
        Ok(buf.into_raw().cast())
    })
}

/// Frees what `hvd_alloc` returned (NULL: nothing). 0, or -1 for a pointer `hvd_alloc` did not return or that was
/// freed already. No operation may still use the buffer; peers that mapped it keep their own mapping, so a peer is
/// never hurt by it.
///
/// # Safety
/// The caller uses no pointer into the buffer afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hvd_free(ptr: *mut c_void) -> i32 {
    guard(-1, || {
        if ptr.is_null() {
            return Ok(0);
        }
        // SAFETY: the caller's contract; an unknown pointer is refused without being touched.
        match unsafe { SharedBuffer::free_raw(ptr.cast()) } {
            true => Ok(0),
            false => Err("hvd_free: not a buffer from hvd_alloc, or freed already".into()),
        }
    })
}

/// 1 when `ptr` (from `hvd_alloc`) is a shared buffer, 0 when `hvd_alloc` fell back to private memory, -1 for a
/// pointer `hvd_alloc` did not return.
#[unsafe(no_mangle)]
pub extern "C" fn hvd_alloc_is_shared(ptr: *const c_void) -> i32 {
    match SharedBuffer::raw_is_shared(ptr.cast()) {
        Some(true) => 1,
        Some(false) => 0,
        None => -1,
    }
}
