//! Element types: the dtypes a tensor node can hold and the Rust types of their elements.
//! Errors name dtypes, so this module sits below every other. `node` and the crate root
//! re-export it.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Element types a tensor node can hold.
///
/// `F16` and `BF16` are storage types: they can be filled, copied, transferred and merged
/// bitwise, and arithmetic kernels convert them through `f32`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 64-bit IEEE float.
    F64,
    /// 16-bit IEEE float (storage).
    F16,
    /// bfloat16 (storage).
    BF16,
    /// 32-bit signed integer.
    I32,
    /// Unsigned byte.
    U8,
}

impl DType {
    /// Every element type, in declaration order.
    pub const ALL: [DType; 6] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::U8,
    ];

    /// Size of one element in bytes.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::F64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    /// Lower-case name, as in error messages and traces.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::U8 => "u8",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// IEEE half-precision float: [`half::f16`], re-exported.
///
/// Conversions come from the `half` crate: `F16::from_f32` rounds to nearest, ties to
/// even (overflow to infinity), using the CPU's conversion instruction where there is one
/// (x86 F16C, aarch64 FP16) and the same rounding in software otherwise; `to_f32` is exact.
/// A NaN stays a NaN with its payload's high bits kept and the quiet bit set (as the
/// hardware does). Slices convert in bulk with [`half::slice::HalfFloatSliceExt`].
/// The Vulkan backend's shaders convert with the same rules, bit for bit.
pub use half::f16 as F16;

/// bfloat16: [`half::bf16`], re-exported; rounding and NaN rules as for [`F16`].
pub use half::bf16 as Bf16;

mod sealed {
    pub trait Sealed {}
}

/// A Rust type that is the element of some [`DType`]; used for typed views of buffers.
///
/// Sealed: every implementor is plain old data with no padding and no invalid bit
/// patterns ([`bytemuck::Pod`]), which is what makes reinterpreting buffer bytes as `[T]`
/// sound.
pub trait Element: sealed::Sealed + bytemuck::Pod + Send + Sync + fmt::Debug + 'static {
    /// The dtype this Rust type represents.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t { const DTYPE: DType = DType::$d; }
    )*};
}
element!(f32 => F32, f64 => F64, F16 => F16, Bf16 => BF16, i32 => I32, u8 => U8);
