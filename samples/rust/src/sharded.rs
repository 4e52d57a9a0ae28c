//! Sharded mode (`--shard flat|parameter`, sfsync 0.3): a distributed AdamW.
//!
//! The parameters live in libsfsync's flat parameter buffer (registered
//! beside their gradients, sf_register_parameter with data = NULL), in the
//! gradient's dtype (w1, b1 float32; w2, b2 float64). At each window's end
//! every bucket is reduce-scattered: this rank receives only the range of
//! each gradient it owns (sf_shard_range), and its AdamW keeps state and a
//! float64 master copy for those ranges only. Per bucket, as soon as its
//! reduce-scatter completes (sf_synchronize_start, sf_wait_bucket), the
//! owned ranges step, are written into the parameter buffer, and the
//! bucket's all-gather starts (sf_start_gather); sf_synchronize then closes
//! the window, and the next forward waits for the gathers (sf_wait_gather).
//!
//! Checked after every window, against a single-process reference (every
//! rank's micro-batches, float64 AdamW over the whole model, its forward on
//! the weights rounded to each tensor's dtype): the gathered weights within
//! the tolerance, no collective inside the window, one reduce-scatter and
//! one all-gather per bucket, and this rank's optimizer state at most 1/W of
//! the full one plus the layout's padding.
//!
//! Save and resume (checkpoint.rs): `--stop-after K --checkpoint PREFIX`
//! stops after window K and each rank writes its own file (its parameters,
//! the AdamW state of its ranges, the shape of the run and the window count
//! from sf_get_stats); `--resume PREFIX` loads this rank's file into a new
//! context, checks that it fits (rank, world size, layout, buckets, ranges;
//! the ranks agree on the verdict with one sf_allreduce_float64, so a bad
//! file on one rank stops every rank, each naming what it found), calls
//! sf_restore_windows with the saved count, replays the reference up to it,
//! and trains the remaining windows. `--weights-out` / `--expect-weights
//! PREFIX` write / compare the final weights bitwise (one file per rank).

use std::fs;

use crate::checkpoint::{self, Checkpoint, RangeState, RunShape, TensorRecord};
use crate::model::{loss_and_grad, micro_batch, Params, NAMES, NUMEL};
use crate::sfsync::{Api, SF_DTYPE_FLOAT32, SF_DTYPE_FLOAT64, SF_SHARD_FLAT};
use crate::{Args, Checks, RunError, Trainer, DTYPES_F32};

const BETA1: f64 = 0.9;
const BETA2: f64 = 0.999;
const EPS: f64 = 1e-8;
const WEIGHT_DECAY: f64 = 0.01;

/// torch.optim.AdamW's update of one range (step counts from 1).
fn adamw(p: &mut [f64], g: &[f64], m: &mut [f64], v: &mut [f64], step: i32, lr: f64) {
    let (c1, c2) = (1.0 - BETA1.powi(step), 1.0 - BETA2.powi(step));
    for i in 0..p.len() {
        p[i] *= 1.0 - lr * WEIGHT_DECAY;
        m[i] = BETA1 * m[i] + (1.0 - BETA1) * g[i];
        v[i] = BETA2 * v[i] + (1.0 - BETA2) * g[i] * g[i];
        p[i] -= lr * (m[i] / c1) / ((v[i] / c2).sqrt() + EPS);
    }
}

/// What this rank steps of one tensor: [offset, offset + count).
struct Shard {
    tensor: usize,
    bucket: i64,
    offset: usize,
    master: Vec<f64>,
    m: Vec<f64>,
    v: Vec<f64>,
}

/// A parameter in the plugin's flat parameter buffer.
enum Param {
    F32(*mut f32),
    F64(*mut f64),
}

impl Param {
    fn read(&self, n: usize) -> Vec<f64> {
        // SAFETY: n elements of the registered dtype, valid for the context's
        // life; no gather is in flight when this runs.
        unsafe {
            match *self {
                Param::F32(p) => std::slice::from_raw_parts(p, n).iter().map(|&x| x as f64).collect(),
                Param::F64(p) => std::slice::from_raw_parts(p, n).to_vec(),
            }
        }
    }

    fn write(&self, offset: usize, values: &[f64]) {
        // SAFETY: inside the registered parameter (offset + len <= numel); the
        // bucket's gather has not started yet.
        unsafe {
            match *self {
                Param::F32(p) => {
                    for (i, v) in values.iter().enumerate() {
                        *p.add(offset + i) = *v as f32;
                    }
                }
                Param::F64(p) => {
                    for (i, v) in values.iter().enumerate() {
                        *p.add(offset + i) = *v;
                    }
                }
            }
        }
    }
}

/// The reference's window `w`: the same data, the full AdamW in float64,
/// its forward on the weights rounded to each tensor's dtype.
fn reference_window(reference: &mut Params, rm: &mut [Vec<f64>], rv: &mut [Vec<f64>], args: &Args, world: usize, w: usize) {
    let n = args.micro_batches;
    let scale = 1.0 / n as f64;
    let fwd = rounded(reference);
    let mut sum: [Vec<f64>; 4] = NUMEL.map(|n| vec![0.0; n]);
    for r in 0..world {
        for m in 0..n {
            let (_, g) = loss_and_grad(&fwd, &micro_batch(args.seed, r, w, m, args.batch));
            for t in 0..4 {
                for (s, v) in sum[t].iter_mut().zip(&g[t]) {
                    *s += scale * v / world as f64;
                }
            }
        }
    }
    for t in 0..4 {
        adamw(&mut reference.t[t], &sum[t], &mut rm[t], &mut rv[t], w as i32 + 1, args.lr);
    }
}

/// The weights as this rank holds them, in each tensor's dtype, as bytes.
fn weight_bytes(params: &[Param]) -> Vec<u8> {
    let mut out = Vec::new();
    for (t, p) in params.iter().enumerate() {
        for x in p.read(NUMEL[t]) {
            if DTYPES_F32[t] {
                out.extend_from_slice(&(x as f32).to_le_bytes());
            } else {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
    }
    out
}

/// Where two weight files first differ: (tensor, element).
fn first_difference(a: &[u8], b: &[u8]) -> Option<(usize, usize)> {
    let mut at = 0;
    for t in 0..4 {
        let width = if DTYPES_F32[t] { 4 } else { 8 };
        for e in 0..NUMEL[t] {
            if a.get(at..at + width) != b.get(at..at + width) {
                return Some((t, e));
            }
            at += width;
        }
    }
    None
}

/// Load this rank's checkpoint and check it against the run; then every
/// rank learns whether every rank's was good (one small collective), so
/// that no rank trains on while another stopped.
fn load_agreed(ctx: &crate::sfsync::Context, prefix: &str, now: &RunShape, args: &Args) -> Result<Checkpoint, RunError> {
    let (rank, world) = (now.rank as usize, now.world_size as usize);
    let file = checkpoint::path(prefix, rank);
    let loaded = Checkpoint::load(&file).and_then(|c| c.matches(now, args.windows).map(|()| c));
    if let Err(why) = &loaded {
        eprintln!("error: checkpoint {file}: {why}");
    }
    let mut bad = vec![0.0; world];
    bad[rank] = if loaded.is_err() { 1.0 } else { 0.0 };
    ctx.allreduce_float64(&mut bad)?;
    let refused: Vec<String> = (0..world).filter(|&r| bad[r] != 0.0).map(|r| r.to_string()).collect();
    if !refused.is_empty() {
        return Err(RunError::Checkpoint(format!(
            "resume refused on every rank: the checkpoint of rank(s) {} does not fit this run (each says why above)",
            refused.join(", ")
        )));
    }
    let c = loaded.expect("agreed good");
    // Every rank must continue from the same window count (sf_restore_windows
    // would catch a difference at the first synchronization; say it here).
    let mut counts = vec![0.0; world];
    counts[rank] = c.windows_completed as f64;
    ctx.allreduce_float64(&mut counts)?;
    if counts.iter().any(|&k| k != c.windows_completed as f64) {
        return Err(RunError::Checkpoint(format!("resume refused on every rank: the ranks' checkpoints hold different window counts {counts:?}")));
    }
    Ok(c)
}

fn rounded(p: &Params) -> Params {
    let mut q = p.clone();
    for t in 0..4 {
        if DTYPES_F32[t] {
            for x in q.t[t].iter_mut() {
                *x = *x as f32 as f64;
            }
        }
    }
    q
}

pub fn run(api: &Api, args: &Args, layout: i32, checks: &mut Checks) -> Result<(), RunError> {
    let trainer = Trainer::new(api, args, Some(layout))?;
    let ctx = &trainer.ctx;
    let opts = ctx.options()?;
    let (rank, world) = (opts.rank as usize, opts.world_size as usize);
    let buckets = ctx.stats()?.bucket_count;
    let init = Params::init(args.seed);
    let mut params = Vec::new();
    let mut shards = Vec::new();
    let mut records = Vec::new();
    for (t, g) in trainer.grads.iter().enumerate() {
        let ptr = ctx.parameter_data(g.id)?;
        let p = if DTYPES_F32[t] { Param::F32(ptr as *mut f32) } else { Param::F64(ptr as *mut f64) };
        p.write(0, &init.t[t]); // every rank starts from the same weights
        let (off, cnt) = ctx.shard_range(g.id)?;
        let bucket = ctx.gradient_bucket(g.id)?;
        records.push(TensorRecord {
            name: NAMES[t].into(),
            numel: NUMEL[t] as i64,
            dtype: if DTYPES_F32[t] { SF_DTYPE_FLOAT32 } else { SF_DTYPE_FLOAT64 },
            bucket,
            offset: off,
            count: cnt,
        });
        let (off, cnt) = (off as usize, cnt as usize);
        checks.expect(off + cnt <= NUMEL[t], format!("shard range of tensor {t}: [{off}, {}) past {}", off + cnt, NUMEL[t]));
        if cnt > 0 {
            shards.push(Shard {
                tensor: t,
                bucket,
                offset: off,
                master: init.t[t][off..off + cnt].to_vec(),
                m: vec![0.0; cnt],
                v: vec![0.0; cnt],
            });
        }
        params.push(p);
    }
    let shape = RunShape { world_size: world as i32, rank: rank as i32, layout, buckets, tensors: records };
    // Optimizer state: 2 values per owned element; the full AdamW's is 2 per
    // element of the model. Padding: a 64-byte alignment per bucket (flat),
    // whole tensors (parameter).
    let owned: usize = shards.iter().map(|s| s.master.len()).sum();
    let total: usize = NUMEL.iter().sum();
    let slack = if layout == SF_SHARD_FLAT { 16 * buckets as usize } else { *NUMEL.iter().max().unwrap() };
    checks.expect(owned <= total / world + 1 + slack, format!("this rank owns {owned} of {total} elements, more than 1/{world} + {slack}"));
    println!(
        "sharded ({}): rank {rank} of {world}, {buckets} buckets, owns {owned} of {total} elements ({} ranges), AdamW state {} B vs the full {} B",
        checkpoint::layout_name(layout),
        shards.len(),
        owned * 16,
        total * 16
    );

    let mut reference = init.clone();
    let (mut rm, mut rv): (Vec<Vec<f64>>, Vec<Vec<f64>>) = (NUMEL.map(|n| vec![0.0; n]).to_vec(), NUMEL.map(|n| vec![0.0; n]).to_vec());
    // Resume: this rank's parameters and ranges' state from its file, the
    // window count into sfsync, the reference replayed up to it.
    let first = match &args.resume {
        None => 0,
        Some(prefix) => {
            let c = load_agreed(ctx, prefix, &shape, args)?;
            for t in 0..4 {
                params[t].write(0, &c.params[t]);
            }
            for s in shards.iter_mut() {
                let st: &RangeState = &c.state[s.tensor];
                s.master.clone_from(&st.master);
                s.m.clone_from(&st.m);
                s.v.clone_from(&st.v);
            }
            ctx.restore_windows(c.windows_completed)?;
            checks.eq("windows completed after sf_restore_windows", ctx.stats()?.windows_completed, c.windows_completed);
            for w in 0..c.windows_completed as usize {
                reference_window(&mut reference, &mut rm, &mut rv, args, world, w);
            }
            println!("resumed from {} after window {} (sf_restore_windows({}))", checkpoint::path(prefix, rank), c.windows_completed - 1, c.windows_completed);
            c.windows_completed as usize
        }
    };
    let last = args.stop_after.unwrap_or(args.windows);

    let n = args.micro_batches;
    let scale = 1.0 / n as f64;
    let mut worst = 0.0f64;
    for w in first..last {
        let mut current = Params::init(args.seed);
        for t in 0..4 {
            current.t[t] = params[t].read(NUMEL[t]);
        }
        let s0 = ctx.stats()?;
        if n > 1 {
            ctx.begin_accumulation()?;
        }
        for m in 0..n - 1 {
            let (_, g) = loss_and_grad(&current, &micro_batch(args.seed, rank, w, m, args.batch));
            trainer.backward(&g, scale)?;
        }
        if n > 1 {
            ctx.end_accumulation()?;
        }
        let s1 = ctx.stats()?;
        let (_, g) = loss_and_grad(&current, &micro_batch(args.seed, rank, w, n - 1, args.batch));
        trainer.backward(&g, scale)?;
        // Per bucket: wait for its reduce-scatter, step the owned ranges,
        // start its all-gather at once.
        ctx.synchronize_start()?;
        for b in 0..buckets {
            ctx.wait_bucket(b)?;
            for s in shards.iter_mut().filter(|s| s.bucket == b) {
                let grad = trainer.grads[s.tensor].to_f64();
                let cnt = s.master.len();
                adamw(&mut s.master, &grad[s.offset..s.offset + cnt], &mut s.m, &mut s.v, w as i32 + 1, args.lr);
                params[s.tensor].write(s.offset, &s.master);
            }
            ctx.start_gather(b)?;
        }
        ctx.synchronize()?;
        ctx.wait_gather(-1)?;
        let s2 = ctx.stats()?;
        checks.eq(&format!("window {w}: collectives inside the window"), s1.collectives_issued - s0.collectives_issued, 0);
        checks.eq(&format!("window {w}: reduce-scatters"), s2.reduce_scatters - s0.reduce_scatters, buckets);
        checks.eq(&format!("window {w}: all-gathers"), s2.all_gathers - s0.all_gathers, buckets);
        checks.eq(&format!("window {w}: windows completed"), s2.windows_completed - s0.windows_completed, 1);
        checks.eq(&format!("window {w}: windows completed in all"), s2.windows_completed, w as i64 + 1);
        let gathered = s2.bytes_gathered - s0.bytes_gathered;
        checks.expect(gathered >= s2.gradient_bytes, format!("window {w}: {gathered} bytes gathered < {} parameter bytes", s2.gradient_bytes));
        ctx.zero_gradients()?;

        reference_window(&mut reference, &mut rm, &mut rv, args, world, w);
        let want = rounded(&reference);
        let mut got = want.clone();
        for t in 0..4 {
            got.t[t] = params[t].read(NUMEL[t]);
        }
        let diff = got.max_abs_diff(&want);
        worst = worst.max(diff);
        checks.expect(diff < args.tolerance, format!("window {w}: max |w - w_ref| = {diff:.3e} exceeds tolerance {:.1e}", args.tolerance));
        println!(
            "window {w}: reduce-scatters {}, all-gathers {} ({gathered} B), inside the window {}, max |w - w_ref| {diff:.3e}",
            s2.reduce_scatters - s0.reduce_scatters,
            s2.all_gathers - s0.all_gathers,
            s1.collectives_issued - s0.collectives_issued
        );
    }
    println!(
        "parity (sharded AdamW): max |w - w_ref| = {worst:.3e} over windows {first}..{} x {n} micro-batches x {world} ranks (tolerance {:.1e})",
        last.saturating_sub(1),
        args.tolerance
    );

    if let Some(prefix) = &args.checkpoint {
        // Stopped after window `last - 1`: this rank's file.
        let windows_completed = ctx.stats()?.windows_completed;
        checks.eq("windows completed at the checkpoint", windows_completed, last as i64);
        let mut state = vec![RangeState::default(); 4];
        for s in &shards {
            state[s.tensor] = RangeState { master: s.master.clone(), m: s.m.clone(), v: s.v.clone() };
        }
        let c = Checkpoint { shape, windows_completed, params: (0..4).map(|t| params[t].read(NUMEL[t])).collect(), state };
        let file = checkpoint::path(prefix, rank);
        c.save(&file).map_err(|e| RunError::Checkpoint(format!("cannot write {file}: {e}")))?;
        println!("checkpoint: {file} after window {} (windows_completed {windows_completed}, {owned} owned elements' AdamW state)", last - 1);
    }
    let weights = weight_bytes(&params);
    if let Some(prefix) = &args.weights_out {
        let file = format!("{prefix}.rank{rank}.weights");
        fs::write(&file, &weights).map_err(|e| RunError::Checkpoint(format!("cannot write {file}: {e}")))?;
        println!("weights: {file} ({} bytes)", weights.len());
    }
    if let Some(prefix) = &args.expect_weights {
        let file = format!("{prefix}.rank{rank}.weights");
        let want = fs::read(&file).map_err(|e| RunError::Checkpoint(format!("cannot read {file}: {e}")))?;
        match first_difference(&weights, &want) {
            None if weights.len() == want.len() => {
                checks.expect(true, String::new());
                println!("weights: bitwise equal to {file} ({} bytes)", want.len());
            }
            None => checks.expect(false, format!("weights: {} bytes, {file} has {}", weights.len(), want.len())),
            Some((t, e)) => checks.expect(false, format!("weights: {}[{e}] differs from {file} (the first difference)", NAMES[t])),
        }
    }
    Ok(())
}
