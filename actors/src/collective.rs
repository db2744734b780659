//! All-reduce and bucketing on a running system.
//!
//! [`AllReducePlan`] links the merge and scaling routines once and checks the contexts. Each
//! [`AllReducePlan::run`] posts the step list of `tributary::collective::plan` to all devices
//! at once. A plan is meant to be reused every training step; [`AllReducePlan::finalize`]
//! releases its routines' contexts.
//!
//! [`BucketedAllReduce`] packs many small gradients into a few buckets, all-reduces the
//! buckets, and unpacks them. The per-operation cost is then paid per bucket.

use tributary::{
    collective::{self, ReduceOp, Strategy, Transfer},
    dispatch::AllReduceCall,
    kernels,
    protocol::{Context, Routine},
    DType, Error, MemoryMode, Result, TensorNode,
};

use crate::{system::System, ticket::Ticket};

/// A linked all-reduce of some nodes (chunks) over some contexts, ready to run repeatedly.
pub struct AllReducePlan {
    sys: System,
    /// The steps, chunks, contexts and linked routines, as every run issues them.
    pub(crate) call: AllReduceCall,
}

impl AllReducePlan {
    /// Links the routines of an all-reduce of `nodes` over `contexts`.
    ///
    /// Every context must hold every node in a buffer of its own (two contexts sharing one
    /// buffer would count it twice): a typed error otherwise, with nothing linked.
    pub fn new<C: AsRef<Context>>(
        sys: &System,
        nodes: &[TensorNode],
        contexts: impl IntoIterator<Item = C>,
        op: ReduceOp,
        strategy: Strategy,
        transfer: Transfer,
    ) -> Result<AllReducePlan> {
        let contexts: Vec<Context> = contexts.into_iter().map(|c| c.as_ref().clone()).collect();
        check_replicas("all_reduce", nodes, &contexts)?;
        let n = contexts.len();
        let mut merge = Vec::with_capacity(n);
        let mut scale = Vec::with_capacity(n);
        for ctx in &contexts {
            let mut m = Vec::with_capacity(nodes.len());
            let mut s = Vec::new();
            for node in nodes {
                m.push(sys.link(ctx, kernels::add_merge(node)?)?.routine().clone());
                if op == ReduceOp::Mean {
                    let spec = kernels::scale_in_place(node, 1.0 / n as f64)?;
                    s.push(sys.link(ctx, spec)?.routine().clone());
                }
            }
            merge.push(m);
            scale.push(s);
        }
        Ok(AllReducePlan {
            sys: sys.clone(),
            call: AllReduceCall {
                steps: collective::plan(n, nodes.len(), strategy, op),
                nodes: nodes.to_vec(),
                contexts,
                merge,
                scale,
                transfer,
            },
        })
    }

    /// The steps this plan issues, in issue order.
    pub fn steps(&self) -> &[collective::AllReduceStep] {
        &self.call.steps
    }

    /// The steps grouped into levels of independent steps ([`collective::levels`]): what
    /// runs at the same time, level after level. Contexts are indices into the contexts
    /// the plan was built with.
    ///
    /// ```
    /// use tributary::{collective::{ReduceOp, Strategy, Transfer}, kernels, DType, MemoryMode};
    /// use tributary_actors::{AllReducePlan, System};
    /// let sys = System::builder().cpu_devices(3).spawn()?;
    /// let g = sys.node("g", DType::F32, [4]).with_mode(MemoryMode::on_device())?;
    /// let mut replicas = Vec::new();
    /// for d in 0..3 {
    ///     let r = sys.context(d, 0)?.link(kernels::fill(&g, d as f64)?)?;
    ///     r.schedule()?;
    ///     replicas.push(r);
    /// }
    /// // Routine handles stand for their contexts: no `.context().context().clone()`.
    /// let plan = AllReducePlan::new(&sys, &[g.clone()], &replicas, ReduceOp::Sum, Strategy::Tree, Transfer::Auto)?;
    /// for (i, level) in plan.levels().iter().enumerate() {
    ///     let steps: Vec<String> = level.iter().map(|s| s.to_string()).collect();
    ///     println!("level {i}: {}", steps.join(", "));
    /// }
    /// assert_eq!(plan.levels().len(), 3); // 2 -> 0; then 1 -> 0; then 0 -> 1 with 0 -> 2
    /// plan.run()?;
    /// assert_eq!(replicas[2].context().read::<f32>(&g)?, vec![3.0; 4]);
    /// plan.finalize()?;
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn levels(&self) -> Vec<Vec<collective::AllReduceStep>> {
        collective::levels(&self.call.steps)
    }

    /// Issues the all-reduce and returns at once: every step goes to its devices in one
    /// atomic post (one operation list per device, no round trip between steps). The
    /// tickets are the final operations (the last write of every chunk in every context);
    /// reads of the nodes wait by themselves.
    pub fn run(&self) -> Result<Vec<Ticket>> {
        self.sys.check_live()?;
        let issued = self.sys.dispatcher().auto_all_reduce(&self.call)?;
        Ok(issued.into_iter().map(Ticket::issued).collect())
    }

    /// Finalizes the routines' contexts (their buffers belong to the parents: nothing is freed).
    pub fn finalize(self) -> Result<()> {
        for r in self.call.merge.iter().chain(&self.call.scale).flatten() {
            self.sys.finalize(r.context())?;
        }
        Ok(())
    }
}

impl System {
    /// All-reduces `nodes` over `contexts` once (see [`AllReducePlan`]); returns the final
    /// events. Prefer a reusable plan in a training loop. `contexts` may be anything that
    /// holds a context: `Context`s, [`ContextHandle`](crate::ContextHandle)s or
    /// [`RoutineHandle`](crate::RoutineHandle)s (standing for the context they wrote).
    ///
    /// ```
    /// use tributary::{collective::{ReduceOp, Strategy}, kernels, DType, MemoryMode};
    /// let sys = tributary_actors::System::builder().cpu_devices(2).spawn()?;
    /// let g = sys.node("g", DType::F32, [3]).with_mode(MemoryMode::on_device())?;
    /// let a = sys.context(0, 0)?.link(kernels::fill(&g, 1.0)?)?;
    /// let b = sys.context(1, 0)?.link(kernels::fill(&g, 3.0)?)?;
    /// a.schedule()?;
    /// b.schedule()?;
    /// sys.all_reduce(&[g.clone()], [&a, &b], ReduceOp::Mean, Strategy::Ring)?;
    /// assert_eq!(a.context().read::<f32>(&g)?, vec![2.0; 3]);
    /// assert_eq!(b.context().read::<f32>(&g)?, vec![2.0; 3]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn all_reduce<C: AsRef<Context>>(
        &self,
        nodes: &[TensorNode],
        contexts: impl IntoIterator<Item = C>,
        op: ReduceOp,
        strategy: Strategy,
    ) -> Result<Vec<Ticket>> {
        let plan = AllReducePlan::new(self, nodes, contexts, op, strategy, Transfer::Auto)?;
        let events = plan.run()?;
        plan.finalize()?;
        Ok(events)
    }
}

/// [`Error::InvalidRoutine`] (naming `what`) unless there are contexts and nodes and every
/// context holds every node in a buffer of its own (two contexts sharing one buffer would
/// count it twice); [`Error::NodeNotInContext`] for a node a context lacks. Shared by the
/// in-system and the cluster all-reduces.
pub(crate) fn check_replicas(what: &str, nodes: &[TensorNode], contexts: &[Context]) -> Result<()> {
    let invalid = |reason: String| Error::InvalidRoutine {
        routine: what.into(),
        reason,
    };
    if contexts.is_empty() || nodes.is_empty() {
        return Err(invalid("no contexts or no nodes".into()));
    }
    for node in nodes {
        let mut seen = Vec::new();
        for ctx in contexts {
            let entry = ctx
                .array(node.id())
                .ok_or_else(|| Error::NodeNotInContext {
                    node: node.to_string(),
                    context: ctx.id(),
                })?;
            let key = (ctx.device(), entry.loc);
            if seen.contains(&key) {
                return Err(invalid(format!(
                    "two contexts share the buffer of {node} on {}",
                    ctx.device()
                )));
            }
            seen.push(key);
        }
    }
    Ok(())
}

/// Gradients packed into buckets, all-reduced per bucket, and unpacked.
pub struct BucketedAllReduce {
    sys: System,
    pub(crate) buckets: Buckets,
    pub(crate) reduce: AllReducePlan,
}

impl BucketedAllReduce {
    /// Plans a bucketed all-reduce of `grads` (same dtype) over `contexts`, with buckets of
    /// at most `bucket_bytes` bytes (a larger gradient gets a bucket of its own).
    ///
    /// ```
    /// use tributary::{collective::{ReduceOp, Strategy}, kernels, DType, MemoryMode};
    /// use tributary_actors::BucketedAllReduce;
    /// let sys = tributary_actors::System::builder().cpu_devices(2).spawn()?;
    /// let grads: Vec<_> = (0..3)
    ///     .map(|i| sys.node(&format!("g{i}"), DType::F32, [2]).with_mode(MemoryMode::on_device()))
    ///     .collect::<Result<_, _>>()?;
    /// let mut replicas = Vec::new();
    /// for d in 0..2 {
    ///     let mut ctx = sys.context(d, 0)?;
    ///     for g in &grads {
    ///         let r = ctx.link(kernels::fill(g, 1.0 + d as f64)?)?;
    ///         r.schedule()?;
    ///         ctx = r.context();
    ///     }
    ///     replicas.push(ctx);
    /// }
    /// let plan = BucketedAllReduce::new(&sys, &grads, &replicas, ReduceOp::Sum, Strategy::Star, 16)?;
    /// assert_eq!(plan.bucket_count(), 2); // 8 + 8 bytes, then 8
    /// plan.run()?;
    /// assert_eq!(sys.read::<f32>(&plan.contexts()[1], &grads[2])?, vec![3.0; 2]);
    /// plan.finalize()?;
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn new<C: AsRef<Context>>(
        sys: &System,
        grads: &[TensorNode],
        contexts: impl IntoIterator<Item = C>,
        op: ReduceOp,
        strategy: Strategy,
        bucket_bytes: u64,
    ) -> Result<BucketedAllReduce> {
        let contexts = contexts.into_iter().map(|c| c.as_ref().clone());
        let buckets = Buckets::link(
            sys,
            "bucketed_all_reduce",
            grads,
            contexts,
            bucket_bytes,
            |b, _| format!("bucket{b}"),
        )?;
        let reduce = AllReducePlan::new(
            sys,
            &buckets.nodes,
            &buckets.holders,
            op,
            strategy,
            Transfer::Auto,
        )?;
        Ok(BucketedAllReduce {
            sys: sys.clone(),
            buckets,
            reduce,
        })
    }

    /// Number of buckets.
    pub fn bucket_count(&self) -> usize {
        self.buckets.nodes.len()
    }

    /// The contexts holding the buckets (descendants of the given ones).
    pub fn contexts(&self) -> &[Context] {
        &self.buckets.holders
    }

    /// Packs, all-reduces and unpacks; returns once everything is issued.
    pub fn run(&self) -> Result<()> {
        self.buckets.pack(&self.sys)?;
        self.reduce.run()?;
        self.buckets.unpack(&self.sys)?;
        Ok(())
    }

    /// Finalizes every context the plan linked (innermost first).
    pub fn finalize(self) -> Result<()> {
        self.buckets.finalize(&self.sys, || self.reduce.finalize())
    }
}

/// Gradients packed into bucket nodes in each of a set of contexts: the buckets, the
/// routines that pack and unpack them, and the contexts holding the packed buckets (where
/// an all-reduce of the buckets runs). Shared by [`BucketedAllReduce`] and the cluster's
/// bucketed all-reduce.
pub(crate) struct Buckets {
    /// The bucket nodes.
    pub(crate) nodes: Vec<TensorNode>,
    /// Per context, the routines packing every gradient into its bucket, in order.
    pub(crate) pack: Vec<Vec<Routine>>,
    /// Per context, the routines unpacking every gradient from its bucket.
    pub(crate) unpack: Vec<Vec<Routine>>,
    /// `holders[i]`: a descendant of the i-th context that holds the packed buckets.
    pub(crate) holders: Vec<Context>,
}

impl Buckets {
    /// Groups `grads` (same dtype) into buckets of at most `bucket_bytes` bytes (a larger
    /// gradient gets one of its own), labelled by `label(bucket, its gradients)`, and links
    /// the pack and unpack routines in each of `contexts`. `what` names the operation in
    /// errors.
    pub(crate) fn link(
        sys: &System,
        what: &str,
        grads: &[TensorNode],
        contexts: impl IntoIterator<Item = Context>,
        bucket_bytes: u64,
        label: impl Fn(usize, &[usize]) -> String,
    ) -> Result<Buckets> {
        let dtype: DType =
            grads
                .first()
                .map(|g| g.dtype())
                .ok_or_else(|| Error::InvalidRoutine {
                    routine: what.into(),
                    reason: "no gradients".into(),
                })?;
        let mut sizes = Vec::with_capacity(grads.len());
        for g in grads {
            g.check_data(dtype, g.numel())?;
            sizes.push(g.size_in_bytes()?);
        }
        let groups = collective::buckets(&sizes, bucket_bytes);
        let nodes: Vec<TensorNode> = groups
            .iter()
            .enumerate()
            .map(|(b, group)| {
                let elems: usize = group.iter().map(|&i| grads[i].numel()).sum();
                // Packed by `copy_range`, which writes a part of the bucket and keeps the
                // rest: the rest must be defined before the first pack.
                TensorNode::new_zeroed(label(b, group), dtype, [elems])
                    .with_mode(MemoryMode::on_device())
            })
            .collect::<Result<_>>()?;
        let (mut pack, mut unpack, mut holders) = (Vec::new(), Vec::new(), Vec::new());
        for ctx in contexts {
            let (p, u, ctx) = link_bucket_copies(sys, ctx, grads, &groups, &nodes)?;
            pack.push(p);
            unpack.push(u);
            holders.push(ctx);
        }
        Ok(Buckets {
            nodes,
            pack,
            unpack,
            holders,
        })
    }

    /// Schedules every pack routine.
    pub(crate) fn pack(&self, sys: &System) -> Result<()> {
        for p in self.pack.iter().flatten() {
            sys.schedule(p)?;
        }
        Ok(())
    }

    /// Schedules every unpack routine; their tickets.
    pub(crate) fn unpack(&self, sys: &System) -> Result<Vec<Ticket>> {
        self.unpack
            .iter()
            .flatten()
            .map(|u| sys.schedule(u))
            .collect()
    }

    /// Finalizes the unpack contexts, then what `reduce` finalizes, then the pack
    /// contexts, innermost first.
    pub(crate) fn finalize(&self, sys: &System, reduce: impl FnOnce() -> Result<()>) -> Result<()> {
        for u in self.unpack.iter().flatten() {
            sys.finalize(u.context())?;
        }
        reduce()?;
        for p in self.pack.iter().rev() {
            for r in p.iter().rev() {
                sys.finalize(r.context())?;
            }
        }
        Ok(())
    }
}

/// Links, in `ctx`, the routines that pack each gradient of `grads` into its slice of its
/// bucket (`groups[b]` lists bucket `b`'s gradients, in order) and those that unpack them
/// back; returns the pack and unpack routines and the context holding the packs (where the
/// all-reduce of the buckets runs).
fn link_bucket_copies(
    sys: &System,
    mut ctx: Context,
    grads: &[TensorNode],
    groups: &[Vec<usize>],
    buckets: &[TensorNode],
) -> Result<(Vec<Routine>, Vec<Routine>, Context)> {
    let (mut pack, mut unpack) = (Vec::new(), Vec::new());
    for (bucket, group) in buckets.iter().zip(groups) {
        let mut offset = 0;
        for &i in group {
            let g = &grads[i];
            let r = sys.link(&ctx, kernels::copy_range(bucket, offset, g, 0, g.numel())?)?;
            ctx = r.routine().context().clone();
            pack.push(r.routine().clone());
            offset += g.numel();
        }
    }
    for (bucket, group) in buckets.iter().zip(groups) {
        let mut offset = 0;
        for &i in group {
            let g = &grads[i];
            let r = sys.link(&ctx, kernels::copy_range(g, 0, bucket, offset, g.numel())?)?;
            unpack.push(r.routine().clone());
            offset += g.numel();
        }
    }
    Ok((pack, unpack, ctx))
}
