//! The wire algorithms of the network operations: what each sends and receives once the
//! ranks agreed on it in `network.rs`. A barrier, the direct and ring all-reduces, and
//! point-to-point sends and receives.

use tributary::{collective::ReduceOp, kernels::ArgError, DType, Error, Result};

use std::sync::Arc;

use smallvec::{smallvec, SmallVec};

use super::{
    bytemuck_bytes, bytemuck_bytes_mut, phase, tag, DataLeg, ExchangePart, ExecGuard, Issued,
    Network, Payload, Requests, Results,
};
use crate::cluster::{
    header::{CrossRankAlgorithm, Status},
    mpi::Request,
    reduce::{self, Wire},
};

impl Network {
    /// A header exchange and nothing else.
    pub(crate) fn barrier(&self, guard: &mut ExecGuard<'_>, op: &Issued) -> Result<()> {
        let direct = CrossRankAlgorithm::Direct;
        self.exchange_headers(guard, op, direct, Status::Ready, 0, Payload::None)
            .map(|_| ())
    }

    /// Tells the other ranks that this rank's input of `op` is unusable (a view error).
    pub(crate) fn input_failed(
        &self,
        guard: &mut ExecGuard<'_>,
        op: &Issued,
        why: String,
    ) -> Result<()> {
        self.catch_up(guard, op);
        Err(Error::Internal(format!(
            "the input of {} could not be read on this rank: {why}",
            op.desc.describe()
        )))
    }

    /// The cross-rank all-reduce of `input` into `output` (same size; the storage dtype of
    /// the operation), the mean divided by the contributions of every rank. A `Direct`
    /// all-reduce of at most [`PIGGYBACK_MAX_BYTES`](super::PIGGYBACK_MAX_BYTES) wire bytes
    /// sends its input in its header's message: one message to every other rank, and the sum
    /// of the payloads once the headers agree.
    ///
    /// `input` must outlive a fault's abandoned requests, as every buffer MPI reads does: the
    /// kernel's view into pool memory, or a vector the network stream keeps with its
    /// abandoned buffers (module docs of `cluster`). f16 and bf16 are accumulated in f32
    /// vectors of this function's, kept so at a fault.
    pub(crate) fn all_reduce(
        &self,
        guard: &mut ExecGuard<'_>,
        op: &Issued,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<()> {
        let dtype = op.desc.dtype;
        let wire = match Wire::of(dtype) {
            Ok(w) => w,
            Err(e) => return self.input_failed(guard, op, e.to_string()),
        };
        if wire.same_as_storage(dtype) {
            return self.all_reduce_on_wire(guard, op, wire, input, output);
        }
        // f16 / bf16: accumulated in f32 (the wire carries f32 partial sums), in vectors of
        // f64 words that a fault keeps with the abandoned buffers (a send may still read the
        // widened input, a receive write the output).
        let n = op.desc.elements() as usize;
        let bytes = n * wire.size();
        let mut wide_in = vec![0f64; bytes.div_ceil(8)];
        let widened = reduce::widen_into(
            dtype,
            input,
            &mut bytemuck::cast_slice_mut::<f64, f32>(&mut wide_in)[..n],
        );
        if let Err(e) = widened {
            return self.input_failed(guard, op, e.to_string());
        }
        let mut wide_out = vec![0f64; bytes.div_ceil(8)];
        let result = self.all_reduce_on_wire(
            guard,
            op,
            wire,
            &bytemuck_bytes(&wide_in)[..bytes],
            &mut bytemuck_bytes_mut(&mut wide_out)[..bytes],
        );
        match result {
            Ok(()) => reduce::narrow(
                dtype,
                &bytemuck::cast_slice::<f64, f32>(&wide_out)[..n],
                output,
            ),
            Err(e) => {
                guard.state.abandoned.push((Vec::new(), wide_in));
                guard.state.abandoned.push((Vec::new(), wide_out));
                Err(e)
            }
        }
    }

    /// [`Network::all_reduce`] of `input` into `output` in the wire type (`input` outlives
    /// abandoned requests: see there).
    fn all_reduce_on_wire(
        &self,
        guard: &mut ExecGuard<'_>,
        op: &Issued,
        wire: Wire,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<()> {
        let n = op.desc.elements() as usize;
        let wire_bytes = n * wire.size();
        if input.len() != wire_bytes || output.len() != wire_bytes {
            let why = format!(
                "its views hold {} and {} wire bytes where {n} elements take {wire_bytes}",
                input.len(),
                output.len()
            );
            return self.input_failed(guard, op, why);
        }
        let algorithm = self.algorithm_for(op.desc.algorithm, wire_bytes);
        // Decided from what the headers compare (algorithm, elements, dtype): ranks whose
        // headers agree decide alike.
        let piggyback = self.piggyback_bytes(&op.desc, algorithm) > 0;
        let payload = if piggyback {
            // SAFETY: `input` outlives abandoned requests (the contract of `all_reduce`).
            unsafe { Payload::kept(input) }
        } else {
            Payload::None
        };
        let scale = self.contribute(guard, op, algorithm, payload)?;
        if piggyback {
            self.sum_payloads(guard, wire, input, output, scale);
            Ok(())
        } else {
            self.all_reduce_wire(guard, op, algorithm, wire, n, input, output, scale)
        }
    }

    /// The header exchange of an all-reduce this rank takes part in with `payload` and its
    /// contributions; the mean's factor over every rank's contributions (`None` for a sum).
    fn contribute(
        &self,
        guard: &mut ExecGuard<'_>,
        op: &Issued,
        algorithm: CrossRankAlgorithm,
        payload: Payload<'_>,
    ) -> Result<Option<f64>> {
        let status = Status::Ready;
        let headers =
            self.exchange_headers(guard, op, algorithm, status, op.contributions, payload)?;
        Ok(mean_scale(op, &headers))
    }

    /// The cross-rank all-reduce of `data` in place (a context's own buffer on the network
    /// stream). A piggybacked `Direct` all-reduce of f32 or f64 sends `data` in its header
    /// message and sums into it in rank order, reading this rank's part where it is: nothing
    /// is copied aside. Otherwise this rank's contribution is copied aside first (into a
    /// vector kept for the next one), then reduced as [`Network::all_reduce`] does into
    /// `data`; on an error the copy is kept with the abandoned buffers, since a send may
    /// still read it.
    pub(crate) fn all_reduce_in_place(
        &self,
        guard: &mut ExecGuard<'_>,
        op: &Issued,
        data: &mut [u8],
    ) -> Result<()> {
        let dtype = op.desc.dtype;
        let algorithm = self.algorithm_for(op.desc.algorithm, super::wire_bytes(&op.desc));
        let piggybacked = self.piggyback_bytes(&op.desc, algorithm);
        if let Ok(wire) = Wire::of(dtype) {
            if wire.same_as_storage(dtype) && piggybacked > 0 && piggybacked == data.len() {
                // SAFETY: `data` is the kernel's view into pool memory, which outlives
                // abandoned requests (module docs of `cluster`).
                let payload = unsafe { Payload::kept(data) };
                let scale = self.contribute(guard, op, algorithm, payload)?;
                let (me, size, len) = (self.rank(), self.size(), data.len());
                let part = |r: usize| Network::payload(guard, r, len);
                sum_in_place(wire, me, size, part, data, scale);
                return Ok(());
            }
        }
        let mut own = std::mem::take(&mut guard.state.own);
        own.clear();
        own.resize(data.len().div_ceil(8), 0.0);
        let own_bytes = &mut bytemuck_bytes_mut(&mut own)[..data.len()];
        own_bytes.copy_from_slice(data);
        let result = self.all_reduce(guard, op, &bytemuck_bytes(&own)[..data.len()], data);
        if result.is_ok() {
            guard.state.own = own;
        } else {
            guard.state.abandoned.push((Vec::new(), own));
        }
        result
    }

    /// The sum, in rank order, of this rank's `input` and the payloads every other rank's
    /// header message brought (a piggybacked `Direct` all-reduce, once the headers agreed).
    fn sum_payloads(
        &self,
        guard: &ExecGuard<'_>,
        wire: Wire,
        input: &[u8],
        output: &mut [u8],
        scale: Option<f64>,
    ) {
        let (me, size) = (self.rank(), self.size());
        let part = |r: usize| Network::payload(guard, r, input.len());
        sum_in_rank_order(wire, me, size, input, part, output, scale);
    }

    #[allow(clippy::too_many_arguments)]
    fn all_reduce_wire(
        &self,
        guard: &mut ExecGuard<'_>,
        op: &Issued,
        algorithm: CrossRankAlgorithm,
        wire: Wire,
        n: usize,
        input: &[u8],
        output: &mut [u8],
        scale: Option<f64>,
    ) -> Result<()> {
        if self.size() == 1 {
            output.copy_from_slice(input);
            if let Some(s) = scale {
                reduce::scale(wire, output, s);
            }
            return Ok(());
        }
        match algorithm {
            CrossRankAlgorithm::Direct | CrossRankAlgorithm::Auto => {
                self.direct(guard, op, wire, input, output, scale)
            }
            CrossRankAlgorithm::Ring => self.ring(guard, op, wire, n, input, output, scale),
            CrossRankAlgorithm::Mpi => {
                // SAFETY: `input` and `output` are the operation's distinct buffers (the
                // kernel's merge view and output view, or this function's own vectors),
                // alive until the request completes or, abandoned, until finalisation
                // (module docs of `cluster`: the pools outlive `MPI_Finalize`).
                let request = unsafe {
                    self.mpi.iallreduce_sum(
                        input.as_ptr(),
                        output.as_mut_ptr(),
                        n,
                        matches!(wire, Wire::F64),
                    )?
                };
                self.wait_one(guard, request, op)?;
                if let Some(s) = scale {
                    reduce::scale(wire, output, s);
                }
                Ok(())
            }
        }
    }

    /// Every rank sends its whole input to every other; each sums all in rank order.
    fn direct(
        &self,
        guard: &mut ExecGuard<'_>,
        op: &Issued,
        wire: Wire,
        input: &[u8],
        output: &mut [u8],
        scale: Option<f64>,
    ) -> Result<()> {
        let (rank, size, bytes) = (self.rank(), self.size(), input.len());
        let t = tag(op.seq, phase::DIRECT);
        let slot = bytes.div_ceil(8);
        let mut keep = std::mem::take(&mut guard.state.staging);
        keep.clear();
        keep.resize(slot * size, 0.0);
        let base = keep.as_mut_ptr().cast::<u8>();
        let mut requests = Requests::with_capacity(2 * size);
        let posted = (|| {
            for peer in (0..size).filter(|&p| p != rank) {
                // SAFETY: slot `peer` of `keep` (not reallocated from here on) receives only
                // this message; `wait` and `abandon` keep `keep` while a request may use it.
                // The input is the operation's input view, alive until finalisation (module
                // docs of `cluster`).
                unsafe {
                    requests.push(self.mpi.irecv(base.add(peer * slot * 8), bytes, peer, t)?);
                    requests.push(self.mpi.isend(input.as_ptr(), bytes, peer, t)?);
                }
            }
            Ok(())
        })();
        if let Err(e) = posted {
            return Err(self.abandon(guard, &mut requests, keep, e));
        }
        let keep = self.wait(guard, &mut requests, keep, op, self.deadline())?;
        let all = bytemuck_bytes(&keep);
        let part = |r: usize| &all[r * slot * 8..r * slot * 8 + bytes];
        sum_in_rank_order(wire, rank, size, input, part, output, scale);
        guard.state.staging = keep;
        Ok(())
    }

    /// Reduce-scatter then all-gather around the ranks, in chunks.
    #[allow(clippy::too_many_arguments)]
    fn ring(
        &self,
        guard: &mut ExecGuard<'_>,
        op: &Issued,
        wire: Wire,
        n: usize,
        input: &[u8],
        output: &mut [u8],
        scale: Option<f64>,
    ) -> Result<()> {
        let (rank, size, es) = (self.rank(), self.size(), wire.size());
        let right = (rank + 1) % size;
        let left = (rank + size - 1) % size;
        let seg = |j: usize| (j * n / size * es)..((j + 1) * n / size * es);
        let longest = (0..size).map(|j| seg(j).len()).max().unwrap_or(0);
        let chunk = self.config.chunk_bytes.max(es) / es * es;
        let mut keep = std::mem::take(&mut guard.state.staging);
        keep.clear();
        keep.resize(longest.div_ceil(8), 0.0);
        let staging = keep.as_mut_ptr().cast::<u8>();
        let out = output.as_mut_ptr();
        // Reduce-scatter: at step s, send segment r - s, receive r - s - 1 and add this
        // rank's input of it (each segment is received once: the input is still unread).
        let t = tag(op.seq, phase::SCATTER);
        for s in 0..size - 1 {
            let send = seg((rank + size - s) % size);
            let recv = seg((rank + 2 * size - s - 1) % size);
            let src = if s == 0 {
                input.as_ptr()
            } else {
                out.cast_const()
            };
            let mut receives = Vec::new();
            let mut sends = Requests::new();
            let posted = (|| {
                let mut at = 0;
                while at < recv.len() || (at == 0 && recv.is_empty()) {
                    let len = chunk.min(recv.len() - at);
                    // SAFETY: staging holds `longest` bytes; the chunk is inside it and only
                    // this receive writes it. Kept in `keep` (see `wait` and `abandon`).
                    receives.push((at, len, unsafe {
                        self.mpi.irecv(staging.add(at), len, left, t)?
                    }));
                    at += len.max(1);
                }
                let mut at = 0;
                while at < send.len() || (at == 0 && send.is_empty()) {
                    let len = chunk.min(send.len() - at);
                    // SAFETY: the segment is inside the input (step 0) or the output, which
                    // outlive the requests (module docs of `cluster`); no receive of this
                    // step writes it.
                    sends.push(unsafe { self.mpi.isend(src.add(send.start + at), len, right, t)? });
                    at += len.max(1);
                }
                Ok(())
            })();
            if let Err(e) = posted {
                let mut all: Requests = receives.into_iter().map(|(_, _, r)| r).collect();
                all.append(&mut sends);
                return Err(self.abandon(guard, &mut all, keep, e));
            }
            for (at, len, request) in receives {
                keep = self.wait(guard, &mut smallvec![request], keep, op, self.deadline())?;
                let range = recv.start + at..recv.start + at + len;
                // SAFETY: the output range is this step's receive segment, which no pending
                // request reads (the sends read another segment); the staging chunk was
                // just received.
                let (dst, incoming) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(out.add(range.start), len),
                        std::slice::from_raw_parts(staging.add(at), len),
                    )
                };
                dst.copy_from_slice(&input[range]);
                reduce::add_into(wire, dst, incoming);
            }
            keep = self.wait(guard, &mut sends, keep, op, self.deadline())?;
        }
        // This rank now holds segment r + 1 in full.
        let full = seg((rank + 1) % size);
        if let Some(s) = scale {
            // SAFETY: no request is pending.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.add(full.start), full.len()) };
            reduce::scale(wire, dst, s);
        }
        // All-gather: at step s, send segment r + 1 - s, receive segment r - s in place.
        let t = tag(op.seq, phase::GATHER);
        for s in 0..size - 1 {
            let send = seg((rank + 1 + size - s) % size);
            let recv = seg((rank + size - s) % size);
            let mut requests = Requests::new();
            let posted = (|| {
                // SAFETY: the receive writes segment `recv` of the output and the send reads
                // segment `send`, two different segments; the output outlives the requests
                // (module docs of `cluster`).
                unsafe {
                    requests.push(self.mpi.irecv(out.add(recv.start), recv.len(), left, t)?);
                    requests.push(self.mpi.isend(out.add(send.start), send.len(), right, t)?);
                }
                Ok(())
            })();
            if let Err(e) = posted {
                return Err(self.abandon(guard, &mut requests, keep, e));
            }
            keep = self.wait(guard, &mut requests, keep, op, self.deadline())?;
        }
        guard.state.staging = keep;
        Ok(())
    }

    /// The sending side of a transfer: data of at most [`PIGGYBACK_MAX_BYTES`](super::PIGGYBACK_MAX_BYTES) travels in
    /// the header's message, larger data after the headers agreed.
    pub(crate) fn send(&self, guard: &mut ExecGuard<'_>, op: &Issued, input: &[u8]) -> Result<()> {
        // Decided from the byte size, which the headers compare (elements and dtype).
        let (sent, _) = self.transfer_payloads(&op.desc);
        if input.len() != super::transfer_bytes(&op.desc) {
            let why = format!("its view holds {} bytes", input.len());
            return self.input_failed(guard, op, why);
        }
        if sent > 0 {
            // SAFETY: the input view is pool memory, which outlives abandoned requests
            // (module docs of `cluster`).
            let payload = unsafe { Payload::kept(input) };
            return self.transfer_headers(guard, op, Status::Ready, payload, 0);
        }
        self.transfer_headers(guard, op, Status::Ready, Payload::None, 0)?;
        let (_, to) = op.desc.route.unwrap_or((0, 0));
        // SAFETY: the input view outlives the request (module docs of `cluster`).
        let request = unsafe {
            self.mpi.isend(
                input.as_ptr(),
                input.len(),
                to,
                tag(op.seq, phase::TRANSFER_DATA),
            )?
        };
        self.wait_one(guard, request, op)
    }

    /// The receiving side of a transfer, into `output` (from the header's message when the
    /// data is at most [`PIGGYBACK_MAX_BYTES`](super::PIGGYBACK_MAX_BYTES)).
    pub(crate) fn recv(
        &self,
        guard: &mut ExecGuard<'_>,
        op: &Issued,
        output: &mut [u8],
    ) -> Result<()> {
        let (_, expected) = self.transfer_payloads(&op.desc);
        if output.len() != super::transfer_bytes(&op.desc) {
            let why = format!("its view holds {} bytes", output.len());
            return self.input_failed(guard, op, why);
        }
        self.transfer_headers(guard, op, Status::Ready, Payload::None, expected)?;
        if expected > 0 {
            return Network::copy_payload(guard, 0, output);
        }
        let (from, _) = op.desc.route.unwrap_or((0, 0));
        // SAFETY: the output view outlives the request (module docs of `cluster`) and
        // nothing else writes it while this routine runs.
        let request = unsafe {
            self.mpi.irecv(
                output.as_mut_ptr(),
                output.len(),
                from,
                tag(op.seq, phase::TRANSFER_DATA),
            )?
        };
        self.wait_one(guard, request, op)
    }

    /// [`Network::wait`] for one request whose memory is the operation's own (no staging of
    /// the network stream's to keep at a fault).
    fn wait_one(&self, guard: &mut ExecGuard<'_>, request: Request, op: &Issued) -> Result<()> {
        let mut requests: Requests = smallvec![request];
        self.wait(guard, &mut requests, Vec::new(), op, self.deadline())
            .map(|_| ())
    }
}

/// What an exchange's kernel gives each of its transfers, in issue order: the view it
/// sends, or the view it receives into (the kernel's error when it could not get one).
pub(crate) enum View<'a> {
    Send(std::result::Result<&'a [u8], ArgError>),
    Recv(std::result::Result<&'a mut [u8], ArgError>),
}

impl Network {
    /// An exchange (a sendrecv's send and receive, or more): the transfers `ops` that
    /// [`Network::issue_group`] queued as one routine's, each with its `views` entry (in
    /// issue order), run at once ([`Network::transfer_parts`]): every header message posted
    /// together, each part's data that does not travel with its header posted once that
    /// part's headers agreed, everything waited for together. So a sendrecv costs one
    /// exchange's latency where a send then a receive cost two, and a ring of them cannot
    /// wait on itself. A view that is missing or of another size than its transfer moves
    /// fails that part here and on its peer (as a failed input does). Each part's result,
    /// in issue order, lands in `results`.
    pub(crate) fn exchange(
        &self,
        guard: &mut ExecGuard<'_>,
        ops: &[Arc<Issued>],
        views: &mut SmallVec<[View<'_>; 4]>,
        results: &mut Results,
    ) {
        let rank = self.rank();
        if views.len() != ops.len() {
            let e = Error::Internal(format!(
                "an exchange of {} transfers given {} views",
                ops.len(),
                views.len()
            ));
            results.clear();
            results.extend(ops.iter().map(|_| Err(e.clone())));
            return;
        }
        // One pass: why each part's own view is unusable here (if it is), what travels
        // with its header, and its data leg. The payloads copy the views' slices out (they
        // borrow the kernel's memory, not `views`), so the parts outlive the pass.
        let mut parts: SmallVec<[ExchangePart<'_>; 4]> = SmallVec::new();
        for (op, view) in ops.iter().zip(views.iter_mut()) {
            let why = unusable(rank, op, view);
            let (sent, expected) = self.transfer_payloads(&op.desc);
            let (from, to) = op.desc.route.unwrap_or((rank, rank));
            let t = tag(op.seq, phase::TRANSFER_DATA);
            let (payload, leg) = match (&mut *view, &why) {
                (_, Some(_)) => (Payload::Unread(sent), None),
                // SAFETY: the input view is pool memory, which outlives abandoned requests
                // (module docs of `cluster`).
                (View::Send(Ok(i)), None) if sent > 0 => (unsafe { Payload::kept(i) }, None),
                // SAFETY: as above, and unwritten while this routine runs: the exchange's
                // receives write other nodes' buffers (a node is not both sent and received
                // by one exchange, `Cluster::exchange`).
                (View::Send(Ok(i)), None) => {
                    (Payload::None, Some(unsafe { DataLeg::send(i, to, t) }))
                }
                // SAFETY: the output view is pool memory, which outlives abandoned requests,
                // and nothing else reads or writes it while this routine runs.
                (View::Recv(Ok(o)), None) if expected == 0 => {
                    (Payload::None, Some(unsafe { DataLeg::recv(o, from, t) }))
                }
                _ => (Payload::None, None),
            };
            parts.push(ExchangePart {
                op,
                status: status_of(&why),
                payload,
                expected,
                data: leg,
                failed: why,
            });
        }
        if let Err(fault) = self.transfer_parts(guard, &parts, results) {
            results.clear();
            results.extend(ops.iter().map(|_| Err(fault.clone())));
            return;
        }
        // By index, not by draining the lists (a drain's and an owning iterator's moves
        // were 1.5% of a replayed Task Bench timestep).
        for (i, (part, view)) in parts.iter().zip(views.iter_mut()).enumerate() {
            let Some(result) = results.get_mut(i) else {
                break;
            };
            if let Some(why) = &part.failed {
                // This rank's own failed view is its part's error (the peer was told by
                // the header).
                *result = Err(Error::Internal(format!(
                    "the view of {} could not be used on this rank: {why}",
                    part.op.desc.describe()
                )));
                continue;
            }
            // Data that travelled with the header: in the part's slot.
            if let (Ok(()), View::Recv(Ok(out)), true) = (&*result, view, part.expected > 0) {
                *result = Network::copy_payload(guard, 2 * i, out);
            }
        }
        views.clear();
    }
}

/// Why the view an exchange's kernel gave `op` cannot be used on this rank (`rank`), if it
/// cannot: the other direction's, or not the transfer's size, or the kernel's error.
fn unusable(rank: usize, op: &Issued, view: &View<'_>) -> Option<String> {
    let sends = op.desc.route.is_some_and(|(from, _)| from == rank);
    let len = match (view, sends) {
        (View::Send(v), true) => v.as_ref().map(|v| v.len()),
        (View::Recv(v), false) => v.as_ref().map(|v| v.len()),
        _ => return Some("the routine's view is the other direction's".into()),
    };
    match len {
        Ok(n) if n == super::transfer_bytes(&op.desc) => None,
        Ok(n) => Some(format!("its view holds {n} bytes")),
        Err(e) => Some(e.to_string()),
    }
}

/// The status a part's header carries: `InputFailed` when its view failed here.
fn status_of(failed: &Option<String>) -> Status {
    match failed {
        None => Status::Ready,
        Some(_) => Status::InputFailed,
    }
}

/// The factor of a mean over the contributions every rank's header announced (`None` for
/// a sum).
fn mean_scale(op: &Issued, headers: &[crate::cluster::header::Header]) -> Option<f64> {
    let total: usize = headers.iter().map(|h| usize::from(h.contributions)).sum();
    match op.desc.op {
        Some(ReduceOp::Mean) => Some(1.0 / total.max(1) as f64),
        _ => None,
    }
}

/// The sum of every rank's part into `output` in rank order (each element summed once, in
/// one order, so every rank gets the same bits): rank `me`'s part is `input`, another
/// rank's `part(r)`; then the mean's scale.
fn sum_in_rank_order<'a>(
    wire: Wire,
    me: usize,
    size: usize,
    input: &'a [u8],
    part: impl Fn(usize) -> &'a [u8],
    output: &mut [u8],
    scale: Option<f64>,
) {
    for r in 0..size {
        let part = if r == me { input } else { part(r) };
        match (r, scale) {
            (0, _) => {
                // Every part is as long as the output (a shorter one would leave the rest).
                let n = part.len().min(output.len());
                output[..n].copy_from_slice(&part[..n]);
            }
            // The mean's scale in the last addition's pass: `(sum + part) * factor`, the
            // same two roundings as adding, then scaling.
            (r, Some(s)) if r == size - 1 => reduce::accumulate(wire, output, part, Some(s)),
            _ => reduce::add_into(wire, output, part),
        }
    }
    if let (1, Some(s)) = (size, scale) {
        reduce::scale(wire, output, s);
    }
}

/// [`sum_in_rank_order`] into `data`, which holds rank `me`'s own part and nothing else
/// does: the same bits, this rank's part read where it is. On rank 0 and rank 1 `data` is
/// the running sum from the start (rank 1 adds rank 0's part first: addition is
/// commutative); a later rank sums blockwise through a small buffer (every element is
/// summed on its own, so blocks give the same bits).
fn sum_in_place<'a>(
    wire: Wire,
    me: usize,
    size: usize,
    part: impl Fn(usize) -> &'a [u8],
    data: &mut [u8],
    scale: Option<f64>,
) {
    if me > 1 {
        const BLOCK: usize = 2048;
        let mut sum = [0u8; BLOCK];
        let mut at = 0;
        while at < data.len() {
            let end = (at + BLOCK).min(data.len());
            let block = &mut sum[..end - at];
            let own = &data[at..end];
            if mutant!("cluster_in_place_order") {
                // The mutant adds the others' parts to this rank's, out of rank order.
                block.copy_from_slice(own);
                for r in (0..size).filter(|&r| r != me) {
                    let last = if r == size - 1 { scale } else { None };
                    reduce::accumulate(wire, block, span(part(r), at, end), last);
                }
            } else {
                let parts = |r: usize| span(part(r), at, end);
                sum_in_rank_order(wire, me, size, own, parts, block, scale);
            }
            data[at..end].copy_from_slice(block);
            at = end;
        }
        return;
    }
    // The last part added: the last rank, or the one before it when that is this one.
    let last = if me + 1 == size {
        me.wrapping_sub(1)
    } else {
        size - 1
    };
    for r in (0..size).filter(|&r| r != me) {
        reduce::accumulate(wire, data, part(r), if r == last { scale } else { None });
    }
    if let (1, Some(s)) = (size, scale) {
        reduce::scale(wire, data, s);
    }
}

/// Bytes `at..end` of `part` (none if it is shorter: every part is as long as the sum).
fn span(part: &[u8], at: usize, end: usize) -> &[u8] {
    part.get(at..end).unwrap_or(&[])
}

/// Whether `dtype` can be all-reduced across ranks (f32, f64, and f16/bf16 through f32).
pub(crate) fn check_dtype(dtype: DType, routine: &str) -> Result<()> {
    Wire::of(dtype)
        .map(|_| ())
        .map_err(|_| Error::InvalidRoutine {
            routine: routine.to_string(),
            reason: format!("{dtype} cannot be all-reduced across ranks (f32, f64, f16, bf16 can)"),
        })
}
