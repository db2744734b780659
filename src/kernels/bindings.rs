//! Per-schedule bindings: values of a routine's named integer indices, given at each schedule.
//! See DESIGN.md §2, "Bindings".
//!
//! A routine declares its indices with [`RoutineSpec::with_index`]. Each schedule gives their
//! values, as [`Engine::schedule_with`] does. The values are snapshotted into the plan, since
//! [`Work::Run`] carries a [`Bindings`]. Nothing reads them when the routine runs.
//!
//! A CPU closure reads the values with [`KernelArgs::index`]. A [`ShaderKernel`] gets them as
//! push constants after its own immediates, and a [`CudaKernel`] as launch arguments after its
//! scalars. Values are `i64`, and each must fit its index's [`IndexType`].
//!
//! A [`Bindings`] holds at most [`MAX_INDICES`] values inline and shares the routine's
//! declarations by reference count. Building, reusing and snapshotting one allocates nothing.
//!
//! [`RoutineSpec::with_index`]: super::RoutineSpec::with_index
//! [`Engine::schedule_with`]: crate::Engine::schedule_with
//! [`Work::Run`]: crate::protocol::Work::Run
//! [`KernelArgs::index`]: super::KernelArgs::index
//! [`ShaderKernel`]: super::ShaderKernel
//! [`CudaKernel`]: super::CudaKernel

use std::{fmt, sync::Arc};

use crate::error::{Error, Result};

/// The most indices one routine may declare (their values live inline in every plan).
pub const MAX_INDICES: usize = 8;

pub use crate::param::IndexType;

/// One declared index of a routine: its name and type.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct IndexDecl {
    name: Arc<str>,
    ty: IndexType,
}

impl IndexDecl {
    pub(crate) fn new(name: &str, ty: IndexType) -> IndexDecl {
        IndexDecl {
            name: name.into(),
            ty,
        }
    }

    /// The index's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its type.
    pub fn ty(&self) -> IndexType {
        self.ty
    }
}

/// The declarations of a linked routine (or of a spec), shared by every [`Bindings`] made
/// for it.
#[derive(Debug, PartialEq, Eq)]
struct IndexSet {
    routine: Arc<str>,
    decls: Box<[IndexDecl]>,
}

/// Values for the indices a routine declares, in declaration order: what one schedule
/// snapshots into its plan.
///
/// Made from a routine ([`Routine::bindings`], [`Routine::bind`]) or a spec
/// ([`RoutineSpec::bindings`]); [`Bindings::set`] checks the name and the range at once.
/// It is cheap to keep and refill every step: the values are inline, the declarations
/// shared.
///
/// ```
/// use tributary::kernels::{Access, IndexType, RoutineSpec};
/// use tributary::{DType, Engine, EngineConfig, Error, TensorNode};
/// let mut e = Engine::cpu(EngineConfig::default())?;
/// let y = TensorNode::new("y", DType::I32, [4]);
/// let spec = RoutineSpec::custom("y = t + base", vec![(y.clone(), Access::Write)], None, |a| {
///     let v = (a.index("t")? + a.index("base")?) as i32;
///     a.output::<i32>(0)?.fill(v);
///     Ok(())
/// })?
/// .with_index("t")?
/// .with_index_typed("base", IndexType::I32)?;
/// let root = e.context(0, 0)?;
/// let r = e.link(&root, spec)?;
/// let mut b = r.bindings();
/// b.set("base", -100)?;
/// for step in 0..3 {
///     b.set("t", step)?; // reused every step: no allocation
///     e.schedule_with(&r, &b)?;
/// }
/// e.sync_all()?;
/// assert_eq!(e.read::<i32>(r.context(), &y)?, vec![-98; 4]);
/// assert!(matches!(b.set("t", -1), Err(Error::BindingOutOfRange { value: -1, .. })));
/// assert!(matches!(b.set("s", 1), Err(Error::UnknownBinding { .. })));
/// # Ok::<(), Error>(())
/// ```
///
/// [`Routine::bindings`]: crate::protocol::Routine::bindings
/// [`Routine::bind`]: crate::protocol::Routine::bind
/// [`RoutineSpec::bindings`]: super::RoutineSpec::bindings
#[derive(Clone)]
pub struct Bindings {
    /// `None`: no declared index (a routine without indices, or [`Bindings::none`]).
    set: Option<Arc<IndexSet>>,
    values: [i64; MAX_INDICES],
    /// Bit `i`: index `i` has a value.
    given: u16,
}

impl Bindings {
    /// No values, for no declared index: what [`Engine::schedule`] gives.
    ///
    /// [`Engine::schedule`]: crate::Engine::schedule
    pub const fn none() -> Bindings {
        Bindings {
            set: None,
            values: [0; MAX_INDICES],
            given: 0,
        }
    }

    /// Empty bindings for `decls` of `routine` (no value given yet).
    pub(crate) fn empty_for(routine: &str, decls: &[IndexDecl]) -> Bindings {
        Bindings {
            set: Some(Arc::new(IndexSet {
                routine: routine.into(),
                decls: decls.into(),
            })),
            ..Bindings::none()
        }
    }

    /// Whether `other` gives the same indices the same values (what a kernel reads of them).
    #[cfg_attr(not(any(feature = "vulkan", feature = "cuda")), allow(dead_code))] // the GPU streams use it
    pub(crate) fn same_values(&self, other: &Bindings) -> bool {
        self.given == other.given && self.values == other.values
    }

    /// The declared indices, in order.
    pub fn decls(&self) -> &[IndexDecl] {
        self.set.as_ref().map_or(&[], |s| &s.decls)
    }

    /// The routine's name (empty for [`Bindings::none`]).
    pub fn routine(&self) -> &str {
        self.set.as_ref().map_or("", |s| &s.routine)
    }

    /// Number of declared indices.
    pub fn len(&self) -> usize {
        self.decls().len()
    }

    /// Whether no index is declared.
    pub fn is_empty(&self) -> bool {
        self.decls().is_empty()
    }

    /// Whether every declared index has a value.
    pub fn is_complete(&self) -> bool {
        self.missing().is_none()
    }

    /// The first declared index without a value.
    fn missing(&self) -> Option<&IndexDecl> {
        self.decls()
            .iter()
            .enumerate()
            .find(|(i, _)| self.given & (1 << i) == 0)
            .map(|(_, d)| d)
    }

    /// The value of index `name`, if declared and given.
    pub fn get(&self, name: &str) -> Option<i64> {
        self.position(name).and_then(|i| self.value_at(i))
    }

    /// The value of the `i`-th declared index, if given.
    pub fn value_at(&self, i: usize) -> Option<i64> {
        (i < self.len() && self.given & (1 << i) != 0).then(|| self.values[i])
    }

    /// Declared indices with their values (`None`: not given), in order.
    pub fn iter(&self) -> impl Iterator<Item = (&IndexDecl, Option<i64>)> + '_ {
        self.decls()
            .iter()
            .enumerate()
            .map(|(i, d)| (d, self.value_at(i)))
    }

    /// The position of index `name` among the declared ones.
    pub(crate) fn position(&self, name: &str) -> Option<usize> {
        self.decls().iter().position(|d| &*d.name == name)
    }

    /// Gives the `i`-th declared index `value`, which the caller checked fits its type
    /// (nothing happens past the declared indices).
    pub(crate) fn set_at(&mut self, i: usize, value: i64) {
        if i < self.len() {
            self.values[i] = value;
            self.given |= 1 << i;
        }
    }

    /// Whether both declare the same indices (the same list, shared by every value set of
    /// one routine, compared by pointer before by content).
    pub(crate) fn same_decls(&self, other: &Bindings) -> bool {
        match (&self.set, &other.set) {
            (Some(a), Some(b)) if Arc::ptr_eq(a, b) => true,
            _ => self.decls() == other.decls(),
        }
    }

    fn declared_list(&self) -> String {
        let names: Vec<String> = self
            .decls()
            .iter()
            .map(|d| format!("{}: {}", d.name, d.ty))
            .collect();
        if names.is_empty() {
            "none".to_string()
        } else {
            names.join(", ")
        }
    }

    /// Gives index `name` the value `value` (replacing an earlier one).
    /// [`Error::UnknownBinding`] if the routine declares no such index,
    /// [`Error::BindingOutOfRange`] if `value` does not fit its type; on error nothing
    /// changes.
    pub fn set(&mut self, name: &str, value: i64) -> Result<&mut Bindings> {
        let i = self.checked_position(name, value)?;
        self.set_at(i, value);
        Ok(self)
    }

    /// [`Bindings::set`], by value (for chaining).
    pub fn with(mut self, name: &str, value: i64) -> Result<Bindings> {
        self.set(name, value)?;
        Ok(self)
    }

    /// The position of `name`, after checking that `value` fits its type.
    fn checked_position(&self, name: &str, value: i64) -> Result<usize> {
        let i = self.position(name).ok_or_else(|| Error::UnknownBinding {
            routine: self.routine().to_string(),
            binding: name.to_string(),
            value,
            declared: self.declared_list(),
        })?;
        let ty = self.decls()[i].ty;
        if !ty.contains(value) {
            return Err(Error::BindingOutOfRange {
                routine: self.routine().to_string(),
                binding: name.to_string(),
                value,
                ty,
            });
        }
        Ok(i)
    }

    /// These bindings filled from `pairs`: every name declared, none twice, every value
    /// in range, every declared index given.
    fn filled_from(mut self, pairs: &[(&str, i64)]) -> Result<Bindings> {
        for &(name, value) in pairs {
            let i = self.checked_position(name, value)?;
            if self.given & (1 << i) != 0 {
                return Err(Error::DuplicateBinding {
                    routine: self.routine().to_string(),
                    binding: name.to_string(),
                    first: self.values[i],
                    second: value,
                });
            }
            self.values[i] = value;
            self.given |= 1 << i;
        }
        self.complete()
    }

    /// `self` if every declared index has a value, else [`Error::MissingBinding`].
    pub(crate) fn complete(self) -> Result<Bindings> {
        match self.missing() {
            None => Ok(self),
            Some(d) => Err(Error::MissingBinding {
                routine: self.routine().to_string(),
                binding: d.name.to_string(),
                declared: self.declared_list(),
            }),
        }
    }

    /// `given`, checked against the declarations of `self` (empty bindings of a routine):
    /// the same declarations take the values as they are, others are matched by name.
    fn adopt(self, given: &Bindings) -> Result<Bindings> {
        let same = match (&self.set, &given.set) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b) || a.decls == b.decls,
            (None, None) => true,
            _ => false,
        };
        if same {
            return Bindings {
                values: given.values,
                given: given.given,
                ..self
            }
            .complete();
        }
        let mut pairs: [(&str, i64); MAX_INDICES] = [("", 0); MAX_INDICES];
        let mut n = 0;
        for (d, v) in given.iter() {
            if let Some(v) = v {
                pairs[n] = (d.name(), v);
                n += 1;
            }
        }
        self.filled_from(&pairs[..n])
    }

    /// The values in declaration order (an index without a value reads 0: see
    /// [`Bindings::is_complete`]).
    pub fn values(&self) -> &[i64] {
        &self.values[..self.len()]
    }
}

impl Default for Bindings {
    fn default() -> Bindings {
        Bindings::none()
    }
}

impl fmt::Debug for Bindings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut m = f.debug_map();
        for (d, v) in self.iter() {
            match v {
                Some(v) => m.entry(&d.name(), &v),
                None => m.entry(&d.name(), &"unset"),
            };
        }
        m.finish()
    }
}

/// What a schedule accepts as values for a routine's indices: a [`Bindings`] (owned or
/// borrowed) or name-value pairs (`&[("t", 3)]`).
///
/// Pairs are checked all at once: an undeclared name is [`Error::UnknownBinding`], a name
/// given twice [`Error::DuplicateBinding`], a value outside its type
/// [`Error::BindingOutOfRange`], a declared index left out [`Error::MissingBinding`].
/// A [`Bindings`] made for another routine is matched by name the same way.
pub trait IntoBindings {
    /// The complete bindings for the routine whose empty bindings are `empty`.
    fn into_bindings(self, empty: Bindings) -> Result<Bindings>;
}

impl IntoBindings for &[(&str, i64)] {
    fn into_bindings(self, empty: Bindings) -> Result<Bindings> {
        empty.filled_from(self)
    }
}

impl<const N: usize> IntoBindings for &[(&str, i64); N] {
    fn into_bindings(self, empty: Bindings) -> Result<Bindings> {
        empty.filled_from(self)
    }
}

impl IntoBindings for &Bindings {
    fn into_bindings(self, empty: Bindings) -> Result<Bindings> {
        empty.adopt(self)
    }
}

impl IntoBindings for Bindings {
    fn into_bindings(self, empty: Bindings) -> Result<Bindings> {
        empty.adopt(&self)
    }
}

#[cfg(all(test, not(tributary_loom)))]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn empty() -> Bindings {
        Bindings::empty_for(
            "r",
            &[
                IndexDecl::new("t", IndexType::U32),
                IndexDecl::new("o", IndexType::I32),
                IndexDecl::new("w", IndexType::I64),
            ],
        )
    }

    #[test]
    fn pairs_are_checked_all_at_once() {
        let b = (&[("o", -5), ("t", 7), ("w", i64::MIN)])
            .into_bindings(empty())
            .unwrap();
        assert_eq!(b.values(), &[7, -5, i64::MIN]);
        assert_eq!(b.get("o"), Some(-5));
        assert_eq!(b.get("x"), None);
        match (&[("t", 1), ("o", 2)]).into_bindings(empty()) {
            Err(Error::MissingBinding {
                routine, binding, ..
            }) => assert_eq!((routine.as_str(), binding.as_str()), ("r", "w")),
            other => panic!("{other:?}"),
        }
        match (&[("t", 1), ("t", 2)]).into_bindings(empty()) {
            Err(Error::DuplicateBinding {
                binding,
                first,
                second,
                ..
            }) => assert_eq!((binding.as_str(), first, second), ("t", 1, 2)),
            other => panic!("{other:?}"),
        }
        match (&[("q", 9)]).into_bindings(empty()) {
            Err(Error::UnknownBinding {
                binding,
                value,
                declared,
                ..
            }) => {
                assert_eq!((binding.as_str(), value), ("q", 9));
                assert_eq!(declared, "t: u32, o: i32, w: i64");
            }
            other => panic!("{other:?}"),
        }
        match (&[("t", -1)]).into_bindings(empty()) {
            Err(Error::BindingOutOfRange {
                binding, value, ty, ..
            }) => assert_eq!((binding.as_str(), value, ty), ("t", -1, IndexType::U32)),
            other => panic!("{other:?}"),
        }
        match (&[("o", 1 << 31)]).into_bindings(empty()) {
            Err(Error::BindingOutOfRange { ty, .. }) => assert_eq!(ty, IndexType::I32),
            other => panic!("{other:?}"),
        }
        // No indices: empty pairs are complete, any pair is unknown.
        assert!((&[] as &[(&str, i64)])
            .into_bindings(Bindings::none())
            .unwrap()
            .is_empty());
        assert!(matches!(
            (&[("t", 1)]).into_bindings(Bindings::none()),
            Err(Error::UnknownBinding { .. })
        ));
    }

    #[test]
    fn set_refuses_without_changing_anything() {
        let mut b = empty();
        b.set("t", 3).unwrap().set("o", -3).unwrap();
        assert!(!b.is_complete());
        assert!(b.set("t", u32::MAX as i64 + 1).is_err());
        assert!(b.set("nope", 0).is_err());
        assert_eq!(b.get("t"), Some(3));
        assert_eq!(b.value_at(2), None);
        b.set("w", 1).unwrap();
        assert!(b.is_complete());
        assert_eq!(format!("{b:?}"), r#"{"t": 3, "o": -3, "w": 1}"#);
    }

    #[test]
    fn bindings_of_another_routine_are_matched_by_name() {
        let mine = empty();
        let b =
            (&mine.clone().with("t", 1).unwrap().with("o", 2).unwrap()).into_bindings(mine.clone());
        assert!(matches!(b, Err(Error::MissingBinding { .. })));
        // Same declarations, other routine value: taken as they are.
        let full = empty()
            .with("t", 1)
            .unwrap()
            .with("o", 2)
            .unwrap()
            .with("w", 3)
            .unwrap();
        assert_eq!(
            full.into_bindings(mine.clone()).unwrap().values(),
            &[1, 2, 3]
        );
        // Other declarations: by name.
        let other = Bindings::empty_for(
            "s",
            &[
                IndexDecl::new("w", IndexType::I64),
                IndexDecl::new("t", IndexType::I64),
                IndexDecl::new("o", IndexType::I64),
            ],
        );
        let b = other
            .clone()
            .with("w", 9)
            .unwrap()
            .with("t", 8)
            .unwrap()
            .with("o", 7)
            .unwrap();
        assert_eq!(
            (&b).into_bindings(mine.clone()).unwrap().values(),
            &[8, 7, 9]
        );
        // A value out of the routine's range is refused there.
        let b = other.with("w", 0).unwrap().with("t", -8).unwrap();
        assert!(matches!(
            b.into_bindings(mine.clone()),
            Err(Error::BindingOutOfRange { value: -8, .. })
        ));
        // None given for a routine with indices: missing.
        assert!(matches!(
            Bindings::none().into_bindings(mine),
            Err(Error::MissingBinding { .. })
        ));
    }
}
