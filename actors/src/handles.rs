//! Handles on the parts of a running system: devices, streams, contexts and routines.
//! Each holds its [`System`] and offers the operations that start from it; the calls of
//! `System` that return a handle are here too, so the system does not depend on the
//! handles that wrap it.

use tributary::{
    dispatch::answer,
    kernels::RoutineSpec,
    protocol::{Context, Routine},
    Element, Error, HostedKind, MemoryMode, Result, TensorNode,
};

use crate::{
    system::System,
    ticket::{block_on, Ticket},
};

/// The calls of [`System`] that return a handle.
impl System {
    /// A handle on device `i`.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let ctx = sys.device(1).stream(0).context()?;
    /// assert_eq!(ctx.device(), tributary::DeviceId(1));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn device(&self, i: usize) -> DeviceHandle {
        DeviceHandle {
            sys: self.clone(),
            index: i,
        }
    }

    /// A root context on `stream` of device `device`.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let ctx = sys.context(1, 1)?;
    /// assert_eq!(ctx.stream().index, 1);
    /// assert!(matches!(sys.context(2, 0), Err(Error::NoSuchDevice { index: 2, count: 2 })));
    /// assert!(matches!(sys.context(0, 5), Err(Error::NoSuchStream { index: 5, .. })));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn context(&self, device: usize, stream: usize) -> Result<ContextHandle> {
        block_on(self.context_async(device, stream))
    }

    /// Async [`System::context`].
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let ctx = block_on(sys.context_async(0, 1))?;
    /// assert_eq!(ctx.stream().index, 1);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub async fn context_async(&self, device: usize, stream: usize) -> Result<ContextHandle> {
        self.check_live()?;
        let ctx = answer(self.dispatcher().new_context(device, stream)?).await?;
        Ok(ContextHandle {
            sys: self.clone(),
            ctx,
        })
    }

    /// Links a routine into `ctx`.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]);
    /// let root = sys.context(0, 0)?;
    /// let fill = sys.link(&root, kernels::fill(&x, 2.0)?)?; // a handle derefs to its context
    /// assert!(fill.protocol_context().contains(&x));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn link(&self, ctx: &Context, spec: RoutineSpec) -> Result<RoutineHandle> {
        block_on(self.link_async(ctx, spec))
    }

    /// Async [`System::link`].
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]);
    /// let root = sys.context(0, 0)?;
    /// let fill = block_on(sys.link_async(&root, kernels::fill(&x, 2.0)?))?;
    /// assert!(fill.protocol_context().contains(&x));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub async fn link_async(&self, ctx: &Context, spec: RoutineSpec) -> Result<RoutineHandle> {
        self.check_live()?;
        let routine = answer(self.dispatcher().link(ctx, spec)?).await?;
        Ok(RoutineHandle {
            sys: self.clone(),
            routine,
        })
    }

    /// Writes `data` as the host value of `node` (made hosted if undecided) and returns a
    /// child of `ctx` holding a buffer initialised from it.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let w = sys.node("w", DType::I32, [3]);
    /// let root = sys.context(1, 0)?;
    /// let held = sys.init_from_host(&root, &w, &[1i32, 2, 3])?;
    /// assert_eq!(held.read::<i32>(&w)?, vec![1, 2, 3]);
    /// assert!(matches!(
    ///     sys.init_from_host(&held, &w, &[0i32; 3]),
    ///     Err(Error::AlreadyInContext { .. })
    /// ));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn init_from_host<T: Element>(
        &self,
        ctx: &Context,
        node: &TensorNode,
        data: &[T],
    ) -> Result<ContextHandle> {
        block_on(self.init_from_host_async(ctx, node, data))
    }

    /// Async [`System::init_from_host`].
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let w = sys.node("w", DType::F32, [2]);
    /// let root = sys.context(0, 0)?;
    /// let held = block_on(sys.init_from_host_async(&root, &w, &[1.0f32, 2.0]))?;
    /// assert_eq!(held.read::<f32>(&w)?, vec![1.0, 2.0]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub async fn init_from_host_async<T: Element>(
        &self,
        ctx: &Context,
        node: &TensorNode,
        data: &[T],
    ) -> Result<ContextHandle> {
        node.check_data(T::DTYPE, data.len())?;
        if ctx.contains(node) {
            return Err(Error::AlreadyInContext {
                node: node.to_string(),
                context: ctx.id(),
            });
        }
        if !node.mode().is_hosted() {
            node.refine_mode(MemoryMode::Hosted(HostedKind::Unset))?;
        }
        self.host_write_async(node, data).await?;
        self.check_live()?;
        let child = answer(self.dispatcher().init_from_host(ctx, node)?).await?;
        Ok(ContextHandle {
            sys: self.clone(),
            ctx: child,
        })
    }
}

/// A device of a running system.
#[derive(Clone)]
pub struct DeviceHandle {
    pub(crate) sys: System,
    pub(crate) index: usize,
}

impl DeviceHandle {
    /// Stream `i` of this device.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let ctx = sys.device(0).stream(1).context()?;
    /// assert_eq!(ctx.stream().index, 1);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn stream(&self, i: usize) -> StreamHandle {
        StreamHandle {
            sys: self.sys.clone(),
            device: self.index,
            index: i,
        }
    }

    /// Number of streams.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// assert_eq!(sys.device(0).stream_count(), 2);
    /// assert_eq!(sys.device(9).stream_count(), 0); // no such device
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn stream_count(&self) -> usize {
        self.sys
            .shared
            .streams
            .get(self.index)
            .copied()
            .unwrap_or(0)
    }
}

/// A stream of a running system.
#[derive(Clone)]
pub struct StreamHandle {
    pub(crate) sys: System,
    pub(crate) device: usize,
    pub(crate) index: usize,
}

impl StreamHandle {
    /// A new root context on this stream.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let root = sys.device(1).stream(0).context()?;
    /// assert_eq!(root.device(), tributary::DeviceId(1));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn context(&self) -> Result<ContextHandle> {
        self.sys.context(self.device, self.index)
    }
}

/// A context of a running system, with the operations that start from it.
///
/// Two types are called "context": this handle (a [`protocol::Context`](Context) plus the
/// [`System`] it lives in, so it can link, read and finalize by itself) and the protocol's
/// [`Context`] value it wraps ([`ContextHandle::protocol_context`]), which the lower-level
/// methods of [`System`] take. A handle derefs to its `Context` and is `AsRef<Context>`,
/// so it can be passed wherever a `&Context` or an `impl AsRef<Context>` is expected.
#[derive(Clone)]
pub struct ContextHandle {
    pub(crate) sys: System,
    pub(crate) ctx: Context,
}

impl ContextHandle {
    /// The protocol's context value this handle wraps.
    ///
    /// ```
    /// let sys = tributary_actors::System::builder().cpu_devices(1).spawn()?;
    /// let ctx = sys.context(0, 0)?;
    /// assert_eq!(ctx.protocol_context().device(), tributary::DeviceId(0));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn protocol_context(&self) -> &Context {
        &self.ctx
    }

    /// The protocol's context value: renamed [`ContextHandle::protocol_context`].
    #[deprecated(note = "renamed `protocol_context` (a `ContextHandle` is itself a context)")]
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Links a routine; its context is a child of this one.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]);
    /// let fill = sys.context(0, 0)?.link(kernels::fill(&x, 1.0)?)?;
    /// fill.schedule()?;
    /// assert_eq!(fill.context().read::<f32>(&x)?, vec![1.0; 4]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn link(&self, spec: RoutineSpec) -> Result<RoutineHandle> {
        self.sys.link(&self.ctx, spec)
    }

    /// See [`System::init_from_host`].
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let w = sys.node("w", DType::F32, [2]);
    /// let held = sys.context(0, 0)?.init_from_host(&w, &[1.0f32, 2.0])?;
    /// assert_eq!(held.read::<f32>(&w)?, vec![1.0, 2.0]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn init_from_host<T: Element>(
        &self,
        node: &TensorNode,
        data: &[T],
    ) -> Result<ContextHandle> {
        self.sys.init_from_host(&self.ctx, node, data)
    }

    /// See [`System::from_host`].
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let w = sys.node("w", DType::F32, [2]);
    /// let held = sys.context(0, 0)?.init_from_host(&w, &[1.0f32, 2.0])?;
    /// sys.host_write(&w, &[3.0f32, 4.0])?;
    /// held.from_host(&w)?.wait()?;
    /// assert_eq!(held.read::<f32>(&w)?, vec![3.0, 4.0]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn from_host(&self, node: &TensorNode) -> Result<Ticket> {
        self.sys.from_host(&self.ctx, node)
    }

    /// See [`System::to_host`].
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let w = sys.node("w", DType::F32, [2]).with_mode(MemoryMode::hosted_changed_on_devices())?;
    /// let held = sys.context(0, 0)?.init_from_host(&w, &[1.0f32, 2.0])?;
    /// let fill = held.link(kernels::fill(&w, 4.0)?)?;
    /// fill.schedule()?;
    /// fill.context().to_host(&w)?.wait()?;
    /// assert_eq!(sys.host_read::<f32>(&w)?, vec![4.0, 4.0]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn to_host(&self, node: &TensorNode) -> Result<Ticket> {
        self.sys.to_host(&self.ctx, node)
    }

    /// Reads the value of `node` in this context: what a routine here would read (see
    /// [`System::read`]).
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F64, [2]);
    /// let fill = sys.context(1, 1)?.link(kernels::fill(&x, 0.5)?)?;
    /// fill.schedule()?;
    /// assert_eq!(fill.context().read::<f64>(&x)?, vec![0.5, 0.5]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn read<T: Element>(&self, node: &TensorNode) -> Result<Vec<T>> {
        self.sys.read(&self.ctx, node)
    }

    /// The bytes of `node`'s buffer in this context as they are, stale or not (see
    /// [`System::read_device_raw`]).
    ///
    /// ```
    /// # use tributary::{kernels, DType};
    /// # use tributary_actors::System;
    /// # let sys = System::builder().cpu_devices(1).spawn()?;
    /// let x = sys.node("x", DType::F32, [2]);
    /// let fill = sys.context(0, 0)?.link(kernels::fill(&x, 0.5)?)?;
    /// fill.schedule()?;
    /// assert_eq!(fill.context().read_device_raw::<f32>(&x)?, vec![0.5, 0.5]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn read_device_raw<T: Element>(&self, node: &TensorNode) -> Result<Vec<T>> {
        self.sys.read_device_raw(&self.ctx, node)
    }

    /// Finalizes this context.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]);
    /// let fill = sys.context(0, 0)?.link(kernels::fill(&x, 1.0)?)?;
    /// fill.schedule()?;
    /// fill.context().finalize()?;
    /// assert!(matches!(fill.context().finalize(), Err(Error::ContextFinalized { .. })));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn finalize(&self) -> Result<()> {
        self.sys.finalize(&self.ctx)
    }
}

impl std::ops::Deref for ContextHandle {
    type Target = Context;
    fn deref(&self) -> &Context {
        &self.ctx
    }
}

impl AsRef<Context> for ContextHandle {
    fn as_ref(&self) -> &Context {
        &self.ctx
    }
}

/// A routine's handle stands for the context it was linked into (a child of the one given
/// to `link`): the context holding what the routine wrote.
impl AsRef<Context> for RoutineHandle {
    fn as_ref(&self) -> &Context {
        self.routine.context()
    }
}

/// A linked routine of a running system.
#[derive(Clone)]
pub struct RoutineHandle {
    pub(crate) sys: System,
    pub(crate) routine: Routine,
}

impl RoutineHandle {
    /// The engine routine (for `MergeBufferUse::StreamingFor`).
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]);
    /// let fill = sys.context(0, 0)?.link(kernels::fill(&x, 1.0)?)?;
    /// assert_eq!(fill.routine().name(), "fill(x)");
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn routine(&self) -> &Routine {
        &self.routine
    }

    /// The protocol's context value of the routine (a child of the one it was linked
    /// into); [`RoutineHandle::context`] gives it as a handle.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]);
    /// let fill = sys.context(0, 0)?.link(kernels::fill(&x, 1.0)?)?;
    /// assert!(fill.protocol_context().contains(&x));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn protocol_context(&self) -> &Context {
        self.routine.context()
    }

    /// The routine's context (a child of the one it was linked into), as a handle.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]);
    /// let y = sys.node("y", DType::F32, [4]);
    /// let fill = sys.context(0, 0)?.link(kernels::fill(&x, 1.0)?)?;
    /// // Chain: link the next routine into the context the first one wrote.
    /// let copy = fill.context().link(kernels::copy(&y, &x)?)?;
    /// fill.schedule()?;
    /// copy.schedule()?;
    /// assert_eq!(copy.context().read::<f32>(&y)?, vec![1.0; 4]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn context(&self) -> ContextHandle {
        ContextHandle {
            sys: self.sys.clone(),
            ctx: self.routine.context().clone(),
        }
    }

    /// Schedules the routine; returns at once with a ticket for its event.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]);
    /// let fill = sys.context(0, 0)?.link(kernels::fill(&x, 1.0)?)?;
    /// let ticket = fill.schedule()?; // returns at once
    /// ticket.wait()?;
    /// assert!(ticket.event()?.is_done());
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn schedule(&self) -> Result<Ticket> {
        self.sys.schedule(&self.routine)
    }

    /// Schedules the routine with values for its declared indices
    /// ([`System::schedule_with`]); returns at once with a ticket for its event.
    ///
    /// ```
    /// # use tributary::{kernels::{Access, RoutineSpec}, DType, Error};
    /// # use tributary_actors::System;
    /// # let sys = System::builder().cpu_devices(1).spawn()?;
    /// let y = sys.node("y", DType::I32, [2]);
    /// let spec = RoutineSpec::custom("y = t", vec![(y.clone(), Access::Write)], None, |a| {
    ///     a.output::<i32>(0)?.fill(a.index("t")? as i32);
    ///     Ok(())
    /// })?
    /// .with_index("t")?;
    /// let r = sys.context(0, 0)?.link(spec)?;
    /// let mut b = r.routine().bindings();
    /// for t in 0..3 {
    ///     b.set("t", t)?;
    ///     r.schedule_with(&b)?;
    /// }
    /// sys.sync()?;
    /// assert_eq!(r.context().read::<i32>(&y)?, vec![2, 2]);
    /// # sys.shutdown()?;
    /// # Ok::<(), Error>(())
    /// ```
    pub fn schedule_with(&self, bindings: impl tributary::kernels::IntoBindings) -> Result<Ticket> {
        self.sys.schedule_with(&self.routine, bindings)
    }
}
