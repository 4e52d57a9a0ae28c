//! A two-layer tanh network with hand-written (analytic) gradients, and the
//! deterministic data it trains on. No sfsync here: the trainer and the
//! single-process reference both use this module, so they differ only in how
//! gradients are accumulated and reduced.

/// Layer sizes. The parameter tensors, in registration order, are
/// w1 [HIDDEN x INPUTS], b1 [HIDDEN], w2 [OUTPUTS x HIDDEN], b2 [OUTPUTS].
pub const INPUTS: usize = 16;
pub const HIDDEN: usize = 24;
pub const OUTPUTS: usize = 4;

pub const NUMEL: [usize; 4] = [HIDDEN * INPUTS, HIDDEN, OUTPUTS * HIDDEN, OUTPUTS];
pub const NAMES: [&str; 4] = ["w1", "b1", "w2", "b2"];

/// splitmix64: a tiny, portable generator, so every rank can regenerate every
/// other rank's micro-batches bit for bit.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1), from the top 53 bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (2.0 / (1u64 << 53) as f64) - 1.0
    }
}

/// Parameters in float64 (the optimizer's master copy).
#[derive(Clone, Debug, PartialEq)]
pub struct Params {
    pub t: [Vec<f64>; 4],
}

impl Params {
    /// The same initial weights on every rank (no broadcast needed).
    pub fn init(seed: u64) -> Params {
        let mut rng = Rng::new(seed ^ 0x5EED_0000_0000_0001);
        let s1 = 1.0 / (INPUTS as f64).sqrt();
        let s2 = 1.0 / (HIDDEN as f64).sqrt();
        let mut gen = |n: usize, scale: f64| (0..n).map(|_| rng.uniform() * scale).collect::<Vec<f64>>();
        Params { t: [gen(NUMEL[0], s1), gen(NUMEL[1], 0.1), gen(NUMEL[2], s2), gen(NUMEL[3], 0.1)] }
    }

    pub fn max_abs_diff(&self, other: &Params) -> f64 {
        let mut m = 0.0f64;
        for (a, b) in self.t.iter().zip(other.t.iter()) {
            for (x, y) in a.iter().zip(b.iter()) {
                m = m.max((x - y).abs());
            }
        }
        m
    }
}

/// One micro-batch: `batch` inputs and their targets, row-major.
pub struct MicroBatch {
    pub x: Vec<f64>,
    pub y: Vec<f64>,
    pub batch: usize,
}

/// The fixed "teacher" the network learns: y = tanh(A x) + 0.5 * B x.
fn teacher(x: &[f64], seed: u64) -> Vec<f64> {
    let mut rng = Rng::new(seed ^ 0x7EAC_4E00_0000_0002);
    let a: Vec<f64> = (0..OUTPUTS * INPUTS).map(|_| rng.uniform()).collect();
    let b: Vec<f64> = (0..OUTPUTS * INPUTS).map(|_| rng.uniform()).collect();
    (0..OUTPUTS)
        .map(|o| {
            let (mut ax, mut bx) = (0.0, 0.0);
            for i in 0..INPUTS {
                ax += a[o * INPUTS + i] * x[i];
                bx += b[o * INPUTS + i] * x[i];
            }
            ax.tanh() + 0.5 * bx
        })
        .collect()
}

/// The micro-batch of (rank, window, micro-batch): a pure function of its
/// arguments, so any rank can compute any other rank's data.
pub fn micro_batch(seed: u64, rank: usize, window: usize, micro: usize, batch: usize) -> MicroBatch {
    let key = seed
        ^ (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (window as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ (micro as u64).wrapping_mul(0x1656_67B1_9E37_79F9);
    let mut rng = Rng::new(key);
    let mut x = Vec::with_capacity(batch * INPUTS);
    let mut y = Vec::with_capacity(batch * OUTPUTS);
    for _ in 0..batch {
        let xi: Vec<f64> = (0..INPUTS).map(|_| rng.uniform()).collect();
        y.extend(teacher(&xi, seed));
        x.extend(xi);
    }
    MicroBatch { x, y, batch }
}

/// Weighted windows (sfsync 0.4): the number of samples ("tokens") of the
/// micro-batch of (rank, window, micro-batch), unequal across ranks and
/// micro-batches: 0..=2*batch (0: a micro-batch that is all padding). A pure
/// function of its arguments, as `micro_batch` is.
pub fn tokens(seed: u64, rank: usize, window: usize, micro: usize, batch: usize) -> usize {
    let key = seed
        ^ 0x70C3_E500_0000_0003
        ^ (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (window as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ (micro as u64).wrapping_mul(0x1656_67B1_9E37_79F9);
    (Rng::new(key).next_u64() % (2 * batch as u64 + 1)) as usize
}

/// Loss 0.5 * mean over the batch of |net(x) - y|^2, and its gradient with
/// respect to every parameter tensor (same layout as `Params::t`).
pub fn loss_and_grad(p: &Params, mb: &MicroBatch) -> (f64, [Vec<f64>; 4]) {
    loss_and_grad_scaled(p, mb, 1.0 / mb.batch as f64)
}

/// Loss 0.5 * sum over the batch of |net(x) - y|^2 (a plain sum: what a
/// weighted window divides by the global count), and its gradient.
pub fn loss_and_grad_sum(p: &Params, mb: &MicroBatch) -> (f64, [Vec<f64>; 4]) {
    loss_and_grad_scaled(p, mb, 1.0)
}

/// Each sample's 0.5 * |net(x) - y|^2 times `inv_b`, summed, and its gradient.
fn loss_and_grad_scaled(p: &Params, mb: &MicroBatch, inv_b: f64) -> (f64, [Vec<f64>; 4]) {
    let [w1, b1, w2, b2] = &p.t;
    let mut g: [Vec<f64>; 4] = [vec![0.0; NUMEL[0]], vec![0.0; NUMEL[1]], vec![0.0; NUMEL[2]], vec![0.0; NUMEL[3]]];
    let mut loss = 0.0;
    let mut h = [0.0f64; HIDDEN];
    let mut dh = [0.0f64; HIDDEN];
    for s in 0..mb.batch {
        let x = &mb.x[s * INPUTS..(s + 1) * INPUTS];
        let y = &mb.y[s * OUTPUTS..(s + 1) * OUTPUTS];
        for j in 0..HIDDEN {
            let mut a = b1[j];
            for i in 0..INPUTS {
                a += w1[j * INPUTS + i] * x[i];
            }
            h[j] = a.tanh();
        }
        dh.iter_mut().for_each(|v| *v = 0.0);
        for o in 0..OUTPUTS {
            let mut out = b2[o];
            for j in 0..HIDDEN {
                out += w2[o * HIDDEN + j] * h[j];
            }
            let r = out - y[o];
            loss += 0.5 * r * r * inv_b;
            let d = r * inv_b; // dLoss/dout
            g[3][o] += d;
            for j in 0..HIDDEN {
                g[2][o * HIDDEN + j] += d * h[j];
                dh[j] += d * w2[o * HIDDEN + j];
            }
        }
        for j in 0..HIDDEN {
            let da = dh[j] * (1.0 - h[j] * h[j]);
            g[1][j] += da;
            for i in 0..INPUTS {
                g[0][j * INPUTS + i] += da * x[i];
            }
        }
    }
    (loss, g)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn analytic_gradient_matches_finite_differences() {
        let p = Params::init(3);
        let mb = micro_batch(3, 1, 2, 0, 5);
        let (_, g) = loss_and_grad(&p, &mb);
        let h = 1e-6;
        let mut worst = 0.0f64;
        for t in 0..4 {
            for k in (0..NUMEL[t]).step_by(7) {
                let mut plus = p.clone();
                plus.t[t][k] += h;
                let mut minus = p.clone();
                minus.t[t][k] -= h;
                let fd = (loss_and_grad(&plus, &mb).0 - loss_and_grad(&minus, &mb).0) / (2.0 * h);
                worst = worst.max((fd - g[t][k]).abs());
            }
        }
        assert!(worst < 1e-7, "worst |finite difference - analytic| = {worst:e}");
    }

    #[test]
    fn sum_loss_is_batch_times_mean_loss() {
        let p = Params::init(5);
        let mb = micro_batch(5, 1, 0, 3, 7);
        let ((lm, gm), (ls, gs)) = (loss_and_grad(&p, &mb), loss_and_grad_sum(&p, &mb));
        assert!((ls - 7.0 * lm).abs() < 1e-12 * ls.abs());
        for t in 0..4 {
            for (a, b) in gm[t].iter().zip(&gs[t]) {
                assert!((7.0 * a - b).abs() < 1e-12, "tensor {t}: 7 * {a} vs {b}");
            }
        }
        // An empty micro-batch: no loss, no gradient (not a NaN).
        let (l0, g0) = loss_and_grad_sum(&p, &micro_batch(5, 1, 0, 3, 0));
        assert_eq!(l0, 0.0);
        assert!(g0.iter().all(|t| t.iter().all(|&v| v == 0.0)));
    }

    #[test]
    fn tokens_are_unequal_and_bounded() {
        let t: Vec<usize> = (0..64).map(|k| tokens(2024, k % 2, k / 8, k % 8, 8)).collect();
        assert!(t.iter().all(|&n| n <= 16));
        assert!(t.iter().any(|&n| n != t[0]));
        assert_eq!(tokens(2024, 1, 2, 3, 8), tokens(2024, 1, 2, 3, 8));
    }

    #[test]
    fn data_depends_on_rank_window_and_micro_batch_only() {
        let a = micro_batch(9, 0, 1, 2, 3);
        assert_eq!(a.x, micro_batch(9, 0, 1, 2, 3).x);
        assert_ne!(a.x, micro_batch(9, 1, 1, 2, 3).x);
        assert_ne!(a.x, micro_batch(9, 0, 2, 2, 3).x);
        assert_ne!(a.x, micro_batch(9, 0, 1, 3, 3).x);
    }
}
