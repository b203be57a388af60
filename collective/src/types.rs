//! Element types and reduction operations.

use std::fmt;

crate::wire_enum! {
    /// The element type of a buffer. Buffers are passed as raw bytes; the dtype says how to read them.
    pub enum DType: u8 {
        F16 = 1,
        BF16,
        F32,
        F64,
        I8,
        U8,
        I32,
        I64,
    }
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }

    /// Whether this is a floating-point type.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DType::named(s).ok_or_else(|| {
            format!("unknown dtype `{s}` (expected one of f16, bf16, f32, f64, i8, u8, i32, i64)")
        })
    }
}

crate::wire_enum! {
    /// A reduction. `Average` is the sum divided by the number of ranks (integer division for integer types).
    pub enum ReduceOp: u8 {
        Sum = 1,
        Average,
        Min,
        Max,
        Product,
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a rank sits in the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Topology {
    /// Global rank, `0..size`.
    pub rank: usize,
    /// Number of ranks in the job.
    pub size: usize,
    /// Rank among the ranks on this host.
    pub local_rank: usize,
    /// Number of ranks on this host.
    pub local_size: usize,
    /// Index of this host among the hosts (ranks with the same `local_rank` form a cross group).
    pub cross_rank: usize,
    /// Number of hosts.
    pub cross_size: usize,
}

impl Topology {
    /// A single host holding all `size` ranks.
    pub fn single_host(rank: usize, size: usize) -> Topology {
        Topology {
            rank,
            size,
            local_rank: rank,
            local_size: size,
            cross_rank: 0,
            cross_size: 1,
        }
    }

    /// Rank `rank`'s place in a job whose rank `r` runs on host `hosts[r]` (any values; equal means one host,
    /// and hosts are numbered in order of first appearance).
    pub fn from_hosts(rank: usize, hosts: &[usize]) -> Topology {
        let index = host_indices(hosts);
        let my_host = hosts[rank];
        Topology {
            rank,
            size: hosts.len(),
            local_rank: hosts[..rank].iter().filter(|h| **h == my_host).count(),
            local_size: hosts.iter().filter(|h| **h == my_host).count(),
            cross_rank: index[rank],
            cross_size: index.iter().max().map_or(0, |m| m + 1),
        }
    }
}

/// The host index of each rank from what names its host (`["b", "a", "b"]` gives `[0, 1, 0]`): hosts are numbered
/// in order of first appearance.
pub fn host_indices<T: PartialEq>(hosts: &[T]) -> Vec<usize> {
    let mut order: Vec<&T> = Vec::new();
    hosts
        .iter()
        .map(|h| match order.iter().position(|o| *o == h) {
            Some(i) => i,
            None => {
                order.push(h);
                order.len() - 1
            }
        })
        .collect()
}
