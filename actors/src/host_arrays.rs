//! Host arrays from the host's side: reading and writing the host value of a hosted node,
//! and reading what a context holds.
//!
//! The rules are the engine's, in `tributary::dispatch::Dispatcher::host_read` and
//! `host_write`. Both hold the node's order lock while they wait, so they are atomic with
//! respect to every other call on the node. See DESIGN.md §3, rule 2, and §4, "Host arrays
//! are shared by every device".

use tributary::{protocol::Context, Element, Error, Result, TensorNode};

use crate::{system::System, ticket::block_on};

impl System {
    /// Reads the host value of hosted `node` (transferring the newest device value first).
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let w = sys.node("w", DType::F32, [2]).with_mode(MemoryMode::hosted_changed_on_devices())?;
    /// let held = sys.context(0, 0)?.init_from_host(&w, &[1.0f32, 2.0])?;
    /// held.link(kernels::fill(&w, 5.0)?)?.schedule()?;
    /// assert_eq!(sys.host_read::<f32>(&w)?, vec![5.0, 5.0]); // the device value, transferred
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn host_read<T: Element>(&self, node: &TensorNode) -> Result<Vec<T>> {
        block_on(self.host_read_async(node))
    }

    /// Async [`System::host_read`].
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let w = sys.node("w", DType::F32, [2]).with_mode(MemoryMode::hosted_changed_on_devices())?;
    /// sys.host_write(&w, &[1.0f32, 2.0])?;
    /// assert_eq!(block_on(sys.host_read_async::<f32>(&w))?, vec![1.0, 2.0]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub async fn host_read_async<T: Element>(&self, node: &TensorNode) -> Result<Vec<T>> {
        node.check_data(T::DTYPE, node.numel())?;
        if !node.mode().is_hosted() {
            return Err(Error::NotHosted {
                node: node.to_string(),
            });
        }
        self.check_live()?;
        let bytes = self.dispatcher().host_read(node).await?;
        Ok(tributary::kernels::from_bytes(&bytes)?)
    }

    /// Writes the host value of hosted `node`; device copies re-upload before their next use.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let w = sys.node("w", DType::F32, [2]).with_mode(MemoryMode::hosted_changed_on_devices())?;
    /// sys.host_write(&w, &[1.0f32, 2.0])?;
    /// assert_eq!(sys.host_read::<f32>(&w)?, vec![1.0, 2.0]);
    /// let plain = sys.node("p", DType::F32, [2]);
    /// assert!(matches!(sys.host_write(&plain, &[0f32; 2]), Err(Error::NotHosted { .. })));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn host_write<T: Element>(&self, node: &TensorNode, data: &[T]) -> Result<()> {
        block_on(self.host_write_async(node, data))
    }

    /// Async [`System::host_write`].
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let w = sys.node("w", DType::F32, [2]).with_mode(MemoryMode::hosted_changed_on_devices())?;
    /// block_on(sys.host_write_async(&w, &[1.0f32, 2.0]))?;
    /// assert_eq!(sys.host_read::<f32>(&w)?, vec![1.0, 2.0]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub async fn host_write_async<T: Element>(&self, node: &TensorNode, data: &[T]) -> Result<()> {
        node.check_data(T::DTYPE, data.len())?;
        if !node.mode().is_hosted() {
            return Err(Error::NotHosted {
                node: node.to_string(),
            });
        }
        self.check_live()?;
        self.dispatcher()
            .host_write(node, &tributary::kernels::to_bytes(data))
            .await
    }

    /// Reads the value of `node` in `ctx` (any memory mode): what a routine of `ctx` would
    /// read. That is the buffer after its last write, or, for a hosted node whose buffer
    /// lags a host write, the host array (which a routine would upload first; the buffer
    /// is left as it is). [`System::read_device_raw`] shows the buffer's bytes instead.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let g = sys.node("g", DType::U8, [3]);
    /// let fill = sys.context(0, 0)?.link(kernels::fill(&g, 7.0)?)?;
    /// fill.schedule()?;
    /// assert_eq!(sys.read::<u8>(fill.protocol_context(), &g)?, vec![7; 3]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn read<T: Element>(&self, ctx: &Context, node: &TensorNode) -> Result<Vec<T>> {
        block_on(self.read_async(ctx, node))
    }

    /// Async [`System::read`].
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let g = sys.node("g", DType::U8, [3]);
    /// let fill = sys.context(0, 0)?.link(kernels::fill(&g, 7.0)?)?;
    /// fill.schedule()?;
    /// assert_eq!(block_on(sys.read_async::<u8>(fill.protocol_context(), &g))?, vec![7; 3]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub async fn read_async<T: Element>(&self, ctx: &Context, node: &TensorNode) -> Result<Vec<T>> {
        node.check_data(T::DTYPE, node.numel())?;
        self.check_live()?;
        let bytes = self.dispatcher().read_value(ctx, node, false).await?;
        Ok(tributary::kernels::from_bytes(&bytes)?)
    }

    /// The bytes of `node`'s buffer in `ctx` as they are, after its last write, for
    /// debugging: unlike [`System::read`], a buffer lagging a host write shows its stale
    /// device value, which no routine would read.
    ///
    /// ```
    /// # use tributary::{kernels, DType, MemoryMode};
    /// # use tributary_actors::System;
    /// # let sys = System::builder().cpu_devices(1).spawn()?;
    /// let w = sys.node("w", DType::F32, [2]).with_mode(MemoryMode::hosted_changed_on_devices())?;
    /// let ctx = sys.context(0, 0)?.init_from_host(&w, &[1.0f32, 1.0])?;
    /// sys.host_write(&w, &[2.0f32, 2.0])?; // the device buffer now lags
    /// assert_eq!(sys.read::<f32>(&ctx, &w)?, vec![2.0, 2.0]); // what a routine would read
    /// assert_eq!(sys.read_device_raw::<f32>(&ctx, &w)?, vec![1.0, 1.0]); // the stale bytes
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn read_device_raw<T: Element>(&self, ctx: &Context, node: &TensorNode) -> Result<Vec<T>> {
        node.check_data(T::DTYPE, node.numel())?;
        self.check_live()?;
        let bytes = block_on(self.dispatcher().read_value(ctx, node, true))?;
        Ok(tributary::kernels::from_bytes(&bytes)?)
    }
}
