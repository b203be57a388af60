//! Reduction kernels over raw byte buffers.
//!
//! Buffers come from arbitrary tensor memory, so nothing here assumes alignment: elements are read with
//! `from_ne_bytes` over `chunks_exact`, which the compiler turns into unaligned vector loads.

use half::{bf16, f16};

use crate::types::{DType, ReduceOp};

#[inline(always)]
fn zip_apply<const N: usize>(dst: &mut [u8], src: &[u8], f: impl Fn([u8; N], [u8; N]) -> [u8; N]) {
    for (d, s) in dst.chunks_exact_mut(N).zip(src.chunks_exact(N)) {
        let a: [u8; N] = (*d).try_into().unwrap_or([0; N]);
        let b: [u8; N] = s.try_into().unwrap_or([0; N]);
        d.copy_from_slice(&f(a, b));
    }
}

macro_rules! prim {
    ($dst:expr, $src:expr, $t:ty, $n:literal, $op:expr) => {{
        let op: ReduceOp = $op;
        match op {
            ReduceOp::Sum | ReduceOp::Average => zip_apply::<$n>($dst, $src, |a, b| {
                prim_add(<$t>::from_ne_bytes(a), <$t>::from_ne_bytes(b)).to_ne_bytes()
            }),
            ReduceOp::Product => zip_apply::<$n>($dst, $src, |a, b| {
                prim_mul(<$t>::from_ne_bytes(a), <$t>::from_ne_bytes(b)).to_ne_bytes()
            }),
            ReduceOp::Min => zip_apply::<$n>($dst, $src, |a, b| {
                let (a, b) = (<$t>::from_ne_bytes(a), <$t>::from_ne_bytes(b));
                (if b < a { b } else { a }).to_ne_bytes()
            }),
            ReduceOp::Max => zip_apply::<$n>($dst, $src, |a, b| {
                let (a, b) = (<$t>::from_ne_bytes(a), <$t>::from_ne_bytes(b));
                (if b > a { b } else { a }).to_ne_bytes()
            }),
        }
    }};
}

trait Arith: Copy {
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
}
macro_rules! int_arith {
    ($($t:ty),*) => {$(impl Arith for $t {
        #[inline(always)] fn add(self, o: Self) -> Self { self.wrapping_add(o) }
        #[inline(always)] fn mul(self, o: Self) -> Self { self.wrapping_mul(o) }
    })*};
}
int_arith!(i8, u8, i32, i64);
macro_rules! float_arith {
    ($($t:ty),*) => {$(impl Arith for $t {
        #[inline(always)] fn add(self, o: Self) -> Self { self + o }
        #[inline(always)] fn mul(self, o: Self) -> Self { self * o }
    })*};
}
float_arith!(f32, f64);
#[inline(always)]
fn prim_add<T: Arith>(a: T, b: T) -> T {
    a.add(b)
}
#[inline(always)]
fn prim_mul<T: Arith>(a: T, b: T) -> T {
    a.mul(b)
}

macro_rules! half_op {
    ($dst:expr, $src:expr, $t:ty, $op:expr) => {{
        let op: ReduceOp = $op;
        zip_apply::<2>($dst, $src, |a, b| {
            let (a, b) = (
                <$t>::from_ne_bytes(a).to_f32(),
                <$t>::from_ne_bytes(b).to_f32(),
            );
            let r = match op {
                ReduceOp::Sum | ReduceOp::Average => a + b,
                ReduceOp::Product => a * b,
                ReduceOp::Min => {
                    if b < a {
                        b
                    } else {
                        a
                    }
                }
                ReduceOp::Max => {
                    if b > a {
                        b
                    } else {
                        a
                    }
                }
            };
            <$t>::from_f32(r).to_ne_bytes()
        })
    }};
}

/// `dst[i] = op(dst[i], src[i])` for every whole element of the shorter buffer. `Average` reduces as a sum;
/// call [`finish_average`] once at the end.
///
/// The loops compile to vector code without per-element bounds checks; on x86-64 CPUs with AVX2 (checked once at
/// run time) the same loops run in a copy compiled for 256-bit vectors.
pub fn reduce_into(dst: &mut [u8], src: &[u8], dtype: DType, op: ReduceOp) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above), the only requirement of `reduce_avx2`.
        unsafe { reduce_avx2(dst, src, dtype, op) };
        return;
    }
    reduce_portable(dst, src, dtype, op);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
/// # Safety
/// The CPU must support AVX2.
unsafe fn reduce_avx2(dst: &mut [u8], src: &[u8], dtype: DType, op: ReduceOp) {
    reduce_portable(dst, src, dtype, op);
}

#[inline(always)]
fn reduce_portable(dst: &mut [u8], src: &[u8], dtype: DType, op: ReduceOp) {
    let n = dst.len().min(src.len());
    let (dst, src) = (&mut dst[..n], &src[..n]);
    match dtype {
        DType::F32 => prim!(dst, src, f32, 4, op),
        DType::F64 => prim!(dst, src, f64, 8, op),
        DType::I8 => prim!(dst, src, i8, 1, op),
        DType::U8 => prim!(dst, src, u8, 1, op),
        DType::I32 => prim!(dst, src, i32, 4, op),
        DType::I64 => prim!(dst, src, i64, 8, op),
        DType::F16 => half_op!(dst, src, f16, op),
        DType::BF16 => half_op!(dst, src, bf16, op),
    }
}

/// The reduction the algorithms run for `op`: Average sums, and [`finish_average`] divides at the end.
pub(crate) fn accumulated(op: ReduceOp) -> ReduceOp {
    if op == ReduceOp::Average {
        ReduceOp::Sum
    } else {
        op
    }
}

/// Divides every element by `n` (the last step of an `Average`). Integer types use truncating division.
pub fn finish_average(buf: &mut [u8], dtype: DType, n: usize) {
    if n <= 1 {
        return;
    }
    macro_rules! div {
        ($t:ty, $w:literal, $conv:expr) => {
            for c in buf.chunks_exact_mut($w) {
                let v = <$t>::from_ne_bytes(c.try_into().unwrap_or([0; $w]));
                let f: fn($t, usize) -> $t = $conv;
                c.copy_from_slice(&f(v, n).to_ne_bytes());
            }
        };
    }
    match dtype {
        DType::F32 => div!(f32, 4, |v, n| v / n as f32),
        DType::F64 => div!(f64, 8, |v, n| v / n as f64),
        DType::I8 => div!(i8, 1, |v, n| (v as i64 / n as i64) as i8),
        DType::U8 => div!(u8, 1, |v, n| (v as u64 / n as u64) as u8),
        DType::I32 => div!(i32, 4, |v, n| (v as i64 / n as i64) as i32),
        DType::I64 => div!(i64, 8, |v, n| v / n as i64),
        DType::F16 => div!(f16, 2, |v, n| f16::from_f32(v.to_f32() / n as f32)),
        DType::BF16 => div!(bf16, 2, |v, n| bf16::from_f32(v.to_f32() / n as f32)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f32_sum_and_average() {
        let mut a: Vec<u8> = [1.0f32, 2.0, 3.0]
            .iter()
            .flat_map(|v| v.to_ne_bytes())
            .collect();
        let b: Vec<u8> = [10.0f32, 20.0, 30.0]
            .iter()
            .flat_map(|v| v.to_ne_bytes())
            .collect();
        reduce_into(&mut a, &b, DType::F32, ReduceOp::Average);
        finish_average(&mut a, DType::F32, 2);
        let got: Vec<f32> = a
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, [5.5, 11.0, 16.5]);
    }

    #[test]
    fn unaligned_i64_min_max() {
        let mut storage = [0u8; 17];
        let dst = &mut storage[1..17];
        dst[..8].copy_from_slice(&5i64.to_ne_bytes());
        dst[8..].copy_from_slice(&(-5i64).to_ne_bytes());
        let src: Vec<u8> = [3i64, 7].iter().flat_map(|v| v.to_ne_bytes()).collect();
        reduce_into(dst, &src, DType::I64, ReduceOp::Max);
        assert_eq!(i64::from_ne_bytes(dst[..8].try_into().unwrap()), 5);
        assert_eq!(i64::from_ne_bytes(dst[8..].try_into().unwrap()), 7);
        reduce_into(dst, &src, DType::I64, ReduceOp::Min);
        assert_eq!(i64::from_ne_bytes(dst[..8].try_into().unwrap()), 3);
    }

    /// The AVX2 copy and the portable loops agree bit for bit, on unaligned odd-length buffers of every type.
    #[test]
    fn dispatch_matches_the_portable_loops() {
        let ops = [
            ReduceOp::Sum,
            ReduceOp::Product,
            ReduceOp::Min,
            ReduceOp::Max,
        ];
        let src: Vec<u8> = (0..1031u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let base: Vec<u8> = (0..1031u32)
            .map(|i| (i.wrapping_mul(40_503) >> 3) as u8)
            .collect();
        for dtype in DType::ALL {
            for op in ops {
                let mut a = base.clone();
                let mut b = base.clone();
                reduce_into(&mut a[1..], &src[3..], dtype, op);
                reduce_portable(&mut b[1..], &src[3..], dtype, op);
                assert_eq!(a, b, "{dtype} {op:?}");
            }
        }
    }

    #[test]
    fn bf16_product() {
        let mut a = bf16::from_f32(3.0).to_ne_bytes().to_vec();
        let b = bf16::from_f32(-2.0).to_ne_bytes();
        reduce_into(&mut a, &b, DType::BF16, ReduceOp::Product);
        assert_eq!(bf16::from_ne_bytes([a[0], a[1]]).to_f32(), -6.0);
    }
}
