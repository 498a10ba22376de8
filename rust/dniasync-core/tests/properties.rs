//! Property tests of the store, optimizers and codecs against straightforward references.
// Index loops read best when comparing several parallel arrays element by element.
#![allow(clippy::needless_range_loop)]
use dniasync_core::quant::int8::{self, Int8Codec};
use dniasync_core::quant::onebit::{self, OneBitCodec};
use dniasync_core::quant::threshold::{self, ThresholdCodec};
use dniasync_core::quant::Codec;
use dniasync_core::{
    available_isas, with_isa, CoreError, Dense, Isa, Layout, NonFinitePolicy, Optimizer,
    OptimizerConfig, ParamStore, SegmentSpec,
};
use proptest::prelude::*;
use std::sync::Arc;

fn store(lens: &[usize], cfg: OptimizerConfig) -> ParamStore {
    let segs = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| SegmentSpec::new(format!("s{i}"), n))
        .collect();
    ParamStore::new(Layout::new(segs, cfg)).unwrap()
}

fn read(s: &ParamStore, seg: usize, slot: usize) -> Vec<f32> {
    let mut out = vec![0.0; s.segments()[seg].len];
    s.read_into(seg, slot, &mut out).unwrap();
    out
}

fn vec_f32(n: std::ops::Range<usize>) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(-4.0f32..4.0, n)
}

fn close(a: f32, b: f32, tol: f32) -> bool {
    (a - b).abs() <= tol * (1.0 + a.abs().max(b.abs()))
}

/// Reference optimizer, one element at a time, written as the papers and torch docs state it.
fn reference_step(
    cfg: &OptimizerConfig,
    w: &mut [f32],
    s1: &mut [f32],
    s2: &mut [f32],
    g: &[f32],
    lr: f32,
    t: i32,
) {
    let norm = g.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
    let scale = match cfg.clip_norm {
        Some(c) if norm > f64::from(c) => (f64::from(c) / (norm + 1e-6)) as f32,
        _ => 1.0,
    };
    for i in 0..w.len() {
        let d = g[i] * scale + cfg.weight_decay * w[i];
        match cfg.optimizer {
            Optimizer::Sgd => w[i] -= lr * d,
            Optimizer::Momentum { momentum } => {
                s1[i] = momentum * s1[i] + d;
                w[i] -= lr * s1[i];
            }
            Optimizer::Nesterov { momentum } => {
                s1[i] = momentum * s1[i] + d;
                w[i] -= lr * (d + momentum * s1[i]);
            }
            Optimizer::Adagrad { eps } => {
                s1[i] += d * d;
                w[i] -= lr * d / (s1[i].sqrt() + eps);
            }
            Optimizer::Adam { beta1, beta2, eps } => {
                s1[i] = beta1 * s1[i] + (1.0 - beta1) * d;
                s2[i] = beta2 * s2[i] + (1.0 - beta2) * d * d;
                let mhat = s1[i] / (1.0 - beta1.powi(t));
                let vhat = s2[i] / (1.0 - beta2.powi(t));
                w[i] -= lr * mhat / (vhat.sqrt() + eps);
            }
        }
    }
}

fn optimizers() -> impl Strategy<Value = OptimizerConfig> {
    let opt = prop_oneof![
        Just(Optimizer::Sgd),
        (0.0f32..0.99).prop_map(|momentum| Optimizer::Momentum { momentum }),
        (0.0f32..0.99).prop_map(|momentum| Optimizer::Nesterov { momentum }),
        Just(Optimizer::Adagrad { eps: 1e-10 }),
        (0.5f32..0.95, 0.9f32..0.9999).prop_map(|(beta1, beta2)| Optimizer::Adam {
            beta1,
            beta2,
            eps: 1e-8
        }),
    ];
    (
        opt,
        prop_oneof![Just(0.0f32), 0.0f32..0.1],
        prop::option::of(0.5f32..20.0),
    )
        .prop_map(|(optimizer, weight_decay, clip_norm)| OptimizerConfig {
            optimizer,
            weight_decay,
            clip_norm,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn optimizer_matches_reference(
        cfg in optimizers(),
        init in vec_f32(1..3000),
        seed_grads in prop::collection::vec(vec_f32(3000..3001), 1..4),
        lr in 0.001f32..0.5,
        isa in prop::sample::select(available_isas()),
    ) {
        with_isa(isa, || {
            let n = init.len();
            let s = store(&[n], cfg);
            s.write(0, 0, &init).unwrap();
            let (mut w, mut s1, mut s2) = (init.clone(), vec![0f32; n], vec![0f32; n]);
            for (t, g) in seed_grads.iter().enumerate() {
                let g = &g[..n];
                s.step_dense(0, g, lr).unwrap();
                reference_step(&cfg, &mut w, &mut s1, &mut s2, g, lr, t as i32 + 1);
            }
            let got = read(&s, 0, 0);
            for i in 0..n {
                prop_assert!(close(got[i], w[i], 1e-4), "element {}: store {} reference {}", i, got[i], w[i]);
            }
            if cfg.optimizer.state_slots() > 0 {
                let st = read(&s, 0, 1);
                for i in 0..n {
                    prop_assert!(close(st[i], s1[i], 1e-4), "state {}: store {} reference {}", i, st[i], s1[i]);
                }
            }
            prop_assert_eq!(s.version(0).unwrap(), seed_grads.len() as u64 + 1);
            Ok(())
        })?;
    }

    #[test]
    fn step_into_gives_the_change_of_the_step_and_leaves_the_parameters(
        cfg in optimizers(),
        init in vec_f32(1..3000),
        seed_grads in prop::collection::vec(vec_f32(3000..3001), 1..4),
        lr in 0.001f32..0.5,
        isa in prop::sample::select(available_isas()),
    ) {
        with_isa(isa, || {
            let n = init.len();
            let (stepped, into) = (store(&[n], cfg), store(&[n], cfg));
            let slots = cfg.optimizer.state_slots();
            for g in &seed_grads {
                // both start each step from the same parameters: `into` is given the stepped ones
                let before = read(&stepped, 0, 0);
                into.write(0, 0, &before).unwrap();
                stepped.step_dense(0, &g[..n], lr).unwrap();
                let version = into.version(0).unwrap();
                let mut out = vec![f32::NAN; n];
                prop_assert_eq!(into.step_into(0, &mut Dense(&g[..n]), lr, &mut out).unwrap(), version);
                let after = read(&stepped, 0, 0);
                prop_assert_eq!(read(&into, 0, 0), before.clone());  // untouched
                for i in 0..n {
                    prop_assert_eq!(out[i].to_bits(), (after[i] - before[i]).to_bits(), "element {}", i);
                }
                for slot in 1..=slots {  // the same state, to the bit
                    let (a, b) = (read(&stepped, 0, slot), read(&into, 0, slot));
                    prop_assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "state {}", slot);
                }
            }
            prop_assert_eq!(into.steps(0).unwrap(), seed_grads.len() as u64);
            let mut short = vec![0.0f32; n + 1];
            prop_assert!(into.step_into(0, &mut Dense(&seed_grads[0][..n]), lr, &mut short).is_err());
            Ok(())
        })?;
    }

    #[test]
    fn capped_threshold_codes_at_most_max_and_keeps_the_rest_for_later(
        steps in prop::collection::vec(vec_f32(500..501), 1..5),
        tau in 0.05f32..3.0,
        max_codes in 1usize..60,
        first in 0usize..500,
    ) {
        let n = 500;
        let mut enc = threshold::ThresholdEncoder::new(n, tau).unwrap();
        let mut codes = Vec::new();
        let mut decoded = vec![0f32; n];
        let mut start = first;
        for g in &steps {
            let old = enc.residual().to_vec();
            let mut all = threshold::ThresholdEncoder::new(n, tau).unwrap();
            let mut uncapped = Vec::new();
            all.encode(&old.iter().zip(g).map(|(r, x)| r + x).collect::<Vec<_>>(), &mut uncapped).unwrap();
            let next = enc.encode_capped(g, max_codes, start, &mut codes).unwrap();
            threshold::validate(&codes, n).unwrap(); // ascending
            prop_assert_eq!(codes.len(), uncapped.len().min(max_codes));
            // the codes are the uncapped ones from `start` on, wrapping
            let mut order: Vec<u32> = uncapped.iter().copied().filter(|c| (c & !(1 << 31)) as usize >= start)
                .chain(uncapped.iter().copied().filter(|c| ((c & !(1 << 31)) as usize) < start)).collect();
            order.truncate(max_codes);
            order.sort_unstable_by_key(|c| c & !(1 << 31));
            prop_assert_eq!(&codes, &order);
            threshold::decode(&codes, tau, &mut decoded).unwrap();
            for i in 0..n {
                let lhs = decoded[i] + enc.residual()[i];
                let rhs = g[i] + old[i];
                let tol = 4.0 * f32::EPSILON * (g[i].abs() + old[i].abs() + tau);
                prop_assert!((lhs - rhs).abs() <= tol, "element {}: {} vs {}", i, lhs, rhs);
            }
            if uncapped.len() > max_codes {
                prop_assert!(next > 0 && next <= n);
            } else {
                prop_assert_eq!(next, start);
            }
            start = next;
        }
    }

    #[test]
    fn threshold_roundtrip_conserves_gradient(
        steps in prop::collection::vec(vec_f32(500..501), 1..5),
        tau in 0.05f32..3.0,
        isa in prop::sample::select(available_isas()),
    ) {
        with_isa(isa, || {
            let n = 500;
            let mut enc = threshold::ThresholdEncoder::new(n, tau).unwrap();
            let mut codes = Vec::new();
            let mut decoded = vec![0f32; n];
            for g in &steps {
                let old = enc.residual().to_vec();
                enc.encode(g, &mut codes).unwrap();
                threshold::decode(&codes, tau, &mut decoded).unwrap();
                for i in 0..n {
                    let lhs = decoded[i] + enc.residual()[i];
                    let rhs = g[i] + old[i];
                    let tol = 2.0 * f32::EPSILON * (g[i].abs() + old[i].abs() + tau);
                    prop_assert!((lhs - rhs).abs() <= tol, "element {}: {} vs {}", i, lhs, rhs);
                    prop_assert!(decoded[i] == 0.0 || decoded[i].abs() == tau);
                }
                // Every element that still holds >= tau must have been emitted this step.
                for i in 0..n {
                    if decoded[i] == 0.0 {
                        prop_assert!(enc.residual()[i].abs() < tau);
                    }
                }
            }
            Ok(())
        })?;
    }

    #[test]
    fn onebit_error_feedback_is_bounded_and_conserves(
        seed in any::<u64>(),
        block in prop_oneof![Just(8usize), Just(64), Just(256)],
        n in 1usize..1200,
        isa in prop::sample::select(available_isas()),
    ) {
        with_isa(isa, || {
            let mut enc = onebit::OneBitEncoder::new(n, block).unwrap();
            let mut rng = proptest::test_runner::TestRng::from_seed(
                proptest::test_runner::RngAlgorithm::ChaCha, &seed.to_le_bytes().repeat(4));
            let (mut sum_g, mut sum_dec) = (vec![0f64; n], vec![0f64; n]);
            let (mut payload, mut dec) = (Vec::new(), vec![0f32; n]);
            // ‖e'‖² <= (1 - 1/B)‖g + e‖² per block, so ‖e‖ <= max‖g‖ / (1 - sqrt(1 - 1/B)).
            let bound = 1.0 / (1.0 - (1.0 - 1.0 / block as f64).sqrt());
            for _ in 0..200 {
                let g: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                enc.encode(&g, &mut payload).unwrap();
                onebit::decode(&payload, block, &mut dec).unwrap();
                for i in 0..n {
                    sum_g[i] += f64::from(g[i]);
                    sum_dec[i] += f64::from(dec[i]);
                }
                for (b, e) in enc.error().chunks(block).enumerate() {
                    let gnorm = (e.len() as f64).sqrt(); // |g_i| <= 1
                    let enorm = e.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
                    prop_assert!(enorm <= bound * gnorm * 1.001, "block {} error norm {} > {}", b, enorm, bound * gnorm);
                }
            }
            // Telescoping: everything sent plus what is still carried equals everything given.
            for i in 0..n {
                let carried = f64::from(enc.error()[i]);
                prop_assert!((sum_dec[i] + carried - sum_g[i]).abs() < 1e-2, "element {} drifted", i);
            }
            // Error feedback works in practice: the carried error stays far below the bound.
            let max_err = enc.error().iter().fold(0f32, |m, x| m.max(x.abs()));
            prop_assert!(max_err < 8.0, "carried error {} grew", max_err);
            Ok(())
        })?;
    }

    #[test]
    fn int8_error_within_half_scale(g in vec_f32(1..2000), block in 1usize..300) {
        let mut payload = Vec::new();
        int8::encode(&g, block, &mut payload).unwrap();
        prop_assert_eq!(payload.len(), int8::payload_len(g.len(), block));
        let mut dec = vec![0f32; g.len()];
        int8::decode(&payload, block, &mut dec).unwrap();
        for (b, (gc, dc)) in g.chunks(block).zip(dec.chunks(block)).enumerate() {
            let scale = gc.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
            for (x, y) in gc.iter().zip(dc) {
                prop_assert!((x - y).abs() <= scale * 0.5 + 1e-6, "block {}: {} vs {}", b, x, y);
            }
        }
    }

    #[test]
    fn codec_apply_equals_dense_step(
        g in vec_f32(1..2500),
        cfg in optimizers(),
        lr in 0.001f32..0.5,
        which in 0usize..3,
        isa in prop::sample::select(available_isas()),
    ) {
        with_isa(isa, || {
            let n = g.len();
            match which {
                0 => apply_equals_dense_step(ThresholdCodec::new(n, 0.5).unwrap(), &g, cfg, lr),
                1 => apply_equals_dense_step(OneBitCodec::new(n, 64).unwrap(), &g, cfg, lr),
                _ => apply_equals_dense_step(Int8Codec::new(n, 32).unwrap(), &g, cfg, lr),
            }
        })?;
    }
}

/// Applying a payload straight into the store == decoding it and stepping densely.
fn apply_equals_dense_step<C: Codec>(
    codec: C,
    g: &[f32],
    cfg: OptimizerConfig,
    lr: f32,
) -> Result<(), TestCaseError> {
    let n = codec.n();
    let mut payload = Vec::new();
    codec.encode(&mut codec.encoder(), g, &mut payload).unwrap();
    let mut dense = vec![0f32; n];
    codec.decode(&payload, &mut dense).unwrap();
    let (a, b) = (store(&[n], cfg), store(&[n], cfg));
    let init: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    a.write(0, 0, &init).unwrap();
    b.write(0, 0, &init).unwrap();
    for _ in 0..2 {
        a.step(0, &mut codec.grad(&payload).unwrap(), lr).unwrap();
        b.step_dense(0, &dense, lr).unwrap();
    }
    let (x, y) = (read(&a, 0, 0), read(&b, 0, 0));
    for i in 0..n {
        prop_assert!(
            close(x[i], y[i], 1e-5),
            "element {}: {} vs {}",
            i,
            x[i],
            y[i]
        );
    }
    Ok(())
}

/// Through the trait: what is carried, what a reset forgets, what an add touches.
fn carried_after_one_encode<C: Codec>(codec: C, g: &[f32]) -> (Vec<f32>, usize) {
    let mut encoder = codec.encoder();
    let mut payload = Vec::new();
    codec.encode(&mut encoder, g, &mut payload).unwrap();
    let carried = codec.carried(&encoder).to_vec();
    codec.reset(&mut encoder);
    assert!(codec.carried(&encoder).iter().all(|&x| x == 0.0));
    assert!(codec.decode(&payload, &mut vec![0.0; g.len() + 1]).is_err());
    (carried, codec.touched(&payload))
}

#[test]
fn codecs_carry_what_was_not_sent() {
    let g: Vec<f32> = (0..100).map(|i| i as f32 / 50.0 - 1.0).collect();
    let mut enc = threshold::ThresholdEncoder::new(100, 0.5).unwrap();
    let mut codes = Vec::new();
    enc.encode(&g, &mut codes).unwrap();
    let (residual, touched) = carried_after_one_encode(ThresholdCodec::new(100, 0.5).unwrap(), &g);
    assert_eq!(
        (residual.as_slice(), touched),
        (enc.residual(), codes.len())
    );

    let mut enc = onebit::OneBitEncoder::new(100, 16).unwrap();
    enc.encode(&g, &mut Vec::new()).unwrap();
    let (error, touched) = carried_after_one_encode(OneBitCodec::new(100, 16).unwrap(), &g);
    assert_eq!((error.as_slice(), touched), (enc.error(), 100));

    let (nothing, touched) = carried_after_one_encode(Int8Codec::new(100, 16).unwrap(), &g);
    assert_eq!((nothing.len(), touched), (0, 100));
}

/// Everything the kernels produce from one input, as bits (so NaN compares equal to NaN).
fn kernel_outputs(
    cfg: OptimizerConfig,
    init: &[f32],
    g: &[f32],
    tau: f32,
    onebit_block: usize,
    int8_block: usize,
) -> Vec<Vec<u32>> {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let bytes = |v: &[u8]| v.iter().map(|&x| u32::from(x)).collect::<Vec<u32>>();
    let n = g.len();
    let s = store(&[n], cfg);
    s.write(0, 0, init).unwrap();
    for _ in 0..3 {
        s.step_dense(0, g, 0.05).unwrap();
    }
    s.add(0, &mut Dense(g), -0.3).unwrap();
    let mut out: Vec<Vec<u32>> = (0..=cfg.optimizer.state_slots())
        .map(|slot| bits(&read(&s, 0, slot)))
        .collect();
    let mut enc = threshold::ThresholdEncoder::new(n, tau).unwrap();
    let mut codes = Vec::new();
    for _ in 0..2 {
        enc.encode(g, &mut codes).unwrap();
        out.push(codes.clone());
    }
    out.push(bits(enc.residual()));
    let mut enc = onebit::OneBitEncoder::new(n, onebit_block).unwrap();
    let mut payload = Vec::new();
    for _ in 0..2 {
        enc.encode(g, &mut payload).unwrap();
        out.push(bytes(&payload));
    }
    out.push(bits(enc.error()));
    int8::encode(g, int8_block, &mut payload).unwrap();
    out.push(bytes(&payload));
    out
}

/// Gradients with what trips kernels up: exact halves (rounding ties for the 8-bit codec),
/// zeros of both signs, values right at a threshold, and a wide range of magnitudes.
fn awkward_vec(n: std::ops::Range<usize>) -> impl Strategy<Value = Vec<f32>> {
    let elem = prop_oneof![
        4 => -4.0f32..4.0,
        1 => (-254i32..254).prop_map(|k| k as f32 * 0.5),
        1 => prop_oneof![Just(0.0f32), Just(-0.0), Just(0.7), Just(-0.7)],
        1 => (-30i32..30, -1.0f32..1.0).prop_map(|(e, m)| m * 2f32.powi(e)),
    ];
    prop::collection::vec(elem, n)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Every instruction set's kernels (portable, AVX2, AVX-512: whichever this CPU has)
    /// give the same bits for every optimizer step and codec, tails and odd blocks included.
    #[test]
    fn every_isa_gives_identical_bits(
        cfg in optimizers(),
        g in awkward_vec(1..2200),
        onebit_block in prop_oneof![Just(8usize), Just(16), Just(24), Just(64), Just(320)],
        int8_block in prop_oneof![1usize..40, Just(256)],
        tau in prop_oneof![Just(0.7f32), 0.05f32..3.0],
    ) {
        let init: Vec<f32> = (0..g.len()).map(|i| (i as f32 * 0.01).cos()).collect();
        let run = |isa| with_isa(isa, || kernel_outputs(cfg, &init, &g, tau, onebit_block, int8_block));
        let base = run(Isa::Base);
        for isa in available_isas() {
            let got = run(isa);
            for (k, (x, y)) in got.iter().zip(&base).enumerate() {
                prop_assert!(x == y, "{:?} differs from the portable kernels in output {} for {:?}", isa, k, cfg);
            }
        }
    }

    /// The 8-bit codec rounds half away from zero, as `f32::round`, at every ISA.
    #[test]
    fn int8_rounds_like_the_reference(g in awkward_vec(1..1000), block in 1usize..300) {
        for isa in available_isas() {
            let mut payload = Vec::new();
            with_isa(isa, || int8::encode(&g, block, &mut payload)).unwrap();
            let codes = &payload[payload.len() - g.len()..];
            for (b, gc) in g.chunks(block).enumerate() {
                let m = gc.iter().fold(0f32, |m, x| m.max(x.abs()));
                let inv = if m > 0.0 { 127.0 / m } else { 0.0 };
                for (j, &v) in gc.iter().enumerate() {
                    let want = ((v * inv).round().clamp(-127.0, 127.0) as i8) as u8;
                    prop_assert_eq!(codes[b * block + j], want, "{:?} block {} element {}", isa, b, j);
                }
            }
        }
    }
}

#[test]
fn int8_rejects_nonfinite_and_keeps_tiny_blocks() {
    for isa in available_isas() {
        with_isa(isa, || {
            let mut payload = vec![1u8; 3];
            let mut g = vec![0.5f32; 1000];
            g[777] = f32::INFINITY;
            assert!(matches!(
                int8::encode(&g, 64, &mut payload),
                Err(CoreError::NonFinite { .. })
            ));
            assert!(payload.is_empty());
            // 127 / max overflows for subnormal blocks: they still quantize to ±127.
            let tiny = vec![1e-45f32, -1e-45, 0.0];
            int8::encode(&tiny, 3, &mut payload).unwrap();
            assert_eq!(&payload[4..], &[127, (-127i8) as u8, 0], "{isa:?}");
        });
    }
}

#[test]
fn disjoint_concurrent_updates_sum_exactly() {
    let threads = 4;
    let per = 10_000;
    // One segment per thread; integers and halves stay exact in f32, so the sum is exact.
    let segs: Vec<usize> = vec![per; threads];
    let s = Arc::new(store(&segs, OptimizerConfig::new(Optimizer::Sgd)));
    std::thread::scope(|scope| {
        for t in 0..threads {
            let s = Arc::clone(&s);
            scope.spawn(move || {
                let delta: Vec<f32> = (0..per).map(|i| ((i % 7) + t) as f32).collect();
                for _ in 0..50 {
                    s.add(t, &mut Dense(&delta), 1.0).unwrap();
                    s.step_dense(t, &delta, 0.5).unwrap();
                }
            });
        }
    });
    for t in 0..threads {
        let got = read(&s, t, 0);
        for (i, &x) in got.iter().enumerate() {
            assert_eq!(x, 25.0 * ((i % 7) + t) as f32, "segment {t} element {i}");
        }
        assert_eq!(s.version(t).unwrap(), 100);
    }
}

#[test]
fn exact_add_from_many_threads_loses_nothing() {
    let threads = 4;
    let n = 2048;
    let rounds = 200;
    let s = Arc::new(store(&[n], OptimizerConfig::new(Optimizer::Sgd)));
    std::thread::scope(|scope| {
        for _ in 0..threads {
            let s = Arc::clone(&s);
            scope.spawn(move || {
                let ones = vec![1f32; n];
                for _ in 0..rounds {
                    s.add_exact(0, &mut Dense(&ones), 1.0).unwrap();
                }
            });
        }
    });
    let got = read(&s, 0, 0);
    assert!(
        got.iter().all(|&x| x == (threads * rounds) as f32),
        "{:?}",
        &got[..8]
    );
    assert_eq!(s.version(0).unwrap(), (threads * rounds) as u64);
}

#[test]
fn a_store_given_anothers_state_and_step_count_continues_as_it_would() {
    let adam = OptimizerConfig::new(Optimizer::Adam {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
    });
    let n = 100;
    let grad = |k: usize| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7 + k * 3) % 11) as f32 - 5.0)
            .collect()
    };
    let first = store(&[n], adam);
    for k in 0..5 {
        first.step_dense(0, &grad(k), 0.01).unwrap();
    }
    // a second store takes over the parameters and both moments, with and without the count
    let took = |steps: Option<u64>| {
        let s = store(&[n], adam);
        for slot in 0..3 {
            s.write(0, slot, &read(&first, 0, slot)).unwrap();
        }
        if let Some(t) = steps {
            s.set_steps(0, t).unwrap();
        }
        s.step_dense(0, &grad(5), 0.01).unwrap();
        s
    };
    let (counted, restarted) = (took(Some(first.steps(0).unwrap())), took(None));
    first.step_dense(0, &grad(5), 0.01).unwrap();
    assert_eq!(counted.steps(0).unwrap(), 6);
    // bit for bit; without the count the bias correction starts again at step 1: a different step
    assert_eq!(read(&counted, 0, 0), read(&first, 0, 0));
    assert_ne!(read(&restarted, 0, 0), read(&first, 0, 0));
    assert!(matches!(
        counted.set_steps(1, 3),
        Err(CoreError::UnknownSegment(_))
    ));
}

#[test]
fn nonfinite_gradient_is_rejected_counted_or_allowed() {
    let s = store(
        &[64],
        OptimizerConfig::new(Optimizer::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }),
    );
    let mut g = vec![0.5f32; 64];
    g[40] = f32::NAN;
    let before = read(&s, 0, 0);
    assert!(matches!(
        s.step_dense(0, &g, 0.1),
        Err(CoreError::NonFinite { .. })
    ));
    g[40] = f32::INFINITY;
    assert!(matches!(
        s.step_dense(0, &g, 0.1),
        Err(CoreError::NonFinite { .. })
    ));
    assert_eq!(s.rejected_nonfinite(), 2);
    assert_eq!(read(&s, 0, 0), before);
    assert_eq!(s.version(0).unwrap(), 0);
    s.set_nonfinite_policy(NonFinitePolicy::Allow);
    s.step_dense(0, &g, 0.1).unwrap();
    assert!(read(&s, 0, 0)[40].is_nan());
}

#[test]
fn bad_input_is_rejected_with_a_reason() {
    let s = store(&[10, 5], OptimizerConfig::new(Optimizer::Sgd));
    assert!(matches!(
        s.segment_index("nope"),
        Err(CoreError::UnknownSegment(_))
    ));
    assert!(matches!(
        s.step_dense(1, &[0.0; 10], 0.1),
        Err(CoreError::LengthMismatch {
            expected: 5,
            got: 10,
            ..
        })
    ));
    assert!(s.step_dense(0, &[0.0; 10], f32::NAN).is_err());
    let dup = Layout::new(
        vec![SegmentSpec::new("a", 1), SegmentSpec::new("a", 2)],
        OptimizerConfig::new(Optimizer::Sgd),
    );
    assert!(ParamStore::new(dup).is_err());
    assert!(threshold::validate(&[3, 2], 10).is_err());
    assert!(threshold::validate(&[3, 11], 10).is_err());
    assert!(onebit::OneBitGrad::new(&[0u8; 3], 10, 8).is_err());
}

#[test]
fn shared_store_create_attach_mismatch_and_stale() {
    let name = format!("core-test-{}", std::process::id());
    let layout = Layout::new(
        vec![SegmentSpec::new("w", 100), SegmentSpec::new("b", 3)],
        OptimizerConfig::new(Optimizer::Momentum { momentum: 0.9 }),
    );
    let owner = ParamStore::create_shared(&name, layout.clone()).unwrap();
    assert!(matches!(
        ParamStore::create_shared(&name, layout.clone()),
        Err(CoreError::AlreadyExists(_))
    ));
    let other = ParamStore::attach(&name, Some(&layout)).unwrap();
    other.step_dense(0, &[1.0; 100], 0.5).unwrap();
    assert_eq!(read(&owner, 0, 0), vec![-0.5; 100]);
    assert_eq!(owner.version(0).unwrap(), 1);
    let mut wrong = layout.clone();
    wrong.segments[1].len = 4;
    match ParamStore::attach(&name, Some(&wrong)) {
        Err(CoreError::LayoutMismatch(msg)) => assert!(msg.contains("b[3]"), "{msg}"),
        other => panic!("expected a layout mismatch, got {:?}", other.map(|_| ())),
    }
    assert!(!ParamStore::is_stale(&name).unwrap());
    assert!(!ParamStore::remove_stale(&name).unwrap());
    owner.close().unwrap();
    assert!(matches!(
        ParamStore::attach(&name, None),
        Err(CoreError::NotFound(_))
    ));
    // The mapping outlives the name: both handles still see the same memory.
    owner.step_dense(1, &[2.0; 3], 1.0).unwrap();
    assert_eq!(read(&other, 1, 0), vec![-2.0; 3]);
}

/// Runs of `mask`, as flattened (start, length) pairs, and the values of `g` they cover.
fn spans_and_values(mask: &[bool], g: &[f32]) -> (Vec<u32>, Vec<f32>) {
    let (mut spans, mut values) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < mask.len() {
        if mask[i] {
            let start = i;
            while i < mask.len() && mask[i] {
                values.push(g[i]);
                i += 1;
            }
            spans.extend([start as u32, (i - start) as u32]);
        } else {
            i += 1;
        }
    }
    (spans, values)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// A step over spans leaves parameters and state where the dense step over the same gradient
    /// (zero outside the spans) leaves them, for every optimizer; with SGD and Adagrad it never
    /// writes outside the spans (a value put there meanwhile, as a concurrent Hogwild step would,
    /// stays).
    #[test]
    fn a_step_over_spans_is_the_dense_step_of_the_scattered_gradient(
        cfg in optimizers(),
        init in vec_f32(1..2000),
        grads in prop::collection::vec((vec_f32(2000..2001), prop::collection::vec(any::<bool>(), 2000)), 1..4),
        lr in 0.001f32..0.5,
        isa in prop::sample::select(available_isas()),
    ) {
        with_isa(isa, || {
            let n = init.len();
            let (dense, spanned) = (store(&[n], cfg), store(&[n], cfg));
            dense.write(0, 0, &init).unwrap();
            spanned.write(0, 0, &init).unwrap();
            for (g, mask) in &grads {
                let mask = &mask[..n];
                let g: Vec<f32> = (0..n).map(|i| if mask[i] { g[i] } else { 0.0 }).collect();
                let (spans, values) = spans_and_values(mask, &g);
                dense.step_dense(0, &g, lr).unwrap();
                spanned.step_spans(0, &spans, &values, lr).unwrap();
            }
            for slot in 0..=cfg.optimizer.state_slots() {
                let (a, b) = (read(&dense, 0, slot), read(&spanned, 0, slot));
                for i in 0..n {
                    prop_assert!(close(a[i], b[i], 1e-6), "slot {} element {}: dense {} spans {}", slot, i, a[i], b[i]);
                }
            }
            prop_assert_eq!(spanned.version(0).unwrap(), dense.version(0).unwrap());
            let untouched: Vec<usize> = (0..n).filter(|&i| grads.iter().all(|(_, m)| !m[i])).collect();
            let lazy = cfg.weight_decay == 0.0 && matches!(cfg.optimizer, Optimizer::Sgd | Optimizer::Adagrad { .. });
            if lazy && !untouched.is_empty() {
                let mut w = read(&spanned, 0, 0);
                for &i in &untouched {
                    w[i] = 1234.5;
                }
                spanned.write(0, 0, &w).unwrap();
                let (g, mask) = &grads[0];
                let g: Vec<f32> = (0..n).map(|i| if mask[i] { g[i] } else { 0.0 }).collect();
                let (spans, values) = spans_and_values(&mask[..n], &g);
                spanned.step_spans(0, &spans, &values, lr).unwrap();
                let after = read(&spanned, 0, 0);
                for &i in &untouched {
                    prop_assert_eq!(after[i], 1234.5);
                }
            }
            Ok(())
        })?;
    }
}

#[test]
fn spans_that_do_not_fit_are_refused_and_change_nothing() {
    let s = store(&[10], OptimizerConfig::new(Optimizer::Sgd));
    let (before, version) = (read(&s, 0, 0), s.version(0).unwrap());
    for (spans, values) in [
        (vec![8u32, 4], vec![1.0f32; 4]), // past the end
        (vec![2, 3, 4, 1], vec![1.0; 4]), // overlapping
        (vec![5, 1, 2, 1], vec![1.0; 2]), // not ascending
        (vec![2, 0], vec![]),             // empty
        (vec![2, 3], vec![1.0; 2]),       // fewer values than elements
        (vec![2], vec![1.0]),             // not pairs
    ] {
        assert!(s.step_spans(0, &spans, &values, 0.1).is_err(), "{spans:?}");
    }
    assert_eq!(read(&s, 0, 0), before);
    assert_eq!(s.version(0).unwrap(), version);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Gathered rows are the source bytes divided by the scale in f32, under every ISA.
    #[test]
    fn gathered_rows_are_the_bytes_divided_by_the_scale(
        src in prop::collection::vec(any::<u8>(), 1..4000),
        row_len in 1usize..300,
        picks in prop::collection::vec(any::<prop::sample::Index>(), 0..40),
        scale in prop_oneof![Just(255.0f32), 0.5f32..1000.0],
        isa in prop::sample::select(available_isas()),
    ) {
        prop_assume!(row_len <= src.len());
        let offsets: Vec<i64> = picks.iter().map(|p| p.index(src.len() - row_len + 1) as i64).collect();
        let mut out = vec![f32::NAN; offsets.len() * row_len];
        with_isa(isa, || dniasync_core::rows::gather_u8_scaled(&src, &offsets, row_len, scale, &mut out)).unwrap();
        for (i, &o) in offsets.iter().enumerate() {
            for j in 0..row_len {
                let want = f32::from(src[o as usize + j]) / scale;
                prop_assert_eq!(out[i * row_len + j].to_bits(), want.to_bits());
            }
        }
    }
}

#[test]
fn rows_outside_the_source_are_refused_and_nothing_is_written() {
    let src = [7u8; 10];
    let mut out = [0f32; 8];
    for offsets in [vec![0i64, 7], vec![-1, 0], vec![0, 100]] {
        assert!(matches!(
            dniasync_core::rows::gather_u8_scaled(&src, &offsets, 4, 1.0, &mut out),
            Err(CoreError::InvalidArgument(_))
        ));
    }
    assert_eq!(out, [0.0; 8]);
    assert!(dniasync_core::rows::gather_u8_scaled(&src, &[0, 6], 4, 0.0, &mut out).is_err());
    assert!(dniasync_core::rows::gather_u8_scaled(&src, &[0], 4, 1.0, &mut out).is_err());
    dniasync_core::rows::gather_u8_scaled(&src, &[0, 6], 4, 2.0, &mut out).unwrap();
    assert_eq!(out, [3.5; 8]);
}

#[test]
fn a_shard_batch_is_read_from_the_blocks_files_or_refused() {
    use dniasync_core::rows::{gather_blocks_u8, Blocks};
    // two files: rows of 2 bytes at 0.., labels (int64) at 100..; positions 0-1 in file 1 from its row 3,
    // positions 2-4 in file 0 from its row 0, then the closing entry
    let mut a = vec![0u8; 200];
    let mut b = vec![0u8; 200];
    for r in 0..10 {
        a[2 * r] = r as u8;
        a[2 * r + 1] = 100 + r as u8;
        b[2 * r] = 50 + r as u8;
        b[2 * r + 1] = 150 + r as u8;
        a[100 + 8 * r..108 + 8 * r].copy_from_slice(&(r as i64).to_le_bytes());
        b[100 + 8 * r..108 + 8 * r].copy_from_slice(&(10 + r as i64).to_le_bytes());
    }
    let srcs: [Option<&[u8]>; 2] = [Some(&a), Some(&b)];
    // position p of block 0 is row 3 + p of file 1; of block 1 is row p - 2 of file 0
    let blocks = Blocks {
        bounds: &[0, 2, 5],
        file: &[1, 0, -1],
        x: &[6, -4, 0],
        y: &[124, 84, 0],
    };
    let (mut x, mut y) = (vec![0f32; 6], vec![0i64; 3]);
    assert!(gather_blocks_u8(&srcs, &blocks, &[1, 4, 2], 2, 2.0, &mut x, &mut y).unwrap());
    assert_eq!(x, [27.0, 77.0, 1.0, 51.0, 0.0, 50.0]);
    assert_eq!(y, [14, 2, 0]);
    for outside in [5i64, -1, 7] {
        assert!(
            !gather_blocks_u8(&srcs, &blocks, &[1, outside, 2], 2, 2.0, &mut x, &mut y).unwrap()
        );
    }
    let unmapped: [Option<&[u8]>; 2] = [Some(&a), None];
    assert!(!gather_blocks_u8(&unmapped, &blocks, &[1], 2, 2.0, &mut x[..2], &mut y[..1]).unwrap());
}
