//! Typed views of a kernel's arguments.
//!
//! A CPU kernel sees its buffers through [`KernelArgs`]: one [`ArgView`] per parameter, in
//! argument order, and the merge-buffer view if any. A view is a typed slice, given after its
//! access, dtype, size and alignment are checked. A borrow flag per parameter refuses
//! aliasing. Flags are never cleared during one kernel call, so a kernel that needs a
//! parameter twice should keep the first slice.

use std::{cell::Cell, fmt, marker::PhantomData, mem, ptr::NonNull, slice};

use super::{bindings::Bindings, spec::Access};
use crate::node::{DType, Element, Shape};
use smallvec::SmallVec;

pub use crate::param::{ArgError, ArgSlot};

impl From<ArgError> for String {
    fn from(e: ArgError) -> String {
        e.to_string()
    }
}

/// One argument buffer as the backend hands it to a kernel: raw memory plus its type.
///
/// Building one is safe; using it is not: see [`KernelArgs::new`].
#[derive(Clone, Debug)]
pub struct ArgView {
    /// Start of the buffer.
    pub ptr: *mut u8,
    /// Length of the buffer in bytes (must be the shape's element count times the dtype's
    /// size).
    pub bytes: usize,
    /// Element type.
    pub dtype: DType,
    /// Shape of the node.
    pub shape: Shape,
    /// How the kernel may use it (ignored for the merge view, which is always read-only).
    pub access: Access,
}

// SAFETY: an `ArgView` is a pointer value plus metadata; it is never dereferenced except
// through `KernelArgs`, whose unsafe constructor makes the caller vouch for the memory on
// the thread where the kernel runs. Moving the pointer value to another thread is harmless.
unsafe impl Send for ArgView {}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Borrow {
    Free,
    Shared,
    Mutable,
}

/// Arguments whose borrow flags live inline in [`KernelArgs`] (more go on the heap).
const INLINE_FLAGS: usize = 16;

/// One borrow flag per argument: inline for up to [`INLINE_FLAGS`] arguments, so a kernel
/// call allocates nothing for them; on the heap beyond.
enum BorrowFlags {
    Inline([Cell<Borrow>; INLINE_FLAGS]),
    Heap(Vec<Cell<Borrow>>),
}

impl BorrowFlags {
    /// `n` free flags.
    fn new(n: usize) -> BorrowFlags {
        if n <= INLINE_FLAGS {
            BorrowFlags::Inline(std::array::from_fn(|_| Cell::new(Borrow::Free)))
        } else {
            BorrowFlags::Heap((0..n).map(|_| Cell::new(Borrow::Free)).collect())
        }
    }

    /// The flag of argument `i` (callers bound `i` by the argument count first).
    fn get(&self, i: usize) -> Option<&Cell<Borrow>> {
        match self {
            BorrowFlags::Inline(flags) => flags.get(i),
            BorrowFlags::Heap(flags) => flags.get(i),
        }
    }
}

/// Views held inline by [`KernelArgs`]: a call with up to this many arguments allocates no
/// list for them.
const INLINE_VIEWS: usize = 8;

/// The arguments of one kernel call: typed, borrow-checked views of its buffers.
///
/// `'a` is the lifetime for which the constructor's caller guarantees the memory.
pub struct KernelArgs<'a> {
    views: SmallVec<[ArgView; INLINE_VIEWS]>,
    merge: Option<ArgView>,
    borrows: BorrowFlags,
    bindings: Bindings,
    _memory: PhantomData<&'a mut [u8]>,
}

impl fmt::Debug for KernelArgs<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KernelArgs")
            .field("views", &self.views)
            .field("merge", &self.merge)
            .field("bindings", &self.bindings)
            .finish()
    }
}

/// The checked parts of a view: element count and a non-null, aligned start pointer.
struct Checked<T> {
    ptr: NonNull<T>,
    len: usize,
}

fn check_view<T: Element>(view: &ArgView, slot: ArgSlot) -> Result<Checked<T>, ArgError> {
    if view.dtype != T::DTYPE {
        return Err(ArgError::DType {
            slot,
            expected: T::DTYPE,
            found: view.dtype,
        });
    }
    let size = mem::size_of::<T>();
    if size != view.dtype.size_in_bytes() {
        // Unreachable for the sealed `Element` types; refuse rather than misread memory.
        return Err(ArgError::BadView {
            slot,
            reason: format!("element type size {size} disagrees with {}", view.dtype),
        });
    }
    let (ptr, len) = check_raw(view, slot, size, mem::align_of::<T>())?;
    Ok(Checked {
        // A dangling, aligned pointer is valid for empty slices.
        ptr: ptr.map_or(NonNull::dangling(), NonNull::cast),
        len,
    })
}

/// Checks size and pointer; returns the pointer (`None` for an empty view, whose pointer
/// is not looked at) and the element count.
fn check_raw(
    view: &ArgView,
    slot: ArgSlot,
    size: usize,
    align: usize,
) -> Result<(Option<NonNull<u8>>, usize), ArgError> {
    let len = view
        .shape
        .numel()
        .filter(|n| n.checked_mul(size) == Some(view.bytes))
        .ok_or_else(|| ArgError::BadView {
            slot,
            reason: format!(
                "{} bytes for shape {} of {}",
                view.bytes, view.shape, view.dtype
            ),
        })?;
    if len == 0 {
        return Ok((None, 0));
    }
    let ptr = NonNull::new(view.ptr).ok_or_else(|| ArgError::BadView {
        slot,
        reason: "null pointer".to_string(),
    })?;
    if (ptr.as_ptr() as usize) % align != 0 {
        return Err(ArgError::BadView {
            slot,
            reason: format!("pointer {:p} not aligned to {align} bytes", ptr.as_ptr()),
        });
    }
    Ok((Some(ptr), len))
}

/// The start of a checked byte view (dangling when empty).
fn byte_start(ptr: Option<NonNull<u8>>) -> NonNull<u8> {
    ptr.unwrap_or(NonNull::dangling())
}

impl<'a> KernelArgs<'a> {
    /// Wraps the views of one kernel call: `views` in argument order, `merge` the stream's
    /// merge buffer when the routine reads it. Up to eight views are held without
    /// allocating.
    ///
    /// Sizes, alignment, dtypes and accesses are checked again when a view is borrowed
    /// (errors, not undefined behaviour), so a malformed view is refused safely; what
    /// cannot be checked is the memory itself.
    ///
    /// # Safety
    ///
    /// For the whole lifetime `'a` (the kernel call):
    ///
    /// - each view with `bytes > 0` points to `bytes` initialised bytes that are valid for
    ///   reads, and also for writes when its access is `Write` or `ReadWrite`;
    /// - no two parameter views overlap, and the merge view overlaps no view whose access
    ///   is `Write` or `ReadWrite` (it may alias a `Read` view);
    /// - nothing else writes to any view's bytes, and nothing else reads the bytes of a
    ///   `Write` or `ReadWrite` view, while this value exists.
    pub unsafe fn new(
        views: impl IntoIterator<Item = ArgView>,
        merge: Option<ArgView>,
    ) -> KernelArgs<'a> {
        // SAFETY: the caller's contract, passed on.
        unsafe { KernelArgs::with_parts(views, merge, Bindings::none()) }
    }

    /// [`KernelArgs::new`] with the index values at once.
    ///
    /// # Safety
    ///
    /// As [`KernelArgs::new`].
    #[inline]
    pub(crate) unsafe fn with_parts(
        views: impl IntoIterator<Item = ArgView>,
        merge: Option<ArgView>,
        bindings: Bindings,
    ) -> KernelArgs<'a> {
        // SAFETY: the caller's contract, passed on.
        let mut args = unsafe { KernelArgs::with_merge(merge, bindings) };
        // SAFETY: as above.
        unsafe { args.extend_views(views) };
        args
    }

    /// Arguments with no parameter view yet, `merge` and the index values: a backend makes
    /// them where it calls the kernel and pushes the views there
    /// ([`KernelArgs::extend_views`]). Made empty, they are moved without their ~500 bytes of
    /// views (made whole and moved, they were copied at every kernel call).
    ///
    /// # Safety
    ///
    /// As [`KernelArgs::new`], for `merge`.
    #[inline(always)]
    pub(crate) unsafe fn with_merge(merge: Option<ArgView>, bindings: Bindings) -> KernelArgs<'a> {
        KernelArgs {
            views: SmallVec::new(),
            merge,
            borrows: BorrowFlags::new(0),
            bindings,
            _memory: PhantomData,
        }
    }

    /// Appends `views` (in argument order) to arguments none of which is borrowed yet.
    ///
    /// # Safety
    ///
    /// As [`KernelArgs::new`], for every view these arguments then hold.
    #[inline]
    pub(crate) unsafe fn extend_views(&mut self, views: impl IntoIterator<Item = ArgView>) {
        self.views.extend(views);
        self.borrows = BorrowFlags::new(self.views.len());
    }

    /// These arguments with the values of the routine's indices (the plan's snapshot).
    /// Safe: the values are plain numbers.
    pub fn with_bindings(mut self, bindings: Bindings) -> KernelArgs<'a> {
        self.bindings = bindings;
        self
    }

    /// The value of the routine's index `name`, as given when it was scheduled
    /// ([`RoutineSpec::with_index`](super::RoutineSpec::with_index)); it fits the index's
    /// declared type. [`ArgError::UnknownIndex`] if the routine declares no such index.
    pub fn index(&self, name: &str) -> Result<i64, ArgError> {
        match self.bindings.iter().find(|(d, _)| d.name() == name) {
            Some((_, Some(v))) => Ok(v),
            Some((d, None)) => Err(ArgError::UnboundIndex {
                name: d.name().to_string(),
            }),
            None => Err(ArgError::UnknownIndex {
                name: name.to_string(),
                declared: self
                    .bindings
                    .decls()
                    .iter()
                    .map(|d| d.name())
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
        }
    }

    /// Every index value, with its declaration, in declaration order.
    pub fn bindings(&self) -> &Bindings {
        &self.bindings
    }

    /// Number of parameters.
    pub fn len(&self) -> usize {
        self.views.len()
    }

    /// Whether there are no parameters.
    pub fn is_empty(&self) -> bool {
        self.views.is_empty()
    }

    /// Shape of parameter `i`.
    pub fn shape(&self, i: usize) -> Option<&Shape> {
        self.views.get(i).map(|v| &v.shape)
    }

    /// Dtype of parameter `i`.
    pub fn dtype(&self, i: usize) -> Option<DType> {
        self.views.get(i).map(|v| v.dtype)
    }

    /// Declared access of parameter `i`.
    pub fn access(&self, i: usize) -> Option<Access> {
        self.views.get(i).map(|v| v.access)
    }

    /// Whether a merge buffer is present.
    pub fn has_merge(&self) -> bool {
        self.merge.is_some()
    }

    /// Shape of the merge buffer's node.
    pub fn merge_shape(&self) -> Option<&Shape> {
        self.merge.as_ref().map(|v| &v.shape)
    }

    /// Dtype of the merge buffer's node.
    pub fn merge_dtype(&self) -> Option<DType> {
        self.merge.as_ref().map(|v| v.dtype)
    }

    fn view(&self, i: usize) -> Result<(&ArgView, &Cell<Borrow>), ArgError> {
        self.views
            .get(i)
            .zip(self.borrows.get(i))
            .ok_or(ArgError::Missing {
                slot: ArgSlot::Param(i),
                len: self.views.len(),
            })
    }

    fn merge_view(&self) -> Result<&ArgView, ArgError> {
        self.merge.as_ref().ok_or(ArgError::Missing {
            slot: ArgSlot::Merge,
            len: self.views.len(),
        })
    }

    /// Checks access and flags for a shared borrow of parameter `i`.
    fn begin_shared(&self, i: usize) -> Result<(&ArgView, &Cell<Borrow>), ArgError> {
        let (view, flag) = self.view(i)?;
        let slot = ArgSlot::Param(i);
        if !view.access.reads() {
            return Err(ArgError::Access {
                slot,
                access: view.access,
                wanted: "read",
            });
        }
        if flag.get() == Borrow::Mutable {
            return Err(ArgError::Borrowed {
                slot,
                mutably: true,
            });
        }
        Ok((view, flag))
    }

    /// Checks access and flags for a mutable borrow of parameter `i`.
    fn begin_mut(&self, i: usize) -> Result<(&ArgView, &Cell<Borrow>), ArgError> {
        let (view, flag) = self.view(i)?;
        let slot = ArgSlot::Param(i);
        if !view.access.writes() {
            return Err(ArgError::Access {
                slot,
                access: view.access,
                wanted: "written",
            });
        }
        match flag.get() {
            Borrow::Free => Ok((view, flag)),
            b => Err(ArgError::Borrowed {
                slot,
                mutably: b == Borrow::Mutable,
            }),
        }
    }

    /// Parameter `i` as a shared slice; it must be `Read` or `ReadWrite` and hold `T`.
    pub fn input<T: Element>(&self, i: usize) -> Result<&[T], ArgError> {
        let (view, flag) = self.begin_shared(i)?;
        let c = check_view::<T>(view, ArgSlot::Param(i))?;
        flag.set(Borrow::Shared);
        // SAFETY: `check_view` checked that the pointer is non-null and aligned for `T`
        // (or dangling for an empty view) and that `len` elements of `T` span exactly
        // `view.bytes` bytes; the caller of `new` guarantees those bytes are initialised
        // and readable for 'a, which outlives `&self`, and that nothing else writes them;
        // every bit pattern is a valid `T` (the sealed `Element` types are plain numbers).
        // The flag is now `Shared` and is never reset, so this value never lends the
        // parameter mutably while the slice lives.
        Ok(unsafe { slice::from_raw_parts(c.ptr.as_ptr(), c.len) })
    }

    /// Parameter `i` as a mutable slice; it must be `Write` or `ReadWrite` and hold `T`,
    /// and must not have been borrowed before in this call.
    #[allow(clippy::mut_from_ref)] // exclusivity is enforced by the borrow flag
    pub fn output<T: Element>(&self, i: usize) -> Result<&mut [T], ArgError> {
        let (view, flag) = self.begin_mut(i)?;
        let c = check_view::<T>(view, ArgSlot::Param(i))?;
        flag.set(Borrow::Mutable);
        // SAFETY: as in `input`, the pointer is aligned and spans `len` initialised
        // elements; the caller of `new` guarantees they are writable and that nothing else
        // (no other view, not the merge view, nothing outside the kernel) accesses them for
        // 'a. The flag was `Free` and is now `Mutable` forever, so this is the only slice
        // of this parameter this value ever hands out.
        Ok(unsafe { slice::from_raw_parts_mut(c.ptr.as_ptr(), c.len) })
    }

    /// The merge buffer as a shared slice of `T`.
    pub fn merge<T: Element>(&self) -> Result<&[T], ArgError> {
        let view = self.merge_view()?;
        let c = check_view::<T>(view, ArgSlot::Merge)?;
        // SAFETY: checked as in `input`; the caller of `new` guarantees the merge bytes are
        // readable for 'a and overlap no view that may be written, and the merge view is
        // only ever lent shared.
        Ok(unsafe { slice::from_raw_parts(c.ptr.as_ptr(), c.len) })
    }

    /// Parameter `i` as raw bytes (any dtype); same rules as [`KernelArgs::input`].
    pub fn input_bytes(&self, i: usize) -> Result<&[u8], ArgError> {
        let (view, flag) = self.begin_shared(i)?;
        let (ptr, _) = check_raw(view, ArgSlot::Param(i), view.dtype.size_in_bytes(), 1)?;
        flag.set(Borrow::Shared);
        // SAFETY: `check_raw` checked the pointer is non-null (or dangling for an empty
        // view) and that whole elements of the dtype span `view.bytes`, so the slice covers
        // exactly the view's bytes, which the caller of `new` guarantees are initialised
        // and readable for 'a; u8 has no alignment requirement. Flags as in `input`.
        Ok(unsafe { slice::from_raw_parts(byte_start(ptr).as_ptr(), view.bytes) })
    }

    /// Parameter `i` as raw mutable bytes (any dtype); same rules as [`KernelArgs::output`].
    #[allow(clippy::mut_from_ref)] // exclusivity is enforced by the borrow flag
    pub fn output_bytes(&self, i: usize) -> Result<&mut [u8], ArgError> {
        let (view, flag) = self.begin_mut(i)?;
        let (ptr, _) = check_raw(view, ArgSlot::Param(i), view.dtype.size_in_bytes(), 1)?;
        flag.set(Borrow::Mutable);
        // SAFETY: as in `input_bytes` for validity; exclusivity as in `output`.
        Ok(unsafe { slice::from_raw_parts_mut(byte_start(ptr).as_ptr(), view.bytes) })
    }

    /// The merge buffer as raw bytes.
    pub fn merge_bytes(&self) -> Result<&[u8], ArgError> {
        let view = self.merge_view()?;
        let (ptr, _) = check_raw(view, ArgSlot::Merge, view.dtype.size_in_bytes(), 1)?;
        // SAFETY: as in `input_bytes`; the merge view is only ever lent shared.
        Ok(unsafe { slice::from_raw_parts(byte_start(ptr).as_ptr(), view.bytes) })
    }
}

/// The bytes of `data` in native byte order.
pub fn to_bytes<T: Element>(data: &[T]) -> Vec<u8> {
    bytemuck::cast_slice::<T, u8>(data).to_vec()
}

/// Elements of `T` read from bytes in native byte order; the length must be a whole
/// number of elements. Any alignment of `bytes` is accepted.
pub fn from_bytes<T: Element>(bytes: &[u8]) -> Result<Vec<T>, ArgError> {
    let size = mem::size_of::<T>();
    if size == 0 || size != T::DTYPE.size_in_bytes() || bytes.len() % size != 0 {
        return Err(ArgError::BadLength {
            bytes: bytes.len(),
            dtype: T::DTYPE,
        });
    }
    // Copies into a fresh, aligned vector: `bytes` itself may have any alignment.
    Ok(bytemuck::pod_collect_to_vec::<u8, T>(bytes))
}

#[cfg(all(test, not(tributary_loom)))]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn view_of(buf: &mut [u64], dtype: DType, n: usize, access: Access) -> ArgView {
        assert!(n * dtype.size_in_bytes() <= buf.len() * 8);
        ArgView {
            ptr: buf.as_mut_ptr().cast(),
            bytes: n * dtype.size_in_bytes(),
            dtype,
            shape: Shape::from([n]),
            access,
        }
    }

    /// Past the inline flags (more arguments than `INLINE_FLAGS`) the flags live on the
    /// heap and refuse aliasing the same way, for the first and the last argument.
    #[test]
    fn borrow_flags_of_many_arguments_refuse_aliasing() {
        for n in [INLINE_FLAGS, INLINE_FLAGS + 4] {
            let mut bufs: Vec<Vec<u64>> = (0..n).map(|_| vec![0u64; 1]).collect();
            let views: Vec<ArgView> = bufs
                .iter_mut()
                .map(|b| view_of(b, DType::I32, 2, Access::Write))
                .collect();
            // SAFETY: `n` distinct live vectors, each large enough, outliving `args`.
            let args = unsafe { KernelArgs::new(views, None) };
            for i in [0, n - 1] {
                args.output::<i32>(i).unwrap()[0] = 7;
                assert!(
                    matches!(
                        args.output::<i32>(i),
                        Err(ArgError::Borrowed { mutably: true, .. })
                    ),
                    "argument {i} of {n} borrowed mutably twice"
                );
            }
            assert!(matches!(
                args.output::<i32>(n),
                Err(ArgError::Missing { len, .. }) if len == n
            ));
        }
    }

    #[test]
    fn borrow_flags_refuse_aliasing() {
        let mut a = vec![0u64; 2];
        let mut b = vec![0u64; 2];
        let mut c = vec![0u64; 2];
        let views = vec![
            view_of(&mut a, DType::F32, 4, Access::ReadWrite),
            view_of(&mut b, DType::F32, 4, Access::Write),
            view_of(&mut c, DType::F32, 4, Access::Read),
        ];
        // SAFETY: three distinct live vectors, each large enough, outliving `args`.
        let args = unsafe { KernelArgs::new(views, None) };
        // ReadWrite: shared first, then mutable is refused.
        let r = args.input::<f32>(0).unwrap();
        assert_eq!(r.len(), 4);
        assert_eq!(
            args.output::<f32>(0).unwrap_err(),
            ArgError::Borrowed {
                slot: ArgSlot::Param(0),
                mutably: false
            }
        );
        // Several shared borrows are fine.
        assert!(args.input::<f32>(0).is_ok());
        // Write: mutable once, then neither mutable nor shared again.
        let w = args.output::<f32>(1).unwrap();
        w[0] = 1.0;
        assert!(matches!(
            args.output::<f32>(1),
            Err(ArgError::Borrowed { mutably: true, .. })
        ));
        assert!(matches!(
            args.output_bytes(1),
            Err(ArgError::Borrowed { mutably: true, .. })
        ));
        // Write-only cannot be read, Read cannot be written.
        assert!(matches!(args.input::<f32>(1), Err(ArgError::Access { .. })));
        assert!(matches!(
            args.output::<f32>(2),
            Err(ArgError::Access { .. })
        ));
        // Wrong dtype, missing argument, missing merge.
        assert!(matches!(args.input::<f64>(2), Err(ArgError::DType { .. })));
        assert!(matches!(
            args.input::<f32>(3),
            Err(ArgError::Missing { .. })
        ));
        assert!(matches!(args.merge::<f32>(), Err(ArgError::Missing { .. })));
        assert_eq!(args.len(), 3);
        assert_eq!(args.dtype(2), Some(DType::F32));
        assert_eq!(args.shape(1), Some(&Shape::from([4])));
        assert_eq!(args.access(0), Some(Access::ReadWrite));
        assert_eq!(args.dtype(7), None);
    }

    #[test]
    fn refused_borrow_does_not_set_the_flag() {
        let mut a = vec![0u64; 2];
        let views = vec![view_of(&mut a, DType::F32, 4, Access::ReadWrite)];
        // SAFETY: one live vector, large enough, outliving `args`.
        let args = unsafe { KernelArgs::new(views, None) };
        assert!(args.output::<i32>(0).is_err());
        assert!(args.input::<f64>(0).is_err());
        assert!(args.output::<f32>(0).is_ok());
    }

    #[test]
    fn bad_views_are_errors() {
        let mut a = vec![0u64; 4];
        // Size disagrees with the shape.
        let mut v = view_of(&mut a, DType::F32, 4, Access::Read);
        v.bytes = 12;
        // Misaligned pointer.
        let mut m = view_of(&mut a, DType::F32, 2, Access::Read);
        // SAFETY: one byte into a 32-byte buffer.
        m.ptr = unsafe { m.ptr.add(1) };
        // Null pointer.
        let mut z = view_of(&mut a, DType::U8, 3, Access::Read);
        z.ptr = std::ptr::null_mut();
        // Empty views are fine even with a null pointer.
        let e = ArgView {
            ptr: std::ptr::null_mut(),
            bytes: 0,
            dtype: DType::F64,
            shape: Shape::from([0, 3]),
            access: Access::Read,
        };
        // SAFETY: every non-empty view lies in `a` (read-only views may overlap), which
        // outlives `args`; the checks refuse the malformed ones before any access.
        let args = unsafe { KernelArgs::new(vec![v, m, z, e], None) };
        assert!(matches!(
            args.input::<f32>(0),
            Err(ArgError::BadView { .. })
        ));
        assert!(matches!(
            args.input::<f32>(1),
            Err(ArgError::BadView { .. })
        ));
        // Bytes have no alignment requirement.
        assert_eq!(args.input_bytes(1).unwrap().len(), 8);
        assert!(matches!(args.input::<u8>(2), Err(ArgError::BadView { .. })));
        assert_eq!(args.input::<f64>(3).unwrap(), &[] as &[f64]);
        assert!(args.input_bytes(3).unwrap().is_empty());
    }

    #[test]
    fn merge_view_is_read_only_and_shared() {
        let mut a = vec![0u64; 1];
        let mut g = vec![0u64; 1];
        g[0] = f64::to_bits(2.5);
        let views = vec![view_of(&mut a, DType::F64, 1, Access::ReadWrite)];
        let merge = view_of(&mut g, DType::F64, 1, Access::Write);
        // SAFETY: two distinct live vectors outliving `args`.
        let args = unsafe { KernelArgs::new(views, Some(merge)) };
        assert_eq!(args.merge::<f64>().unwrap(), &[2.5]);
        assert_eq!(args.merge::<f64>().unwrap(), &[2.5]);
        assert_eq!(args.merge_bytes().unwrap().len(), 8);
        assert_eq!(args.merge_dtype(), Some(DType::F64));
        assert!(args.has_merge());
        assert!(matches!(args.merge::<f32>(), Err(ArgError::DType { .. })));
    }

    #[test]
    fn byte_round_trips() {
        let xs = [1.5f32, -0.0, f32::INFINITY];
        let b = to_bytes(&xs);
        assert_eq!(b.len(), 12);
        assert_eq!(from_bytes::<f32>(&b).unwrap(), xs);
        // Unaligned source.
        let mut shifted = vec![0u8];
        shifted.extend_from_slice(&b);
        assert_eq!(from_bytes::<f32>(&shifted[1..]).unwrap(), xs);
        assert!(matches!(
            from_bytes::<f64>(&b),
            Err(ArgError::BadLength { bytes: 12, .. })
        ));
    }
}
