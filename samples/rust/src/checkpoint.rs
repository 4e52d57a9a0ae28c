//! Per-rank checkpoints of the sharded mode (`--stop-after K --checkpoint
//! PREFIX` saves, `--resume PREFIX` loads): what one rank needs to go on
//! exactly where it stopped, in one file per rank, `PREFIX.rank<R>.ckpt`.
//!
//! A file holds the run's shape (world size, this rank, the shard layout, the
//! bucket count, and per tensor its numel, dtype, bucket and the range
//! sf_shard_range gave this rank), the window count (sf_stats
//! .windows_completed at the save), the whole parameters as the gather left
//! them (every rank holds the same), and the AdamW state of this rank's
//! ranges only (float64 master copy, first and second moments). `matches`
//! compares a loaded file with the resumed run's own shape and names the
//! first difference. No training and no sfsync call here.
//!
//! Format (little-endian): the magic line, then i64 fields, then per tensor
//! its record, then per tensor its parameters and its three state vectors as
//! f64 (f32 tensors' values are exact in f64). Version 1.

use std::fs;
use std::io;

const MAGIC: &[u8] = b"sfsync rust sample checkpoint v1\n";

/// One tensor's place in the run: what a resumed run must find the same.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorRecord {
    pub name: String,
    pub numel: i64,
    pub dtype: i32,
    pub bucket: i64,
    pub offset: i64, // this rank's range, from sf_shard_range
    pub count: i64,
}

/// The shape of a run as one rank sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct RunShape {
    pub world_size: i32,
    pub rank: i32,
    pub layout: i32,
    pub buckets: i64,
    pub tensors: Vec<TensorRecord>,
}

/// AdamW state of one tensor's owned range (empty when the rank owns none).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RangeState {
    pub master: Vec<f64>,
    pub m: Vec<f64>,
    pub v: Vec<f64>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    pub shape: RunShape,
    pub windows_completed: i64,
    pub params: Vec<Vec<f64>>,   // per tensor, whole
    pub state: Vec<RangeState>, // per tensor, this rank's range
}

/// The file of `rank` under `prefix`.
pub fn path(prefix: &str, rank: usize) -> String {
    format!("{prefix}.rank{rank}.ckpt")
}

pub fn layout_name(layout: i32) -> String {
    match layout {
        1 => "flat".into(),
        2 => "parameter".into(),
        n => format!("{n} (not a sharded layout)"),
    }
}

fn dtype_name(dtype: i32) -> &'static str {
    match dtype {
        0 => "float32",
        1 => "float64",
        _ => "?",
    }
}

struct Writer(Vec<u8>);

impl Writer {
    fn i64(&mut self, v: i64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn f64s(&mut self, v: &[f64]) {
        self.i64(v.len() as i64);
        for x in v {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
    }
    fn text(&mut self, s: &str) {
        self.i64(s.len() as i64);
        self.0.extend_from_slice(s.as_bytes());
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        if self.bytes.len() - self.at < n {
            return Err(format!("truncated: {} bytes, needs more than {}", self.bytes.len(), self.at));
        }
        self.at += n;
        Ok(&self.bytes[self.at - n..self.at])
    }
    fn i64(&mut self) -> Result<i64, String> {
        Ok(i64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn len(&mut self, what: &str) -> Result<usize, String> {
        let n = self.i64()?;
        if n < 0 || n as usize > self.bytes.len() {
            return Err(format!("{what}: length {n} does not fit the file"));
        }
        Ok(n as usize)
    }
    fn f64s(&mut self, what: &str) -> Result<Vec<f64>, String> {
        let n = self.len(what)?;
        let raw = self.take(8 * n)?;
        Ok(raw.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect())
    }
    fn text(&mut self, what: &str) -> Result<String, String> {
        let n = self.len(what)?;
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
}

impl Checkpoint {
    pub fn save(&self, path: &str) -> io::Result<()> {
        let mut w = Writer(MAGIC.to_vec());
        let s = &self.shape;
        for v in [s.world_size as i64, s.rank as i64, s.layout as i64, s.buckets, self.windows_completed, s.tensors.len() as i64] {
            w.i64(v);
        }
        for t in &s.tensors {
            w.text(&t.name);
            for v in [t.numel, t.dtype as i64, t.bucket, t.offset, t.count] {
                w.i64(v);
            }
        }
        for (p, st) in self.params.iter().zip(&self.state) {
            w.f64s(p);
            w.f64s(&st.master);
            w.f64s(&st.m);
            w.f64s(&st.v);
        }
        // Written whole, then renamed: a run killed while saving leaves the
        // previous file or none, never half of one.
        let tmp = format!("{path}.tmp");
        fs::write(&tmp, &w.0)?;
        fs::rename(&tmp, path)
    }

    pub fn load(path: &str) -> Result<Checkpoint, String> {
        let bytes = fs::read(path).map_err(|e| format!("cannot read it: {e}"))?;
        if !bytes.starts_with(MAGIC) {
            return Err("not a checkpoint of this sample (its first line differs)".into());
        }
        let mut r = Reader { bytes: &bytes, at: MAGIC.len() };
        let world_size = r.i64()? as i32;
        let rank = r.i64()? as i32;
        let layout = r.i64()? as i32;
        let buckets = r.i64()?;
        let windows_completed = r.i64()?;
        let n = r.len("tensor count")?;
        let mut tensors = Vec::with_capacity(n);
        for _ in 0..n {
            let name = r.text("tensor name")?;
            let (numel, dtype, bucket, offset, count) = (r.i64()?, r.i64()? as i32, r.i64()?, r.i64()?, r.i64()?);
            tensors.push(TensorRecord { name, numel, dtype, bucket, offset, count });
        }
        let (mut params, mut state) = (Vec::new(), Vec::new());
        for t in &tensors {
            let p = r.f64s(&t.name)?;
            let st = RangeState { master: r.f64s(&t.name)?, m: r.f64s(&t.name)?, v: r.f64s(&t.name)? };
            if p.len() as i64 != t.numel || [&st.master, &st.m, &st.v].iter().any(|v| v.len() as i64 != t.count) {
                return Err(format!("tensor {}: {} parameters and {} state values for numel {} and a range of {}", t.name, p.len(), st.master.len(), t.numel, t.count));
            }
            params.push(p);
            state.push(st);
        }
        if r.at != bytes.len() {
            return Err(format!("{} bytes after the last tensor", bytes.len() - r.at));
        }
        Ok(Checkpoint { shape: RunShape { world_size, rank, layout, buckets, tensors }, windows_completed, params, state })
    }

    /// Ok when this checkpoint fits the resumed run `now` (the same rank,
    /// world size, layout, buckets and ranges) and leaves windows to train;
    /// else the first difference, "<what> <saved> in the checkpoint, <now>
    /// in this run".
    pub fn matches(&self, now: &RunShape, windows: usize) -> Result<(), String> {
        let (a, b) = (&self.shape, now);
        let differ = |what: &str, saved: String, here: String| Err(format!("{what} {saved} in the checkpoint, {here} in this run"));
        if a.world_size != b.world_size {
            return differ("world size", a.world_size.to_string(), b.world_size.to_string());
        }
        if a.rank != b.rank {
            return differ("rank", a.rank.to_string(), b.rank.to_string());
        }
        if a.layout != b.layout {
            return differ("shard layout", layout_name(a.layout), layout_name(b.layout));
        }
        if a.buckets != b.buckets {
            return differ("bucket count", a.buckets.to_string(), b.buckets.to_string());
        }
        if a.tensors.len() != b.tensors.len() {
            return differ("tensor count", a.tensors.len().to_string(), b.tensors.len().to_string());
        }
        for (s, h) in a.tensors.iter().zip(&b.tensors) {
            if s.name != h.name || s.numel != h.numel || s.dtype != h.dtype {
                return differ("tensor", format!("{} ({} x {})", s.name, s.numel, dtype_name(s.dtype)), format!("{} ({} x {})", h.name, h.numel, dtype_name(h.dtype)));
            }
            if s.bucket != h.bucket || s.offset != h.offset || s.count != h.count {
                return differ(
                    &format!("tensor {}: bucket and shard range", s.name),
                    format!("{} [{}, {})", s.bucket, s.offset, s.offset + s.count),
                    format!("{} [{}, {})", h.bucket, h.offset, h.offset + h.count),
                );
            }
        }
        if self.windows_completed < 0 || self.windows_completed as usize >= windows {
            return Err(format!("the checkpoint completed {} windows; --windows {windows} leaves none to train", self.windows_completed));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Checkpoint {
        let t = |name: &str, numel, offset, count| TensorRecord { name: name.into(), numel, dtype: 1, bucket: 0, offset, count };
        Checkpoint {
            shape: RunShape { world_size: 2, rank: 1, layout: 1, buckets: 1, tensors: vec![t("a", 3, 2, 1), t("b", 2, 0, 0)] },
            windows_completed: 4,
            params: vec![vec![1.0, -0.0, f64::MIN_POSITIVE], vec![3.5, 1e300]],
            state: vec![RangeState { master: vec![0.25], m: vec![-1.0], v: vec![2.0] }, RangeState::default()],
        }
    }

    #[test]
    fn a_saved_checkpoint_loads_bitwise_and_names_the_first_difference() {
        let dir = std::env::temp_dir().join(format!("sfsync-ckpt-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let p = path(dir.join("c").to_str().unwrap(), 1);
        let c = sample();
        c.save(&p).unwrap();
        let back = Checkpoint::load(&p).unwrap();
        assert_eq!(back, c);
        assert_eq!(back.params[0][1].to_bits(), (-0.0f64).to_bits());
        assert_eq!(back.matches(&c.shape, 5), Ok(()));
        let mut other = c.shape.clone();
        other.world_size = 3;
        assert_eq!(back.matches(&other, 5), Err("world size 2 in the checkpoint, 3 in this run".into()));
        let mut other = c.shape.clone();
        other.tensors[0].count = 2;
        assert_eq!(back.matches(&other, 5), Err("tensor a: bucket and shard range 0 [2, 3) in the checkpoint, 0 [2, 4) in this run".into()));
        assert!(back.matches(&c.shape, 4).unwrap_err().contains("leaves none"));
        let bytes = fs::read(&p).unwrap();
        fs::write(&p, &bytes[..bytes.len() - 3]).unwrap();
        assert!(Checkpoint::load(&p).unwrap_err().contains("truncated"));
        fs::remove_dir_all(&dir).unwrap();
    }
}
