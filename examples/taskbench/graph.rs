//! Task Bench's task graphs: `width` columns × `steps` timesteps; task `(t, i)` reads the
//! outputs of tasks `(t - 1, j)` for the `j` its dependence pattern names.
//!
//! The patterns follow Task Bench's definitions (Slaughter et al., SC'20, `core/core.cc`):
//! `trivial` (no dependencies), `no_comm` (`i`), `stencil_1d` (`i - 1 ..= i + 1`, clipped),
//! `nearest` (a window of `radix` columns around `i`, clipped), `spread` (`radix` columns
//! spread over the width, shifted by the timestep's dependence set) and `all_to_all`
//! (every column). Timestep 0 reads nothing.

use clap::ValueEnum;

/// A dependence pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Pattern {
    /// No dependencies: independent tasks.
    Trivial,
    /// Each column depends on itself.
    NoComm,
    /// Each column depends on itself and its two neighbours.
    Stencil1d,
    /// A window of `radix` columns around each column.
    Nearest,
    /// `radix` columns spread over the width, shifted every timestep.
    Spread,
    /// Every column.
    AllToAll,
}

impl Pattern {
    /// Every pattern, for the quick check.
    pub const ALL: [Pattern; 6] = [
        Pattern::Trivial,
        Pattern::NoComm,
        Pattern::Stencil1d,
        Pattern::Nearest,
        Pattern::Spread,
        Pattern::AllToAll,
    ];

    /// Task Bench's name.
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Trivial => "trivial",
            Pattern::NoComm => "no_comm",
            Pattern::Stencil1d => "stencil_1d",
            Pattern::Nearest => "nearest",
            Pattern::Spread => "spread",
            Pattern::AllToAll => "all_to_all",
        }
    }
}

/// One task graph.
#[derive(Clone, Copy, Debug)]
pub struct Graph {
    pub pattern: Pattern,
    pub width: usize,
    pub steps: usize,
    /// Columns a `nearest` or `spread` task reads.
    pub radix: usize,
    /// How many timesteps a `spread` pattern takes to repeat.
    pub period: usize,
}

impl Graph {
    /// How many distinct dependence sets the pattern cycles through.
    pub fn dependence_sets(&self) -> usize {
        match self.pattern {
            Pattern::Spread => self.period.max(1),
            _ => 1,
        }
    }

    /// The columns task `(t, i)` reads, in increasing order without repeats.
    pub fn deps(&self, t: usize, i: usize) -> Vec<usize> {
        if t == 0 {
            return Vec::new();
        }
        let w = self.width;
        let mut deps: Vec<usize> = match self.pattern {
            Pattern::Trivial => Vec::new(),
            Pattern::NoComm => vec![i],
            Pattern::Stencil1d => (i.saturating_sub(1)..=(i + 1).min(w - 1)).collect(),
            Pattern::Nearest if self.radix == 0 => Vec::new(),
            Pattern::Nearest => {
                let lo = i.saturating_sub(self.radix / 2);
                let hi = (i + (self.radix - 1) / 2).min(w - 1);
                (lo..=hi).collect()
            }
            Pattern::Spread => {
                let set = t % self.dependence_sets();
                (0..self.radix)
                    .map(|k| (i + k * w / self.radix + if k > 0 { set } else { 0 }) % w)
                    .collect()
            }
            Pattern::AllToAll => (0..w).collect(),
        };
        deps.sort_unstable();
        deps.dedup();
        deps
    }

    /// The columns that read column `j`'s output of timestep `t` (at timestep `t + 1`).
    pub fn consumers(&self, t: usize, j: usize) -> Vec<usize> {
        (0..self.width)
            .filter(|&i| self.deps(t + 1, i).contains(&j))
            .collect()
    }

    /// Tasks in the graph.
    pub fn tasks(&self) -> usize {
        self.width * self.steps
    }

    /// Inputs all tasks read together (each is checked by its consumer).
    pub fn inputs(&self) -> u64 {
        (0..self.steps)
            .flat_map(|t| (0..self.width).map(move |i| (t, i)))
            .map(|(t, i)| self.deps(t, i).len() as u64)
            .sum()
    }

    /// How many routines each column needs so that one routine always reads the same
    /// inputs and writes the same output buffer: timesteps are taken modulo this (even
    /// and odd timesteps write different buffers; `spread` cycles its sets).
    pub fn phases(&self) -> usize {
        2 * self.dependence_sets()
    }

    /// Timesteps a replaying runner captures as its step: the smallest multiple of the
    /// phases that is at least [`CAPTURED_TIMESTEPS`], so that a replay's fixed cost (its
    /// check, its one program per stream) is shared by several timesteps, as a user
    /// capturing a training loop's period would.
    pub fn capture_period(&self) -> usize {
        let phases = self.phases().max(1);
        phases * CAPTURED_TIMESTEPS.div_ceil(phases)
    }
}

/// Timesteps a replaying runner captures at least (issue 30: "say 8").
pub const CAPTURED_TIMESTEPS: usize = 8;

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(pattern: Pattern, width: usize) -> Graph {
        Graph {
            pattern,
            width,
            steps: 4,
            radix: 3,
            period: 3,
        }
    }

    #[test]
    fn patterns_match_task_bench() {
        assert_eq!(graph(Pattern::Stencil1d, 4).deps(1, 0), vec![0, 1]);
        assert_eq!(graph(Pattern::Stencil1d, 4).deps(1, 3), vec![2, 3]);
        assert_eq!(graph(Pattern::Nearest, 8).deps(1, 4), vec![3, 4, 5]);
        assert_eq!(graph(Pattern::Spread, 9).deps(1, 0), vec![0, 4, 7]);
        assert_eq!(graph(Pattern::Spread, 9).deps(3, 0), vec![0, 3, 6]);
        assert_eq!(graph(Pattern::AllToAll, 3).deps(2, 1), vec![0, 1, 2]);
        assert!(graph(Pattern::Trivial, 3).deps(2, 1).is_empty());
        assert!(graph(Pattern::AllToAll, 3).deps(0, 1).is_empty());
        assert_eq!(graph(Pattern::Stencil1d, 4).consumers(0, 0), vec![0, 1]);
    }
}
