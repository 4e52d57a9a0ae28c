//! sfsync Rust sample: a data-parallel trainer with gradient accumulation.
//!
//! Every rank trains the same two-layer network (model.rs) on its own
//! deterministic micro-batches, for W windows of N micro-batches:
//!
//!   sf_begin_accumulation; micro-batches 1..N-1; sf_end_accumulation;
//!   micro-batch N (sf_grad_ready as each gradient is final); sf_synchronize;
//!   SGD step; sf_zero_gradients
//!
//! Gradients w1, b1 (float32) and b2 (float64) live in libsfsync's flat buffer
//! (sf_add_gradient + sf_gradient_data); w2 (float64) is a buffer this program
//! owns (sf_register_gradient). Every rank also runs a single-process
//! reference that regenerates the micro-batches of ALL ranks, sums them in
//! float64 and averages over the world size, and checks after every window:
//!   - max |w - w_ref| < tolerance,
//!   - no collective inside the window (stats before and after),
//!   - exactly bucket_count collectives and gradient_bytes bytes per window.
//! Any failed check makes the exit status 1; an sfsync error makes it 2.
//!
//! `--weighted` (sfsync 0.4, weighted windows): each micro-batch holds an
//! unequal, deterministic number of samples ("tokens", 0..=2B), the loss is
//! a plain sum, and the context reduces with SF_REDUCE_WEIGHTED: per
//! micro-batch sf_add_window_weight(tokens) and sf_add_window_sums({loss
//! sum, tokens, found-inf, 1}) before its backward. The reference divides
//! the float64 sum of every rank's plain-sum gradients by the window's total
//! count, and sf_get_window_totals must give that count (exactly) and the
//! loss sum after every window. `--late-weight K` adds one more weight in
//! window K after the buckets started: SF_ERR_INVALID_STATE naming bucket 0
//! and the window, and the window's total without it. `--micro-mean`: the
//! same data the plain data-parallel way (each micro-batch's mean loss / N,
//! averaged over ranks) against the same token-mean reference: it differs.
//!
//! `--shard flat|parameter` trains with a sharded AdamW instead (sharded.rs),
//! which can also stop after K windows with a checkpoint per rank
//! (`--stop-after K --checkpoint PREFIX`) and resume from it in new
//! processes (`--resume PREFIX`, sf_restore_windows); a checkpoint that does
//! not fit the run makes the exit status 3.
//!
//! Run one process per rank with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//! set (sfsync-run -n 2 -- sfsync_trainer), or alone for world size 1.

mod checkpoint;
mod model;
mod sfsync;
mod sharded;

use std::ffi::c_void;
use std::process::ExitCode;

use model::{loss_and_grad, loss_and_grad_sum, micro_batch, tokens, Params, NAMES, NUMEL};
use sfsync::{Api, Context, SfError, SfStats, SF_DTYPE_FLOAT32, SF_DTYPE_FLOAT64};

const USAGE: &str = "usage: sfsync_trainer [--windows W] [--micro-batches N] [--batch B] [--lr LR]
                      [--tolerance T] [--seed S] [--bucket-cap-mb MB] [--first-bucket-cap-mb MB]
                      [--weighted [--late-weight K] | --micro-mean]
                      [--shard flat|parameter [--stop-after K --checkpoint PREFIX]
                       [--resume PREFIX] [--weights-out PREFIX] [--expect-weights PREFIX]]
Environment: SFSYNC_LIBRARY (default libsfsync.so.1), RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and the SF_* variables of include/sfsync.h.";

struct Args {
    windows: usize,
    micro_batches: usize,
    batch: usize,
    lr: f64,
    tolerance: f64,
    seed: u64,
    bucket_cap_mb: f64,
    first_bucket_cap_mb: f64,
    shard: Option<i32>,
    /// How each window's gradient is normalized.
    norm: Norm,
    /// --weighted only: add a weight in window K after its buckets started.
    late_weight: Option<usize>,
    /// Sharded only: train windows [0, K) (or from the checkpoint on), then
    /// write PREFIX.rank<R>.ckpt.
    stop_after: Option<usize>,
    checkpoint: Option<String>,
    /// Sharded only: continue from PREFIX.rank<R>.ckpt.
    resume: Option<String>,
    /// Sharded only: write / compare bitwise the final weights (PREFIX.rank<R>.weights).
    weights_out: Option<String>,
    expect_weights: Option<String>,
}

/// Why a run stopped: an sfsync call failed (exit status 2), or a
/// checkpoint could not be written, read or used (exit status 3).
#[derive(Debug)]
enum RunError {
    Sf(SfError),
    Checkpoint(String),
}

impl From<SfError> for RunError {
    fn from(e: SfError) -> RunError {
        RunError::Sf(e)
    }
}

/// The loss normalization of a run.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Norm {
    /// Every micro-batch has `--batch` samples; its mean loss / N, averaged
    /// over ranks (the default).
    BatchMean,
    /// `--weighted`: micro-batches of `tokens()` samples, plain-sum loss,
    /// SF_REDUCE_WEIGHTED with each micro-batch's count as its weight.
    Weighted,
    /// `--micro-mean`: the same micro-batches as `--weighted`, each one's
    /// mean loss / N, averaged over ranks (plain data parallelism).
    MicroMean,
}

/// Which tensors are float32 (w1, b1); the others are float64.
const DTYPES_F32: [bool; 4] = [true, true, false, false];

fn parse_args() -> Result<Args, String> {
    // Small caps so that the ~2.4 KB of gradients span several buckets
    // (2 with sfsync 0.4: [b2 w2] [b1 w1]; 3 with 0.1: [b1] [b2 w2] [w1]).
    let mut a = Args {
        windows: 6,
        micro_batches: 4,
        batch: 8,
        lr: 0.1,
        tolerance: 1e-6,
        seed: 2024,
        bucket_cap_mb: 0.002,
        first_bucket_cap_mb: 0.001,
        shard: None,
        norm: Norm::BatchMean,
        late_weight: None,
        stop_after: None,
        checkpoint: None,
        resume: None,
        weights_out: None,
        expect_weights: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            return Err(String::new());
        }
        if flag == "--weighted" || flag == "--micro-mean" {
            if a.norm != Norm::BatchMean {
                return Err("--weighted and --micro-mean are given once, one of them".into());
            }
            a.norm = if flag == "--weighted" { Norm::Weighted } else { Norm::MicroMean };
            continue;
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let bad = |what: &str| format!("{flag} = '{value}' is not {what}");
        match flag.as_str() {
            "--windows" => a.windows = value.parse().map_err(|_| bad("a count"))?,
            "--micro-batches" => a.micro_batches = value.parse().map_err(|_| bad("a count"))?,
            "--batch" => a.batch = value.parse().map_err(|_| bad("a count"))?,
            "--lr" => a.lr = value.parse().map_err(|_| bad("a number"))?,
            "--tolerance" => a.tolerance = value.parse().map_err(|_| bad("a number"))?,
            "--seed" => a.seed = value.parse().map_err(|_| bad("an unsigned integer"))?,
            "--bucket-cap-mb" => a.bucket_cap_mb = value.parse().map_err(|_| bad("a number"))?,
            "--first-bucket-cap-mb" => a.first_bucket_cap_mb = value.parse().map_err(|_| bad("a number"))?,
            "--shard" => {
                a.shard = Some(match value.as_str() {
                    "flat" => sfsync::SF_SHARD_FLAT,
                    "parameter" => sfsync::SF_SHARD_PARAMETER,
                    _ => return Err(bad("flat or parameter")),
                })
            }
            "--late-weight" => a.late_weight = Some(value.parse().map_err(|_| bad("a window index"))?),
            "--stop-after" => a.stop_after = Some(value.parse().map_err(|_| bad("a count"))?),
            "--checkpoint" => a.checkpoint = Some(value),
            "--resume" => a.resume = Some(value),
            "--weights-out" => a.weights_out = Some(value),
            "--expect-weights" => a.expect_weights = Some(value),
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if a.windows == 0 || a.micro_batches == 0 || a.batch == 0 {
        return Err("--windows, --micro-batches and --batch must be at least 1".into());
    }
    let restart = a.stop_after.is_some() || a.checkpoint.is_some() || a.resume.is_some() || a.weights_out.is_some() || a.expect_weights.is_some();
    if restart && a.shard.is_none() {
        return Err("--stop-after, --checkpoint, --resume, --weights-out and --expect-weights need --shard".into());
    }
    if a.norm != Norm::BatchMean && a.shard.is_some() {
        return Err("--weighted and --micro-mean are not implemented with --shard in this sample".into());
    }
    if let Some(k) = a.late_weight {
        if a.norm != Norm::Weighted || k >= a.windows {
            return Err(format!("--late-weight {k} needs --weighted and a window below --windows {}", a.windows));
        }
    }
    if a.stop_after.is_some() != a.checkpoint.is_some() {
        return Err("--stop-after K and --checkpoint PREFIX go together".into());
    }
    if let Some(k) = a.stop_after {
        if k == 0 || k >= a.windows {
            return Err(format!("--stop-after {k} must be at least 1 and below --windows {}", a.windows));
        }
    }
    Ok(a)
}

/// A float64 buffer this program owns and lends to sfsync for the life of a
/// context. Held as a raw pointer (from a leaked Box) so that the plugin's
/// writes during sf_synchronize never alias a live Rust reference.
struct HostBuffer {
    ptr: *mut f64,
    len: usize,
}

impl HostBuffer {
    fn zeroed(len: usize) -> HostBuffer {
        let b: Box<[f64]> = vec![0.0; len].into_boxed_slice();
        HostBuffer { ptr: Box::into_raw(b) as *mut f64, len }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: ptr/len came from Box::into_raw of a boxed slice of len.
        unsafe { drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len))) }
    }
}

/// Where one gradient lives: a typed pointer into the plugin's flat buffer or
/// into a HostBuffer, valid while the context (and the HostBuffer) live.
enum Storage {
    F32(*mut f32),
    F64(*mut f64),
}

struct Grad {
    id: i64,
    numel: usize,
    storage: Storage,
}

impl Grad {
    /// grad += scale * g (accumulation across micro-batches).
    fn accumulate(&self, g: &[f64], scale: f64) {
        assert_eq!(g.len(), self.numel);
        // SAFETY: the pointer addresses numel elements of the stated type that
        // nobody else touches outside sfsync calls.
        unsafe {
            match self.storage {
                Storage::F32(p) => {
                    for (d, s) in std::slice::from_raw_parts_mut(p, self.numel).iter_mut().zip(g) {
                        *d += (scale * s) as f32;
                    }
                }
                Storage::F64(p) => {
                    for (d, s) in std::slice::from_raw_parts_mut(p, self.numel).iter_mut().zip(g) {
                        *d += scale * s;
                    }
                }
            }
        }
    }

    fn to_f64(&self) -> Vec<f64> {
        // SAFETY: as in accumulate.
        unsafe {
            match self.storage {
                Storage::F32(p) => std::slice::from_raw_parts(p, self.numel).iter().map(|&v| v as f64).collect(),
                Storage::F64(p) => std::slice::from_raw_parts(p, self.numel).to_vec(),
            }
        }
    }

    fn bytes(&self) -> i64 {
        let width = match self.storage {
            Storage::F32(_) => 4,
            Storage::F64(_) => 8,
        };
        (self.numel * width) as i64
    }
}

/// The context, its gradients, and the host buffer they point into. Fields
/// drop in order: the context first, the buffer it borrowed last.
struct Trainer<'a> {
    ctx: Context<'a>,
    grads: Vec<Grad>,
    _w2_grad: HostBuffer,
}

impl<'a> Trainer<'a> {
    /// `shard`: a sharded context (sf_shard_layout), every gradient with a
    /// parameter in the plugin's flat parameter buffer.
    fn new(api: &'a Api, args: &Args, shard: Option<i32>) -> Result<Trainer<'a>, SfError> {
        let mut opts = api.options_init()?; // RANK, WORLD_SIZE, MASTER_* from the environment
        match args.norm {
            Norm::Weighted => opts.reduce_op = sfsync::SF_REDUCE_WEIGHTED,
            Norm::MicroMean => opts.reduce_op = sfsync::SF_REDUCE_AVERAGE,
            Norm::BatchMean => {} // SF_REDUCE from the environment (default average)
        }
        let ctx = api.create(&opts)?;
        if let Some(layout) = shard {
            ctx.set_shard_layout(layout)?;
        }
        ctx.set_first_bucket_cap_mb(args.first_bucket_cap_mb)?;
        ctx.set_bucket_cap_mb(args.bucket_cap_mb)?;
        let w2_grad = HostBuffer::zeroed(NUMEL[2]);
        let id_w1 = ctx.add_gradient(NUMEL[0] as i64, SF_DTYPE_FLOAT32, NAMES[0])?;
        let id_b1 = ctx.add_gradient(NUMEL[1] as i64, SF_DTYPE_FLOAT32, NAMES[1])?;
        // SAFETY: w2_grad lives in the Trainer next to ctx and drops after it.
        let id_w2 = unsafe { ctx.register_gradient(w2_grad.ptr as *mut c_void, NUMEL[2] as i64, SF_DTYPE_FLOAT64, NAMES[2])? };
        let id_b2 = ctx.add_gradient(NUMEL[3] as i64, SF_DTYPE_FLOAT64, NAMES[3])?;
        if shard.is_some() {
            for (t, id) in [id_w1, id_b1, id_w2, id_b2].into_iter().enumerate() {
                ctx.add_parameter(id, NUMEL[t] as i64, if DTYPES_F32[t] { SF_DTYPE_FLOAT32 } else { SF_DTYPE_FLOAT64 })?;
            }
        }
        ctx.build_buckets()?;
        let grads = vec![
            Grad { id: id_w1, numel: NUMEL[0], storage: Storage::F32(ctx.gradient_data(id_w1)? as *mut f32) },
            Grad { id: id_b1, numel: NUMEL[1], storage: Storage::F32(ctx.gradient_data(id_b1)? as *mut f32) },
            Grad { id: id_w2, numel: NUMEL[2], storage: Storage::F64(ctx.gradient_data(id_w2)? as *mut f64) },
            Grad { id: id_b2, numel: NUMEL[3], storage: Storage::F64(ctx.gradient_data(id_b2)? as *mut f64) },
        ];
        Ok(Trainer { ctx, grads, _w2_grad: w2_grad })
    }

    /// Backward of one micro-batch: add 1/N of its gradients, last layer
    /// first (the order a backward pass finishes them), reporting each one
    /// ready as a host's autograd hook would.
    fn backward(&self, grads: &[Vec<f64>; 4], scale: f64) -> Result<(), SfError> {
        for t in (0..4).rev() {
            self.grads[t].accumulate(&grads[t], scale);
            self.ctx.grad_ready(self.grads[t].id)?;
        }
        Ok(())
    }
}

/// Collects failed checks; the run fails if there is any.
#[derive(Default)]
struct Checks {
    failures: Vec<String>,
    passed: usize,
}

impl Checks {
    fn expect(&mut self, ok: bool, what: String) {
        if ok {
            self.passed += 1;
        } else {
            eprintln!("CHECK FAILED: {what}");
            self.failures.push(what);
        }
    }

    fn eq(&mut self, what: &str, got: i64, want: i64) {
        self.expect(got == want, format!("{what}: got {got}, expected {want}"));
    }
}

fn delta(a: &SfStats, b: &SfStats, f: fn(&SfStats) -> i64) -> i64 {
    f(b) - f(a)
}

/// The single-process reference: one SGD step on the float64 average over
/// ranks of the float64 sum over micro-batches of (1/N) * gradient.
fn reference_step(p: &mut Params, args: &Args, world: usize, window: usize) {
    let mut sum: [Vec<f64>; 4] = NUMEL.map(|n| vec![0.0; n]);
    let scale = 1.0 / (args.micro_batches as f64 * world as f64);
    for r in 0..world {
        for m in 0..args.micro_batches {
            let (_, g) = loss_and_grad(p, &micro_batch(args.seed, r, window, m, args.batch));
            for t in 0..4 {
                for (s, v) in sum[t].iter_mut().zip(&g[t]) {
                    *s += scale * v;
                }
            }
        }
    }
    for t in 0..4 {
        for (w, g) in p.t[t].iter_mut().zip(&sum[t]) {
            *w -= args.lr * g;
        }
    }
}

/// The token-mean reference of a weighted window: one SGD step on the
/// float64 sum over ranks and micro-batches of the plain-sum gradients,
/// divided by the window's total sample count. Returns (total count, loss sum).
fn reference_step_weighted(p: &mut Params, args: &Args, world: usize, window: usize) -> (f64, f64) {
    let mut sum: [Vec<f64>; 4] = NUMEL.map(|n| vec![0.0; n]);
    let (mut count, mut loss) = (0usize, 0.0f64);
    for r in 0..world {
        for m in 0..args.micro_batches {
            let samples = tokens(args.seed, r, window, m, args.batch);
            let (l, g) = loss_and_grad_sum(p, &micro_batch(args.seed, r, window, m, samples));
            count += samples;
            loss += l;
            for (st, gt) in sum.iter_mut().zip(&g) {
                for (s, v) in st.iter_mut().zip(gt) {
                    *s += v;
                }
            }
        }
    }
    if count > 0 {
        for (pt, st) in p.t.iter_mut().zip(&sum) {
            for (w, g) in pt.iter_mut().zip(st) {
                *w -= args.lr * (g / count as f64);
            }
        }
    }
    (count as f64, loss)
}

/// One micro-batch (m of n, window w) of this rank: forward, the window
/// calls of `args.norm`, backward. Returns (its loss: the mean with
/// Norm::BatchMean, else the sum; its samples).
fn micro_step(trainer: &Trainer<'_>, args: &Args, params: &Params, rank: usize, w: usize, m: usize) -> Result<(f64, usize), SfError> {
    let n = args.micro_batches as f64;
    match args.norm {
        Norm::BatchMean => {
            let (l, g) = loss_and_grad(params, &micro_batch(args.seed, rank, w, m, args.batch));
            trainer.backward(&g, 1.0 / n)?;
            Ok((l, args.batch)) // the mean loss
        }
        Norm::Weighted => {
            let t = tokens(args.seed, rank, w, m, args.batch);
            // The weight before the backward; the sums (the loss is known
            // after the forward) before any gradient is reported ready.
            trainer.ctx.add_window_weight(t as f64)?;
            let (l, g) = loss_and_grad_sum(params, &micro_batch(args.seed, rank, w, m, t));
            let found_inf = g.iter().any(|t| t.iter().any(|v| !v.is_finite()));
            trainer.ctx.add_window_sums(&[l, t as f64, found_inf as i32 as f64, 1.0])?;
            trainer.backward(&g, 1.0)?;
            Ok((l, t))
        }
        Norm::MicroMean => {
            let t = tokens(args.seed, rank, w, m, args.batch);
            // An empty micro-batch has no mean: it adds nothing (its
            // gradients are still reported ready).
            let (l, g) = loss_and_grad_sum(params, &micro_batch(args.seed, rank, w, m, t));
            trainer.backward(&g, if t > 0 { 1.0 / (t as f64 * n) } else { 0.0 })?;
            Ok((l, t))
        }
    }
}

/// Mean loss on a fixed held-out set no rank trains on.
fn held_out_loss(p: &Params, args: &Args) -> f64 {
    (0..4).map(|m| loss_and_grad(p, &micro_batch(args.seed, usize::MAX, 0, m, 64)).0).sum::<f64>() / 4.0
}

fn reduce_name(op: i32) -> &'static str {
    match op {
        sfsync::SF_REDUCE_AVERAGE => "average",
        sfsync::SF_REDUCE_SUM => "sum",
        sfsync::SF_REDUCE_PRESCALED_SUM => "prescaled_sum",
        sfsync::SF_REDUCE_WEIGHTED => "weighted",
        _ => "?",
    }
}

fn run(api: &Api, args: &Args, checks: &mut Checks) -> Result<(), RunError> {
    if let Some(layout) = args.shard {
        return sharded::run(api, args, layout, checks);
    }
    let trainer = Trainer::new(api, args, None)?;
    let ctx = &trainer.ctx;
    let opts = ctx.options()?;
    let (rank, world) = (opts.rank as usize, opts.world_size as usize);
    println!(
        "sfsync {} (abi {}) from {}: rank {rank} of {world}, rendezvous '{}', reduce {}, caps {} / {} MiB",
        api.version(),
        api.abi_version(),
        api.path,
        opts.rendezvous(),
        reduce_name(opts.reduce_op),
        opts.first_bucket_cap_mb,
        opts.bucket_cap_mb
    );

    // The bucket layout: one dtype per bucket, every gradient in exactly one.
    let st = ctx.stats()?;
    let expected_bytes: i64 = trainer.grads.iter().map(Grad::bytes).sum();
    checks.eq("gradient_count", st.gradient_count, 4);
    checks.eq("gradient_bytes", st.gradient_bytes, expected_bytes);
    checks.expect(st.bucket_count >= 2, format!("bucket_count = {} < 2 with float32 and float64 gradients", st.bucket_count));
    let (mut bucket_bytes, mut bucket_grads) = (0i64, 0i64);
    let mut layout = Vec::new();
    for b in 0..st.bucket_count {
        let (bytes, n, dtype) = ctx.bucket_info(b)?;
        bucket_bytes += bytes;
        bucket_grads += n;
        layout.push(format!("{bytes} B/{n} grad(s)/{}", if dtype == SF_DTYPE_FLOAT32 { "f32" } else { "f64" }));
    }
    checks.eq("sum of bucket bytes", bucket_bytes, st.gradient_bytes);
    checks.eq("sum of bucket gradient counts", bucket_grads, 4);
    println!("buckets: {} [{}], gradient bytes {}", st.bucket_count, layout.join(", "), st.gradient_bytes);

    let mut params = Params::init(args.seed);
    let mut reference = params.clone();
    let loss_before = held_out_loss(&params, args);
    let n = args.micro_batches;
    let mut worst = 0.0f64;

    for w in 0..args.windows {
        let s0 = ctx.stats()?;
        ctx.begin_accumulation()?;
        checks.expect(ctx.in_accumulation(), format!("window {w}: sf_in_accumulation is 0 after begin"));
        if w == 0 {
            // Synchronizing inside a window must fail loudly, with a message.
            match ctx.synchronize() {
                Ok(()) => checks.expect(false, "sf_synchronize inside a window succeeded".into()),
                Err(e) => {
                    println!("expected error: {e}");
                    checks.eq("status of sf_synchronize inside a window", e.status as i64, 2);
                    checks.expect(e.message.contains("sf_synchronize"), format!("sf_last_error() does not name the call: '{}'", e.message));
                }
            }
        }
        let (mut loss, mut samples) = (0.0, 0usize);
        for m in 0..n - 1 {
            let (l, t) = micro_step(&trainer, args, &params, rank, w, m)?;
            loss += l;
            samples += t;
        }
        ctx.end_accumulation()?;
        let s1 = ctx.stats()?;
        let (l, t) = micro_step(&trainer, args, &params, rank, w, n - 1)?; // outside the window: buckets start here
        loss += l;
        samples += t;
        if args.late_weight == Some(w) {
            // Every bucket has started (each gradient was reported ready):
            // a weight now would miss the window. It must be refused, naming
            // bucket 0 and the window (the library numbers windows from 1),
            // and not be added (the window totals below must not include it).
            let number = s0.windows_completed + 1;
            match ctx.add_window_weight(1000.0) {
                Ok(()) => checks.expect(false, format!("window {w}: a weight after the buckets started was accepted")),
                Err(e) => {
                    println!("expected error: {e}");
                    checks.eq(&format!("window {w}: status of a late sf_add_window_weight"), e.status as i64, 2);
                    let names = format!("bucket 0 of window {number} has started reducing");
                    checks.expect(e.message.contains(&names), format!("window {w}: sf_last_error() does not say '{names}': '{}'", e.message));
                }
            }
        }
        ctx.synchronize()?;
        let s2 = ctx.stats()?;

        let inside = delta(&s0, &s1, |s| s.collectives_issued);
        let collectives = delta(&s0, &s2, |s| s.collectives_issued);
        let bytes = delta(&s0, &s2, |s| s.bytes_reduced);
        let early = delta(&s0, &s2, |s| s.early_launches);
        checks.eq(&format!("window {w}: collectives inside the window"), inside, 0);
        checks.eq(&format!("window {w}: bytes inside the window"), delta(&s0, &s1, |s| s.bytes_reduced), 0);
        checks.eq(&format!("window {w}: collectives per window"), collectives, s2.bucket_count);
        checks.eq(&format!("window {w}: bytes per window"), bytes, s2.gradient_bytes);
        // Every gradient was reported ready before sf_synchronize, so every
        // bucket was launched by sf_grad_ready.
        checks.eq(&format!("window {w}: early launches"), early, s2.bucket_count);
        checks.eq(&format!("window {w}: deferred grad-ready calls"), delta(&s0, &s2, |s| s.deferred_ready_calls), 4 * (n as i64 - 1));
        checks.eq(&format!("window {w}: deferred passes"), delta(&s0, &s2, |s| s.deferred_passes), n as i64 - 1);
        checks.eq(&format!("window {w}: windows begun"), delta(&s0, &s2, |s| s.windows_begun), 1);
        checks.eq(&format!("window {w}: windows completed"), delta(&s0, &s2, |s| s.windows_completed), 1);

        // SGD on the averaged gradients, then zero them for the next window.
        for (t, grad) in trainer.grads.iter().enumerate() {
            for (p, g) in params.t[t].iter_mut().zip(grad.to_f64()) {
                *p -= args.lr * g;
            }
        }
        ctx.zero_gradients()?;
        checks.expect(trainer.grads.iter().all(|g| g.to_f64().iter().all(|&v| v == 0.0)), format!("window {w}: gradients not zero after sf_zero_gradients"));

        let mut totals = String::new();
        if args.norm == Norm::BatchMean {
            reference_step(&mut reference, args, world, w);
        } else {
            let (ref_count, ref_loss) = reference_step_weighted(&mut reference, args, world, w);
            if args.norm == Norm::Weighted {
                // The window's global weight and sums, delivered with the
                // gradients: the counts exact, the loss sum as the reference
                // computes it on its own weights.
                let (weight, sums) = ctx.window_totals()?;
                checks.expect(weight == ref_count, format!("window {w}: global weight {weight} != the reference's count {ref_count}"));
                checks.expect(sums[1] == ref_count, format!("window {w}: token sum {} != the reference's count {ref_count}", sums[1]));
                let loss_err = (sums[0] - ref_loss).abs() / ref_loss.abs().max(1.0);
                checks.expect(loss_err < args.tolerance, format!("window {w}: loss sum {} vs the reference's {ref_loss}: relative {loss_err:.3e}", sums[0]));
                checks.expect(sums[2] == 0.0, format!("window {w}: found-inf sum {}", sums[2]));
                checks.eq(&format!("window {w}: micro-batch sum"), sums[3] as i64, (world * n) as i64);
                totals = format!(
                    ", window totals: weight {weight} (reference {ref_count}), loss sum {:.9} (reference {ref_loss:.9}), tokens {}, found-inf {}, micro-batches {}",
                    sums[0], sums[1], sums[2], sums[3]
                );
            }
        }
        let diff = params.max_abs_diff(&reference);
        worst = worst.max(diff);
        checks.expect(diff < args.tolerance, format!("window {w}: max |w - w_ref| = {diff:.3e} exceeds tolerance {:.1e}", args.tolerance));
        println!(
            "window {w}: collectives {collectives} (buckets {}, inside window {inside}, early {early}), bytes {bytes} (gradient bytes {}), local loss {:.6}{}, max |w - w_ref| {diff:.3e}{totals}",
            s2.bucket_count,
            s2.gradient_bytes,
            match args.norm {
                Norm::BatchMean => loss / n as f64, // the mean of the micro-batch means
                _ if samples > 0 => loss / samples as f64,
                _ => 0.0,
            },
            if args.norm == Norm::BatchMean { String::new() } else { format!(" ({samples} samples)") }
        );
    }

    let loss_after = held_out_loss(&params, args);
    checks.expect(loss_after < loss_before, format!("held-out loss did not decrease: {loss_before:.6} -> {loss_after:.6}"));
    let st = ctx.stats()?;
    checks.eq("total collectives", st.collectives_issued, args.windows as i64 * st.bucket_count);
    // The size of a miss, against how far the reference moved the weights.
    let moved = format!("; the reference moved the weights by up to {:.3e}", reference.max_abs_diff(&Params::init(args.seed)));
    let (against, moved) = match args.norm {
        Norm::BatchMean => ("", String::new()),
        Norm::Weighted => (" (weighted windows against the token-mean reference)", moved),
        Norm::MicroMean => (" (per-micro-batch means against the token-mean reference)", moved),
    };
    println!(
        "parity{against}: max |w - w_ref| = {worst:.3e} over {} windows x {n} micro-batches x {world} ranks (tolerance {:.1e}){moved}; held-out loss {loss_before:.6} -> {loss_after:.6}; {} collectives, {} bytes in all",
        args.windows, args.tolerance, st.collectives_issued, st.bytes_reduced
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("error: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(if e.is_empty() { 0 } else { 2 });
        }
    };
    let api = match Api::load_from_env() {
        Ok(api) => api,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let mut checks = Checks::default();
    match run(&api, &args, &mut checks) {
        Ok(()) => {}
        Err(RunError::Sf(e)) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
        Err(RunError::Checkpoint(why)) => {
            eprintln!("error: {why}");
            return ExitCode::from(3);
        }
    }
    if checks.failures.is_empty() {
        println!("OK: {} checks passed", checks.passed);
        ExitCode::SUCCESS
    } else {
        eprintln!("FAILED: {} of {} checks", checks.failures.len(), checks.failures.len() + checks.passed);
        ExitCode::from(1)
    }
}
