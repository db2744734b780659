//! The task body every system runs: check the inputs, run Task Bench's `compute_bound`
//! kernel, write the output `(timestep, column)`.

use std::sync::atomic::{AtomicU64, Ordering};

/// Doubles the kernel works on (Task Bench's `compute_bound`: 64).
const LANES: usize = 64;

/// Floating-point operations of one task (Task Bench's count: a multiply-add per lane per
/// iteration, plus one operation per lane).
pub fn flops_per_task(iterations: u64) -> f64 {
    (2 * LANES as u64 * iterations + LANES as u64) as f64
}

/// Task Bench's `compute_bound` kernel: `iterations` rounds of `a = a * a + a` over 64
/// doubles. Returns a value that depends on every lane, so nothing is optimised away.
pub fn compute_bound(iterations: u64) -> f64 {
    let mut a = [1.2345f64; LANES];
    for _ in 0..iterations {
        for x in a.iter_mut() {
            *x = *x * *x + *x;
        }
        a = std::hint::black_box(a);
    }
    a.iter().sum()
}

/// Checks one input of task `(t, i)`: it must be the output of `(t - 1, j)`.
pub fn check_input(t: usize, i: usize, j: usize, input: &[f64]) -> Result<(), String> {
    let want = [(t - 1) as f64, j as f64];
    if input.len() != 2 || input[0] != want[0] || input[1] != want[1] {
        return Err(format!(
            "task ({t}, {i}) read {input:?} from column {j}, expected {want:?}"
        ));
    }
    Ok(())
}

/// The output of task `(t, i)`.
pub fn output(t: usize, i: usize) -> [f64; 2] {
    [t as f64, i as f64]
}

/// Counts the inputs every system checked, so a run that skipped checks is caught.
#[derive(Default)]
pub struct Checks {
    inputs: AtomicU64,
    sink: AtomicU64,
}

impl Checks {
    /// Records `n` checked inputs and the kernel's value.
    pub fn record(&self, n: usize, kernel_value: f64) {
        self.inputs.fetch_add(n as u64, Ordering::Relaxed);
        self.sink
            .fetch_add(kernel_value.to_bits() & 1, Ordering::Relaxed);
    }

    /// Records `inputs` checked inputs and a worker's sum of its kernels' low bits, once
    /// per run (the baseline's workers count locally).
    pub fn add(&self, inputs: u64, sink: u64) {
        self.inputs.fetch_add(inputs, Ordering::Relaxed);
        self.sink.fetch_add(sink, Ordering::Relaxed);
    }

    /// Checked inputs so far.
    pub fn inputs(&self) -> u64 {
        self.inputs.load(Ordering::Relaxed)
    }

    /// Resets the count for the next run.
    pub fn reset(&self) {
        self.inputs.store(0, Ordering::Relaxed);
    }
}
