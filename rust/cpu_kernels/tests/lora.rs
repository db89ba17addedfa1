//! The LoRA kernel against the delta computed densely in f64 from the same weights.

mod common;

use common::{Rng, ScopedThreads};
use pyserve_cpu_kernels::{add_lora, add_lora_on, LoraError, LoraWeights};

struct Case {
    x: Vec<f32>,
    a: Vec<f32>,
    b: Vec<f32>,
    y: Vec<f32>,
    slots: Vec<i64>,
    num_slots: usize,
    rank: usize,
    fan_in: usize,
    fan_out: usize,
}

fn case(slots: &[i64], num_slots: usize, rank: usize, fan_in: usize, fan_out: usize, seed: u64) -> Case {
    let mut rng = Rng(seed);
    Case {
        x: rng.vec(slots.len() * fan_in),
        a: rng.vec(num_slots * rank * fan_in),
        b: rng.vec(num_slots * rank * fan_out),
        y: rng.vec(slots.len() * fan_out),
        slots: slots.to_vec(),
        num_slots,
        rank,
        fan_in,
        fan_out,
    }
}

impl Case {
    fn weights(&self) -> LoraWeights<'_> {
        LoraWeights {
            a: &self.a,
            b_scaled: &self.b,
            num_slots: self.num_slots,
            rank: self.rank,
            fan_in: self.fan_in,
            fan_out: self.fan_out,
        }
    }

    fn run(&self) -> Result<Vec<f32>, LoraError> {
        let mut y = self.y.clone();
        add_lora(&self.x, &self.slots, &self.weights(), &mut y)?;
        Ok(y)
    }

    fn dense(&self) -> Vec<f64> {
        let (r, fi, fo) = (self.rank, self.fan_in, self.fan_out);
        let mut y: Vec<f64> = self.y.iter().map(|&v| v as f64).collect();
        for (t, &s) in self.slots.iter().enumerate() {
            if s < 0 {
                continue;
            }
            let s = s as usize;
            for k in 0..r {
                let a_row = &self.a[(s * r + k) * fi..][..fi];
                let xa: f64 =
                    a_row.iter().zip(&self.x[t * fi..][..fi]).map(|(&a, &x)| a as f64 * x as f64).sum();
                for o in 0..fo {
                    y[t * fo + o] += xa * self.b[(s * r + k) * fo + o] as f64;
                }
            }
        }
        y
    }
}

fn assert_close(got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!((g as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()), "element {i}: {g} vs {w}");
    }
}

#[test]
fn mixed_slots_match_dense_and_base_tokens_are_untouched() {
    // fan sizes and rank off the block widths, slots interleaved, two tokens without an adapter
    let c = case(&[2, -1, 0, 0, 1, 2, -1, 1, 0], 3, 5, 37, 45, 7);
    let got = c.run().unwrap();
    assert_close(&got, &c.dense());
    for t in [1, 6] {
        assert_eq!(got[t * 45..][..45], c.y[t * 45..][..45]);
    }
}

#[test]
fn decode_sized_projection_matches_dense() {
    let slots: Vec<i64> = (0..64).map(|t| t % 8).collect();
    let c = case(&slots, 8, 16, 256, 768, 3);
    assert_close(&c.run().unwrap(), &c.dense());
}

#[test]
fn no_tokens_and_no_adapter_tokens_change_nothing() {
    let c = case(&[], 2, 4, 8, 8, 1);
    assert_eq!(c.run().unwrap(), Vec::<f32>::new());
    let c = case(&[-1, -1], 2, 4, 8, 8, 1);
    assert_eq!(c.run().unwrap(), c.y);
}

#[test]
fn bad_shapes_and_slots_are_errors() {
    let c = case(&[0, 3], 2, 4, 8, 8, 1);
    assert_eq!(c.run(), Err(LoraError::SlotOutOfRange { token: 1, slot: 3, num_slots: 2 }));
    let mut c = case(&[0, 1], 2, 4, 8, 8, 1);
    c.x.pop();
    assert!(matches!(c.run(), Err(LoraError::Shape(m)) if m == "x must be [2, 8]"));
    let mut c = case(&[0, 1], 2, 4, 8, 8, 1);
    c.b.truncate(8);
    assert!(matches!(c.run(), Err(LoraError::Shape(m)) if m == "b_scaled must be [2, 4, 8]"));
}

#[test]
fn blocks_spread_over_lent_threads_give_the_same_bits() {
    // 64 tokens over 8 slots (and some base tokens): 16 blocks, over the work threshold, so
    // they are split into eight ranges and each written by whichever thread took it.
    let slots: Vec<i64> = (0..64).map(|t| if t % 9 == 4 { -1 } else { t % 8 }).collect();
    let c = case(&slots, 8, 16, 96, 200, 17);
    let pool = ScopedThreads::new(2);
    let mut spread = c.y.clone();
    add_lora_on(&pool, &c.x, &c.slots, &c.weights(), &mut spread).unwrap();
    assert_eq!(*pool.calls.lock().unwrap(), vec![8]);
    assert_eq!(pool.workers.lock().unwrap().len(), 2);
    let alone = c.run().unwrap();
    assert_eq!(
        spread.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    assert_close(&spread, &c.dense());
}

#[test]
fn a_small_call_stays_on_the_calling_thread() {
    let c = case(&[0, 1, -1, 1], 2, 4, 16, 24, 3);
    let pool = ScopedThreads::new(2);
    let mut y = c.y.clone();
    add_lora_on(&pool, &c.x, &c.slots, &c.weights(), &mut y).unwrap();
    assert!(pool.calls.lock().unwrap().is_empty());
    assert_close(&y, &c.dense());
}
