//! io_uring against a rival turn by turn.
//!
//! `--compare` runs the implementations in turns of a few milliseconds, so
//! the two figures of one turn saw the same machine — on this VM, the same
//! one of its two wake-up modes, which move a whole run's p50 by up to 2×.
//! Pooling every turn's samples before comparing throws that pairing away:
//! whichever implementation had more of its turns in the slow mode loses,
//! and the verdict flips from run to run. Here each turn gives one lead
//! (ours against theirs, > 1 where io_uring is ahead) and a sign test says
//! whether io_uring was behind in more turns than chance allows.

use super::Sample;

/// One turn's figure: p50 µs for latency cases (lower is better), Gb/s
/// otherwise (higher is better).
pub(super) fn turn_figure(samples: &[Sample], by_latency: bool) -> f64 {
    if by_latency {
        let mut us: Vec<f64> = samples.iter().map(|s| s.took.as_secs_f64() * 1e6).collect();
        us.sort_by(f64::total_cmp);
        us.get(us.len() / 2).copied().unwrap_or(f64::NAN)
    } else {
        let bytes: u64 = samples.iter().map(|s| s.bytes).sum();
        let secs: f64 = samples.iter().map(|s| s.took.as_secs_f64()).sum();
        bytes as f64 * 8.0 / secs.max(1e-12) / 1e9
    }
}

/// io_uring's lead over a rival from one figure each (> 1: ahead): the
/// rival's p50 over ours for latency cases, our throughput over theirs
/// otherwise.
pub(super) fn lead(ours: f64, theirs: f64, by_latency: bool) -> f64 {
    if by_latency {
        theirs / ours
    } else {
        ours / theirs
    }
}

/// The turns compared.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Paired {
    pub turns: usize,
    /// Turns in which io_uring's figure was worse.
    pub behind: usize,
    /// The median of the turns' leads (> 1: io_uring ahead).
    pub median_lead: f64,
    /// The chance of being behind in at least `behind` of `turns` turns if
    /// each turn were a coin toss (one-sided sign test).
    pub p_behind: f64,
}

impl Paired {
    /// Behind in more turns than chance allows (p < 0.05).
    pub fn significantly_behind(&self) -> bool {
        self.median_lead < 1.0 && self.p_behind < 0.05
    }
}

/// Compares `ours` and `theirs`, one figure per turn, turn by turn.
pub(super) fn paired(ours: &[f64], theirs: &[f64], by_latency: bool) -> Paired {
    let mut leads: Vec<f64> = ours
        .iter()
        .zip(theirs)
        .map(|(&o, &t)| lead(o, t, by_latency))
        .filter(|l| l.is_finite())
        .collect();
    leads.sort_by(f64::total_cmp);
    let turns = leads.len();
    let behind = leads.iter().filter(|&&l| l < 1.0).count();
    let median_lead = match turns {
        0 => f64::NAN,
        n if n % 2 == 1 => leads[n / 2],
        n => (leads[n / 2 - 1] + leads[n / 2]) / 2.0,
    };
    Paired {
        turns,
        behind,
        median_lead,
        p_behind: coin_tail(turns, behind),
    }
}

/// P(X ≥ k) for X ~ Binomial(n, 1/2).
fn coin_tail(n: usize, k: usize) -> f64 {
    // C(n, i) / 2^n, term by term in log space: 2^-n alone underflows an
    // f64 past ~1,074 turns, where the terms near n/2 are still large.
    let mut ln_term = -(n as f64) * std::f64::consts::LN_2; // i = 0
    let mut tail = if k == 0 { ln_term.exp() } else { 0.0 };
    for i in 1..=n {
        ln_term += ((n - i + 1) as f64 / i as f64).ln();
        if i >= k {
            tail += ln_term.exp();
        }
    }
    tail.min(1.0)
}

/// Puts `order` in the permutation number `seed` picks (Fisher–Yates with
/// a fixed xorshift stream: the same turn gets the same order every run).
pub fn shuffle(order: &mut [usize], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for k in (1..order.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(k, (x % (k as u64 + 1)) as usize);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_coin_tail_is_the_binomial_one() {
        assert!((coin_tail(8, 0) - 1.0).abs() < 1e-12);
        assert!((coin_tail(8, 7) - 9.0 / 256.0).abs() < 1e-12);
        assert!((coin_tail(8, 8) - 1.0 / 256.0).abs() < 1e-12);
        assert!((coin_tail(20, 15) - 21_700.0 / 1_048_576.0).abs() < 1e-12);
        // Past ~1,074 turns 2^-n underflows: the tail must not follow it.
        assert!((coin_tail(1_100, 0) - 1.0).abs() < 1e-9);
        assert!((coin_tail(5_000, 2_500) - 0.5056).abs() < 1e-3);
        assert!(coin_tail(5_000, 2_800) < 1e-9);
    }

    #[test]
    fn a_lead_is_ours_against_theirs_turn_by_turn() {
        // Latency: ours lower in 7 of 8 turns, though pooled it would not
        // look so (one slow turn of ours).
        let ours = [10.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0, 90.0];
        let theirs = [11.0, 12.0, 11.0, 11.0, 12.0, 11.0, 11.0, 20.0];
        let p = paired(&ours, &theirs, true);
        assert_eq!((p.turns, p.behind), (8, 1));
        assert!(p.median_lead > 1.0 && !p.significantly_behind());
        // Throughput the other way round: behind in every turn.
        let p = paired(&[1.0; 8], &[2.0; 8], false);
        assert_eq!((p.behind, p.median_lead), (8, 0.5));
        assert!(p.significantly_behind(), "{p:?}");
        // Behind in 5 of 8 is chance.
        let p = paired(&[1.0, 1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.0], &[2.0; 8], false);
        assert_eq!(p.behind, 5);
        assert!(!p.significantly_behind(), "{p:?}");
    }

    /// Every turn's order holds each implementation once, and over a
    /// run's turns each one follows several others, not one.
    #[test]
    fn turn_orders_are_permutations_with_varied_neighbours() {
        let mut seen = std::collections::HashSet::new();
        for turn in 0..40u64 {
            let mut order: Vec<usize> = (0..6).collect();
            shuffle(&mut order, turn);
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..6).collect::<Vec<_>>());
            seen.extend(order.windows(2).filter(|w| w[1] == 3).map(|w| w[0]));
        }
        assert!(seen.len() >= 4, "3 followed only {seen:?}");
    }
}
