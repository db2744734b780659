//! The baseline a user would write by hand: one persistent worker thread per core, each
//! owning a fixed set of columns, with one atomic step counter per column. A worker runs
//! task `(t, i)` once every column it reads has finished timestep `t - 1` and every column
//! that read its previous output of the same buffer has finished with it; it spins (then
//! yields) while it waits. Outputs are double-buffered atomics, checked like everywhere.

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
        for w in 0..workers {
            let (tx, rx) = mpsc::channel::<Job>();
            let done_tx = done_tx.clone();
            threads.push(std::thread::spawn(move || {
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

/// Runs `graph` with `iterations` per task on the pool; `Err` names the first bad input.
pub fn run(pool: &Pool, graph: Graph, iterations: u64, checks: &Arc<Checks>) -> Result<(), String> {
    let w = graph.width;
    // done[i] = timesteps column i has finished.
    let done: Arc<Vec<AtomicUsize>> = Arc::new((0..w).map(|_| AtomicUsize::new(0)).collect());
    let out: Arc<Vec<[AtomicU64; 2]>> = Arc::new(
        (0..2 * w)
            .map(|_| [AtomicU64::new(0), AtomicU64::new(0)])
            .collect(),
    );
    let error: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
    let workers = pool.workers();
    let checks = checks.clone();
    let err = error.clone();
    pool.run(Arc::new(move |me: usize| {
        let mine: Vec<usize> = (me..w).step_by(workers).collect();
        for t in 0..graph.steps {
            for &i in &mine {
                let deps = graph.deps(t, i);
                // RAW: every input written (its column finished timestep t - 1); WAR: every
                // reader of this buffer's last value (timestep t - 2's output, read at
                // timestep t - 1) finished timestep t - 1 too.
                spin_until(|| deps.iter().all(|&j| done[j].load(Ordering::Acquire) >= t));
                if t >= 2 {
                    let readers = graph.consumers(t - 2, i);
                    spin_until(|| {
                        readers
                            .iter()
                            .all(|&k| done[k].load(Ordering::Acquire) >= t)
                    });
                }
                let mut checked = 0;
                for &j in &deps {
                    let slot = &out[((t - 1) % 2) * w + j];
                    let input = [
                        f64::from_bits(slot[0].load(Ordering::Relaxed)),
                        f64::from_bits(slot[1].load(Ordering::Relaxed)),
                    ];
                    if let Err(e) = check_input(t, i, j, &input) {
                        err.lock().unwrap().get_or_insert(e);
                    }
                    checked += 1;
                }
                let value = compute_bound(iterations);
                let slot = &out[(t % 2) * w + i];
                let o = output(t, i);
                slot[0].store(o[0].to_bits(), Ordering::Relaxed);
                slot[1].store(o[1].to_bits(), Ordering::Relaxed);
                checks.record(checked, value);
                done[i].store(t + 1, Ordering::Release);
            }
        }
    }));
    let e = error.lock().unwrap().take();
    e.map_or(Ok(()), Err)
}
