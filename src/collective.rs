//! Collectives: all-reduce plans built only from the protocol's primitives. See DESIGN.md §5,
//! "Collectives", for the pairing of each strategy.
//!
//! An all-reduce over `n` contexts is a list of [`AllReduceStep`]s. A reduce is `dst += src`:
//! a copy into the merge buffer, or a `StreamingFor` read, then a merge routine. A broadcast
//! is `dst = src`. A scale takes the mean. Each step waits for exactly what it reads and
//! overwrites, so independent chunks overlap with no host barrier.
//!
//! - [`Strategy::Star`] reduces into context 0 and broadcasts from it.
//! - [`Strategy::Tree`] reduces in pairwise levels, then broadcasts through the same levels in
//!   reverse: `⌈log2 n⌉` levels each way.
//! - [`Strategy::Ring`] runs a reduce-scatter, then an all-gather. Each link carries `2 - 2/n`
//!   times the data, which is bandwidth-optimal for balanced chunks.
//!
//! The planner, [`plan`], is pure; executors such as `System::all_reduce` run the steps.
//! [`levels`] groups a plan's steps into levels of independent steps:
//!
//! ```
//! use tributary::collective::{levels, plan, ReduceOp, Strategy};
//! let steps = plan(5, 1, Strategy::Tree, ReduceOp::Sum);
//! for (i, level) in levels(&steps).iter().enumerate() {
//!     let steps: Vec<String> = level.iter().map(|s| s.to_string()).collect();
//!     println!("level {i}: {}", steps.join(", "));
//! }
//! // level 0: reduce chunk 0: ctx 3 -> ctx 0, reduce chunk 0: ctx 4 -> ctx 1  (ctx 2 sits out)
//! // level 1: reduce chunk 0: ctx 2 -> ctx 0
//! // level 2: reduce chunk 0: ctx 1 -> ctx 0
//! // level 3: broadcast chunk 0: ctx 0 -> ctx 1, ... ctx 0 -> ctx 2, ... ctx 0 -> ctx 3
//! // level 4: broadcast chunk 0: ctx 1 -> ctx 4
//! let first: Vec<String> = levels(&steps)[0].iter().map(|s| s.to_string()).collect();
//! assert_eq!(first, ["reduce chunk 0: ctx 3 -> ctx 0", "reduce chunk 0: ctx 4 -> ctx 1"]);
//! ```

use std::{collections::HashMap, fmt};

use serde::{Deserialize, Serialize};

/// How the contributions are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ReduceOp {
    /// The sum.
    Sum,
    /// The mean (the sum scaled by `1/n`).
    Mean,
}

/// The communication pattern of an all-reduce (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Strategy {
    /// Everything into one owner, then broadcast.
    Star,
    /// Pairwise levels, then the reverse levels: with `m` contexts left, context
    /// `⌈m/2⌉ + i` merges into context `i`; for odd `m` the middle context `⌈m/2⌉ - 1`
    /// sits the level out.
    Tree,
    /// Reduce-scatter then all-gather around a ring.
    Ring,
}

impl Strategy {
    /// Every strategy.
    pub const ALL: [Strategy; 3] = [Strategy::Star, Strategy::Tree, Strategy::Ring];
}

/// How a reduce step moves the source to the destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Transfer {
    /// Copy into the destination stream's merge buffer, then merge.
    Copy,
    /// The merge routine reads the source in place (`StreamingFor`).
    Streaming,
    /// `Streaming` where the backend can read the source in place, `Copy` otherwise.
    Auto,
}

/// One step of an all-reduce; contexts and chunks are indices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AllReduceStep {
    /// `chunk` of context `dst` += `chunk` of context `src`.
    Reduce {
        /// Chunk index.
        chunk: usize,
        /// Sending context.
        src: usize,
        /// Receiving (merging) context.
        dst: usize,
    },
    /// `chunk` of context `dst` = `chunk` of context `src`.
    Broadcast {
        /// Chunk index.
        chunk: usize,
        /// Sending context.
        src: usize,
        /// Receiving context.
        dst: usize,
    },
    /// `chunk` of context `ctx` *= 1/n.
    Scale {
        /// Chunk index.
        chunk: usize,
        /// The context.
        ctx: usize,
    },
}

impl fmt::Display for AllReduceStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            AllReduceStep::Reduce { chunk, src, dst } => {
                write!(f, "reduce chunk {chunk}: ctx {src} -> ctx {dst}")
            }
            AllReduceStep::Broadcast { chunk, src, dst } => {
                write!(f, "broadcast chunk {chunk}: ctx {src} -> ctx {dst}")
            }
            AllReduceStep::Scale { chunk, ctx } => write!(f, "scale chunk {chunk} in ctx {ctx}"),
        }
    }
}

impl AllReduceStep {
    /// The chunk of one context this step reads (the source), if it reads another one's.
    fn reads(&self) -> Option<(usize, usize)> {
        match *self {
            AllReduceStep::Reduce { chunk, src, .. }
            | AllReduceStep::Broadcast { chunk, src, .. } => Some((src, chunk)),
            AllReduceStep::Scale { .. } => None,
        }
    }

    /// The chunk of one context this step writes (read first by reduce and scale).
    fn writes(&self) -> (usize, usize) {
        match *self {
            AllReduceStep::Reduce { chunk, dst, .. }
            | AllReduceStep::Broadcast { chunk, dst, .. } => (dst, chunk),
            AllReduceStep::Scale { chunk, ctx } => (ctx, chunk),
        }
    }
}

/// Groups `steps` (in issue order) into levels of independent steps.
///
/// A step goes into the level after the latest earlier step it must wait for: one that
/// wrote a chunk it reads or writes, or that read a chunk it writes. Steps of one level
/// touch disjoint data and may run at the same time; running the levels one after another
/// gives the same result as the steps in issue order. Within a level, steps keep their
/// issue order. See the module docs for an example.
pub fn levels(steps: &[AllReduceStep]) -> Vec<Vec<AllReduceStep>> {
    // Per (context, chunk): the level of its last writer and of its last reader.
    let mut last_write: HashMap<(usize, usize), usize> = HashMap::new();
    let mut last_read: HashMap<(usize, usize), usize> = HashMap::new();
    let mut out: Vec<Vec<AllReduceStep>> = Vec::new();
    for step in steps {
        let w = step.writes();
        let after_write = |x| last_write.get(&x).map(|l| l + 1);
        let level = [
            step.reads().and_then(after_write),
            after_write(w),
            last_read.get(&w).map(|l| l + 1),
        ]
        .into_iter()
        .flatten()
        .max()
        .unwrap_or(0);
        if let Some(r) = step.reads() {
            let e = last_read.entry(r).or_insert(level);
            *e = (*e).max(level);
        }
        // A reduce or scale also reads what it writes.
        last_read.insert(w, level);
        last_write.insert(w, level);
        if out.len() <= level {
            out.resize_with(level + 1, Vec::new);
        }
        out[level].push(*step);
    }
    out
}

/// The steps of an all-reduce of `chunks` chunks over `n` contexts, in issue order.
///
/// With `n <= 1` there is nothing to exchange (a mean over one context is the identity).
pub fn plan(n: usize, chunks: usize, strategy: Strategy, op: ReduceOp) -> Vec<AllReduceStep> {
    let mut steps = Vec::new();
    if n <= 1 || chunks == 0 {
        return steps;
    }
    let mean = op == ReduceOp::Mean;
    match strategy {
        Strategy::Star => {
            for chunk in 0..chunks {
                for src in 1..n {
                    steps.push(AllReduceStep::Reduce { chunk, src, dst: 0 });
                }
                if mean {
                    steps.push(AllReduceStep::Scale { chunk, ctx: 0 });
                }
                for dst in 1..n {
                    steps.push(AllReduceStep::Broadcast { chunk, src: 0, dst });
                }
            }
        }
        Strategy::Tree => {
            let mut levels = Vec::new();
            let mut m = n;
            while m > 1 {
                let h = m.div_ceil(2);
                levels.push((h, m));
                m = h;
            }
            for chunk in 0..chunks {
                for &(h, m) in &levels {
                    for i in 0..m - h {
                        steps.push(AllReduceStep::Reduce {
                            chunk,
                            src: i + h,
                            dst: i,
                        });
                    }
                }
                if mean {
                    steps.push(AllReduceStep::Scale { chunk, ctx: 0 });
                }
                for &(h, m) in levels.iter().rev() {
                    for i in 0..m - h {
                        steps.push(AllReduceStep::Broadcast {
                            chunk,
                            src: i,
                            dst: i + h,
                        });
                    }
                }
            }
        }
        Strategy::Ring => {
            // Chunk group g = chunks c with c % n == g.
            let group = |g: usize| (0..chunks).filter(move |c| c % n == g);
            for s in 0..n - 1 {
                for i in 0..n {
                    let g = (i + n - s % n) % n;
                    for chunk in group(g) {
                        steps.push(AllReduceStep::Reduce {
                            chunk,
                            src: i,
                            dst: (i + 1) % n,
                        });
                    }
                }
            }
            // Context i now holds the full sum of group (i + 1) % n.
            if mean {
                for i in 0..n {
                    for chunk in group((i + 1) % n) {
                        steps.push(AllReduceStep::Scale { chunk, ctx: i });
                    }
                }
            }
            for s in 0..n - 1 {
                for i in 0..n {
                    let g = (i + 1 + n - s % n) % n;
                    for chunk in group(g) {
                        steps.push(AllReduceStep::Broadcast {
                            chunk,
                            src: i,
                            dst: (i + 1) % n,
                        });
                    }
                }
            }
        }
    }
    steps
}

/// Runs `steps` on plain numbers: `values[ctx][chunk]`. The reference the executors are
/// tested against, and a check of the planner itself.
pub fn simulate(steps: &[AllReduceStep], values: &mut [Vec<f64>], n: usize) {
    for step in steps {
        match *step {
            AllReduceStep::Reduce { chunk, src, dst } => values[dst][chunk] += values[src][chunk],
            AllReduceStep::Broadcast { chunk, src, dst } => values[dst][chunk] = values[src][chunk],
            AllReduceStep::Scale { chunk, ctx } => values[ctx][chunk] /= n as f64,
        }
    }
}

/// Splits `sizes` (bytes of each gradient, in order) into buckets of at most
/// `bucket_bytes` each (a gradient larger than a bucket gets a bucket of its own).
/// Returns, per bucket, the indices of its gradients.
pub fn buckets(sizes: &[u64], bucket_bytes: u64) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut fill = 0u64;
    for (i, &s) in sizes.iter().enumerate() {
        match out.last_mut() {
            Some(b) if fill + s <= bucket_bytes => {
                b.push(i);
                fill += s;
            }
            _ => {
                out.push(vec![i]);
                fill = s;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(n: usize, chunks: usize, strategy: Strategy, op: ReduceOp) {
        let steps = plan(n, chunks, strategy, op);
        let mut values: Vec<Vec<f64>> = (0..n)
            .map(|i| (0..chunks).map(|c| ((i + 1) * 10 + c) as f64).collect())
            .collect();
        let expected: Vec<f64> = (0..chunks)
            .map(|c| {
                let s: f64 = (0..n).map(|i| ((i + 1) * 10 + c) as f64).sum();
                if op == ReduceOp::Mean {
                    s / n as f64
                } else {
                    s
                }
            })
            .collect();
        simulate(&steps, &mut values, n);
        for (i, v) in values.iter().enumerate() {
            assert_eq!(v, &expected, "{strategy:?} n={n} chunks={chunks} ctx {i}");
        }
    }

    #[test]
    fn every_strategy_reduces_into_every_context() {
        for strategy in Strategy::ALL {
            for n in 1..=9 {
                for chunks in [1, 2, 3, n, 2 * n + 1] {
                    check(n, chunks, strategy, ReduceOp::Sum);
                    check(n, chunks, strategy, ReduceOp::Mean);
                }
            }
        }
    }

    #[test]
    fn transfer_counts_match_the_algorithms() {
        for n in 2..=8 {
            // Star and tree move every chunk 2(n-1) times.
            assert_eq!(plan(n, 1, Strategy::Star, ReduceOp::Sum).len(), 2 * (n - 1));
            assert_eq!(plan(n, 1, Strategy::Tree, ReduceOp::Sum).len(), 2 * (n - 1));
            // Ring with n chunks: n-1 steps of n transfers each way, each of one chunk.
            let ring = plan(n, n, Strategy::Ring, ReduceOp::Sum);
            assert_eq!(ring.len(), 2 * n * (n - 1));
            // Every context sends exactly 2(n-1) chunks: the bandwidth-optimal amount.
            for i in 0..n {
                let sent = ring
                    .iter()
                    .filter(|s| matches!(s, AllReduceStep::Reduce { src, .. } | AllReduceStep::Broadcast { src, .. } if *src == i))
                    .count();
                assert_eq!(sent, 2 * (n - 1));
            }
        }
    }

    #[test]
    fn tree_depth_is_logarithmic() {
        // Reduce steps into context 0 for one chunk: one per level.
        let steps = plan(8, 1, Strategy::Tree, ReduceOp::Sum);
        let into0 = steps
            .iter()
            .filter(|s| matches!(s, AllReduceStep::Reduce { dst: 0, .. }))
            .count();
        assert_eq!(into0, 3);
    }

    #[test]
    fn levels_hold_independent_steps_in_dependency_order() {
        for strategy in Strategy::ALL {
            for n in 1..=9 {
                for chunks in [1, 3, n] {
                    for op in [ReduceOp::Sum, ReduceOp::Mean] {
                        let steps = plan(n, chunks, strategy, op);
                        let lv = levels(&steps);
                        // Every step exactly once.
                        let flat: Vec<AllReduceStep> = lv.iter().flatten().copied().collect();
                        assert_eq!(flat.len(), steps.len());
                        // No two steps of a level touch a chunk one of them writes.
                        for level in &lv {
                            for (i, a) in level.iter().enumerate() {
                                for b in &level[i + 1..] {
                                    assert_ne!(a.writes(), b.writes(), "{a} / {b}");
                                    assert_ne!(Some(a.writes()), b.reads(), "{a} / {b}");
                                    assert_ne!(a.reads(), Some(b.writes()), "{a} / {b}");
                                }
                            }
                        }
                        // Levels in order compute the same as issue order.
                        let init = |_: ()| -> Vec<Vec<f64>> {
                            (0..n)
                                .map(|i| (0..chunks).map(|c| (i * 31 + c) as f64).collect())
                                .collect()
                        };
                        let (mut a, mut b) = (init(()), init(()));
                        simulate(&steps, &mut a, n);
                        simulate(&flat, &mut b, n);
                        assert_eq!(a, b, "{strategy:?} n={n} chunks={chunks}");
                    }
                }
            }
        }
    }

    #[test]
    fn tree_levels_pair_the_upper_half_with_the_lower() {
        let lv = levels(&plan(5, 1, Strategy::Tree, ReduceOp::Sum));
        let r = |src, dst| AllReduceStep::Reduce { chunk: 0, src, dst };
        let b = |src, dst| AllReduceStep::Broadcast { chunk: 0, src, dst };
        assert_eq!(
            lv,
            vec![
                vec![r(3, 0), r(4, 1)], // context 2, the middle of 5, sits out
                vec![r(2, 0)],          // 3 left: context 1 sits out
                vec![r(1, 0)],
                // Broadcasts start as soon as their source holds the sum: context 0
                // serves 1, 2 and 3 at once; 4 waits for 1.
                vec![b(0, 1), b(0, 2), b(0, 3)],
                vec![b(1, 4)],
            ]
        );
        // A ring of 4 over 4 chunks: n-1 levels each way, every context busy in each.
        let ring = levels(&plan(4, 4, Strategy::Ring, ReduceOp::Sum));
        assert_eq!(ring.len(), 6);
        assert!(ring.iter().all(|l| l.len() == 4));
    }

    #[test]
    fn bucketing() {
        assert_eq!(
            buckets(&[4, 4, 4, 10, 1], 8),
            vec![vec![0, 1], vec![2], vec![3], vec![4]]
        );
        assert_eq!(buckets(&[], 8), Vec::<Vec<usize>>::new());
        assert_eq!(buckets(&[1, 1, 1], 100), vec![vec![0, 1, 2]]);
    }
}
