//! METG(50%), computed as Task Bench's `scripts/chart_metg.py` does: efficiency is a run's
//! FLOP/s divided by the peak FLOP/s of the whole session (the best run of any system);
//! granularity is `wall × cores ÷ tasks`; METG is the smallest granularity whose efficiency
//! is still at least 50%, linearly interpolated with the next smaller point (which falls
//! below 50%) at exactly 50%.

/// One measured run of a sweep.
#[derive(Clone, Copy, Debug)]
pub struct Point {
    /// FLOP/s of the run.
    pub flops: f64,
    /// Wall × cores ÷ tasks, microseconds.
    pub granularity_us: f64,
}

/// METG at `threshold` (0.5) for `points` (any order) given the session's `peak` FLOP/s;
/// `None` if no point reaches the threshold.
pub fn metg(points: &[Point], peak: f64, threshold: f64) -> Option<f64> {
    let mut pts: Vec<(f64, f64)> = points
        .iter()
        .map(|p| (p.granularity_us, p.flops / peak))
        .collect();
    // From coarse to fine grain.
    pts.sort_by(|a, b| b.0.total_cmp(&a.0));
    let last_ok = pts.iter().rposition(|&(_, eff)| eff >= threshold)?;
    let (g1, e1) = pts[last_ok];
    match pts.get(last_ok + 1) {
        Some(&(g2, e2)) if e2 < threshold && e1 > e2 => {
            Some(g1 + (threshold - e1) * (g2 - g1) / (e2 - e1))
        }
        _ => Some(g1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(granularity_us: f64, flops: f64) -> Point {
        Point {
            flops,
            granularity_us,
        }
    }

    #[test]
    fn interpolates_at_the_threshold() {
        let pts = [p(100.0, 1.0), p(10.0, 0.8), p(1.0, 0.2)];
        // Between (10, 0.8) and (1, 0.2): 50% at 10 - 0.3 / 0.6 * 9 = 5.5.
        let m = metg(&pts, 1.0, 0.5).unwrap();
        assert!((m - 5.5).abs() < 1e-9, "{m}");
        assert_eq!(metg(&[p(1.0, 0.1)], 1.0, 0.5), None);
        assert_eq!(metg(&[p(3.0, 0.9)], 1.0, 0.5), Some(3.0));
    }
}
