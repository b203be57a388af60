//! Whether the ranks of a segment are oversubscribed (more ranks than cores to run them), from the CPU sets they
//! publish when they attach and this process's CPU quota (cgroup `cpu.max`, or v1's `cpu.cfs_quota_us` /
//! `cpu.cfs_period_us`).

use std::path::{Component, Path, PathBuf};

/// Whether the ranks whose CPU sets are `sets` (bit `c` for CPU `c`, as `ShmSegment::cpus` holds them) are
/// oversubscribed, given a CPU quota of `quota()` whole CPUs (`None`: no quota; asked only when the sets decide).
/// `None` when the sets do not decide:
/// all alike (then this process's own count stands, which heeds the quota), or one could not be read (`0`, or
/// `u64::MAX`: it may run on a CPU from 64 up).
///
/// Oversubscribed when the ranks outnumber the quota, or when they cannot each have a CPU of their own set:
/// `{0},{0},{0-3}` is, though its union has 4 CPUs for 3 ranks (ranks 0 and 1 share CPU 0).
pub(super) fn oversubscribed(sets: &[u64], quota: impl FnOnce() -> Option<usize>) -> Option<bool> {
    let first = *sets.first()?;
    if sets.iter().any(|s| *s == u64::MAX || *s == 0) || sets.iter().all(|s| *s == first) {
        return None;
    }
    Some(quota().is_some_and(|q| sets.len() > q) || !core_each(sets))
}

/// Whether each rank can have a CPU of its own set, no two the same (a perfect matching of ranks to CPUs, found by
/// augmenting paths).
fn core_each(sets: &[u64]) -> bool {
    if sets.len() > 64 {
        return false;
    }
    // owner[c]: the rank CPU `c` is given to.
    let mut owner = [usize::MAX; 64];
    (0..sets.len()).all(|r| {
        let mut seen = 0u64;
        augment(sets, r, &mut owner, &mut seen)
    })
}

/// Gives rank `r` a CPU of its set, moving other ranks to other CPUs of theirs where needed.
fn augment(sets: &[u64], r: usize, owner: &mut [usize; 64], seen: &mut u64) -> bool {
    for c in 0..64 {
        let bit = 1u64 << c;
        if sets[r] & bit == 0 || *seen & bit != 0 {
            continue;
        }
        *seen |= bit;
        if owner[c] == usize::MAX || augment(sets, owner[c], owner, seen) {
            owner[c] = r;
            return true;
        }
    }
    false
}

/// The whole CPUs this process's cgroup CPU quota allows (at least 1); `None` when there is no quota or it could
/// not be read (never an error: the quota only caps the count).
pub(super) fn quota_cpus() -> Option<usize> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let root = Path::new("/sys/fs/cgroup");
    let mut least: Option<usize> = None;
    let mut take = |q: Option<usize>| {
        if let Some(q) = q {
            least = Some(least.map_or(q, |l| l.min(q)));
        }
    };
    for line in cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if controllers.is_empty() {
            // cgroup v2: every level from this process's group up to the mount's root may carry a quota.
            for dir in levels(root, path) {
                take(read(&dir.join("cpu.max")).and_then(|s| parse_cpu_max(&s)));
            }
        } else if controllers.split(',').any(|c| c == "cpu") {
            for mount in ["cpu", "cpu,cpuacct", "cpuacct,cpu"] {
                for dir in levels(&root.join(mount), path) {
                    let quota = read(&dir.join("cpu.cfs_quota_us"));
                    let period = read(&dir.join("cpu.cfs_period_us"));
                    if let (Some(q), Some(p)) = (quota, period) {
                        take(parse_cfs(&q, &p));
                    }
                }
            }
        }
    }
    least
}

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

/// `base` joined with each leading part of `path` (a cgroup path from /proc/self/cgroup), deepest first, `base`
/// last; a path with `..` or anything but plain names counts as `base` alone.
fn levels(base: &Path, path: &str) -> Vec<PathBuf> {
    let rel = Path::new(path.trim_start_matches('/'));
    let mut dirs = vec![base.to_path_buf()];
    if rel.components().all(|c| matches!(c, Component::Normal(_))) {
        let mut dir = base.to_path_buf();
        for c in rel.components() {
            dir.push(c);
            dirs.push(dir.clone());
        }
    }
    dirs.reverse();
    dirs
}

/// cgroup v2's `cpu.max`: `"$MAX $PERIOD"` in microseconds, `$MAX` = `max` for no quota.
fn parse_cpu_max(text: &str) -> Option<usize> {
    let mut words = text.split_whitespace();
    let (quota, period) = (words.next()?, words.next().unwrap_or("100000"));
    cpus(quota.parse().ok()?, period.parse().ok()?)
}

/// cgroup v1's `cpu.cfs_quota_us` (-1 for no quota) and `cpu.cfs_period_us`.
fn parse_cfs(quota: &str, period: &str) -> Option<usize> {
    cpus(quota.trim().parse().ok()?, period.trim().parse().ok()?)
}

/// Whole CPUs in `quota` per `period` (at least 1, as `available_parallelism` counts them); `None` for no quota.
fn cpus(quota: i64, period: i64) -> Option<usize> {
    if quota <= 0 || period <= 0 {
        return None;
    }
    Some(usize::try_from(quota / period).unwrap_or(usize::MAX).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quota_below_the_ranks_oversubscribes_ranks_bound_to_cores_of_their_own() {
        // 8 ranks bound one per core (`mpirun --bind-to core`) in a pod limited to 2 CPUs.
        let bound: Vec<u64> = (0..8).map(|c| 1 << c).collect();
        assert_eq!(oversubscribed(&bound, || Some(2)), Some(true));
        assert_eq!(oversubscribed(&bound, || Some(8)), Some(false));
        assert_eq!(oversubscribed(&bound, || None), Some(false));
    }

    #[test]
    fn ranks_that_must_share_a_core_are_oversubscribed_whatever_the_union() {
        // {0},{0},{0-3}: 4 CPUs for 3 ranks, but ranks 0 and 1 share CPU 0.
        assert_eq!(oversubscribed(&[0b1, 0b1, 0b1111], || None), Some(true));
        // {0},{0-1},{0-2}: each has one of its own (0, 1, 2).
        assert_eq!(oversubscribed(&[0b1, 0b11, 0b111], || None), Some(false));
        // {0-1},{0-1},{0-1},{2-7}: three ranks on two CPUs, though the union has 8.
        assert_eq!(
            oversubscribed(&[0b11, 0b11, 0b11, 0b1111_1100], || None),
            Some(true)
        );
        // Found only by moving rank 0 off CPU 0: {0-1},{0}.
        assert_eq!(oversubscribed(&[0b11, 0b1], || None), Some(false));
    }

    #[test]
    fn distinct_singletons_are_not_oversubscribed() {
        assert_eq!(
            oversubscribed(&[1 << 0, 1 << 5, 1 << 63], || None),
            Some(false)
        );
    }

    #[test]
    fn sets_alike_or_unreadable_leave_the_own_count_standing() {
        assert_eq!(oversubscribed(&[0b11, 0b11], || Some(1)), None);
        assert_eq!(oversubscribed(&[0b1, u64::MAX], || None), None);
        assert_eq!(oversubscribed(&[0b1, 0], || None), None);
        assert_eq!(oversubscribed(&[], || None), None);
    }

    #[test]
    fn quota_files_parse_and_garbage_means_no_quota() {
        assert_eq!(parse_cpu_max("max 100000\n"), None);
        assert_eq!(parse_cpu_max("200000 100000\n"), Some(2));
        assert_eq!(parse_cpu_max("150000 100000"), Some(1));
        assert_eq!(parse_cpu_max("50000 100000"), Some(1));
        assert_eq!(parse_cpu_max("200000"), Some(2));
        for garbage in ["", "x y", "100 0", "-5 100000", "99999999999999999999999 1"] {
            assert_eq!(parse_cpu_max(garbage), None, "{garbage:?}");
        }
        assert_eq!(parse_cfs("-1\n", "100000\n"), None);
        assert_eq!(parse_cfs("400000\n", "100000\n"), Some(4));
        assert_eq!(parse_cfs("junk", "100000"), None);
        // Whatever this machine has, reading it never panics.
        let _ = quota_cpus();
    }

    #[test]
    fn cgroup_paths_stay_under_the_mount() {
        let root = Path::new("/sys/fs/cgroup");
        assert_eq!(
            levels(root, "/a/b"),
            [root.join("a/b"), root.join("a"), root.to_path_buf()]
        );
        assert_eq!(levels(root, "/"), [root.to_path_buf()]);
        assert_eq!(levels(root, "/a/../../etc"), [root.to_path_buf()]);
    }
}
