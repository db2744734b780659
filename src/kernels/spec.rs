//! Routine specs: a kernel with the nodes it touches, in argument order, and the indices
//! each schedule gives values to.

use std::collections::HashSet;

use super::{
    bindings::{Bindings, IndexDecl, IndexType, MAX_INDICES},
    CpuKernel, CudaKernel, Kernel, KernelArgs, ShaderKernel,
};
use crate::{
    error::{Error, Result},
    node::TensorNode,
};

pub use crate::param::Access;

/// One argument of a routine: a node and how the routine uses it.
#[derive(Clone, Debug)]
pub struct Param {
    /// The node.
    pub node: TensorNode,
    /// How it is used.
    pub access: Access,
}

/// A kernel with the nodes it touches, in argument order. Linking it into a context gives
/// a routine.
///
/// Invariants (checked by [`RoutineSpec::new`]): at least one parameter, and no node twice
/// among the parameters. The merge node may also be a parameter (`g += merge(g)`).
/// Declared indices ([`RoutineSpec::with_index`]): at most [`MAX_INDICES`], distinct
/// names, none on a built-in.
#[derive(Clone, Debug)]
pub struct RoutineSpec {
    /// The routine's name (in traces and failures).
    pub name: String,
    /// The nodes, in argument order.
    pub params: Vec<Param>,
    /// The node the routine expects in its stream's merge buffer, if it reads it.
    pub merge: Option<TensorNode>,
    /// What it computes.
    pub kernel: Kernel,
    /// Its declared indices, in order (values given per schedule).
    indices: Vec<IndexDecl>,
}

impl RoutineSpec {
    /// Builds a spec; [`Error::InvalidRoutine`] when `params` is empty or names a node twice.
    ///
    /// Built-in kernels are not checked against the parameters here; use the constructor
    /// functions of [`crate::kernels`], which do.
    pub fn new(
        name: impl Into<String>,
        params: Vec<Param>,
        merge: Option<TensorNode>,
        kernel: Kernel,
    ) -> Result<RoutineSpec> {
        let name = name.into();
        if params.is_empty() {
            return Err(Error::InvalidRoutine {
                routine: name,
                reason: "a routine needs at least one parameter".to_string(),
            });
        }
        let mut seen = HashSet::with_capacity(params.len());
        for p in &params {
            if !seen.insert(p.node.id()) {
                return Err(Error::InvalidRoutine {
                    reason: format!("node {} appears twice among its parameters", p.node),
                    routine: name,
                });
            }
        }
        Ok(RoutineSpec {
            name,
            params,
            merge,
            kernel,
            indices: Vec::new(),
        })
    }

    /// Declares an integer index `name` of type [`IndexType::U32`], whose value each
    /// schedule gives ([`Engine::schedule_with`](crate::Engine::schedule_with)); see
    /// [`RoutineSpec::with_index_typed`].
    ///
    /// ```
    /// use tributary::kernels::{Access, RoutineSpec};
    /// use tributary::{DType, Engine, EngineConfig, Error, TensorNode};
    /// let mut e = Engine::cpu(EngineConfig::default())?;
    /// let y = TensorNode::new("y", DType::U8, [4]);
    /// let spec = RoutineSpec::custom("y = t", vec![(y.clone(), Access::Write)], None, |a| {
    ///     let t = a.index("t")?;
    ///     a.output::<u8>(0)?.fill(t as u8);
    ///     Ok(())
    /// })?
    /// .with_index("t")?;
    /// let root = e.context(0, 0)?;
    /// let r = e.link(&root, spec)?;
    /// e.schedule_with(&r, &[("t", 7)])?;
    /// assert_eq!(e.read::<u8>(r.context(), &y)?, vec![7; 4]);
    /// // A routine with indices cannot be scheduled without their values.
    /// assert!(matches!(e.schedule(&r), Err(Error::MissingBinding { .. })));
    /// # Ok::<(), Error>(())
    /// ```
    pub fn with_index(self, name: &str) -> Result<RoutineSpec> {
        self.with_index_typed(name, IndexType::U32)
    }

    /// Declares an integer index `name` of type `ty`: a value given per schedule, in
    /// `ty`'s range, snapshotted into the plan when the routine is scheduled (never read
    /// when it runs). A CPU closure reads it with
    /// [`KernelArgs::index`](super::KernelArgs::index), a shader as push constants after
    /// its immediates ([`ShaderKernel`]), a CUDA kernel as arguments after its scalars
    /// ([`CudaKernel`]).
    ///
    /// [`Error::InvalidRoutine`] for an empty or repeated name, more than [`MAX_INDICES`]
    /// indices, or a built-in kernel (built-ins read no index).
    ///
    /// ```
    /// use tributary::kernels::{self, Access, IndexType, RoutineSpec};
    /// use tributary::{DType, Error, TensorNode};
    /// let y = TensorNode::new("y", DType::F32, [4]);
    /// let spec = RoutineSpec::custom("f", vec![(y.clone(), Access::Write)], None, |_| Ok(()))?
    ///     .with_index_typed("offset", IndexType::I64)?;
    /// assert_eq!(spec.indices()[0].name(), "offset");
    /// assert!(matches!(spec.with_index("offset"), Err(Error::InvalidRoutine { .. })));
    /// assert!(matches!(kernels::fill(&y, 1.0)?.with_index("t"), Err(Error::InvalidRoutine { .. })));
    /// # Ok::<(), Error>(())
    /// ```
    pub fn with_index_typed(mut self, name: &str, ty: IndexType) -> Result<RoutineSpec> {
        let reason = if name.is_empty() {
            Some("an index needs a name".to_string())
        } else if self.indices.iter().any(|d| d.name() == name) {
            Some(format!("index {name} is declared twice"))
        } else if self.indices.len() >= MAX_INDICES {
            Some(format!(
                "index {name} is one too many: a routine declares at most {MAX_INDICES}"
            ))
        } else if let Kernel::Builtin(b) = &self.kernel {
            Some(format!(
                "index {name}: the built-in {} reads no index",
                b.name()
            ))
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(Error::InvalidRoutine {
                routine: self.name,
                reason,
            });
        }
        self.indices.push(IndexDecl::new(name, ty));
        Ok(self)
    }

    /// The declared indices, in order.
    pub fn indices(&self) -> &[IndexDecl] {
        &self.indices
    }

    /// Empty bindings for this spec's indices (for [`run_on_host_with`](super::run_on_host_with)).
    pub fn bindings(&self) -> Bindings {
        Bindings::empty_for(&self.name, &self.indices)
    }

    /// A spec running a Rust closure (CPU devices only); see [`RoutineSpec::new`].
    ///
    /// The closure returns `Err(message)` to fail the routine. Argument accesses return
    /// [`ArgError`](super::ArgError), which converts into `String`, so `?` works on them
    /// as on any `Result<_, String>` (no `.map_err(|e| e.to_string())`):
    ///
    /// ```
    /// use tributary::kernels::{self, Access, RoutineSpec};
    /// use tributary::{DType, TensorNode};
    /// let x = TensorNode::new("x", DType::F32, [3]);
    /// let y = TensorNode::new("y", DType::F32, [3]);
    /// let axpy = RoutineSpec::custom(
    ///     "y += 2x",
    ///     vec![(y.clone(), Access::ReadWrite), (x.clone(), Access::Read)],
    ///     None,
    ///     |args| {
    ///         let x = args.input::<f32>(1)?; // ArgError -> String through `?`
    ///         for (y, x) in args.output::<f32>(0)?.iter_mut().zip(x) {
    ///             *y += 2.0 * x;
    ///         }
    ///         if x.is_empty() {
    ///             return Err("nothing to do".into());
    ///         }
    ///         Ok(())
    ///     },
    /// )?;
    /// // Run on plain byte vectors (the CPU interpreter).
    /// let mut bufs = vec![kernels::to_bytes(&[1f32, 1.0, 1.0]), kernels::to_bytes(&[1f32, 2.0, 3.0])];
    /// kernels::run_on_host(&axpy, &mut bufs, None).expect("runs");
    /// assert_eq!(kernels::from_bytes::<f32>(&bufs[0])?, vec![3.0, 5.0, 7.0]);
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn custom(
        name: impl Into<String>,
        params: Vec<(TensorNode, Access)>,
        merge: Option<TensorNode>,
        f: impl Fn(&KernelArgs<'_>) -> Result<(), String> + Send + Sync + 'static,
    ) -> Result<RoutineSpec> {
        let params = params
            .into_iter()
            .map(|(node, access)| Param { node, access })
            .collect();
        RoutineSpec::new(name, params, merge, Kernel::Cpu(CpuKernel::new(f)))
    }

    /// A spec running a compute shader (Vulkan devices only); see [`ShaderKernel`] for the
    /// binding interface and [`RoutineSpec::new`] for the checks.
    pub fn shader(
        name: impl Into<String>,
        params: Vec<(TensorNode, Access)>,
        merge: Option<TensorNode>,
        shader: ShaderKernel,
    ) -> Result<RoutineSpec> {
        let params = params
            .into_iter()
            .map(|(node, access)| Param { node, access })
            .collect();
        RoutineSpec::new(name, params, merge, Kernel::Shader(shader))
    }

    /// A spec running a CUDA kernel (CUDA devices only); see [`CudaKernel`] for the
    /// parameter interface and [`RoutineSpec::new`] for the checks.
    pub fn cuda(
        name: impl Into<String>,
        params: Vec<(TensorNode, Access)>,
        merge: Option<TensorNode>,
        kernel: CudaKernel,
    ) -> Result<RoutineSpec> {
        let params = params
            .into_iter()
            .map(|(node, access)| Param { node, access })
            .collect();
        RoutineSpec::new(name, params, merge, Kernel::Cuda(kernel))
    }

    /// The nodes it reads (`Read` or `ReadWrite`), in argument order. The merge node is
    /// not among them unless it is also a parameter.
    pub fn inputs(&self) -> impl Iterator<Item = &TensorNode> {
        self.params
            .iter()
            .filter(|p| p.access.reads())
            .map(|p| &p.node)
    }

    /// The nodes it writes (`Write` or `ReadWrite`), in argument order.
    pub fn outputs(&self) -> impl Iterator<Item = &TensorNode> {
        self.params
            .iter()
            .filter(|p| p.access.writes())
            .map(|p| &p.node)
    }
}

#[cfg(all(test, not(tributary_loom)))]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::node::Shape;
    use crate::{
        kernels::{add_merge, axpy, scale},
        node::DType,
    };

    fn node(label: &str, dtype: DType, dims: &[usize]) -> TensorNode {
        TensorNode::new(label, dtype, Shape::from(dims))
    }

    #[test]
    fn new_refuses_duplicates_and_empty() {
        let a = node("a", DType::F32, &[4]);
        let dup = RoutineSpec::custom(
            "dup",
            vec![(a.clone(), Access::Read), (a.clone(), Access::Write)],
            None,
            |_| Ok(()),
        );
        assert!(matches!(dup, Err(Error::InvalidRoutine { .. })));
        let empty = RoutineSpec::custom("empty", vec![], None, |_| Ok(()));
        assert!(matches!(empty, Err(Error::InvalidRoutine { .. })));
        // The merge node may be a parameter too.
        let ok = RoutineSpec::custom("m", vec![(a.clone(), Access::ReadWrite)], Some(a), |_| {
            Ok(())
        });
        assert!(ok.is_ok());
    }

    #[test]
    fn inputs_and_outputs_follow_access() {
        let x = node("x", DType::F32, &[3]);
        let y = node("y", DType::F32, &[3]);
        let s = axpy(&y, &x, 2.0).unwrap();
        let ins: Vec<_> = s.inputs().cloned().collect();
        let outs: Vec<_> = s.outputs().cloned().collect();
        assert_eq!(ins, vec![y.clone(), x.clone()]);
        assert_eq!(outs, vec![y.clone()]);
        let s = scale(&y, &x, 2.0).unwrap();
        assert_eq!(s.inputs().cloned().collect::<Vec<_>>(), vec![x.clone()]);
        assert_eq!(s.outputs().cloned().collect::<Vec<_>>(), vec![y]);
        assert!(s.merge.is_none());
        let m = add_merge(&x).unwrap();
        assert_eq!(m.merge, Some(x));
    }

    #[test]
    fn specs_are_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<RoutineSpec>();
        assert_send_sync::<Kernel>();
    }
}
