//! GGUF blocks as pyserve's quantized layers hold them, converted in one pass over each row (the
//! load of a quantized file, which numpy did in several passes over whole tensors):
//! - `repack_q4`: Q4_0, Q4_1 and Q4_K rows as `linear_q4`'s layout in groups of 32 (nibbles two a
//!   byte in weight order; each group's scale and offset in f16: Q4_0's offset is -8 scales,
//!   Q4_K's scale d * sc and offset -dmin * m are f32 products rounded to f16);
//! - `widen`: any of them to f32 with the `gguf` package's arithmetic (an embedding table);
//! - `requantize_int8`: Q8_0, Q5_0 and Q6_K rows widened with the `gguf` package's arithmetic
//!   (the same f32 products in the same order) and rounded to int8 with one scale per row, as
//!   pyserve's `quantize_int8` rounds a widened weight: scale = max(max |w|, f32::MIN_POSITIVE) /
//!   127, q = w / scale rounded half to even.
//!
//! Block layouts (llama.cpp's ggml-common.h, little-endian):
//! - Q4_0, 18 bytes / 32 weights: d (f16), qs[16]: weight j in qs[j]'s low nibble, j + 16 in its high;
//! - Q4_1, 20 bytes: d, m (f16), qs[16] as Q4_0's; weight = q * d + m;
//! - Q4_K, 144 bytes / 256: d, dmin (f16), 12 bytes of 6-bit scales sc and mins m for 8 groups of
//!   32 (bytes 0-3: sc[0..4] low 6 bits, sc[4..8]'s high 2 above; 4-7 likewise m; 8-11: sc[4..8]'s
//!   low 4 bits low, m[4..8]'s high), qs[128]: each 64 weights 32 bytes, the first 32 in the low
//!   nibbles; weight = d * sc * q - dmin * m;
//! - Q8_0, 34 bytes / 32: d (f16), q[32] i8; weight = q * d;
//! - Q5_0, 22 bytes / 32: d (f16), qh (u32: bit j the 5th bit of weight j), qs[16] as Q4_0's;
//!   weight = d * (q - 16);
//! - Q6_K, 210 bytes / 256: ql[128], qh[64], sc[16] i8, d (f16); weight i of a half h (128
//!   weights) at r = i % 128: low 4 bits in ql[64h + r % 64] (shifted by 4 when r >= 64), high 2
//!   in qh[32h + r % 32] (shifted by 2 * (r / 32)); weight = (d * sc[i / 16]) * (q - 32).

use half::f16;

use crate::parallel::{ForkJoin, PARTS_PER_THREAD};
use crate::vector::round_ties_even_small;

/// A GGUF block type `repack_q4` or `requantize_int8` takes, with its block's weights and bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockKind {
    Q4_0,
    Q4_1,
    Q4K,
    Q8_0,
    Q5_0,
    Q6K,
}

impl BlockKind {
    /// Every type, in a fixed order.
    pub const ALL: [Self; 6] = [Self::Q4_0, Self::Q4_1, Self::Q4K, Self::Q8_0, Self::Q5_0, Self::Q6K];

    /// Its GGUF name (`Q4_K`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q4K => "Q4_K",
            Self::Q8_0 => "Q8_0",
            Self::Q5_0 => "Q5_0",
            Self::Q6K => "Q6_K",
        }
    }

    /// The type by its GGUF name.
    pub fn named(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Weights of a block, and its bytes.
    pub fn weights_and_bytes(self) -> (usize, usize) {
        match self {
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q4K => (256, 144),
            Self::Q8_0 => (32, 34),
            Self::Q5_0 => (32, 22),
            Self::Q6K => (256, 210),
        }
    }

    /// Bytes of a row of `fan_in` weights (None: not a whole number of blocks, or none).
    pub fn row_bytes(self, fan_in: usize) -> Option<usize> {
        let (weights, bytes) = self.weights_and_bytes();
        (fan_in > 0 && fan_in.is_multiple_of(weights)).then(|| fan_in / weights * bytes)
    }

    fn is_q4(self) -> bool {
        matches!(self, Self::Q4_0 | Self::Q4_1 | Self::Q4K)
    }
}

/// A conversion's shapes did not fit: the message names the argument.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BlocksError(String);

/// Rows of `blocks` [rows, row bytes] with `fan_in` weights each, checked.
fn check(kind: BlockKind, blocks: &[u8], rows: usize, fan_in: usize) -> Result<usize, BlocksError> {
    let Some(row_bytes) = kind.row_bytes(fan_in) else {
        let weights = kind.weights_and_bytes().0;
        return Err(BlocksError(format!(
            "fan_in: {fan_in} is not a whole number of {kind:?}'s {weights}-weight blocks"
        )));
    };
    if blocks.len() != rows * row_bytes {
        return Err(BlocksError(format!(
            "blocks: {} bytes for {rows} rows of {fan_in} {kind:?} weights ({row_bytes} bytes a row)",
            blocks.len()
        )));
    }
    Ok(row_bytes)
}

pub(crate) fn f16_at(b: &[u8], at: usize) -> f16 {
    f16::from_le_bytes([b[at], b[at + 1]])
}

/// Runs `task(rows)` over consecutive ranges of `rows`, spread over `pool`.
fn for_row_ranges(pool: &dyn ForkJoin, rows: usize, task: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
    let parts = (pool.threads() * PARTS_PER_THREAD).clamp(1, rows.max(1));
    let per = rows.div_ceil(parts);
    pool.run(parts, &|p| {
        let range = (p * per).min(rows)..((p + 1) * per).min(rows);
        if !range.is_empty() {
            task(range)
        }
    });
}

/// Output slices written by several threads, each its own rows.
struct Shared<T> {
    ptr: *mut T,
    len: usize,
}
unsafe impl<T: Send> Sync for Shared<T> {}

impl<T> Shared<T> {
    fn new(v: &mut [T]) -> Self {
        Self { ptr: v.as_mut_ptr(), len: v.len() }
    }
    /// SAFETY: no two threads take overlapping ranges.
    #[allow(clippy::mut_from_ref)]
    unsafe fn range(&self, start: usize, len: usize) -> &mut [T] {
        assert!(start + len <= self.len);
        std::slice::from_raw_parts_mut(self.ptr.add(start), len)
    }
}

/// Q4_0 / Q4_1 / Q4_K rows [rows, row bytes] as `packed` [rows, fan_in / 2], `scales` and
/// `offsets` [rows, fan_in / 32].
#[allow(clippy::too_many_arguments)]
pub fn repack_q4(
    pool: &dyn ForkJoin,
    kind: BlockKind,
    blocks: &[u8],
    rows: usize,
    fan_in: usize,
    packed: &mut [u8],
    scales: &mut [f16],
    offsets: &mut [f16],
) -> Result<(), BlocksError> {
    if !kind.is_q4() {
        return Err(BlocksError(format!("kind: {kind:?} is not a 4-bit type")));
    }
    let row_bytes = check(kind, blocks, rows, fan_in)?;
    let groups = fan_in / 32;
    if packed.len() != rows * fan_in / 2 || scales.len() != rows * groups || offsets.len() != rows * groups {
        return Err(BlocksError(format!(
            "packed, scales, offsets: {}, {}, {} values for [{rows}, {}] and [{rows}, {groups}]",
            packed.len(),
            scales.len(),
            offsets.len(),
            fan_in / 2
        )));
    }
    let (out_packed, out_scales, out_offsets) =
        (Shared::new(packed), Shared::new(scales), Shared::new(offsets));
    for_row_ranges(pool, rows, &|range| {
        for r in range {
            let row = &blocks[r * row_bytes..][..row_bytes];
            // SAFETY: row r's outputs are this task's alone.
            let (p, s, o) = unsafe {
                (
                    out_packed.range(r * fan_in / 2, fan_in / 2),
                    out_scales.range(r * groups, groups),
                    out_offsets.range(r * groups, groups),
                )
            };
            match kind {
                BlockKind::Q4K => q4_k_row(row, p, s, o),
                _ => q4_0_1_row(kind, row, p, s, o),
            }
        }
    });
    Ok(())
}

/// Weight j (0..32) of a 32-weight block's 16 bytes of nibbles (Q4_0, Q4_1, Q5_0's low bits):
/// weight j in byte j's low nibble, j + 16 in its high one.
#[inline(always)]
fn nibble(qs: &[u8], j: usize) -> u8 {
    if j < 16 {
        qs[j] & 0xF
    } else {
        qs[j - 16] >> 4
    }
}

/// 32 weights in order, two a byte as `linear_q4` reads them (2j low, 2j + 1 high).
fn pack_32(qs: &[u8], out: &mut [u8]) {
    for (j, byte) in out[..16].iter_mut().enumerate() {
        *byte = nibble(qs, 2 * j) | (nibble(qs, 2 * j + 1) << 4);
    }
}

fn q4_0_1_row(kind: BlockKind, row: &[u8], packed: &mut [u8], scales: &mut [f16], offsets: &mut [f16]) {
    let bytes = kind.weights_and_bytes().1;
    for (g, block) in row.chunks_exact(bytes).enumerate() {
        let d = f16_at(block, 0);
        scales[g] = d;
        let qs = if kind == BlockKind::Q4_1 {
            offsets[g] = f16_at(block, 2);
            &block[4..]
        } else {
            offsets[g] = f16::from_f32(d.to_f32() * -8.0); // exact: a power of two
            &block[2..]
        };
        pack_32(qs, &mut packed[g * 16..]);
    }
}

/// Q4_K's six-bit scale and minimum of group j (0..8) from a block's 12 bytes.
pub(crate) fn q4_k_scale_min(b: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (b[j] & 0x3F, b[j + 4] & 0x3F)
    } else {
        ((b[j + 4] & 0xF) | ((b[j - 4] >> 6) << 4), (b[j + 4] >> 4) | ((b[j] >> 6) << 4))
    }
}

/// The nibbles (0..16) of sub-block j (0..8, 32 weights) of a Q4_K block, in weight order.
#[inline(always)]
pub(crate) fn q4_k_nibbles(block: &[u8], j: usize) -> [u8; 32] {
    let (qs, shift) = (&block[16 + 32 * (j / 2)..][..32], 4 * (j % 2));
    std::array::from_fn(|b| (qs[b] >> shift) & 0xF)
}

/// The 6-bit q (0..64) of run `run` (0..8, 32 weights) of a Q6_K block, in weight order (the
/// layout above: the run is quarter run % 4 of half run / 4).
#[inline(always)]
pub(crate) fn q6_k_run(block: &[u8], run: usize) -> [u8; 32] {
    let (h, t) = (run / 4, run % 4);
    let (low, high) = (&block[64 * h + 32 * (t % 2)..][..32], &block[128 + 32 * h..][..32]);
    std::array::from_fn(|b| ((low[b] >> (4 * (t / 2))) & 0xF) | (((high[b] >> (2 * t)) & 3) << 4))
}

fn q4_k_row(row: &[u8], packed: &mut [u8], scales: &mut [f16], offsets: &mut [f16]) {
    for (blk, block) in row.chunks_exact(144).enumerate() {
        let (d, dmin) = (f16_at(block, 0).to_f32(), f16_at(block, 2).to_f32());
        let packed_scales = &block[4..16];
        for chunk in 0..4 {
            let qs = &block[16 + 32 * chunk..][..32];
            for half in 0..2 {
                let g = blk * 8 + chunk * 2 + half;
                let (sc, m) = q4_k_scale_min(packed_scales, chunk * 2 + half);
                scales[g] = f16::from_f32(d * sc as f32);
                offsets[g] = f16::from_f32(-(dmin * m as f32));
                let out = &mut packed[g * 16..][..16];
                for (j, byte) in out.iter_mut().enumerate() {
                    let (a, b) = (qs[2 * j], qs[2 * j + 1]);
                    *byte = if half == 0 { (a & 0xF) | ((b & 0xF) << 4) } else { (a >> 4) | (b & 0xF0) };
                }
            }
        }
    }
}

/// Q8_0 / Q5_0 / Q6_K rows [rows, row bytes] as int8 `q` [rows, fan_in] with one `scales`
/// [rows] per row.
pub fn requantize_int8(
    pool: &dyn ForkJoin,
    kind: BlockKind,
    blocks: &[u8],
    rows: usize,
    fan_in: usize,
    q: &mut [i8],
    scales: &mut [f32],
) -> Result<(), BlocksError> {
    if kind.is_q4() {
        return Err(BlocksError(format!("kind: {kind:?} is a 4-bit type (repack_q4 takes it)")));
    }
    let row_bytes = check(kind, blocks, rows, fan_in)?;
    if q.len() != rows * fan_in || scales.len() != rows {
        return Err(BlocksError(format!(
            "q, scales: {} and {} values for [{rows}, {fan_in}] and [{rows}]",
            q.len(),
            scales.len()
        )));
    }
    let (out_q, out_scales) = (Shared::new(q), Shared::new(scales));
    for_row_ranges(pool, rows, &|range| {
        let mut w = vec![0.0f32; fan_in];
        for r in range {
            widen_row(kind, &blocks[r * row_bytes..][..row_bytes], &mut w);
            let largest = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let scale = largest.max(f32::MIN_POSITIVE) / 127.0;
            // SAFETY: row r's outputs are this task's alone.
            let (row_q, row_scale) = unsafe { (out_q.range(r * fan_in, fan_in), out_scales.range(r, 1)) };
            row_scale[0] = scale;
            for (out, v) in row_q.iter_mut().zip(&w) {
                // |v / scale| <= 127: the small-range rounding is round half to even (and no libm call)
                *out = round_ties_even_small(v / scale).clamp(-127.0, 127.0) as i8;
            }
        }
    });
    Ok(())
}

/// Rows of any kind's blocks [rows, row bytes] widened to f32 `out` [rows, fan_in] with the
/// `gguf` package's arithmetic (the same products in the same order: its bits).
pub fn widen(
    pool: &dyn ForkJoin,
    kind: BlockKind,
    blocks: &[u8],
    rows: usize,
    fan_in: usize,
    out: &mut [f32],
) -> Result<(), BlocksError> {
    let row_bytes = check(kind, blocks, rows, fan_in)?;
    if out.len() != rows * fan_in {
        return Err(BlocksError(format!("out: {} values for [{rows}, {fan_in}]", out.len())));
    }
    let shared = Shared::new(out);
    for_row_ranges(pool, rows, &|range| {
        for r in range {
            // SAFETY: row r's outputs are this task's alone.
            let w = unsafe { shared.range(r * fan_in, fan_in) };
            widen_row(kind, &blocks[r * row_bytes..][..row_bytes], w);
        }
    });
    Ok(())
}

/// One row of blocks widened to f32 (gguf: Q4_0 d * (q - 8), Q4_1 d * q + m, Q4_K (d * sc) * q -
/// dmin * m, Q8_0 d * q, Q5_0 d * (q - 16), Q6_K (d * sc) * (q - 32)).
pub(crate) fn widen_row(kind: BlockKind, row: &[u8], w: &mut [f32]) {
    match kind {
        BlockKind::Q4_0 | BlockKind::Q4_1 => {
            let bytes = kind.weights_and_bytes().1;
            for (block, out) in row.chunks_exact(bytes).zip(w.chunks_exact_mut(32)) {
                let d = f16_at(block, 0).to_f32();
                let (m, qs) = if kind == BlockKind::Q4_1 {
                    (f16_at(block, 2).to_f32(), &block[4..])
                } else {
                    (0.0, &block[2..])
                };
                for (j, o) in out.iter_mut().enumerate() {
                    let q = nibble(qs, j);
                    *o = if kind == BlockKind::Q4_1 { d * q as f32 + m } else { d * (q as i32 - 8) as f32 };
                }
            }
        }
        BlockKind::Q4K => {
            for (block, out) in row.chunks_exact(144).zip(w.chunks_exact_mut(256)) {
                let (d, dmin) = (f16_at(block, 0).to_f32(), f16_at(block, 2).to_f32());
                for (g, out) in out.chunks_exact_mut(32).enumerate() {
                    let (sc, m) = q4_k_scale_min(&block[4..16], g);
                    let (scale, min) = (d * sc as f32, dmin * m as f32);
                    for (o, q) in out.iter_mut().zip(q4_k_nibbles(block, g)) {
                        *o = scale * q as f32 - min;
                    }
                }
            }
        }
        BlockKind::Q8_0 => {
            for (block, out) in row.chunks_exact(34).zip(w.chunks_exact_mut(32)) {
                let d = f16_at(block, 0).to_f32();
                for (o, &q) in out.iter_mut().zip(&block[2..]) {
                    *o = q as i8 as f32 * d;
                }
            }
        }
        BlockKind::Q5_0 => {
            for (block, out) in row.chunks_exact(22).zip(w.chunks_exact_mut(32)) {
                let d = f16_at(block, 0).to_f32();
                let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
                let qs = &block[6..];
                for (j, o) in out.iter_mut().enumerate() {
                    let low = nibble(qs, j);
                    let q = (low | (((qh >> j) & 1) as u8) << 4) as i32 - 16;
                    *o = d * q as f32;
                }
            }
        }
        BlockKind::Q6K => {
            for (block, out) in row.chunks_exact(210).zip(w.chunks_exact_mut(256)) {
                let (sc, d) = (&block[192..208], f16_at(block, 208).to_f32());
                // runs of 32 weights share their bytes' shifts: the inner loop is straight-line
                for (run, out) in out.chunks_exact_mut(32).enumerate() {
                    let scales = [d * sc[2 * run] as i8 as f32, d * sc[2 * run + 1] as i8 as f32];
                    for (b, (o, q)) in out.iter_mut().zip(q6_k_run(block, run)).enumerate() {
                        *o = scales[b / 16] * (q as i32 - 32) as f32;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::OnCallingThread;

    #[test]
    fn q4_0_repacks_to_the_weights_in_order_with_an_offset_of_minus_8_scales() {
        let mut block = vec![0u8; 18];
        block[..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        for j in 0..16 {
            block[2 + j] = (j as u8) | (((15 - j) as u8) << 4); // weight j = j, weight j + 16 = 15 - j
        }
        let (mut p, mut s, mut o) = (vec![0u8; 16], vec![f16::ZERO; 1], vec![f16::ZERO; 1]);
        repack_q4(&OnCallingThread, BlockKind::Q4_0, &block, 1, 32, &mut p, &mut s, &mut o).unwrap();
        let weights: Vec<u8> = p.iter().flat_map(|b| [b & 0xF, b >> 4]).collect();
        let want: Vec<u8> = (0..16).chain((0..16).map(|j| 15 - j)).collect();
        assert_eq!(weights, want);
        assert_eq!((s[0].to_f32(), o[0].to_f32()), (0.5, -4.0));
    }

    #[test]
    fn q6_k_widens_each_weight_from_its_low_and_high_bits() {
        // weight 197 = 128 + 69: half 1, r = 69: low bits in ql[64 + 5]'s high nibble (r >= 64),
        // high bits in qh[32 + 5] shifted by 2 * (69 / 32) = 4; its scale sc[197 / 16] = sc[12]
        let mut block = vec![0u8; 210];
        block[64 + 5] = 0x70; // low bits 7
        block[128 + 32 + 5] = 0b10 << 4; // high bits 2: q = 7 | 2 << 4 = 39
        block[192 + 12] = (-3i8) as u8;
        block[208..210].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        let mut w = vec![0.0f32; 256];
        widen_row(BlockKind::Q6K, &block, &mut w);
        assert_eq!(w[197], (0.25 * -3.0) * (39.0 - 32.0));
        assert_eq!(w[192], (0.25 * -3.0) * (0.0 - 32.0)); // a weight of the same scale, its bits all 0
        assert_eq!(w[0], 0.0); // scale 0
    }

    #[test]
    fn int8_rows_take_one_scale_from_the_largest_weight() {
        let mut block = vec![0u8; 34];
        block[..2].copy_from_slice(&f16::from_f32(2.0).to_le_bytes());
        for j in 0..32 {
            block[2 + j] = (j as i8 - 16) as u8;
        }
        let (mut q, mut s) = (vec![0i8; 32], vec![0.0f32; 1]);
        requantize_int8(&OnCallingThread, BlockKind::Q8_0, &block, 1, 32, &mut q, &mut s).unwrap();
        assert_eq!(s[0], 32.0 / 127.0);
        assert_eq!(q[0], -127);
        assert_eq!(q[16], 0);
        assert_eq!(q[31], (30.0f32 / (32.0 / 127.0)).round_ties_even() as i8);
    }

    #[test]
    fn bad_shapes_are_errors_naming_the_argument() {
        let blocks = vec![0u8; 34];
        let (mut q, mut s) = (vec![0i8; 32], vec![0.0f32; 1]);
        let e = |r: Result<(), BlocksError>| r.unwrap_err().to_string();
        assert!(e(requantize_int8(&OnCallingThread, BlockKind::Q8_0, &blocks, 1, 48, &mut q, &mut s))
            .starts_with("fan_in:"));
        assert!(e(requantize_int8(&OnCallingThread, BlockKind::Q8_0, &blocks[..33], 1, 32, &mut q, &mut s))
            .starts_with("blocks:"));
        assert!(e(requantize_int8(&OnCallingThread, BlockKind::Q8_0, &blocks, 1, 32, &mut q[..31], &mut s))
            .starts_with("q, scales:"));
        assert!(e(requantize_int8(&OnCallingThread, BlockKind::Q4_0, &blocks, 1, 32, &mut q, &mut s))
            .starts_with("kind:"));
    }
}
