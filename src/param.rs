//! How a kernel's parameters are described: a routine's [`Access`] to each node, the
//! [`ArgSlot`] a failure is about, the [`ArgError`] that says why a view cannot be given, and
//! the [`IndexType`] of an index. It sits below the kernels and the errors that name these
//! types. `kernels` re-exports it.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::dtype::DType;

/// How a routine uses one of its nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Access {
    /// Only read.
    Read,
    /// Only written (every element, before any read of it).
    Write,
    /// Read, then written (or read before written, as in `dst += src`).
    ReadWrite,
}

impl Access {
    /// Whether the routine reads the node (`Read` or `ReadWrite`): it is an input.
    pub const fn reads(self) -> bool {
        matches!(self, Access::Read | Access::ReadWrite)
    }

    /// Whether the routine writes the node (`Write` or `ReadWrite`): it is an output.
    pub const fn writes(self) -> bool {
        matches!(self, Access::Write | Access::ReadWrite)
    }
}

/// Which argument of a kernel an [`ArgError`] is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ArgSlot {
    /// A parameter, by index in argument order.
    Param(usize),
    /// The stream's merge buffer.
    Merge,
}

impl fmt::Display for ArgSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ArgSlot::Param(i) => write!(f, "argument {i}"),
            ArgSlot::Merge => f.write_str("the merge buffer"),
        }
    }
}

/// Why a kernel could not get a view of an argument.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ArgError {
    /// There is no such parameter, or no merge buffer.
    #[error("{slot} does not exist ({len} parameters)")]
    Missing {
        /// The argument asked for.
        slot: ArgSlot,
        /// How many parameters the kernel has.
        len: usize,
    },
    /// The argument has another dtype than the one asked for.
    #[error("{slot} holds {found}, not {expected}")]
    DType {
        /// The argument.
        slot: ArgSlot,
        /// The dtype asked for.
        expected: DType,
        /// The argument's dtype.
        found: DType,
    },
    /// The argument's access does not allow this use (reading a `Write` parameter, writing
    /// a `Read` one).
    #[error("{slot} is declared {access:?} and cannot be {wanted}")]
    Access {
        /// The argument.
        slot: ArgSlot,
        /// Its declared access.
        access: Access,
        /// What was attempted (`read`, `written`).
        wanted: &'static str,
    },
    /// The argument is already lent in a way that conflicts with this borrow.
    #[error("{slot} is already borrowed{}", if *.mutably { " mutably" } else { "" })]
    Borrowed {
        /// The argument.
        slot: ArgSlot,
        /// Whether the earlier borrow was mutable.
        mutably: bool,
    },
    /// The view itself is unusable (size disagrees with shape and dtype, null or
    /// misaligned pointer).
    #[error("{slot} has an invalid view: {reason}")]
    BadView {
        /// The argument.
        slot: ArgSlot,
        /// What is wrong.
        reason: String,
    },
    /// The routine declares no index of this name.
    #[error("the routine declares no index {name} (it declares {declared})")]
    UnknownIndex {
        /// The name asked for.
        name: String,
        /// The indices it declares.
        declared: String,
    },
    /// The index is declared but these arguments carry no value for it (arguments made
    /// by hand without complete [`Bindings`](crate::kernels::Bindings); a scheduled routine always has them).
    #[error("index {name} has no value")]
    UnboundIndex {
        /// The index.
        name: String,
    },
    /// A byte vector whose length is not a whole number of elements.
    #[error("{bytes} bytes are not a whole number of {dtype} elements")]
    BadLength {
        /// The byte length.
        bytes: usize,
        /// The element type.
        dtype: DType,
    },
}

/// The type of an index: the range its values must fit, and how a GPU kernel receives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum IndexType {
    /// `0..=u32::MAX`; WGSL `u32`, C `unsigned int`. The default: indices, offsets and
    /// steps are rarely negative, and WGSL indexes arrays with `u32`.
    U32,
    /// `i32::MIN..=i32::MAX`; WGSL `i32`, C `int`.
    I32,
    /// Any `i64`; C `long long`; in WGSL (which has no 64-bit integers without an
    /// extension) a `vec2<u32>` of the low then the high word (little-endian).
    I64,
}

impl IndexType {
    /// The type's name (`u32`, `i32`, `i64`).
    pub const fn name(self) -> &'static str {
        match self {
            IndexType::U32 => "u32",
            IndexType::I32 => "i32",
            IndexType::I64 => "i64",
        }
    }

    /// Bytes a value takes in push constants and launch arguments (also its alignment).
    pub const fn size_in_bytes(self) -> usize {
        match self {
            IndexType::U32 | IndexType::I32 => 4,
            IndexType::I64 => 8,
        }
    }

    /// Whether `value` is in the type's range.
    ///
    /// ```
    /// use tributary::kernels::IndexType;
    /// assert!(IndexType::U32.contains(4_000_000_000));
    /// assert!(!IndexType::U32.contains(-1));
    /// assert!(!IndexType::I32.contains(1 << 31));
    /// assert!(IndexType::I64.contains(i64::MIN));
    /// ```
    pub const fn contains(self, value: i64) -> bool {
        match self {
            IndexType::U32 => value >= 0 && value <= u32::MAX as i64,
            IndexType::I32 => value >= i32::MIN as i64 && value <= i32::MAX as i64,
            IndexType::I64 => true,
        }
    }
}

impl fmt::Display for IndexType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
