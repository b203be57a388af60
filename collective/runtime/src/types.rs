//! Element types, reduction operations and the small numeric kernels the engine needs of its own (scaling, the
//! identity contribution of a joined rank, and the reference reduction of the in-process transport).

use std::fmt;

use half::{bf16, f16};

/// Element type of a tensor. The discriminants are the C ABI's `HVD_*` dtype constants: never renumber.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DataType {
    U8 = 0,
    I8 = 1,
    I32 = 2,
    I64 = 3,
    F16 = 4,
    F32 = 5,
    F64 = 6,
    Bf16 = 7,
}

impl DataType {
    pub const ALL: [DataType; 8] = [
        DataType::U8,
        DataType::I8,
        DataType::I32,
        DataType::I64,
        DataType::F16,
        DataType::F32,
        DataType::F64,
        DataType::Bf16,
    ];

    pub fn from_code(code: i32) -> Option<DataType> {
        DataType::ALL.into_iter().find(|d| *d as i32 == code)
    }

    pub fn size(self) -> usize {
        match self {
            DataType::U8 | DataType::I8 => 1,
            DataType::F16 | DataType::Bf16 => 2,
            DataType::I32 | DataType::F32 => 4,
            DataType::I64 | DataType::F64 => 8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DataType::U8 => "uint8",
            DataType::I8 => "int8",
            DataType::I32 => "int32",
            DataType::I64 => "int64",
            DataType::F16 => "float16",
            DataType::F32 => "float32",
            DataType::F64 => "float64",
            DataType::Bf16 => "bfloat16",
        }
    }

    pub fn is_float(self) -> bool {
        matches!(
            self,
            DataType::F16 | DataType::F32 | DataType::F64 | DataType::Bf16
        )
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Reduction operation. The discriminants are the C ABI's `HVD_*` op constants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    Sum = 0,
    Average = 1,
    Min = 2,
    Max = 3,
    Product = 4,
}

impl ReduceOp {
    pub fn from_code(code: i32) -> Option<ReduceOp> {
        [
            ReduceOp::Sum,
            ReduceOp::Average,
            ReduceOp::Min,
            ReduceOp::Max,
            ReduceOp::Product,
        ]
        .into_iter()
        .find(|o| *o as i32 == code)
    }

    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Average => "average",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Product => "product",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Element-wise reduction that the transports perform (average is a sum followed by a scale in the engine).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reduction {
    Sum,
    Min,
    Max,
    Product,
}

impl ReduceOp {
    /// The element-wise reduction, and whether the result is divided by the world size afterwards.
    pub fn reduction(self) -> (Reduction, bool) {
        match self {
            ReduceOp::Sum => (Reduction::Sum, false),
            ReduceOp::Average => (Reduction::Sum, true),
            ReduceOp::Min => (Reduction::Min, false),
            ReduceOp::Max => (Reduction::Max, false),
            ReduceOp::Product => (Reduction::Product, false),
        }
    }
}

/// A scalar type the kernels work on, converted through f64 for scaling.
trait Element: Copy + PartialOrd {
    fn read(bytes: &[u8]) -> Self;
    fn write(self, bytes: &mut [u8]);
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
    fn add(self, other: Self) -> Self;
    fn mul(self, other: Self) -> Self;
    const LOWEST: Self;
    const HIGHEST: Self;
    const ZERO: Self;
    const ONE: Self;
}

macro_rules! int_element {
    ($t:ty) => {
        impl Element for $t {
            fn read(bytes: &[u8]) -> Self {
                let mut a = [0u8; std::mem::size_of::<$t>()];
                a.copy_from_slice(bytes);
                <$t>::from_le_bytes(a)
            }
            fn write(self, bytes: &mut [u8]) {
                bytes.copy_from_slice(&self.to_le_bytes());
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn from_f64(v: f64) -> Self {
                // `as` saturates; rounding keeps integer averages of exact sums exact.
                v.round() as $t
            }
            fn add(self, other: Self) -> Self {
                self.wrapping_add(other)
            }
            fn mul(self, other: Self) -> Self {
                self.wrapping_mul(other)
            }
            const LOWEST: Self = <$t>::MIN;
            const HIGHEST: Self = <$t>::MAX;
            const ZERO: Self = 0;
            const ONE: Self = 1;
        }
    };
}
int_element!(u8);
int_element!(i8);
int_element!(i32);
int_element!(i64);

macro_rules! float_element {
    ($t:ty, $to:expr, $from:expr, $lowest:expr, $highest:expr, $zero:expr, $one:expr) => {
        impl Element for $t {
            fn read(bytes: &[u8]) -> Self {
                let mut a = [0u8; std::mem::size_of::<$t>()];
                a.copy_from_slice(bytes);
                <$t>::from_le_bytes(a)
            }
            fn write(self, bytes: &mut [u8]) {
                bytes.copy_from_slice(&self.to_le_bytes());
            }
            fn to_f64(self) -> f64 {
                $to(self)
            }
            fn from_f64(v: f64) -> Self {
                $from(v)
            }
            fn add(self, other: Self) -> Self {
                $from($to(self) + $to(other))
            }
            fn mul(self, other: Self) -> Self {
                $from($to(self) * $to(other))
            }
            const LOWEST: Self = $lowest;
            const HIGHEST: Self = $highest;
            const ZERO: Self = $zero;
            const ONE: Self = $one;
        }
    };
}
float_element!(
    f32,
    |x: f32| x as f64,
    |v: f64| v as f32,
    f32::NEG_INFINITY,
    f32::INFINITY,
    0.0,
    1.0
);
float_element!(
    f64,
    |x: f64| x,
    |v: f64| v,
    f64::NEG_INFINITY,
    f64::INFINITY,
    0.0,
    1.0
);
float_element!(
    f16,
    f16::to_f64,
    f16::from_f64,
    f16::NEG_INFINITY,
    f16::INFINITY,
    f16::ZERO,
    f16::ONE
);
float_element!(
    bf16,
    bf16::to_f64,
    bf16::from_f64,
    bf16::NEG_INFINITY,
    bf16::INFINITY,
    bf16::ZERO,
    bf16::ONE
);

macro_rules! dispatch {
    ($dtype:expr, $f:ident, $($arg:expr),*) => {
        match $dtype {
            DataType::U8 => $f::<u8>($($arg),*),
            DataType::I8 => $f::<i8>($($arg),*),
            DataType::I32 => $f::<i32>($($arg),*),
            DataType::I64 => $f::<i64>($($arg),*),
            DataType::F16 => $f::<f16>($($arg),*),
            DataType::F32 => $f::<f32>($($arg),*),
            DataType::F64 => $f::<f64>($($arg),*),
            DataType::Bf16 => $f::<bf16>($($arg),*),
        }
    };
}

fn scale_typed<T: Element>(buf: &mut [u8], factor: f64) {
    let n = std::mem::size_of::<T>();
    for chunk in buf.chunks_exact_mut(n) {
        T::from_f64(T::read(chunk).to_f64() * factor).write(chunk);
    }
}

/// Multiplies every element of `buf` (little-endian `dtype` values) by `factor`. Integers round to nearest.
pub fn scale(buf: &mut [u8], dtype: DataType, factor: f64) {
    if factor == 1.0 {
        return;
    }
    if dtype == DataType::F32 {
        // The hot case (gradient averaging) gets a loop the compiler vectorises.
        let f = factor as f32;
        for chunk in buf.chunks_exact_mut(4) {
            let v = f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]) * f;
            chunk.copy_from_slice(&v.to_le_bytes());
        }
        return;
    }
    dispatch!(dtype, scale_typed, buf, factor)
}

fn fill_typed<T: Element>(buf: &mut [u8], reduction: Reduction) {
    let v = match reduction {
        Reduction::Sum => T::ZERO,
        Reduction::Product => T::ONE,
        Reduction::Min => T::HIGHEST,
        Reduction::Max => T::LOWEST,
    };
    let n = std::mem::size_of::<T>();
    for chunk in buf.chunks_exact_mut(n) {
        v.write(chunk);
    }
}

/// Fills `buf` with the identity of `reduction`: what a joined rank contributes.
pub fn fill_identity(buf: &mut [u8], dtype: DataType, reduction: Reduction) {
    dispatch!(dtype, fill_typed, buf, reduction)
}

fn reduce_typed<T: Element>(acc: &mut [u8], other: &[u8], reduction: Reduction) {
    let n = std::mem::size_of::<T>();
    for (a, b) in acc.chunks_exact_mut(n).zip(other.chunks_exact(n)) {
        let x = T::read(a);
        let y = T::read(b);
        let r = match reduction {
            Reduction::Sum => x.add(y),
            Reduction::Product => x.mul(y),
            Reduction::Min => {
                if y < x {
                    y
                } else {
                    x
                }
            }
            Reduction::Max => {
                if y > x {
                    y
                } else {
                    x
                }
            }
        };
        r.write(a);
    }
}

/// `acc[i] = acc[i] (op) other[i]`: the reference reduction used by the in-process transport.
pub fn reduce_into(acc: &mut [u8], other: &[u8], dtype: DataType, reduction: Reduction) {
    dispatch!(dtype, reduce_typed, acc, other, reduction)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_rounds_integers_and_scales_halves() {
        let mut b: Vec<u8> = [3i32, -5].iter().flat_map(|v| v.to_le_bytes()).collect();
        scale(&mut b, DataType::I32, 0.5);
        assert_eq!(i32::read(&b[0..4]), 2);
        assert_eq!(i32::read(&b[4..8]), -3);
        let mut h = f16::from_f32(3.0).to_le_bytes().to_vec();
        scale(&mut h, DataType::F16, 0.5);
        assert_eq!(f16::read(&h), f16::from_f32(1.5));
    }

    #[test]
    fn identity_is_neutral() {
        for dtype in DataType::ALL {
            for r in [
                Reduction::Sum,
                Reduction::Min,
                Reduction::Max,
                Reduction::Product,
            ] {
                let mut x = vec![0u8; dtype.size() * 3];
                scale_from_f64(&mut x, dtype, &[1.0, 2.0, 3.0]);
                let orig = x.clone();
                let mut id = vec![0u8; x.len()];
                fill_identity(&mut id, dtype, r);
                reduce_into(&mut x, &id, dtype, r);
                assert_eq!(x, orig, "{dtype} {r:?}");
            }
        }
    }

    fn scale_from_f64(buf: &mut [u8], dtype: DataType, vals: &[f64]) {
        fn put<T: Element>(buf: &mut [u8], vals: &[f64]) {
            let n = std::mem::size_of::<T>();
            for (c, v) in buf.chunks_exact_mut(n).zip(vals) {
                T::from_f64(*v).write(c);
            }
        }
        dispatch!(dtype, put, buf, vals)
    }
}
