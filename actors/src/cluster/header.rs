//! What a network operation is, and the header every rank sends before its data.
//!
//! MPI assumes the SPMD contract and never checks it. Here every rank compares the headers of
//! each network operation before any data moves, so a mismatch is
//! [`Error::CollectiveMismatch`] on every rank, not a hang. A failed input travels as
//! [`Status::InputFailed`] and becomes [`Error::RankInputFailed`] on the other ranks. See
//! DESIGN.md §9, "The SPMD contract and its check".

use std::{
    hash::{Hash, Hasher},
    sync::Arc,
};

use tributary::{collective::ReduceOp, DType, Error};

/// The kind of a network operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OpKind {
    /// An all-reduce across every rank.
    AllReduce = 1,
    /// A node sent from one rank to another (both describe it the same way).
    Transfer = 2,
    /// Headers only: every rank reached this point (the cluster's shutdown).
    Barrier = 3,
    /// User MPI code on the network stream: no header.
    Raw = 4,
}

/// How the cross-rank part of an all-reduce moves data (the same on every rank: it is part
/// of the header).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum CrossRankAlgorithm {
    /// By size: `Direct` up to [`ClusterConfig::direct_max_bytes`], `Ring` above.
    ///
    /// [`ClusterConfig::direct_max_bytes`]: crate::cluster::ClusterConfig::direct_max_bytes
    Auto,
    /// Every rank sends its header and data to every other rank in one message and sums
    /// the contributions in rank order: one round trip, `(R-1)·n` bytes per rank.
    Direct,
    /// Reduce-scatter then all-gather around the ranks over `MPI_Isend`/`MPI_Irecv` in
    /// chunks: `2(R-1)/R·n` bytes per rank.
    Ring,
    /// `MPI_Iallreduce`, the MPI library's own algorithm.
    Mpi,
}

impl CrossRankAlgorithm {
    fn code(self) -> u8 {
        match self {
            CrossRankAlgorithm::Auto => 0,
            CrossRankAlgorithm::Direct => 1,
            CrossRankAlgorithm::Ring => 2,
            CrossRankAlgorithm::Mpi => 3,
        }
    }

    fn from_code(code: u8) -> &'static str {
        match code {
            0 => "auto",
            1 => "direct",
            2 => "ring",
            3 => "mpi",
            _ => "?",
        }
    }
}

/// One network operation as this rank describes it.
#[derive(Clone, Debug)]
pub(crate) struct OpDesc {
    pub(crate) kind: OpKind,
    /// The node's label (the same on every rank in an SPMD program; ids are not).
    /// Shared, as the shape: an operation's description is cloned onto the issue queue at
    /// every call, which must not allocate.
    pub(crate) label: Arc<str>,
    pub(crate) shape: Arc<[usize]>,
    pub(crate) dtype: DType,
    /// All-reduce only.
    pub(crate) op: Option<ReduceOp>,
    /// Transfer only: (sender, receiver).
    pub(crate) route: Option<(usize, usize)>,
    /// All-reduce only: the algorithm this operation uses instead of the cluster's.
    pub(crate) algorithm: Option<CrossRankAlgorithm>,
    /// The hashes of `label` and `shape` every header carries, computed once by
    /// [`OpDesc::new`] (a description is made once per call site or captured step and
    /// its header built at every run; `label` and `shape` never change after).
    hashes: (u64, u64),
    /// The shape's element count, computed once as the hashes (every header and every
    /// transfer's byte count reads it).
    elements: u64,
}

impl OpDesc {
    /// The description of a network operation `kind` on a node `label` of `shape` and
    /// `dtype`; `op`, `route` and `algorithm` unset ([`OpDesc::reducing`],
    /// [`OpDesc::routed`]).
    pub(crate) fn new(kind: OpKind, label: &str, shape: &[usize], dtype: DType) -> OpDesc {
        OpDesc {
            kind,
            label: label.into(),
            shape: shape.into(),
            dtype,
            op: None,
            route: None,
            algorithm: None,
            hashes: (hash_of(label), hash_of(shape)),
            elements: shape.iter().product::<usize>() as u64,
        }
    }

    /// This description, an all-reduce's with `op`.
    pub(crate) fn reducing(self, op: ReduceOp) -> OpDesc {
        OpDesc {
            op: Some(op),
            ..self
        }
    }

    /// This description, a transfer's from rank `from` to rank `to`.
    pub(crate) fn routed(self, from: usize, to: usize) -> OpDesc {
        OpDesc {
            route: Some((from, to)),
            ..self
        }
    }

    pub(crate) fn elements(&self) -> u64 {
        self.elements
    }

    /// `all_reduce of dw1 [8, 32] f32 sum`, `transfer of x [4] f32 from rank 0 to rank 1`.
    pub(crate) fn describe(&self) -> String {
        match self.kind {
            OpKind::AllReduce => format!(
                "all_reduce of {} {:?} {} {}",
                self.label,
                self.shape,
                self.dtype,
                match self.op {
                    Some(ReduceOp::Mean) => "mean",
                    _ => "sum",
                }
            ),
            OpKind::Transfer => {
                let (from, to) = self.route.unwrap_or((0, 0));
                format!(
                    "transfer of {} {:?} {} from rank {from} to rank {to}",
                    self.label, self.shape, self.dtype
                )
            }
            OpKind::Barrier => "barrier".to_string(),
            OpKind::Raw => format!("MPI code ({})", self.label),
        }
    }
}

/// Whether a rank takes part in an operation with data, or only sends its header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Status {
    Ready = 0,
    /// Its input failed on that rank: it sends the header and nothing else.
    InputFailed = 1,
}

/// The bytes of a header on the wire.
pub(crate) const HEADER_BYTES: usize = 96;
const MAGIC: u32 = 0x7472_6962; // "trib"
const LABEL_BYTES: usize = 40;

/// The header of one network operation on one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) call: u64,
    pub(crate) sender: u32,
    pub(crate) kind: u8,
    pub(crate) op: u8,
    pub(crate) dtype: u8,
    pub(crate) algorithm: u8,
    pub(crate) status: u8,
    pub(crate) elements: u64,
    pub(crate) label_hash: u64,
    pub(crate) shape_hash: u64,
    pub(crate) route: (u32, u32),
    /// The label's first bytes, for error messages.
    pub(crate) label: [u8; LABEL_BYTES],
    pub(crate) ndim: u8,
    /// How many contributions the sender adds (its contexts), for the mean; not compared.
    pub(crate) contributions: u16,
}

fn hash_of(value: impl Hash) -> u64 {
    // FNV-1a through `Hasher`: the same on every rank and every build (std's
    // `DefaultHasher` is only stable within one build, and ranks may differ).
    struct Fnv(u64);
    impl Hasher for Fnv {
        fn finish(&self) -> u64 {
            self.0
        }
        fn write(&mut self, bytes: &[u8]) {
            for b in bytes {
                self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
            }
        }
    }
    let mut h = Fnv(0xcbf2_9ce4_8422_2325);
    value.hash(&mut h);
    h.finish()
}

fn dtype_code(dtype: DType) -> u8 {
    DType::ALL
        .iter()
        .position(|d| *d == dtype)
        .map_or(u8::MAX, |i| i as u8)
}

impl Header {
    /// This rank's header for `desc` as network call `call`.
    pub(crate) fn new(
        desc: &OpDesc,
        call: u64,
        sender: usize,
        algorithm: CrossRankAlgorithm,
        status: Status,
    ) -> Header {
        let mut label = [0u8; LABEL_BYTES];
        let bytes = desc.label.as_bytes();
        let n = bytes.len().min(LABEL_BYTES);
        label[..n].copy_from_slice(&bytes[..n]);
        let (from, to) = desc.route.unwrap_or((0, 0));
        Header {
            call,
            sender: sender as u32,
            kind: desc.kind as u8,
            op: match desc.op {
                None => 0,
                Some(ReduceOp::Sum) => 1,
                Some(_) => 2,
            },
            dtype: dtype_code(desc.dtype),
            algorithm: algorithm.code(),
            status: status as u8,
            elements: desc.elements(),
            label_hash: desc.hashes.0,
            shape_hash: desc.hashes.1,
            route: (from as u32, to as u32),
            label,
            ndim: desc.shape.len().min(255) as u8,
            contributions: 0,
        }
    }

    pub(crate) fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..12].copy_from_slice(&self.call.to_le_bytes());
        b[12..16].copy_from_slice(&self.sender.to_le_bytes());
        b[16] = self.kind;
        b[17] = self.op;
        b[18] = self.dtype;
        b[19] = self.algorithm;
        b[20] = self.status;
        b[21] = self.ndim;
        b[22..24].copy_from_slice(&self.contributions.to_le_bytes());
        b[24..32].copy_from_slice(&self.elements.to_le_bytes());
        b[32..40].copy_from_slice(&self.label_hash.to_le_bytes());
        b[40..48].copy_from_slice(&self.shape_hash.to_le_bytes());
        b[48..52].copy_from_slice(&self.route.0.to_le_bytes());
        b[52..56].copy_from_slice(&self.route.1.to_le_bytes());
        b[56..96].copy_from_slice(&self.label);
        b
    }

    /// `None` for bytes that are no header (another program's message).
    pub(crate) fn decode(b: &[u8]) -> Option<Header> {
        // Read in place (no copy: every network operation decodes a header per peer).
        let u64_at = |at: usize| {
            b.get(at..at + 8)
                .and_then(|s| <[u8; 8]>::try_from(s).ok())
                .map(u64::from_le_bytes)
        };
        let u32_at = |at: usize| {
            b.get(at..at + 4)
                .and_then(|s| <[u8; 4]>::try_from(s).ok())
                .map(u32::from_le_bytes)
        };
        if b.len() < HEADER_BYTES || u32_at(0)? != MAGIC {
            return None;
        }
        let mut label = [0u8; LABEL_BYTES];
        label.copy_from_slice(&b[56..96]);
        Some(Header {
            call: u64_at(4)?,
            sender: u32_at(12)?,
            kind: b[16],
            op: b[17],
            dtype: b[18],
            algorithm: b[19],
            status: b[20],
            ndim: b[21],
            elements: u64_at(24)?,
            label_hash: u64_at(32)?,
            shape_hash: u64_at(40)?,
            route: (u32_at(48)?, u32_at(52)?),
            label,
            contributions: u16::from_le_bytes([b[22], b[23]]),
        })
    }

    /// Whether two ranks' headers describe the same operation (everything but the sender
    /// and the status).
    pub(crate) fn same_operation(&self, other: &Header) -> bool {
        if mutant!("cluster_header_check") {
            return true;
        }
        (
            self.call,
            self.kind,
            self.op,
            self.dtype,
            self.algorithm,
            self.elements,
            self.label_hash,
            self.shape_hash,
            self.route,
            self.ndim,
        ) == (
            other.call,
            other.kind,
            other.op,
            other.dtype,
            other.algorithm,
            other.elements,
            other.label_hash,
            other.shape_hash,
            other.route,
            other.ndim,
        )
    }

    /// A readable account of the header, for [`Error::CollectiveMismatch`].
    pub(crate) fn describe(&self) -> String {
        let end = self
            .label
            .iter()
            .position(|&c| c == 0)
            .unwrap_or(LABEL_BYTES);
        let label = String::from_utf8_lossy(&self.label[..end]);
        let dtype = DType::ALL
            .get(self.dtype as usize)
            .map_or("?".to_string(), |d| d.to_string());
        let what = match self.kind {
            1 => format!(
                "all_reduce of {label} ({} elements, {dtype}, {}, {})",
                self.elements,
                if self.op == 2 { "mean" } else { "sum" },
                CrossRankAlgorithm::from_code(self.algorithm)
            ),
            2 => format!(
                "transfer of {label} ({} elements, {dtype}) from rank {} to rank {}",
                self.elements, self.route.0, self.route.1
            ),
            3 => "barrier".to_string(),
            k => format!("operation of kind {k}"),
        };
        format!("{what} as call {}", self.call)
    }
}

/// Whether `theirs` (a peer's header as received) is a ready header of the operation whose
/// header this rank encoded as `mine`: the fields [`Header::same_operation`] compares, as
/// the bytes they are encoded in, and the status. `false` tells nothing more: the caller
/// decodes both headers to tell a mismatch from a failed input ([`check_peer`]). Every
/// transfer's header is checked so first: no header is decoded where the ranks agree.
pub(crate) fn agrees(mine: &[u8; HEADER_BYTES], theirs: &[u8; HEADER_BYTES]) -> bool {
    // The bytes of `encode`: 0..4 the magic, 4..12 the call, 12..16 the sender (not
    // compared), 16..20 kind, op, dtype and algorithm, 20 the status, 21 ndim, 22..24 the
    // contributions (not compared), 24..56 elements, both hashes and the route, 56.. the
    // label's first bytes (not compared: its hash is).
    theirs[0..4] == MAGIC.to_le_bytes()
        && mine[4..12] == theirs[4..12]
        && mine[16..20] == theirs[16..20]
        && mine[21] == theirs[21]
        && mine[24..56] == theirs[24..56]
        && theirs[20] == Status::Ready as u8
}

/// Checks the headers of every rank (index = rank) against this rank's: the first rank in
/// rank order whose operation differs is a [`Error::CollectiveMismatch`]; else the first
/// rank whose input failed is a [`Error::RankInputFailed`].
pub(crate) fn check_headers(
    this_rank: usize,
    mine: &Header,
    all: &[Header],
    operation: impl std::fmt::Display,
) -> Result<(), Error> {
    for (rank, theirs) in all.iter().enumerate() {
        if rank != this_rank && !mine.same_operation(theirs) {
            return Err(mismatch(this_rank, mine, rank, theirs));
        }
    }
    for (rank, theirs) in all.iter().enumerate() {
        if rank != this_rank && theirs.status != Status::Ready as u8 {
            return Err(input_failed(mine, rank, operation));
        }
    }
    Ok(())
}

/// [`check_headers`] of a transfer: this rank's header against its one peer's (`theirs`,
/// from rank `peer`), with no list of every rank's made.
pub(crate) fn check_peer(
    this_rank: usize,
    mine: &Header,
    peer: usize,
    theirs: &Header,
    operation: impl std::fmt::Display,
) -> Result<(), Error> {
    if !mine.same_operation(theirs) {
        return Err(mismatch(this_rank, mine, peer, theirs));
    }
    if theirs.status != Status::Ready as u8 {
        return Err(input_failed(mine, peer, operation));
    }
    Ok(())
}

fn mismatch(this_rank: usize, mine: &Header, rank: usize, theirs: &Header) -> Error {
    Error::CollectiveMismatch {
        call: mine.call,
        rank,
        this_rank,
        ours: mine.describe(),
        theirs: theirs.describe(),
    }
}

fn input_failed(mine: &Header, rank: usize, operation: impl std::fmt::Display) -> Error {
    Error::RankInputFailed {
        rank,
        call: mine.call,
        operation: operation.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(label: &str, shape: &[usize], dtype: DType, op: ReduceOp) -> OpDesc {
        OpDesc::new(OpKind::AllReduce, label, shape, dtype).reducing(op)
    }

    #[test]
    fn headers_round_trip() {
        let d = desc("dw1", &[8, 32], DType::F16, ReduceOp::Mean);
        let h = Header::new(&d, 7, 3, CrossRankAlgorithm::Ring, Status::InputFailed);
        assert_eq!(Header::decode(&h.encode()), Some(h.clone()));
        assert_eq!(Header::decode(&[0u8; HEADER_BYTES]), None);
        assert!(h
            .describe()
            .contains("dw1 (256 elements, f16, mean, ring) as call 7"));
    }

    /// Random pairs of operations: `check_headers` refuses exactly those that differ in
    /// something but the sender and status, on every rank, naming the other rank.
    #[test]
    fn every_difference_is_a_mismatch_on_every_rank() {
        let mut random = crate::cluster::xorshift(0x1234_5678_9abc_def0);
        let mut next = move |n: u64| random() % n;
        let labels = [
            "w",
            "dw1",
            "dw2",
            "a-much-longer-label-than-forty-bytes-of-header-0",
            "a-much-longer-label-than-forty-bytes-of-header-1",
        ];
        let dtypes = [DType::F32, DType::F64, DType::F16, DType::BF16];
        let shapes: [&[usize]; 4] = [&[4], &[2, 2], &[4, 1], &[5]];
        let ops = [ReduceOp::Sum, ReduceOp::Mean];
        let mut mismatches = 0;
        for _ in 0..2000 {
            let mut pick = || {
                desc(
                    labels[next(labels.len() as u64) as usize],
                    shapes[next(shapes.len() as u64) as usize],
                    dtypes[next(dtypes.len() as u64) as usize],
                    ops[next(2) as usize],
                )
            };
            let (a, b) = (pick(), pick());
            let (ca, cb) = (next(3), next(3));
            let differ = a.label != b.label
                || a.shape != b.shape
                || a.dtype != b.dtype
                || a.op != b.op
                || ca != cb;
            let ha = Header::new(&a, ca, 0, CrossRankAlgorithm::Ring, Status::Ready);
            let hb = Header::new(&b, cb, 1, CrossRankAlgorithm::Ring, Status::Ready);
            let all = [ha.clone(), hb.clone()];
            let on0 = check_headers(0, &ha, &all, "op");
            let on1 = check_headers(1, &hb, &all, "op");
            if differ {
                mismatches += 1;
                match (on0, on1) {
                    (
                        Err(Error::CollectiveMismatch {
                            rank: 1,
                            this_rank: 0,
                            ..
                        }),
                        Err(Error::CollectiveMismatch {
                            rank: 0,
                            this_rank: 1,
                            ..
                        }),
                    ) => {}
                    other => panic!("{a:?} vs {b:?} (calls {ca}, {cb}) not refused: {other:?}"),
                }
            } else {
                assert_eq!((on0, on1), (Ok(()), Ok(())), "{a:?} refused");
            }
        }
        assert!(
            mismatches > 1000,
            "the generator made {mismatches} mismatches"
        );
    }

    #[test]
    fn a_failed_input_fails_the_others_naming_its_rank() {
        let d = desc("g", &[4], DType::F32, ReduceOp::Sum);
        let all: Vec<Header> = (0..3)
            .map(|r| {
                let status = if r == 2 {
                    Status::InputFailed
                } else {
                    Status::Ready
                };
                Header::new(&d, 0, r, CrossRankAlgorithm::Direct, status)
            })
            .collect();
        assert!(matches!(
            check_headers(0, &all[0], &all, "all_reduce of g"),
            Err(Error::RankInputFailed {
                rank: 2,
                call: 0,
                ..
            })
        ));
    }

    /// `agrees` says yes exactly where the decoded check passes: any change of a compared
    /// field or of the status makes it say no, a change of the sender or the contributions
    /// does not (one field at a time, from random headers, every field's every byte).
    #[test]
    fn the_byte_check_agrees_exactly_where_the_decoded_check_passes() {
        let mut next = crate::cluster::xorshift(0x0bad_cafe_f00d_1234);
        let mut refused = 0;
        for _ in 0..200 {
            let d = OpDesc::new(
                OpKind::Transfer,
                "halo",
                &[1 + (next() % 9) as usize],
                DType::F32,
            )
            .routed(0, 1);
            let mine = Header::new(
                &d,
                next() % 1000,
                0,
                CrossRankAlgorithm::Direct,
                Status::Ready,
            );
            let mine_bytes = mine.encode();
            let ready = Header {
                sender: 1,
                ..mine.clone()
            };
            assert!(agrees(&mine_bytes, &ready.encode()));
            // Every byte of the peer's header changed alone.
            for at in 0..HEADER_BYTES {
                let mut theirs = ready.encode();
                theirs[at] ^= 1 + (next() % 255) as u8;
                let decoded = Header::decode(&theirs);
                let passes = decoded
                    .as_ref()
                    .is_some_and(|t| check_peer(0, &mine, 1, t, "transfer of halo").is_ok());
                assert_eq!(
                    agrees(&mine_bytes, &theirs),
                    passes,
                    "byte {at} changed: {decoded:?} against {mine:?}"
                );
                refused += usize::from(!passes);
            }
        }
        // The magic, call, kind, op, dtype, algorithm, status, ndim, count, hashes and
        // route: 4 + 8 + 4 + 1 + 1 + 32 = 50 of the 96 bytes refuse.
        assert_eq!(refused, 200 * 50);
    }
}
