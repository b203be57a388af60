//! The two numeric kernels the engine needs beyond `hvd-collective`'s reductions: scaling by a factor
//! (prescale, postscale, average) and the identity contribution of a joined rank. Element types and reductions are
//! `hvd_collective::{DType, ReduceOp}`; element-wise reduction is `hvd_collective::reduce::reduce_into`.

use half::{bf16, f16};
use hvd_collective::{DType, ReduceOp};

/// The element-wise reduction the transport performs for `op`, and whether the engine divides by the world size
/// afterwards. The engine reduces an average as a sum and scales once (together with the postscale factor), so
/// integer averages round to nearest, as hvd.h documents.
pub fn elementwise(op: ReduceOp) -> (ReduceOp, bool) {
    match op {
        ReduceOp::Average => (ReduceOp::Sum, true),
        other => (other, false),
    }
}

/// The name users see in error messages (numpy's spelling, as Horovod prints it).
pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::U8 => "uint8",
        DType::I8 => "int8",
        DType::I32 => "int32",
        DType::I64 => "int64",
        DType::F16 => "float16",
        DType::F32 => "float32",
        DType::F64 => "float64",
        DType::BF16 => "bfloat16",
    }
}

/// Multiplies every element of `buf` (little-endian `dtype` values) by `factor`. Integers round to nearest
/// (saturating).
pub fn scale(buf: &mut [u8], dtype: DType, factor: f64) {
    if factor == 1.0 {
        return;
    }
    macro_rules! each {
        ($n:literal, $f:expr) => {
            for c in buf.chunks_exact_mut($n) {
                let a: [u8; $n] = (*c).try_into().unwrap_or([0; $n]);
                c.copy_from_slice(&$f(a));
            }
        };
    }
    match dtype {
        // The hot case (gradient averaging): a loop the compiler vectorises.
        DType::F32 => {
            let f = factor as f32;
            each!(4, |a| (f32::from_le_bytes(a) * f).to_le_bytes())
        }
        DType::F64 => each!(8, |a| (f64::from_le_bytes(a) * factor).to_le_bytes()),
        DType::F16 => each!(2, |a| f16::from_f64(
            f16::from_le_bytes(a).to_f64() * factor
        )
        .to_le_bytes()),
        DType::BF16 => each!(2, |a| bf16::from_f64(
            bf16::from_le_bytes(a).to_f64() * factor
        )
        .to_le_bytes()),
        // `as` saturates; rounding keeps integer averages of exact sums exact.
        DType::U8 => each!(1, |a| ((u8::from_le_bytes(a) as f64 * factor).round()
            as u8)
            .to_le_bytes()),
        DType::I8 => each!(1, |a| ((i8::from_le_bytes(a) as f64 * factor).round()
            as i8)
            .to_le_bytes()),
        DType::I32 => each!(4, |a| ((i32::from_le_bytes(a) as f64 * factor).round()
            as i32)
            .to_le_bytes()),
        DType::I64 => each!(8, |a| ((i64::from_le_bytes(a) as f64 * factor).round()
            as i64)
            .to_le_bytes()),
    }
}

/// Fills `buf` with the identity of `op` (0 for sum and average, 1 for product, the largest value for min, the
/// smallest for max): what a joined rank contributes.
pub fn fill_identity(buf: &mut [u8], dtype: DType, op: ReduceOp) {
    macro_rules! fill {
        ($t:ty, $zero:expr, $one:expr, $max:expr, $min:expr) => {{
            let v: $t = match op {
                ReduceOp::Sum | ReduceOp::Average => $zero,
                ReduceOp::Product => $one,
                ReduceOp::Min => $max,
                ReduceOp::Max => $min,
            };
            let bytes = v.to_le_bytes();
            for c in buf.chunks_exact_mut(bytes.len()) {
                c.copy_from_slice(&bytes);
            }
        }};
    }
    match dtype {
        DType::U8 => fill!(u8, 0, 1, u8::MAX, u8::MIN),
        DType::I8 => fill!(i8, 0, 1, i8::MAX, i8::MIN),
        DType::I32 => fill!(i32, 0, 1, i32::MAX, i32::MIN),
        DType::I64 => fill!(i64, 0, 1, i64::MAX, i64::MIN),
        DType::F16 => fill!(f16, f16::ZERO, f16::ONE, f16::INFINITY, f16::NEG_INFINITY),
        DType::BF16 => fill!(
            bf16,
            bf16::ZERO,
            bf16::ONE,
            bf16::INFINITY,
            bf16::NEG_INFINITY
        ),
        DType::F32 => fill!(f32, 0.0, 1.0, f32::INFINITY, f32::NEG_INFINITY),
        DType::F64 => fill!(f64, 0.0, 1.0, f64::INFINITY, f64::NEG_INFINITY),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hvd_collective::reduce::reduce_into;

    #[test]
    fn scale_rounds_integers_and_scales_halves() {
        let mut b: Vec<u8> = [3i32, -5].iter().flat_map(|v| v.to_le_bytes()).collect();
        scale(&mut b, DType::I32, 0.5);
        assert_eq!(b[0..4], 2i32.to_le_bytes());
        assert_eq!(b[4..8], (-3i32).to_le_bytes());
        let mut h = f16::from_f32(3.0).to_le_bytes().to_vec();
        scale(&mut h, DType::F16, 0.5);
        assert_eq!(h, f16::from_f32(1.5).to_le_bytes());
        let mut u = vec![200u8];
        scale(&mut u, DType::U8, 2.0);
        assert_eq!(u, [255], "saturates");
    }

    #[test]
    fn identity_is_neutral_under_the_collective_crates_reduction() {
        for dtype in DType::ALL {
            for op in ReduceOp::ALL {
                // 1, 2, 3 in this dtype: scale a buffer of ones.
                let mut x = vec![0u8; dtype.size() * 3];
                fill_identity(&mut x, dtype, ReduceOp::Product);
                for (i, c) in x.chunks_exact_mut(dtype.size()).enumerate() {
                    scale(c, dtype, (i + 1) as f64);
                }
                let orig = x.clone();
                let mut id = vec![0u8; x.len()];
                fill_identity(&mut id, dtype, op);
                reduce_into(&mut x, &id, dtype, elementwise(op).0);
                assert_eq!(x, orig, "{dtype} {op}");
            }
        }
    }
}
