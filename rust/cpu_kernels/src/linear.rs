//! Linear layers over a few rows (decode steps, draft verification): `y[r] = W x[r] + bias`.
//!
//! `W` is row-major `[fan_out, fan_in]`, as checkpoints store it, and is read from memory once
//! per call whatever the number of rows: each tile of weight rows, once loaded, serves every row
//! of `x` from cache. At a few rows a linear layer is a stream of its weights, and BLAS libraries
//! reach a third of a CPU's read bandwidth there (they pack the weights on every call); this
//! kernel reads them as they lie.
//!
//! Every output is one dot product summed in the same order whatever the number of rows, the
//! tile it falls in or the thread that computes it, so a row's result does not depend on the
//! rows beside it: a draft verified with other tokens gets the bits a lone decode step would.
//!
//! Layouts (row-major, f32): `x [rows, fan_in]`, `bias [fan_out]`, `y [rows, fan_out]`.

use std::ops::Range;

use crate::parallel::{ForkJoin, OnCallingThread, MIN_PARALLEL_WORK, PARTS_PER_THREAD};
use crate::vector::dot;

/// Weight rows a tile holds: each load of an input vector serves this many outputs.
pub(crate) const TILE_OUTPUTS: usize = 4;

/// One linear layer's parameters.
pub struct LinearWeights<'a> {
    pub weight: &'a [f32],
    pub bias: Option<&'a [f32]>,
    pub fan_in: usize,
    pub fan_out: usize,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct LinearError(String);

impl LinearError {
    pub(crate) fn new(message: String) -> Self {
        Self(message)
    }
}

/// `y = x W^T + bias` on the calling thread.
pub fn linear(x: &[f32], weights: &LinearWeights<'_>, y: &mut [f32]) -> Result<(), LinearError> {
    linear_on(&OnCallingThread, x, weights, y)
}

/// `linear` with the outputs spread over the threads of `pool` (`PARTS_PER_THREAD` ranges of
/// outputs per thread). The result is the same bits as on one thread.
pub fn linear_on(
    pool: &dyn ForkJoin,
    x: &[f32],
    weights: &LinearWeights<'_>,
    y: &mut [f32],
) -> Result<(), LinearError> {
    run_checked(pool, x, weights, y)
}

/// What the kernel needs of a layer's weights, whatever they are stored as: weight (o, j) as
/// f32, and the output made of output o's dot product (the bias added; a quantized layer's
/// scale applied first).
pub(crate) trait RowWeights: Sync {
    /// Bits of one weight: how far the next tile's weights lie (the AVX2 half prefetches them).
    const BITS: usize;
    fn fan_in(&self) -> usize;
    fn fan_out(&self) -> usize;
    fn bias(&self) -> Option<&[f32]>;
    /// Whether the stored arrays have the sizes fan_in and fan_out say (the error names one).
    fn check(&self) -> Result<(), LinearError>;
    fn value(&self, o: usize, j: usize) -> f32;
    fn finish(&self, o: usize, dot: f32) -> f32;
    /// Where row o's weights begin.
    fn row_ptr(&self, o: usize) -> *const u8;
    /// Weights (o, i..i + 8) as f32. Safety: AVX2, and i + 8 <= fan_in.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(&self, o: usize, i: usize) -> std::arch::x86_64::__m256;
    /// Outputs `outputs` of every row with AVX2: the generic tiles over `load8`, unless a weight
    /// type has a kernel of its own. Safety: AVX2 and FMA, shapes checked.
    #[cfg(target_arch = "x86_64")]
    unsafe fn run_outputs_avx2(&self, x: &[f32], rows: usize, outputs: Range<usize>, y: &SharedOutputs)
    where
        Self: Sized,
    {
        crate::linear_avx2::run_outputs(x, rows, self, outputs, y)
    }
}

impl RowWeights for LinearWeights<'_> {
    const BITS: usize = 32;
    fn fan_in(&self) -> usize {
        self.fan_in
    }
    fn fan_out(&self) -> usize {
        self.fan_out
    }
    fn bias(&self) -> Option<&[f32]> {
        self.bias
    }
    fn check(&self) -> Result<(), LinearError> {
        let (k, n) = (self.fan_in, self.fan_out);
        if k == 0 || self.weight.len() != n * k {
            return Err(LinearError(format!(
                "weight: {} values for [fan_out {n}, fan_in {k}]",
                self.weight.len()
            )));
        }
        Ok(())
    }
    #[inline(always)]
    fn value(&self, o: usize, j: usize) -> f32 {
        self.weight[o * self.fan_in + j]
    }
    #[inline(always)]
    fn finish(&self, o: usize, dot: f32) -> f32 {
        self.bias.map_or(dot, |b| dot + b[o])
    }
    #[inline(always)]
    fn row_ptr(&self, o: usize) -> *const u8 {
        self.weight.as_ptr().wrapping_add(o * self.fan_in) as *const u8
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(&self, o: usize, i: usize) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(self.weight.as_ptr().add(o * self.fan_in + i))
    }
}

/// `y = x W^T + bias` once the weights' arrays and the step's (x, y, bias) are checked.
pub(crate) fn run_checked<W: RowWeights>(
    pool: &dyn ForkJoin,
    x: &[f32],
    weights: &W,
    y: &mut [f32],
) -> Result<(), LinearError> {
    weights.check()?;
    check_rows(x, weights.fan_in(), weights.fan_out(), weights.bias(), y)?;
    run_rows(pool, x, weights, y);
    Ok(())
}

/// Checks the shapes of the step's arrays against fan_in `k` and fan_out `n`; returns the rows.
pub(crate) fn check_rows(
    x: &[f32],
    k: usize,
    n: usize,
    bias: Option<&[f32]>,
    y: &[f32],
) -> Result<usize, LinearError> {
    if let Some(b) = bias.filter(|b| b.len() != n) {
        return Err(LinearError(format!("bias: {} values for fan_out {n}", b.len())));
    }
    if !x.len().is_multiple_of(k) {
        return Err(LinearError(format!("x: {} values is not a whole number of rows of {k}", x.len())));
    }
    let rows = x.len() / k;
    if y.len() != rows * n {
        return Err(LinearError(format!("y: {} values for [rows {rows}, fan_out {n}]", y.len())));
    }
    Ok(rows)
}

/// Rows one pass over the weights serves: their inputs stay in the cache while it streams.
/// More rows (a prompt) take a pass per CHUNK_ROWS rows.
pub const CHUNK_ROWS: usize = 16;

/// `y = x W^T` through the kernel, for shapes already checked.
fn run_rows<W: RowWeights>(pool: &dyn ForkJoin, x: &[f32], weights: &W, y: &mut [f32]) {
    let (k, n) = (weights.fan_in(), weights.fan_out());
    for (xs, ys) in x.chunks(CHUNK_ROWS * k).zip(y.chunks_mut(CHUNK_ROWS * n)) {
        run_chunk(pool, xs, xs.len() / k, weights, ys);
    }
}

/// At most CHUNK_ROWS rows: each tile of weight rows, once loaded, serves all of them.
fn run_chunk<W: RowWeights>(pool: &dyn ForkJoin, x: &[f32], rows: usize, weights: &W, y: &mut [f32]) {
    let n = weights.fan_out();
    let out = SharedOutputs { ptr: y.as_mut_ptr(), len: y.len() };
    for_output_ranges(pool, n, rows * weights.fan_in() * n, &|outputs| {
        run_outputs(x, rows, weights, outputs, &out)
    });
}

/// Runs `run` over outputs 0..n split into ranges of whole tiles (TILE_OUTPUTS), one range per
/// part of `pool`'s work (`PARTS_PER_THREAD` per thread), or all of them on the calling thread
/// when the call's `work` (multiply-adds) is under MIN_PARALLEL_WORK.
pub(crate) fn for_output_ranges(
    pool: &dyn ForkJoin,
    n: usize,
    work: usize,
    run: &(dyn Fn(Range<usize>) + Sync),
) {
    let tiles = n.div_ceil(TILE_OUTPUTS);
    let parts = if work < MIN_PARALLEL_WORK { 1 } else { tiles.min(PARTS_PER_THREAD * pool.threads()) };
    let outputs = |tiles: Range<usize>| tiles.start * TILE_OUTPUTS..(tiles.end * TILE_OUTPUTS).min(n);
    if parts <= 1 {
        run(outputs(0..tiles));
    } else {
        pool.run(parts, &|i| run(outputs(i * tiles / parts..(i + 1) * tiles / parts)));
    }
}

/// Each output `$o` of `$outputs` over input rows 0..`$rows` in tiles of at most `$max` (at most
/// 8) rows: `$tile::<N, ..>(..)` once a tile, N its rows, `$r` its first row. The row count
/// becomes the constant a tile's registers are sized by; the kernels tiled this way share it.
macro_rules! for_row_tiles {
    ($outputs:expr, $rows:expr, $max:expr, |$o:ident, $r:ident| $tile:ident::<N $(, $g:tt)*>($($arg:expr),* $(,)?)) => {
        for $o in $outputs {
            let mut $r = 0;
            while $r < $rows {
                let n = ($rows - $r).min($max);
                match n {
                    1 => $tile::<1 $(, $g)*>($($arg),*),
                    2 => $tile::<2 $(, $g)*>($($arg),*),
                    3 => $tile::<3 $(, $g)*>($($arg),*),
                    4 => $tile::<4 $(, $g)*>($($arg),*),
                    5 => $tile::<5 $(, $g)*>($($arg),*),
                    6 => $tile::<6 $(, $g)*>($($arg),*),
                    7 => $tile::<7 $(, $g)*>($($arg),*),
                    _ => $tile::<8 $(, $g)*>($($arg),*),
                }
                $r += n;
            }
        }
    };
}
pub(crate) use for_row_tiles;

/// The outputs of the rows of `y`, written by several threads at once, each only the columns of
/// its own range of outputs.
pub(crate) struct SharedOutputs {
    pub ptr: *mut f32,
    pub len: usize,
}

// SAFETY: the threads sharing it write disjoint elements (see above).
unsafe impl Sync for SharedOutputs {}

impl SharedOutputs {
    /// Sets element `i`. Safety: no other thread writes element `i`.
    #[inline(always)]
    pub(crate) unsafe fn set(&self, i: usize, value: f32) {
        assert!(i < self.len);
        *self.ptr.add(i) = value;
    }
}

/// Columns `outputs` of every row, on the calling thread.
fn run_outputs<W: RowWeights>(x: &[f32], rows: usize, w: &W, outputs: Range<usize>, y: &SharedOutputs) {
    #[cfg(target_arch = "x86_64")]
    if crate::vector::avx2_fma_available() {
        // SAFETY: the CPU has AVX2 and FMA; the shapes were checked against every length the
        // AVX2 half reads.
        return unsafe { w.run_outputs_avx2(x, rows, outputs, y) };
    }
    let k = w.fan_in();
    let mut row = vec![0.0f32; k];
    for o in outputs {
        for (j, v) in row.iter_mut().enumerate() {
            *v = w.value(o, j);
        }
        for r in 0..rows {
            let s = w.finish(o, dot(&row, &x[r * k..][..k]));
            // SAFETY: this call's range of outputs is its own.
            unsafe { y.set(r * w.fan_out() + o, s) };
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A pool of two "threads" that runs the parts in reverse order (on the calling thread).
    pub(crate) struct TwoParts;
    impl ForkJoin for TwoParts {
        fn run(&self, parts: usize, task: &(dyn Fn(usize) + Sync)) {
            (0..parts).rev().for_each(task);
        }
        fn threads(&self) -> usize {
            2
        }
    }

    /// A quantized layer's outputs against its float64 reference, within a tolerance that grows
    /// with the fan_in `k` (the sums' rounding).
    pub(crate) fn assert_close(got: &[f32], want: &[f64], k: usize) {
        assert_eq!(got.len(), want.len());
        for (&got, &want) in got.iter().zip(want) {
            let got = got as f64;
            assert!((got - want).abs() < 1e-4 * (1.0 + want.abs()) * k as f64, "{got} vs {want}");
        }
    }

    /// Deterministic values in [-1, 1].
    pub(crate) fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).max(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    fn reference(x: &[f32], w: &[f32], bias: Option<&[f32]>, k: usize, n: usize) -> Vec<f64> {
        let rows = x.len() / k;
        let mut y = vec![0.0f64; rows * n];
        for r in 0..rows {
            for o in 0..n {
                let s: f64 = (0..k).map(|i| x[r * k + i] as f64 * w[o * k + i] as f64).sum();
                y[r * n + o] = s + bias.map_or(0.0, |b| b[o] as f64);
            }
        }
        y
    }

    #[test]
    fn matches_a_float64_reference_for_odd_shapes() {
        for (rows, k, n) in [(1, 8, 4), (3, 37, 9), (2, 256, 130), (5, 100, 7)] {
            let (x, w, b) = (values(rows * k, 1), values(n * k, 2), values(n, 3));
            for bias in [None, Some(b.as_slice())] {
                let mut y = vec![f32::NAN; rows * n];
                linear(&x, &LinearWeights { weight: &w, bias, fan_in: k, fan_out: n }, &mut y).unwrap();
                for (got, want) in y.iter().zip(reference(&x, &w, bias, k, n)) {
                    assert!((*got as f64 - want).abs() < 1e-4 * (1.0 + want.abs()), "{got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn a_row_gets_the_same_bits_alone_beside_other_rows_and_on_several_threads() {
        let (k, n) = (300, 1030);
        let w = values(n * k, 5);
        let weights = LinearWeights { weight: &w, bias: None, fan_in: k, fan_out: n };
        // Three rows pass over a tile of four weight rows at once; from four rows on, tiles of
        // two weight rows take six rows a pass (seven: six and one; thirteen: six, six and one),
        // and outputs left over go through the narrower tiles.
        for rows in [3, 4, 5, 7, 13] {
            let x = values(rows * k, 4);
            let mut all = vec![0.0; rows * n];
            linear_on(&TwoParts, &x, &weights, &mut all).unwrap();
            for r in 0..rows {
                let mut one = vec![0.0; n];
                linear(&x[r * k..][..k], &weights, &mut one).unwrap();
                assert_eq!(one, all[r * n..][..n], "row {r} of {rows}");
            }
        }
    }

    #[test]
    fn bad_shapes_are_errors_naming_the_argument() {
        let w = vec![0.0; 12];
        let ok = LinearWeights { weight: &w, bias: None, fan_in: 4, fan_out: 3 };
        let err = |x: &[f32], w: &LinearWeights<'_>, y: &mut [f32]| linear(x, w, y).unwrap_err().to_string();
        assert!(err(&[0.0; 5], &ok, &mut [0.0; 3]).starts_with("x:"));
        assert!(err(&[0.0; 4], &ok, &mut [0.0; 4]).starts_with("y:"));
        let bad_bias = LinearWeights { bias: Some(&[0.0; 2]), ..ok };
        assert!(err(&[0.0; 4], &bad_bias, &mut [0.0; 3]).starts_with("bias:"));
        let bad_weight = LinearWeights { weight: &w[..11], bias: None, fan_in: 4, fan_out: 3 };
        assert!(err(&[0.0; 4], &bad_weight, &mut [0.0; 3]).starts_with("weight:"));
    }
}
