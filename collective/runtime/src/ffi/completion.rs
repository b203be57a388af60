//! The C ABI of completion (hvd.h): waiting for and polling submitted handles, reading a finished operation's
//! result (shape, bytes, splits, value) and releasing it. Submitting stays in `ffi.rs`.

use std::ffi::c_void;

use super::{Failure, RESULTS, ResultMap, engine_of, guard, lock, split_handle};
use crate::engine::Output;

/// # Safety
/// `handles` points to `n` readable values.
unsafe fn handle_slice<'a>(handles: *const i64, n: i32) -> Result<&'a [i64], String> {
    if n < 0 || (n > 0 && handles.is_null()) {
        return Err("invalid handle array".into());
    }
    if n == 0 {
        return Ok(&[]);
    }
    // SAFETY: `n` readable values per the contract.
    Ok(unsafe { std::slice::from_raw_parts(handles, n as usize) })
}

/// Blocks until all `n` operations complete and releases them: for operations whose results are in the caller's
/// memory (allreduce, broadcast, barrier), e.g. the handles of one `hvd_enqueue_many`. Handles <= 0 are skipped.
/// One wait for the whole group. 0 when all succeeded, -1 otherwise (`hvd_last_error` holds the first failure;
/// every handle is still waited for and released).
///
/// # Safety
/// `handles` points to `n` readable values.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hvd_wait_many(handles: *const i64, n: i32) -> i32 {
    guard(-1, || {
        // SAFETY: per the function contract.
        let handles = unsafe { handle_slice(handles, n) }?;
        let mut ids = Vec::with_capacity(handles.len());
        if let Some(r) = lock(&RESULTS).as_mut() {
            // Handles already waited for one by one.
            ids.extend(
                handles
                    .iter()
                    .filter(|h| **h > 0 && r.remove(h).is_none())
                    .copied(),
            );
        } else {
            ids.extend(handles.iter().filter(|h| **h > 0).copied());
        }
        let mut first: Option<Failure> = None;
        for (set, ids) in by_set(&ids)? {
            let failed = match engine_of(set) {
                Ok(e) => e
                    .wait_all(&ids)
                    .into_iter()
                    .find_map(Result::err)
                    .map(Failure::from),
                Err(f) => Some(f),
            };
            if first.is_none() {
                first = failed;
            }
        }
        match first {
            Some(f) => Err(f),
            None => Ok(0),
        }
    })
}

/// `handles` (positive C handles) grouped by process set, in order of first appearance, as each set's engine's.
fn by_set(handles: &[i64]) -> Result<Vec<(i32, Vec<u64>)>, Failure> {
    let mut groups: Vec<(i32, Vec<u64>)> = Vec::new();
    for &h in handles {
        let (set, local) = split_handle(h)?;
        match groups.iter_mut().find(|(s, _)| *s == set) {
            Some((_, ids)) => ids.push(local),
            None => groups.push((set, vec![local])),
        }
    }
    Ok(groups)
}

/// Waits for `handles[i]` of a batch of operations whose results are in the caller's memory (e.g. the handles of
/// one `hvd_enqueue_allreduces`) and releases it, then releases the handles after it that have completed
/// successfully, up to the first that has not, marking each one 1 in `done` (`n` bytes, zero at first, shared by
/// every wait on the batch): the caller skips the wait of a handle marked 1. A failed handle is left for its own
/// wait. `handles[i]` itself is marked 1 (success) or -1 (failure); one already marked is not waited for again.
/// 0 when `handles[i]` succeeded, -1 when it failed (`hvd_last_error`).
///
/// # Safety
/// `handles` and `done` point to `n` values; `done` is written only by the library while calls are in flight.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hvd_wait_batch(handles: *const i64, n: i32, i: i32, done: *mut i8) -> i32 {
    guard(-1, || {
        // SAFETY: per the function contract.
        let handles = unsafe { handle_slice(handles, n) }?;
        let Some(index) = usize::try_from(i).ok().filter(|i| *i < handles.len()) else {
            return Err(format!("handle index {i} is not in 0..{n}").into());
        };
        if done.is_null() {
            return Err("done is a null pointer".into());
        }
        // SAFETY: `n` bytes per the contract, shared only through atomics (AtomicI8 has the layout of i8) while
        // the library may write them.
        let done = unsafe {
            std::slice::from_raw_parts(done.cast::<std::sync::atomic::AtomicI8>(), handles.len())
        };
        // Handles are positive; anything else is refused by the table as unknown. A batch is one set's.
        let (set, _) = split_handle(handles[index])?;
        let ids = handles
            .iter()
            .map(|h| split_handle(*h).map(|(_, local)| local))
            .collect::<Result<Vec<u64>, Failure>>()?;
        engine_of(set)?
            .wait_batch(&ids, index, done)
            .map(|()| 0)
            .map_err(Failure::from)
    })
}

/// 1 when all `n` operations have completed, 0 when any is pending, -1 for an unknown handle.
///
/// # Safety
/// `handles` points to `n` readable values.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hvd_poll_many(handles: *const i64, n: i32) -> i32 {
    guard(-1, || {
        // SAFETY: per the function contract.
        let handles = unsafe { handle_slice(handles, n) }?;
        let ids: Vec<i64> = {
            let results = lock(&RESULTS);
            handles
                .iter()
                .filter(|h| **h > 0 && !results.as_ref().is_some_and(|r| r.contains_key(h)))
                .copied()
                .collect()
        };
        for (set, ids) in by_set(&ids)? {
            if !engine_of(set)?.poll_all(&ids)? {
                return Ok(0);
            }
        }
        Ok(1)
    })
}

/// 1 when the operation has completed (successfully or not), 0 when pending, -1 for an unknown handle.
#[unsafe(no_mangle)]
pub extern "C" fn hvd_poll(handle: i64) -> i32 {
    guard(-1, || {
        if lock(&RESULTS)
            .as_ref()
            .is_some_and(|r| r.contains_key(&handle))
        {
            return Ok(1);
        }
        let (set, local) = split_handle(handle)?;
        engine_of(set)?
            .poll(local)
            .map(i32::from)
            .map_err(Failure::from)
    })
}

/// Blocks until the operation completes. 0 on success (its result stays available until `hvd_release`), -1 on
/// failure (the message is in `hvd_last_error`; the handle is released).
#[unsafe(no_mangle)]
pub extern "C" fn hvd_wait(handle: i64) -> i32 {
    guard(-1, || {
        if lock(&RESULTS)
            .as_ref()
            .is_some_and(|r| r.contains_key(&handle))
        {
            return Ok(0);
        }
        let (set, local) = split_handle(handle)?;
        let out = engine_of(set)?.wait(local)?;
        lock(&RESULTS)
            .get_or_insert_with(ResultMap::default)
            .insert(handle, out);
        Ok(0)
    })
}

/// Blocks until the operation completes and releases the handle: for operations whose result is already in the
/// caller's memory (allreduce, broadcast, barrier). 0 on success, -1 on failure (message in `hvd_last_error`).
#[unsafe(no_mangle)]
pub extern "C" fn hvd_wait_and_release(handle: i64) -> i32 {
    guard(-1, || {
        if let Some(r) = lock(&RESULTS).as_mut()
            && r.remove(&handle).is_some()
        {
            return Ok(0);
        }
        let (set, local) = split_handle(handle)?;
        engine_of(set)?
            .wait(local)
            .map(|_| 0)
            .map_err(Failure::from)
    })
}

fn with_result<T>(handle: i64, fallback: T, f: impl FnOnce(&Output) -> Result<T, String>) -> T {
    guard(fallback, || {
        match lock(&RESULTS).as_ref().and_then(|r| r.get(&handle)) {
            Some(out) => Ok(f(out)?),
            None => Err(format!("handle {handle} has no result: call hvd_wait first").into()),
        }
    })
}

/// Number of dimensions of the result, or -1.
#[unsafe(no_mangle)]
pub extern "C" fn hvd_result_ndim(handle: i64) -> i32 {
    with_result(handle, -1, |o| Ok(o.shape.len() as i32))
}

/// Writes the result's shape (`hvd_result_ndim` values) to `shape`. 0 or -1.
///
/// # Safety
/// `shape` has room for `hvd_result_ndim(handle)` values.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hvd_result_shape(handle: i64, shape: *mut i64) -> i32 {
    with_result(handle, -1, |o| {
        if shape.is_null() && !o.shape.is_empty() {
            return Err("shape is a null pointer".into());
        }
        for (i, d) in o.shape.iter().enumerate() {
            // SAFETY: room for ndim values per the contract.
            unsafe { *shape.add(i) = *d };
        }
        Ok(0)
    })
}

/// Size in bytes of a library-owned result (0 when the result went to the caller's output buffer).
#[unsafe(no_mangle)]
pub extern "C" fn hvd_result_nbytes(handle: i64) -> i64 {
    with_result(handle, -1, |o| Ok(o.data.len() as i64))
}

/// Copies a library-owned result into `dst` (`nbytes` must equal `hvd_result_nbytes`). 0 or -1.
///
/// # Safety
/// `dst` has room for `nbytes` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hvd_result_copy(handle: i64, dst: *mut c_void, nbytes: i64) -> i32 {
    with_result(handle, -1, |o| {
        if nbytes != o.data.len() as i64 {
            return Err(format!("result has {} bytes, not {nbytes}", o.data.len()));
        }
        if !o.data.is_empty() {
            if dst.is_null() {
                return Err("destination is a null pointer".into());
            }
            // SAFETY: `dst` has room for `nbytes` bytes per the contract; the regions cannot overlap.
            unsafe { std::ptr::copy_nonoverlapping(o.data.as_ptr(), dst as *mut u8, o.data.len()) };
        }
        Ok(0)
    })
}

/// Alltoall: writes the rows received from each rank (`hvd_size()` values) to `splits`. Returns how many values it
/// wrote (`hvd_size()` for an alltoall's result, 0 for any other), or -1.
///
/// # Safety
/// `splits` has room for `hvd_size()` values.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hvd_result_splits(handle: i64, splits: *mut i64) -> i32 {
    with_result(handle, -1, |o| {
        if splits.is_null() && !o.splits.is_empty() {
            return Err("splits is a null pointer".into());
        }
        for (i, s) in o.splits.iter().enumerate() {
            // SAFETY: room for size values per the contract.
            unsafe { *splits.add(i) = *s };
        }
        Ok(o.splits.len() as i32)
    })
}

/// Join: the rank that joined last. -1 on error.
#[unsafe(no_mangle)]
pub extern "C" fn hvd_result_value(handle: i64) -> i64 {
    with_result(handle, -1, |o| Ok(o.value))
}

/// Frees a completed handle's result. Unknown handles are ignored.
#[unsafe(no_mangle)]
pub extern "C" fn hvd_release(handle: i64) {
    guard((), || {
        if let Some(r) = lock(&RESULTS).as_mut() {
            r.remove(&handle);
        }
        Ok(())
    })
}
