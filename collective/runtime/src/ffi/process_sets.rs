//! The C ABI of process sets (hvd.h): adding and removing them, and what a rank knows of one. Submitting over a
//! set (`hvd_enqueue_ps`) and routing handles to a set's engine stay with the other submissions in `ffi.rs`.

use super::{Failure, JOB, engine, guard, lock, not_initialized, sets};
use crate::process_set::{GLOBAL, ProcessSetError};

/// Adds a process set of the `n` global ranks at `ranks` (any order; no duplicates, all in the job, not every rank,
/// not a set that exists already), collectively: every rank of the job calls it with the same ranks, in the same
/// order as its other adds. Returns the set's id (> 0, the same on every rank), or -1 (`hvd_last_error`;
/// `HVD_ERROR_INVALID_ARGUMENT` for refused ranks, `HVD_ERROR_MISMATCH` when the ranks asked for different sets).
///
/// # Safety
/// `ranks` points to `n` readable values.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hvd_add_process_set(ranks: *const i64, n: i32) -> i32 {
    guard(-1, || {
        if n < 0 || (n > 0 && ranks.is_null()) {
            return Err("invalid rank array".into());
        }
        let requested: &[i64] = if n == 0 {
            &[]
        } else {
            // SAFETY: `n` readable values per the contract.
            unsafe { std::slice::from_raw_parts(ranks, n as usize) }
        };
        let global = engine()?;
        let config = lock(&JOB)
            .as_ref()
            .map(|j| j.config.clone())
            .ok_or_else(not_initialized)?;
        let sets = sets()?;
        let job = hvd_collective::bootstrap::JobEnv::from_env()
            .map_err(|e| Failure::collective("cannot join a process set", &e));
        let connect = |member: usize, size: usize, tag: &str| match &job {
            Ok(job) => hvd_collective::bootstrap::connect_group(job, member, size, tag),
            Err(f) => Err(hvd_collective::Error::Bootstrap(f.message.clone())),
        };
        Ok(sets.add(&global, requested, &config, &connect)?)
    })
}

/// Removes process set `id`, collectively: every rank of the job calls it with the same id, in the same order as
/// its other adds and removes (agreed through the job's engine like an add); its members then shut its engine
/// down together, as `hvd_shutdown` does for the job, the others forget it. 0, or -1 (`HVD_ERROR_MISMATCH`: the
/// ranks asked to remove different sets, or one asked to add; `HVD_ERROR_INVALID_ARGUMENT`: an unknown set, the
/// global set; `HVD_ERROR_STALLED`: the set's engine did not stop in time).
#[unsafe(no_mangle)]
pub extern "C" fn hvd_remove_process_set(id: i32) -> i32 {
    guard(-1, || {
        let global = engine()?;
        sets()?.remove(&global, id)?;
        Ok(0)
    })
}

/// This rank's rank in process set `id` (its position among the members), or -1 (not a member, an unknown set,
/// not initialized).
#[unsafe(no_mangle)]
pub extern "C" fn hvd_process_set_rank(id: i32) -> i32 {
    guard(-1, || {
        let rank = engine()?.topology().rank;
        if id == GLOBAL {
            return Ok(rank as i32);
        }
        let set = sets()?.get(id)?;
        match set.rank_of(rank) {
            Some(r) => Ok(r as i32),
            None => Err(ProcessSetError::NotMember {
                rank,
                id,
                ranks: set.ranks().to_vec(),
            }
            .into()),
        }
    })
}

/// The number of ranks of process set `id`, or -1 (an unknown set, not initialized).
#[unsafe(no_mangle)]
pub extern "C" fn hvd_process_set_size(id: i32) -> i32 {
    guard(-1, || {
        if id == GLOBAL {
            return Ok(engine()?.topology().size as i32);
        }
        let set = sets()?.get(id)?;
        Ok(set.ranks().len() as i32)
    })
}

/// Writes up to `capacity` of process set `id`'s global ranks (ascending) to `ranks` and returns how many it has,
/// or -1 (an unknown set, not initialized).
///
/// # Safety
/// `ranks` has room for `capacity` values (it may be null when `capacity` is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hvd_process_set_ranks(id: i32, ranks: *mut i64, capacity: i32) -> i32 {
    guard(-1, || {
        if capacity < 0 || (capacity > 0 && ranks.is_null()) {
            return Err("invalid rank array".into());
        }
        let members: Vec<usize> = if id == GLOBAL {
            (0..engine()?.topology().size).collect()
        } else {
            sets()?.get(id)?.ranks().to_vec()
        };
        for (i, r) in members.iter().take(capacity as usize).enumerate() {
            // SAFETY: room for `capacity` values per the contract.
            unsafe { *ranks.add(i) = *r as i64 };
        }
        Ok(members.len() as i32)
    })
}
