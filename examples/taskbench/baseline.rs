//! The baseline a careful engineer would write by hand: one persistent worker thread
//! pinned to each core, each owning a contiguous block of columns, with one atomic step
//! counter per column on cache lines of its own. A worker runs task `(t, i)` once every
//! column it reads has finished timestep `t - 1` and every column that read its previous
//! output of the same buffer has finished with it; it spins (then yields) while it waits.
//! Outputs are double-buffered atomics, checked like everywhere; nothing is allocated per
//! task.

use std::{
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        mpsc, Arc,
    },
    thread::JoinHandle,
};

use super::{
    graph::Graph,
    kernel::{check_input, compute_bound, output, Checks},
};

type Job = Arc<dyn Fn(usize) + Send + Sync>;

/// Worker threads that live as long as the pool: a run hands each a job, no thread is
/// spawned per run.
pub struct Pool {
    jobs: Vec<mpsc::Sender<Job>>,
    done: mpsc::Receiver<()>,
    threads: Vec<JoinHandle<()>>,
}

impl Pool {
    pub fn new(workers: usize) -> Pool {
        let (done_tx, done) = mpsc::channel();
        let mut jobs = Vec::new();
        let mut threads = Vec::new();
        let cores = core_affinity::get_core_ids().unwrap_or_default();
        for w in 0..workers {
            let (tx, rx) = mpsc::channel::<Job>();
            let done_tx = done_tx.clone();
            let core = (!cores.is_empty()).then(|| cores[w % cores.len()]);
            threads.push(std::thread::spawn(move || {
                // Pinned where the OS lets it (a failure leaves the thread unpinned).
                if let Some(core) = core {
                    core_affinity::set_for_current(core);
                }
                for job in rx {
                    job(w);
                    let _ = done_tx.send(());
                }
            }));
            jobs.push(tx);
        }
        Pool {
            jobs,
            done,
            threads,
        }
    }

    pub fn workers(&self) -> usize {
        self.jobs.len()
    }

    /// Runs `job(worker)` on every worker and waits for all of them.
    fn run(&self, job: Job) {
        for tx in &self.jobs {
            tx.send(job.clone()).expect("worker alive");
        }
        for _ in &self.jobs {
            self.done.recv().expect("worker alive");
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.jobs.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn spin_until(cond: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !cond() {
        if spins < 1000 {
            std::hint::spin_loop();
            spins += 1;
        } else {
            std::thread::yield_now();
        }
    }
}

/// One column's step counter and double-buffered output, alone on its cache lines (two
/// 64-byte lines: adjacent-line prefetch), so workers never share a line they write.
#[repr(align(128))]
struct Column {
    /// Timesteps this column has finished.
    done: AtomicUsize,
    /// `out[t % 2]`: the output of timestep `t`.
    out: [[AtomicU64; 2]; 2],
}

/// Runs `graph` with `iterations` per task on the pool; `Err` names the first bad input.
///
/// Each worker owns a contiguous block of columns (so only the block edges wait on another
/// worker), has every dependence list it will need computed before its first task, counts
/// its checks locally and publishes them once: nothing is allocated, locked or shared
/// per task but the columns' own counters and outputs.
pub fn run(pool: &Pool, graph: Graph, iterations: u64, checks: &Arc<Checks>) -> Result<(), String> {
    let w = graph.width;
    let columns: Arc<Vec<Column>> = Arc::new(
        (0..w)
            .map(|_| Column {
                done: AtomicUsize::new(0),
                out: Default::default(),
            })
            .collect(),
    );
    // Per dependence set `s` (timestep `t` uses set `t % sets`): what each column reads, and
    // who reads its output of the timestep before (the consumers at `t - 1`).
    let sets = graph.dependence_sets();
    let deps: Arc<Vec<Vec<Vec<usize>>>> = Arc::new(
        (0..sets)
            .map(|s| (0..w).map(|i| graph.deps(sets + s, i)).collect())
            .collect(),
    );
    let readers: Arc<Vec<Vec<Vec<usize>>>> = Arc::new(
        (0..sets)
            .map(|s| (0..w).map(|i| graph.consumers(sets + s - 1, i)).collect())
            .collect(),
    );
    let error: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
    let workers = pool.workers();
    let checks = checks.clone();
    let err = error.clone();
    pool.run(Arc::new(move |me: usize| {
        let mine = me * w / workers..(me + 1) * w / workers;
        let (mut inputs, mut sink) = (0u64, 0u64);
        for t in 0..graph.steps {
            for i in mine.clone() {
                let set = t % sets;
                let deps: &[usize] = if t == 0 { &[] } else { &deps[set][i] };
                // RAW: every input written (its column finished timestep t - 1); WAR: every
                // reader of this buffer's last value (timestep t - 2's output, read at
                // timestep t - 1) finished timestep t - 1 too.
                spin_until(|| {
                    deps.iter()
                        .all(|&j| columns[j].done.load(Ordering::Acquire) >= t)
                });
                if t >= 2 {
                    let readers = &readers[(t - 1) % sets][i];
                    spin_until(|| {
                        readers
                            .iter()
                            .all(|&k| columns[k].done.load(Ordering::Acquire) >= t)
                    });
                }
                for &j in deps {
                    let slot = &columns[j].out[(t - 1) % 2];
                    let input = [
                        f64::from_bits(slot[0].load(Ordering::Relaxed)),
                        f64::from_bits(slot[1].load(Ordering::Relaxed)),
                    ];
                    if let Err(e) = check_input(t, i, j, &input) {
                        err.lock().unwrap().get_or_insert(e);
                    }
                }
                inputs += deps.len() as u64;
                let value = compute_bound(iterations);
                sink = sink.wrapping_add(value.to_bits() & 1);
                let column = &columns[i];
                let o = output(t, i);
                column.out[t % 2][0].store(o[0].to_bits(), Ordering::Relaxed);
                column.out[t % 2][1].store(o[1].to_bits(), Ordering::Relaxed);
                column.done.store(t + 1, Ordering::Release);
            }
        }
        checks.add(inputs, sink);
    }));
    let e = error.lock().unwrap().take();
    e.map_or(Ok(()), Err)
}
