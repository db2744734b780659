//! Contexts and linked routines: immutable values handed to the caller. See DESIGN.md §2,
//! "Context".
//!
//! The device state keeps a record of every context and checks it on every use. So a stale,
//! finalized or foreign context is an error, never a dangling buffer.

use std::{fmt, sync::Arc};

use crate::{
    ids::{BufferLoc, ContextId, DeviceId, IdMap, NodeId, StreamId},
    kernels::{Bindings, IndexDecl, IntoBindings, RoutineSpec},
    node::TensorNode,
};

/// A buffer of a node in a context.
#[derive(Clone, Debug)]
pub struct ArrayEntry {
    /// The node.
    pub node: TensorNode,
    /// Where its buffer is on the context's device.
    pub loc: BufferLoc,
    /// Size in bytes.
    pub bytes: u64,
    /// Whether the buffer is the device-wide one shared by all streams.
    pub shared: bool,
}

pub(crate) struct ContextInner {
    /// The device state that made it (contexts of another engine or system are refused).
    pub(crate) owner: u64,
    pub(crate) id: ContextId,
    pub(crate) stream: StreamId,
    pub(crate) parent: Option<Context>,
    pub(crate) arrays: IdMap<NodeId, ArrayEntry>,
}

/// An immutable context: a stream and the buffers of the nodes it (or an ancestor) holds.
#[derive(Clone)]
pub struct Context(pub(crate) Arc<ContextInner>);

impl Context {
    /// The context's id (unique on its device).
    pub fn id(&self) -> ContextId {
        self.0.id
    }

    /// The stream it runs on.
    pub fn stream(&self) -> StreamId {
        self.0.stream
    }

    /// The device it belongs to.
    pub fn device(&self) -> DeviceId {
        self.0.stream.device
    }

    /// The parent context, if any.
    pub fn parent(&self) -> Option<&Context> {
        self.0.parent.as_ref()
    }

    /// The buffer of `node` in this context, if it has one.
    pub fn array(&self, node: NodeId) -> Option<&ArrayEntry> {
        self.0.arrays.get(&node)
    }

    /// Whether `node` has a buffer in this context.
    pub fn contains(&self, node: &TensorNode) -> bool {
        self.0.arrays.contains_key(&node.id())
    }

    /// Every node with a buffer in this context.
    pub fn nodes(&self) -> impl Iterator<Item = &TensorNode> {
        self.0.arrays.values().map(|a| &a.node)
    }
}

/// Lets APIs that take "something holding a context" (`impl AsRef<Context>`) take a
/// `Context` itself, as well as the actor system's handles.
impl AsRef<Context> for Context {
    fn as_ref(&self) -> &Context {
        self
    }
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Context({} on {}, {} arrays)",
            self.0.id,
            self.0.stream,
            self.0.arrays.len()
        )
    }
}

/// A routine linked into a context: ready to be scheduled any number of times.
#[derive(Clone)]
pub struct Routine(pub(crate) Arc<RoutineInner>);

pub(crate) struct RoutineInner {
    pub(crate) spec: RoutineSpec,
    pub(crate) context: Context,
    /// Empty bindings of its declared indices: what every schedule fills, sharing the
    /// declarations and the routine's name.
    pub(crate) empty_bindings: Bindings,
    /// Its name, shared by every plan that runs it.
    pub(crate) name: std::sync::Arc<str>,
    /// Its parameters' buffers, resolved when it was linked (its context is immutable).
    pub(crate) args: std::sync::Arc<[crate::protocol::ArgBinding]>,
}

impl Routine {
    /// The context the routine was linked into (the child returned by linking).
    pub fn context(&self) -> &Context {
        &self.0.context
    }

    /// The routine's name.
    pub fn name(&self) -> &str {
        &self.0.spec.name
    }

    /// What the routine runs and touches.
    pub fn spec(&self) -> &RoutineSpec {
        &self.0.spec
    }

    /// The node the routine expects in its stream's merge buffer, if any.
    pub fn merge_node(&self) -> Option<&TensorNode> {
        self.0.spec.merge.as_ref()
    }

    /// The integer indices it declares, in order
    /// ([`RoutineSpec::with_index`](crate::kernels::RoutineSpec::with_index)).
    pub fn indices(&self) -> &[IndexDecl] {
        self.0.empty_bindings.decls()
    }

    /// Empty bindings of its indices, to fill with [`Bindings::set`] and give to a
    /// schedule; keep one and refill it every step (no allocation).
    pub fn bindings(&self) -> Bindings {
        self.0.empty_bindings.clone()
    }

    /// Complete bindings of its indices from `values` (pairs such as `&[("t", 3)]`, or a
    /// [`Bindings`]): [`Error::MissingBinding`](crate::Error::MissingBinding),
    /// [`Error::UnknownBinding`](crate::Error::UnknownBinding),
    /// [`Error::DuplicateBinding`](crate::Error::DuplicateBinding) or
    /// [`Error::BindingOutOfRange`](crate::Error::BindingOutOfRange) otherwise. Every
    /// schedule checks its values this way.
    ///
    /// ```
    /// # use tributary::kernels::{Access, RoutineSpec};
    /// # use tributary::{DType, Engine, EngineConfig, Error, TensorNode};
    /// # let mut e = Engine::cpu(EngineConfig::default())?;
    /// # let y = TensorNode::new("y", DType::F32, [4]);
    /// # let spec = RoutineSpec::custom("f", vec![(y, Access::Write)], None, |_| Ok(()))?.with_index("t")?;
    /// let root = e.context(0, 0)?;
    /// let r = e.link(&root, spec)?;
    /// assert_eq!(r.bind(&[("t", 3)])?.get("t"), Some(3));
    /// assert!(matches!(r.bind(&[("t", 3), ("t", 4)]), Err(Error::DuplicateBinding { .. })));
    /// # Ok::<(), Error>(())
    /// ```
    pub fn bind(&self, values: impl IntoBindings) -> crate::error::Result<Bindings> {
        values.into_bindings(self.bindings())
    }
}

impl fmt::Debug for Routine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Routine({} in {:?})", self.0.spec.name, self.0.context)
    }
}
