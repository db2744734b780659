//! The sequential reference: what every host-visible value of a program must be.
//!
//! A plain single-threaded interpreter of the public operations. Every operation takes
//! effect completely, in program order, on plain vectors; there are no events, streams
//! only name merge buffers and owners. It is written from the documented semantics
//! (DESIGN.md §2-3 and the module docs of `protocol::device` and `protocol::host`), not
//! from the engine's code:
//!
//! - **Buffers.** A context sees its parent's buffers plus those its link added. A node
//!   gets a fresh (zeroed) buffer per context chain, unless it is shared across the
//!   streams of the device: then one device-wide buffer, which lives as long as the
//!   device. A node's sharing is its declared one, else decided per device by its first
//!   link (read first: shared; written first: per stream; `init_from_host` of an
//!   undecided node: per stream). Written shared nodes have one owner stream per device;
//!   another stream linking a write is a `SecondWriter`. A routine or a copy reading a
//!   buffer that nothing wrote (no routine output, copy or upload; the node not declared
//!   zeroed, not hosted) is `UninitialisedRead`; `read` of such a buffer shows its zeros.
//! - **Hosted nodes** have a host array (zeros at first) and a version bumped by host
//!   writes. A buffer remembers the host version its content derives from, or none (a
//!   fresh buffer: its content is unknown to the host protocol). A buffer *lags* when that
//!   is not the current version; a routine reading a lagging buffer first re-uploads the
//!   host array into it. A device write (routine output, `device_to_device` into the
//!   node's buffer) makes that buffer the node's newest value; a host read first copies
//!   the newest value into the host array. `from_host` uploads; `to_host` makes the host
//!   array equal the buffer; a host write makes every buffer lag and forgets the newest
//!   device value; finalizing a context first saves the newest value if it lives in a
//!   buffer being freed.
//! - **Merge buffers**: one per stream, holding the node and value of the last `Copy`
//!   into it; an `add_merge` consumer needs its node there. `StreamingFor` consumers read
//!   the source buffer in place (after their own uploads) and leave the slot alone; a
//!   source that is also one of the consumer's outputs cannot be streamed.
//! - **A copy never reads a stale value.** `device_to_device` (every mode) of a hosted
//!   node whose source buffer lags first uploads the host array into the source buffer,
//!   as a routine reading it would, once every check of the operation passed.
//! - `read` returns what a routine of the context would read: the buffer's content, or,
//!   when a hosted buffer lags, the host array's (without uploading: a read changes
//!   nothing).
//!
//! Errors are reported by variant name, like [`describe`](super::program::describe); the
//! reference checks the misuses a generated program could contain, and the generator drops
//! operations the reference refuses.

use std::collections::{BTreeMap, HashMap};

use super::program::*;

/// Values of a buffer, in their dtype.
#[derive(Clone, Debug, PartialEq)]
pub enum Vals {
    /// `f32` values.
    F32(Vec<f32>),
    /// `i32` values.
    I32(Vec<i32>),
}

impl Vals {
    fn zeros(dtype: Dt, n: usize) -> Vals {
        match dtype {
            Dt::F32 => Vals::F32(vec![0.0; n]),
            Dt::I32 => Vals::I32(vec![0; n]),
        }
    }

    fn from_data(dtype: Dt, data: Data, n: usize) -> Vals {
        match dtype {
            Dt::F32 => Vals::F32(data.f32s(n)),
            Dt::I32 => Vals::I32(data.i32s(n)),
        }
    }

    /// For comparison.
    pub fn values(&self) -> Values {
        match self {
            Vals::F32(v) => Values::f32s(v),
            Vals::I32(v) => Values::I32(v.clone()),
        }
    }

    fn f32s(&self) -> Result<&[f32], String> {
        match self {
            Vals::F32(v) => Ok(v),
            Vals::I32(_) => Err("DTypeMismatch: f32 kernel on i32".into()),
        }
    }
}

struct Buf {
    node: usize,
    data: Vals,
    host_version: Option<u64>,
    /// Something wrote it (a routine, a copy, an upload), or its node is declared zeroed.
    written: bool,
}

#[derive(Clone)]
struct Ctx {
    device: usize,
    stream: usize,
    parent: Option<usize>,
    /// node -> (buffer, shared across streams)
    arrays: BTreeMap<usize, (usize, bool)>,
    live: bool,
    children: usize,
    owned: Vec<usize>,
}

struct Routine {
    ctx: usize,
    kernel: Kernel,
}

struct Host {
    data: Vals,
    version: u64,
    newer: Option<usize>,
}

struct Device {
    sharing: HashMap<usize, Share>,
    candidates: HashMap<usize, usize>,
    owner: HashMap<usize, usize>,
    merge: Vec<Option<(usize, Vals)>>,
}

enum MergeFrom {
    None,
    Slot(Vals),
    Source(usize),
}

/// The reference interpreter; also the generator's oracle of what is valid.
pub struct Reference {
    setup: Setup,
    streaming: Streaming,
    devices: Vec<Device>,
    bufs: Vec<Buf>,
    ctxs: Vec<Ctx>,
    routines: Vec<Routine>,
    hosts: Vec<Host>,
    /// How many reads and copies found their buffer lagging a host write (the generator's
    /// coverage of stale reads): `read`, `device_to_device` `No`, `Copy`, `StreamingFor`.
    pub lagging_reads: [usize; 4],
}

type Res<T> = Result<T, String>;

impl Reference {
    /// A fresh system.
    pub fn new(setup: &Setup) -> Reference {
        Reference::with_streaming(setup, Streaming::AnyDevice)
    }

    /// A fresh system whose backend can stream as `streaming` says.
    pub fn with_streaming(setup: &Setup, streaming: Streaming) -> Reference {
        Reference {
            setup: setup.clone(),
            streaming,
            devices: (0..setup.devices)
                .map(|_| Device {
                    sharing: HashMap::new(),
                    candidates: HashMap::new(),
                    owner: HashMap::new(),
                    merge: vec![None; setup.streams],
                })
                .collect(),
            bufs: Vec::new(),
            ctxs: Vec::new(),
            routines: Vec::new(),
            hosts: setup
                .nodes
                .iter()
                .map(|n| Host {
                    data: Vals::zeros(n.dtype, n.numel()),
                    version: 0,
                    newer: None,
                })
                .collect(),
            lagging_reads: [0; 4],
        }
    }

    // ---- queries for the generator ------------------------------------------------------

    /// The setup.
    pub fn setup(&self) -> &Setup {
        &self.setup
    }

    /// Live contexts, oldest first.
    pub fn live_contexts(&self) -> Vec<C> {
        (0..self.ctxs.len())
            .filter(|&i| self.ctxs[i].live)
            .map(C)
            .collect()
    }

    /// Live contexts without live children.
    pub fn leaf_contexts(&self) -> Vec<C> {
        (0..self.ctxs.len())
            .filter(|&i| self.ctxs[i].live && self.ctxs[i].children == 0)
            .map(C)
            .collect()
    }

    /// Nodes with a buffer in `c`.
    pub fn nodes_of(&self, c: C) -> Vec<N> {
        self.ctxs[c.0].arrays.keys().map(|&n| N(n)).collect()
    }

    /// Whether `n` has a buffer in `c`.
    pub fn contains(&self, c: C, n: N) -> bool {
        self.ctxs[c.0].arrays.contains_key(&n.0)
    }

    /// Routines whose context is live, oldest first.
    pub fn live_routines(&self) -> Vec<R> {
        (0..self.routines.len())
            .filter(|&i| self.ctxs[self.routines[i].ctx].live)
            .map(R)
            .collect()
    }

    /// The routine's kernel.
    pub fn kernel_of(&self, r: R) -> &Kernel {
        &self.routines[r.0].kernel
    }

    /// The routine's context.
    pub fn context_of(&self, r: R) -> C {
        C(self.routines[r.0].ctx)
    }

    /// Number of contexts created so far (the next context handle).
    pub fn context_count(&self) -> usize {
        self.ctxs.len()
    }

    /// Number of routines created so far (the next routine handle).
    pub fn routine_count(&self) -> usize {
        self.routines.len()
    }

    // ---- helpers ---------------------------------------------------------------------------

    fn decl(&self, n: usize) -> Res<&NodeDecl> {
        self.setup
            .nodes
            .get(n)
            .ok_or_else(|| format!("Unknown: node n{n}"))
    }

    fn hosted(&self, n: usize) -> Res<bool> {
        Ok(self.decl(n)?.mode.is_hosted())
    }

    fn live_ctx(&self, c: C) -> Res<&Ctx> {
        let ctx = self
            .ctxs
            .get(c.0)
            .ok_or_else(|| format!("Unknown: context c{}", c.0))?;
        if ctx.live {
            Ok(ctx)
        } else {
            Err(format!("ContextFinalized: c{}", c.0))
        }
    }

    fn buf_of(&self, c: C, n: N) -> Res<usize> {
        let ctx = self.live_ctx(c)?;
        ctx.arrays
            .get(&n.0)
            .map(|&(b, _)| b)
            .ok_or_else(|| format!("NodeNotInContext: n{} in c{}", n.0, c.0))
    }

    fn effective_sharing(&self, device: usize, n: usize) -> Res<Share> {
        Ok(match self.decl(n)?.mode.declared_sharing() {
            Share::Unset => self.devices[device]
                .sharing
                .get(&n)
                .copied()
                .unwrap_or(Share::Unset),
            s => s,
        })
    }

    /// Whether `stream` may write shared node `n` on `device`, and whether it becomes owner.
    fn owner_check(&self, device: usize, n: usize, stream: usize) -> Res<bool> {
        match self.devices[device].owner.get(&n) {
            Some(&o) if o != stream => Err(format!(
                "SecondWriter: n{n} on d{device} is owned by s{o}, s{stream} cannot write it"
            )),
            Some(_) => Ok(false),
            None => Ok(true),
        }
    }

    fn new_buf(&mut self, n: usize) -> usize {
        let d = &self.setup.nodes[n];
        self.bufs.push(Buf {
            node: n,
            data: Vals::zeros(d.dtype, d.numel()),
            // Fresh memory's content is not the host array's (which may have been set by a
            // transfer without a version change): it must be uploaded before it is read.
            host_version: None,
            written: d.zeroed,
        });
        self.bufs.len() - 1
    }

    fn candidate(&mut self, device: usize, n: usize) -> usize {
        if let Some(&b) = self.devices[device].candidates.get(&n) {
            return b;
        }
        let b = self.new_buf(n);
        self.devices[device].candidates.insert(n, b);
        b
    }

    fn add_child(&mut self, parent: usize, arrays: Vec<(usize, usize, bool)>) -> C {
        let p = &mut self.ctxs[parent];
        p.children += 1;
        let mut child = Ctx {
            device: p.device,
            stream: p.stream,
            parent: Some(parent),
            arrays: p.arrays.clone(),
            live: true,
            children: 0,
            owned: Vec::new(),
        };
        for (n, b, shared) in arrays {
            child.arrays.insert(n, (b, shared));
            if !shared {
                child.owned.push(b);
            }
        }
        self.ctxs.push(child);
        C(self.ctxs.len() - 1)
    }

    /// `UninitialisedRead` when buffer `b` of `n` is read but nothing wrote it (a hosted
    /// node's buffer is uploaded before it is read, so it always holds a value).
    fn check_written(&self, b: usize, n: N) -> Res<()> {
        if self.bufs[b].written || self.hosted(n.0)? {
            return Ok(());
        }
        Err(format!(
            "UninitialisedRead: n{} (buffer {b}) was never written",
            n.0
        ))
    }

    fn lagging(&self, b: usize) -> bool {
        let n = self.bufs[b].node;
        self.bufs[b].host_version != Some(self.hosts[n].version)
    }

    fn upload(&mut self, b: usize) {
        let n = self.bufs[b].node;
        let h = &mut self.hosts[n];
        self.bufs[b].data = h.data.clone();
        self.bufs[b].host_version = Some(h.version);
        self.bufs[b].written = true;
        if h.newer == Some(b) {
            h.newer = None;
        }
    }

    fn save_newest(&mut self, n: usize) {
        if let Some(b) = self.hosts[n].newer.take() {
            self.hosts[n].data = self.bufs[b].data.clone();
        }
    }

    fn check_kernel(&self, k: &Kernel) -> Res<()> {
        let params = k.params();
        let first = self.decl(params[0].0 .0)?;
        for (n, _) in &params {
            if self.decl(n.0)?.dtype != first.dtype {
                return Err("DTypeMismatch: kernel parameters".into());
            }
        }
        let numel = |n: N| self.setup.nodes[n.0].numel();
        let dims = |n: N| self.setup.nodes[n.0].dims.clone();
        let f32_only = || {
            if first.dtype == Dt::F32 {
                Ok(())
            } else {
                Err("DTypeMismatch: f32 kernel".to_string())
            }
        };
        match *k {
            Kernel::Fill { .. } | Kernel::AddMerge { .. } | Kernel::FillIndex { .. } => Ok(()),
            Kernel::Copy { dst, src } | Kernel::AddInto { dst, src } => {
                if dst == src || numel(dst) != numel(src) {
                    Err("SizeMismatch: elementwise".into())
                } else {
                    Ok(())
                }
            }
            Kernel::Scale { dst, src, .. } | Kernel::Axpy { y: dst, x: src, .. } => {
                f32_only()?;
                if dst == src || numel(dst) != numel(src) {
                    Err("SizeMismatch: elementwise".into())
                } else {
                    Ok(())
                }
            }
            Kernel::Matmul { c, a, b } => {
                f32_only()?;
                match (&dims(c)[..], &dims(a)[..], &dims(b)[..]) {
                    (&[m, n], &[m2, k], &[k2, n2]) if m == m2 && n == n2 && k == k2 => Ok(()),
                    _ => Err("SizeMismatch: matmul".into()),
                }
            }
            Kernel::SumRows { dst, src } => {
                f32_only()?;
                match dims(src)[..] {
                    [_, n] if numel(dst) == n => Ok(()),
                    _ => Err("SizeMismatch: sum_rows".into()),
                }
            }
        }
    }

    // ---- operations ------------------------------------------------------------------------

    fn root(&mut self, device: usize, stream: usize) -> Res<Obs> {
        if device >= self.setup.devices {
            return Err(format!("NoSuchDevice: device {device}"));
        }
        if stream >= self.setup.streams {
            return Err(format!("NoSuchStream: stream {stream} of device {device}"));
        }
        self.ctxs.push(Ctx {
            device,
            stream,
            parent: None,
            arrays: BTreeMap::new(),
            live: true,
            children: 0,
            owned: Vec::new(),
        });
        Ok(Obs::Done)
    }

    fn link(&mut self, c: C, kernel: &Kernel) -> Res<Obs> {
        self.check_kernel(kernel)?;
        let ctx = self.live_ctx(c)?.clone();
        let (device, stream) = (ctx.device, ctx.stream);
        #[derive(Clone, Copy)]
        enum Place {
            Existing,
            Fresh,
            Candidate,
        }
        let mut decided = Vec::new();
        let mut owners = Vec::new();
        for (n, acc) in kernel.params() {
            let n = n.0;
            let writable = acc != Acc::Read;
            if let Some(&(_, shared)) = ctx.arrays.get(&n) {
                if writable && shared && self.owner_check(device, n, stream)? {
                    owners.push(n);
                }
                decided.push((n, Place::Existing, None));
                continue;
            }
            let (place, decision) = match (writable, self.effective_sharing(device, n)?) {
                (false, Share::PerStream) => (Place::Fresh, None),
                (false, _) => (Place::Candidate, Some(Share::Shared)),
                (true, Share::Shared) => {
                    if self.owner_check(device, n, stream)? {
                        owners.push(n);
                    }
                    (Place::Candidate, None)
                }
                (true, _) => (Place::Fresh, Some(Share::PerStream)),
            };
            decided.push((n, place, decision));
        }
        // Valid: commit.
        let mut arrays = Vec::new();
        for (n, place, decision) in decided {
            if let Some(s) = decision {
                self.devices[device].sharing.insert(n, s);
            }
            match place {
                Place::Existing => {}
                Place::Fresh => arrays.push((n, self.new_buf(n), false)),
                Place::Candidate => arrays.push((n, self.candidate(device, n), true)),
            }
        }
        for n in owners {
            self.devices[device].owner.insert(n, stream);
        }
        let child = self.add_child(c.0, arrays);
        self.routines.push(Routine {
            ctx: child.0,
            kernel: kernel.clone(),
        });
        Ok(Obs::Done)
    }

    /// Schedules routine `r` with the value `t` for its index, if given: a routine with an
    /// index needs one (`MissingBinding`), one without takes none (`UnknownBinding`), and it
    /// must fit `i32` (`BindingOutOfRange`).
    fn schedule(&mut self, r: R, t: Option<i64>) -> Res<Obs> {
        let routine = self
            .routines
            .get(r.0)
            .ok_or_else(|| format!("Unknown: routine r{}", r.0))?;
        let (c, kernel) = (C(routine.ctx), routine.kernel.clone());
        match (kernel.index(), t) {
            (Some(name), None) => return Err(format!("MissingBinding: {name} of r{}", r.0)),
            (None, Some(t)) => return Err(format!("UnknownBinding: {t} for r{}", r.0)),
            (Some(_), Some(t)) if i32::try_from(t).is_err() => {
                return Err(format!("BindingOutOfRange: {t} for r{}", r.0))
            }
            _ => {}
        }
        let ctx = self.live_ctx(c)?;
        let merge = match kernel.merge() {
            None => MergeFrom::None,
            Some(m) => match &self.devices[ctx.device].merge[ctx.stream] {
                Some((n, v)) if *n == m.0 => MergeFrom::Slot(v.clone()),
                other => {
                    return Err(format!(
                        "MergeBufferMismatch: expects n{}, holds {:?}",
                        m.0,
                        other.as_ref().map(|(n, _)| *n)
                    ))
                }
            },
        };
        self.run(c, &kernel, merge, t)
    }

    /// Runs a routine (with `t` the value of its index): uploads of lagging hosted inputs,
    /// the kernel, the bookkeeping of its outputs.
    fn run(&mut self, c: C, kernel: &Kernel, merge: MergeFrom, t: Option<i64>) -> Res<Obs> {
        let params = kernel.params();
        let mut bufs = Vec::with_capacity(params.len());
        for &(n, _) in &params {
            bufs.push(self.buf_of(c, n)?);
        }
        for (&(n, acc), &b) in params.iter().zip(&bufs) {
            if acc != Acc::Write {
                self.check_written(b, n)?;
            }
        }
        for (&(n, acc), &b) in params.iter().zip(&bufs) {
            if self.hosted(n.0)? && acc != Acc::Write && self.lagging(b) {
                self.upload(b);
            }
        }
        let merge = match merge {
            MergeFrom::None => None,
            MergeFrom::Slot(v) => Some(v),
            MergeFrom::Source(b) => Some(self.bufs[b].data.clone()),
        };
        let mut vals: Vec<Vals> = bufs.iter().map(|&b| self.bufs[b].data.clone()).collect();
        self.compute(kernel, &mut vals, merge, t)?;
        for ((&(n, acc), &b), v) in params.iter().zip(&bufs).zip(vals) {
            if acc == Acc::Read {
                continue;
            }
            self.bufs[b].data = v;
            self.bufs[b].written = true;
            self.bufs[b].host_version = Some(self.hosts[n.0].version);
            if self.hosted(n.0)? {
                self.hosts[n.0].newer = Some(b);
            }
        }
        Ok(Obs::Done)
    }

    fn compute(
        &self,
        kernel: &Kernel,
        vals: &mut [Vals],
        merge: Option<Vals>,
        t: Option<i64>,
    ) -> Res<()> {
        fn zip_f32(d: &mut Vals, s: &Vals, f: impl Fn(f32, f32) -> f32) -> Res<()> {
            match (d, s) {
                (Vals::F32(d), Vals::F32(s)) => {
                    d.iter_mut().zip(s).for_each(|(d, &s)| *d = f(*d, s));
                    Ok(())
                }
                _ => Err("DTypeMismatch: f32 kernel".into()),
            }
        }
        fn add(d: &mut Vals, s: &Vals) -> Res<()> {
            match (d, s) {
                (Vals::I32(d), Vals::I32(s)) => {
                    d.iter_mut()
                        .zip(s)
                        .for_each(|(d, &s)| *d = d.wrapping_add(s));
                    Ok(())
                }
                (d, s) => zip_f32(d, s, |d, s| d + s),
            }
        }
        let dims = |n: N| self.setup.nodes[n.0].dims.clone();
        let (head, tail) = vals.split_at_mut(1);
        let dst = &mut head[0];
        match *kernel {
            Kernel::Fill { value, .. } => match dst {
                Vals::F32(d) => d.fill(value as f32),
                Vals::I32(d) => d.fill(value as i32),
            },
            Kernel::FillIndex { .. } => {
                let t = t.ok_or("MissingBinding: t")?;
                match dst {
                    Vals::F32(d) => d.fill(t as f32),
                    Vals::I32(d) => d.fill(t as i32),
                }
            }
            Kernel::Copy { .. } => *dst = tail[0].clone(),
            Kernel::AddInto { .. } => add(dst, &tail[0])?,
            Kernel::AddMerge { .. } => {
                let m = merge.ok_or("MergeBufferMismatch: nothing to merge")?;
                add(dst, &m)?
            }
            Kernel::Scale { alpha, .. } => {
                let a = alpha as f32;
                zip_f32(dst, &tail[0], |_, s| a * s)?
            }
            Kernel::Axpy { alpha, .. } => {
                let a = alpha as f32;
                zip_f32(dst, &tail[0], |y, x| y + a * x)?
            }
            Kernel::Matmul { a, b, .. } => {
                let (&[m, k], &[_, n]) = (&dims(a)[..], &dims(b)[..]) else {
                    return Err("SizeMismatch: matmul".into());
                };
                let (av, bv) = (tail[0].f32s()?, tail[1].f32s()?);
                let mut c = vec![0.0f32; m * n];
                for i in 0..m {
                    for j in 0..n {
                        let mut acc = 0.0f32;
                        for p in 0..k {
                            acc += av[i * k + p] * bv[p * n + j];
                        }
                        c[i * n + j] = acc;
                    }
                }
                *dst = Vals::F32(c);
            }
            Kernel::SumRows { src, .. } => {
                let &[m, n] = &dims(src)[..] else {
                    return Err("SizeMismatch: sum_rows".into());
                };
                let s = tail[0].f32s()?;
                let mut d = vec![0.0f32; n];
                for i in 0..m {
                    for j in 0..n {
                        d[j] += s[i * n + j];
                    }
                }
                *dst = Vals::F32(d);
            }
        }
        Ok(())
    }

    fn init_from_host(&mut self, c: C, n: N, data: Data) -> Res<Obs> {
        let ctx = self.live_ctx(c)?;
        let device = ctx.device;
        if ctx.arrays.contains_key(&n.0) {
            return Err(format!("AlreadyInContext: n{} in c{}", n.0, c.0));
        }
        if !self.hosted(n.0)? {
            return Err(format!("ModeConflict: n{} is not hosted", n.0));
        }
        self.host_write(n, data)?;
        let (b, shared) = match self.effective_sharing(device, n.0)? {
            Share::Shared => (self.candidate(device, n.0), true),
            _ => {
                self.devices[device].sharing.insert(n.0, Share::PerStream);
                (self.new_buf(n.0), false)
            }
        };
        self.add_child(c.0, vec![(n.0, b, shared)]);
        self.upload(b);
        Ok(Obs::Done)
    }

    fn hosted_buf(&self, c: C, n: N) -> Res<usize> {
        self.live_ctx(c)?;
        if !self.hosted(n.0)? {
            return Err(format!("NotHosted: n{}", n.0));
        }
        self.buf_of(c, n)
    }

    fn host_write(&mut self, n: N, data: Data) -> Res<Obs> {
        let d = self.decl(n.0)?.clone();
        if !d.mode.is_hosted() {
            return Err(format!("NotHosted: n{}", n.0));
        }
        let h = &mut self.hosts[n.0];
        h.data = Vals::from_data(d.dtype, data, d.numel());
        h.version += 1;
        h.newer = None;
        Ok(Obs::Done)
    }

    fn host_read(&mut self, n: N) -> Res<Values> {
        if !self.hosted(n.0)? {
            return Err(format!("NotHosted: n{}", n.0));
        }
        self.save_newest(n.0);
        Ok(self.hosts[n.0].data.values())
    }

    /// The value a routine of the context holding buffer `b` would read: the buffer's, or
    /// the host array's when the buffer lags it.
    fn value_of(&self, b: usize) -> Values {
        let n = self.bufs[b].node;
        if self.setup.nodes[n].mode.is_hosted() && self.lagging(b) {
            self.hosts[n].data.values()
        } else {
            self.bufs[b].data.values()
        }
    }

    fn device_to_device(&mut self, n: N, src: C, dst: C, mode: D2d) -> Res<Obs> {
        let d = self.live_ctx(dst)?.clone();
        let sb = self.buf_of(src, n)?;
        // Every check first: a refused operation changes nothing.
        let db = match mode {
            D2d::No => {
                let db = self.buf_of(dst, n)?;
                if db == sb {
                    return Ok(Obs::NoOp);
                }
                Some(db)
            }
            D2d::Copy => None,
            D2d::StreamingFor(r) => {
                self.check_streaming(n, src, &d, sb, r)?;
                None
            }
        };
        // The source is read: it must hold a value, and a lagging one is uploaded first, as
        // for a routine.
        self.check_written(sb, n)?;
        if self.hosted(n.0)? && self.lagging(sb) {
            self.upload(sb);
            let mode = match mode {
                D2d::No => 1,
                D2d::Copy => 2,
                D2d::StreamingFor(_) => 3,
            };
            self.lagging_reads[mode] += 1;
        }
        match (mode, db) {
            (D2d::No, Some(db)) => {
                self.bufs[db].data = self.bufs[sb].data.clone();
                self.bufs[db].written = true;
                self.bufs[db].host_version = self.bufs[sb].host_version;
                if self.hosted(n.0)? {
                    // The source holds the current host version now, so the copy is the
                    // node's newest device value (equal to the host's).
                    self.hosts[n.0].newer = Some(db);
                }
                Ok(Obs::Done)
            }
            (D2d::Copy, _) => {
                let v = self.bufs[sb].data.clone();
                self.devices[d.device].merge[d.stream] = Some((n.0, v));
                Ok(Obs::Done)
            }
            (D2d::StreamingFor(r), _) => {
                let (rc, kernel) = (C(self.routines[r.0].ctx), self.routines[r.0].kernel.clone());
                // A streaming consumer gets no index values (the generator's consumers,
                // `add_merge`, declare none).
                self.run(rc, &kernel, MergeFrom::Source(sb), None)
            }
            (D2d::No, None) => Err("Unknown: no destination buffer".into()),
        }
    }

    /// The checks of a `StreamingFor` of `n` from buffer `sb` (of context `src`) to the
    /// consumer `r` on `dst`'s stream.
    fn check_streaming(&self, n: N, src: C, dst: &Ctx, sb: usize, r: R) -> Res<()> {
        let routine = self
            .routines
            .get(r.0)
            .ok_or_else(|| format!("Unknown: routine r{}", r.0))?;
        let (rc, kernel) = (C(routine.ctx), routine.kernel.clone());
        let consumer = self.live_ctx(rc)?;
        if (consumer.device, consumer.stream) != (dst.device, dst.stream) {
            return Err("InvalidRoutine: consumer on another stream".into());
        }
        let src_device = self.live_ctx(src)?.device;
        if self.streaming == Streaming::SameDevice && src_device != dst.device {
            return Err("StreamingUnsupported: across devices".into());
        }
        match kernel.merge() {
            None => return Err("InvalidRoutine: the consumer reads no merge buffer".into()),
            Some(m) if m != n => return Err(format!("MergeBufferMismatch: expects n{}", m.0)),
            Some(_) => {}
        }
        for (p, acc) in kernel.params() {
            let pb = self.buf_of(rc, p)?;
            if acc != Acc::Read && pb == sb {
                return Err("StreamingUnsupported: the source is the consumer's output".into());
            }
        }
        Ok(())
    }

    fn finalize(&mut self, c: C) -> Res<Obs> {
        let ctx = self.live_ctx(c)?;
        if ctx.children > 0 {
            return Err(format!(
                "ContextInUse: c{} has {} children",
                c.0, ctx.children
            ));
        }
        let (owned, parent) = (ctx.owned.clone(), ctx.parent);
        for b in owned {
            let n = self.bufs[b].node;
            if self.hosts[n].newer == Some(b) {
                self.save_newest(n);
            }
        }
        self.ctxs[c.0].live = false;
        if let Some(p) = parent {
            self.ctxs[p].children -= 1;
        }
        Ok(Obs::Done)
    }

    fn checkpoint(&mut self) -> Res<Obs> {
        let mut buffers = Vec::new();
        for (i, ctx) in self.ctxs.iter().enumerate() {
            if !ctx.live {
                continue;
            }
            for (&n, &(b, _)) in &ctx.arrays {
                buffers.push((C(i), N(n), self.value_of(b)));
            }
        }
        let mut host = Vec::new();
        for n in 0..self.setup.nodes.len() {
            if self.setup.nodes[n].mode.is_hosted() {
                host.push((N(n), self.host_read(N(n))?));
            }
        }
        Ok(Obs::Checkpoint { buffers, host })
    }

    fn teardown(&mut self) -> Res<Obs> {
        for i in (0..self.ctxs.len()).rev() {
            if self.ctxs[i].live {
                self.finalize(C(i))?;
            }
        }
        Ok(Obs::Memory(
            self.devices
                .iter()
                .map(|d| DeviceMemory {
                    allocations: d.candidates.len(),
                    live_bytes: d
                        .candidates
                        .keys()
                        .map(|&n| self.setup.nodes[n].bytes().div_ceil(64) * 64)
                        .sum(),
                    contexts: 0,
                })
                .collect(),
        ))
    }

    /// Applies one operation; on error nothing changes.
    pub fn apply(&mut self, op: &Op) -> OpResult {
        match op {
            Op::Root { device, stream } => self.root(*device, *stream),
            Op::Link { ctx, kernel } => self.link(*ctx, kernel),
            Op::Schedule { routine } => self.schedule(*routine, None),
            Op::ScheduleWith { routine, t } => self.schedule(*routine, Some(*t)),
            Op::InitFromHost { ctx, node, data } => self.init_from_host(*ctx, *node, *data),
            Op::FromHost { ctx, node } => {
                let b = self.hosted_buf(*ctx, *node)?;
                self.upload(b);
                Ok(Obs::Done)
            }
            Op::ToHost { ctx, node } => {
                let b = self.hosted_buf(*ctx, *node)?;
                let h = &mut self.hosts[node.0];
                h.data = self.bufs[b].data.clone();
                h.newer = None;
                Ok(Obs::Done)
            }
            Op::DeviceToDevice {
                node,
                src,
                dst,
                mode,
            } => self.device_to_device(*node, *src, *dst, *mode),
            Op::HostRead { node } => self.host_read(*node).map(Obs::Values),
            Op::HostWrite { node, data } => self.host_write(*node, *data),
            Op::Read { ctx, node } => {
                let b = self.buf_of(*ctx, *node)?;
                if self.hosted(node.0)? && self.lagging(b) {
                    self.lagging_reads[0] += 1;
                }
                Ok(Obs::Values(self.value_of(b)))
            }
            Op::Finalize { ctx } => self.finalize(*ctx),
            Op::Sync => Ok(Obs::Done),
            Op::Checkpoint => self.checkpoint(),
            Op::Teardown => self.teardown(),
            Op::Step { ops, replays } => {
                // What a captured step means: its operations issued `1 + replays` times.
                for _ in 0..=*replays {
                    for op in ops {
                        self.apply(op)?;
                    }
                }
                Ok(Obs::Done)
            }
        }
    }
}

impl Executor for Reference {
    fn apply(&mut self, op: &Op) -> OpResult {
        Reference::apply(self, op)
    }
}

/// Where a backend can read a buffer in place (`StreamingFor`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Streaming {
    /// Any device's memory (the CPU backend: one address space).
    #[default]
    AnyDevice,
    /// Only memory of the consumer's own device (Vulkan: a kernel binds buffers of its
    /// own `VkDevice`); streaming across devices is refused with `StreamingUnsupported`.
    SameDevice,
}

/// Runs programs on the reference.
#[derive(Clone, Copy, Debug, Default)]
pub struct ReferenceRunner {
    /// What the backend being checked can stream.
    pub streaming: Streaming,
}

impl ReferenceRunner {
    /// The reference of a backend that streams as `streaming` says.
    pub fn streaming(streaming: Streaming) -> ReferenceRunner {
        ReferenceRunner { streaming }
    }
}

impl ProgramRunner for ReferenceRunner {
    fn name(&self) -> String {
        "reference".into()
    }

    fn start(&mut self, setup: &Setup) -> Result<Box<dyn Executor>, String> {
        Ok(Box::new(Reference::with_streaming(setup, self.streaming)))
    }
}
