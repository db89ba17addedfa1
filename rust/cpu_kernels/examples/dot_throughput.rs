//! The integer dot-product instructions the 4-bit kernels' extra rows are made of, alone: eight
//! independent accumulators each, on one thread, so the figure is the CPU's issue rate, not a
//! chain's latency. `vpdpwssd` multiplies int16 inputs (Q4_0 / Q4_1 / Q8_0 rows), `vpdpbusd`
//! int8 ones (the K-quants and Q5_0). What a kernel's row costs at least: its weights over the
//! multiply-accumulates a second printed here.
//!
//! `cargo run --release -p pyserve-cpu-kernels --example dot_throughput` (needs AVX-512 VNNI).

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::hint::black_box;
    use std::time::Instant;

    const STEPS: usize = 50_000_000;
    const CHAINS: usize = 8;

    macro_rules! rate {
        ($name:literal, $vector:ty, $zero:ident, $op:ident, $macs:literal) => {{
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
            unsafe fn run(a: $vector, b: $vector) -> $vector {
                let mut acc = [$zero(); CHAINS];
                for _ in 0..STEPS {
                    for c in acc.iter_mut() {
                        *c = $op(*c, a, b);
                    }
                }
                acc.into_iter().fold($zero(), |s, c| $op(s, c, b))
            }
            // SAFETY: the CPU was checked for AVX-512 F, BW, VL and VNNI in main.
            let ones: $vector = unsafe { std::mem::transmute([1u8; std::mem::size_of::<$vector>()]) };
            let start = Instant::now();
            black_box(unsafe { run(black_box(ones), black_box(ones)) });
            let each = start.elapsed().as_secs_f64() / (STEPS * CHAINS) as f64;
            println!(
                "{:<14} {:.3} ns each, {:.1} G multiply-accumulates a second",
                $name,
                each * 1e9,
                $macs as f64 / each / 1e9
            );
        }};
    }

    pub fn main() {
        let needs = ["avx512f", "avx512bw", "avx512vl", "avx512vnni"];
        if !(is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni"))
        {
            eprintln!("this CPU lacks one of {needs:?}");
            std::process::exit(1);
        }
        rate!("vpdpwssd ymm", __m256i, _mm256_setzero_si256, _mm256_dpwssd_epi32, 16);
        rate!("vpdpwssd zmm", __m512i, _mm512_setzero_si512, _mm512_dpwssd_epi32, 32);
        rate!("vpdpbusd ymm", __m256i, _mm256_setzero_si256, _mm256_dpbusd_epi32, 32);
        rate!("vpdpbusd zmm", __m512i, _mm512_setzero_si512, _mm512_dpbusd_epi32, 64);
    }
}

#[cfg(target_arch = "x86_64")]
fn main() {
    x86::main()
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    eprintln!("these instructions are x86-64's (AVX-512 VNNI)");
    std::process::exit(1);
}
