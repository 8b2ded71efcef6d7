//! The MoE reference against plain per-token arithmetic written here: the router's choice (group limit,
//! ties, normalisation, the shared slot) and the experts' weighted sum.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{rng, tensor, uniform};
use glm5_ops::moe::{experts_reference, route_reference, RouteRule};

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The choice written out differently from the reference: sort (value desc, index asc) per group and overall.
fn expected_route(logits: &[f32], bias: &[f32], rule: &RouteRule) -> Vec<(u32, f32)> {
    let e = logits.len();
    let score: Vec<f32> = logits.iter().map(|&l| sigmoid(l)).collect();
    let choice: Vec<f32> = score.iter().zip(bias).map(|(s, b)| s + b).collect();
    let size = e / rule.n_group;
    let mut groups: Vec<(f32, usize)> = (0..rule.n_group)
        .map(|g| {
            let mut m = choice[g * size..(g + 1) * size].to_vec();
            m.sort_by(|a, b| b.partial_cmp(a).unwrap());
            (m.iter().take(2).sum(), g)
        })
        .collect();
    groups.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap().then(a.1.cmp(&b.1)));
    let kept: Vec<usize> = groups[..rule.topk_group].iter().map(|g| g.1).collect();
    let mut candidates: Vec<(f32, usize)> = (0..e)
        .map(|i| {
            let v = if kept.contains(&(i / size)) {
                choice[i]
            } else {
                f32::NEG_INFINITY
            };
            (v, i)
        })
        .collect();
    candidates.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap().then(a.1.cmp(&b.1)));
    let chosen: Vec<usize> = candidates[..rule.top_k].iter().map(|c| c.1).collect();
    let total: f32 = chosen.iter().map(|&i| score[i]).sum::<f32>() + 1e-20;
    chosen
        .iter()
        .map(|&i| {
            let g = if rule.normalise {
                score[i] / total
            } else {
                score[i]
            };
            (i as u32, g * rule.scaling)
        })
        .collect()
}

fn check_route(
    logits: &[f32],
    bias: &[f32],
    t: usize,
    e: usize,
    rule: RouteRule,
    shared: Option<u32>,
) {
    let routes = route_reference(
        &Tensor::from_slice(logits, (t, e), &Device::Cpu).unwrap(),
        &Tensor::from_slice(bias, e, &Device::Cpu).unwrap(),
        &rule,
        shared,
    )
    .unwrap();
    let ids: Vec<Vec<u32>> = routes.ids.to_vec2().unwrap();
    let gates: Vec<Vec<f32>> = routes.gates.to_vec2().unwrap();
    for token in 0..t {
        let expected = expected_route(&logits[token * e..(token + 1) * e], bias, &rule);
        for (slot, (id, gate)) in expected.iter().enumerate() {
            assert_eq!(ids[token][slot], *id, "token {token} slot {slot}");
            assert!((gates[token][slot] - gate).abs() <= 1e-6 * gate.abs().max(1.0));
        }
        if let Some(shared) = shared {
            assert_eq!(ids[token][rule.top_k], shared);
            assert_eq!(gates[token][rule.top_k], 1.0);
        }
    }
}

#[test]
fn route_reference_matches_sorted_choice_with_groups_ties_and_shared_slot() {
    let mut r = rng(46);
    let (t, e) = (9, 64);
    let bias: Vec<f32> = uniform(&mut r, e).iter().map(|b| b * 0.1).collect();
    let rules = [
        RouteRule {
            n_group: 1,
            topk_group: 1,
            top_k: 8,
            normalise: true,
            scaling: 2.5,
        },
        RouteRule {
            n_group: 8,
            topk_group: 3,
            top_k: 6,
            normalise: true,
            scaling: 1.0,
        },
        RouteRule {
            n_group: 4,
            topk_group: 2,
            top_k: 5,
            normalise: false,
            scaling: 1.5,
        },
    ];
    for rule in rules {
        let logits: Vec<f32> = uniform(&mut r, t * e).iter().map(|x| x * 4.0).collect();
        check_route(&logits, &bias, t, e, rule, None);
        check_route(&logits, &bias, t, e, rule, Some(e as u32));
        // Few distinct values and no bias: many exact ties, which go to the lower expert.
        let tied: Vec<f32> = logits.iter().map(|x| (x * 2.0).round() / 2.0).collect();
        check_route(&tied, &vec![0.0; e], t, e, rule, None);
    }
}

#[test]
fn route_rejects_rules_that_do_not_fit_the_experts() {
    let logits = Tensor::zeros((2, 10), DType::F32, &Device::Cpu).unwrap();
    let bias = Tensor::zeros(10, DType::F32, &Device::Cpu).unwrap();
    for rule in [
        RouteRule {
            n_group: 3,
            topk_group: 1,
            top_k: 2,
            normalise: true,
            scaling: 1.0,
        },
        RouteRule {
            n_group: 2,
            topk_group: 3,
            top_k: 2,
            normalise: true,
            scaling: 1.0,
        },
        RouteRule {
            n_group: 1,
            topk_group: 1,
            top_k: 11,
            normalise: true,
            scaling: 1.0,
        },
    ] {
        let err = route_reference(&logits, &bias, &rule, None).unwrap_err();
        assert!(err.to_string().contains("moe route"), "{err}");
    }
}

/// `out[t] = Σ_s gate · down(silu(gate_e x) · up_e x)` per token in f64, independent of candle.
fn expected_experts(
    x: &[f32],
    ids: &[u32],
    gates: &[f32],
    gate_up: &[f32],
    down: &[f32],
    (t, slots, h, i): (usize, usize, usize, usize),
) -> Vec<f32> {
    let mut out = vec![0f32; t * h];
    for token in 0..t {
        let xt = &x[token * h..(token + 1) * h];
        for s in 0..slots {
            let e = ids[token * slots + s] as usize;
            let w = &gate_up[e * 2 * i * h..(e + 1) * 2 * i * h];
            let hidden: Vec<f64> = (0..i)
                .map(|n| {
                    let dot = |row: &[f32]| {
                        row.iter()
                            .zip(xt)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                    };
                    let g = dot(&w[n * h..(n + 1) * h]);
                    let u = dot(&w[(i + n) * h..(i + n + 1) * h]);
                    g / (1.0 + (-g).exp()) * u
                })
                .collect();
            let d = &down[e * h * i..(e + 1) * h * i];
            for r in 0..h {
                let y: f64 = (0..i).map(|n| d[r * i + n] as f64 * hidden[n]).sum();
                out[token * h + r] += (gates[token * slots + s] as f64 * y) as f32;
            }
        }
    }
    out
}

#[test]
fn experts_reference_equals_per_token_arithmetic() {
    let mut r = rng(47);
    let (t, n_experts, slots, h, i) = (5, 6, 3, 32, 16);
    let x = uniform(&mut r, t * h);
    let gate_up = uniform(&mut r, n_experts * 2 * i * h);
    let down = uniform(&mut r, n_experts * h * i);
    let ids: Vec<u32> = (0..t * slots)
        .map(|a| ((a * 7 + a / slots) % n_experts) as u32)
        .collect();
    let gates = uniform(&mut r, t * slots);
    let routes = glm5_ops::moe::Routes {
        ids: Tensor::from_slice(&ids, (t, slots), &Device::Cpu).unwrap(),
        gates: Tensor::from_slice(&gates, (t, slots), &Device::Cpu).unwrap(),
    };
    let got = experts_reference(
        &tensor(&x, &[t, h], DType::F32),
        &routes,
        &tensor(&gate_up, &[n_experts, 2 * i, h], DType::F32),
        &tensor(&down, &[n_experts, h, i], DType::F32),
    )
    .unwrap()
    .flatten_all()
    .unwrap()
    .to_vec1::<f32>()
    .unwrap();
    let expected = expected_experts(&x, &ids, &gates, &gate_up, &down, (t, slots, h, i));
    for (a, b) in got.iter().zip(&expected) {
        assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "{a} vs {b}");
    }
}

/// Experts kept in FP8 (partial edge blocks included) or NVFP4, stacked, on the CPU: the per-expert chain
/// over the quantised projections equals the per-token arithmetic over the dequantised weights.
#[test]
fn quantized_experts_reference_equals_per_token_arithmetic_on_the_dequantised_weights() {
    use common::quantized::{experts, Format};
    use glm5_ops::gguf_matmul::GgufFormat;
    let mut r = rng(4901);
    let (t, n_experts, slots) = (6, 5, 3);
    for (format, (h, i)) in [
        (Format::Fp8 { block: [128, 128] }, (80, 48)),
        (Format::Fp8 { block: [16, 32] }, (80, 48)),
        (Format::Nvfp4, (80, 48)),
        (
            Format::GgufBlocks {
                gate_up: GgufFormat::Iq3S,
                down: GgufFormat::Iq4Xs,
            },
            (512, 256),
        ),
        (
            Format::GgufBlocks {
                gate_up: GgufFormat::Iq2Xxs,
                down: GgufFormat::Iq1M,
            },
            (256, 512),
        ),
        (
            Format::GgufBlocks {
                gate_up: GgufFormat::Iq4Nl,
                down: GgufFormat::Iq4Nl,
            },
            (96, 64),
        ),
        (
            Format::GgufBlocks {
                gate_up: GgufFormat::Q4K,
                down: GgufFormat::Q4K,
            },
            (256, 512),
        ),
    ] {
        let (weights, gate_up, down) = experts(&mut r, &format, (n_experts, h, i), &Device::Cpu);
        let x = uniform(&mut r, t * h);
        let ids: Vec<u32> = (0..t * slots)
            .map(|a| ((a * 7 + a / slots) % n_experts) as u32)
            .collect();
        let gates = uniform(&mut r, t * slots);
        let routes = glm5_ops::moe::Routes {
            ids: Tensor::from_slice(&ids, (t, slots), &Device::Cpu).unwrap(),
            gates: Tensor::from_slice(&gates, (t, slots), &Device::Cpu).unwrap(),
        };
        assert!(matches!(
            glm5_ops::moe::quantized_experts_backend(&tensor(&x, &[t, h], DType::F32), &weights),
            glm5_ops::moe::ExpertsBackend::Reference(_)
        ));
        let got =
            glm5_ops::moe::quantized_experts(&tensor(&x, &[t, h], DType::F32), &routes, &weights)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
        let flat = |w: &Tensor| w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let expected = expected_experts(
            &x,
            &ids,
            &gates,
            &flat(&gate_up),
            &flat(&down),
            (t, slots, h, i),
        );
        let scale = expected.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (a, b) in got.iter().zip(&expected) {
            assert!((a - b).abs() <= 1e-5 * scale, "{a} vs {b} (scale {scale})");
        }
    }
}

/// Stacking refuses parts of different shapes, naming the part.
#[test]
fn stacking_quantized_experts_of_different_shapes_is_an_error() {
    use common::quantized::{fp8, nvfp4};
    let mut r = rng(4902);
    let (a, b) = (fp8(&mut r, 32, 64, [16, 16]), fp8(&mut r, 16, 64, [16, 16]));
    let err = glm5_ops::moe::StackedFp8::stack(&[vec![&a], vec![&b]]).unwrap_err();
    assert!(err.to_string().contains("every FP8 part"), "{err}");
    let (a, b) = (nvfp4(&mut r, 32, 64), nvfp4(&mut r, 32, 32));
    let err = glm5_ops::moe::StackedNvfp4::stack(&[vec![&a], vec![&b]]).unwrap_err();
    assert!(err.to_string().contains("every NVFP4 part"), "{err}");
}

/// The shared expert as one more GGUF-block slot (`push_gguf_expert`): the stacked bytes equal experts
/// stacked with it from the start, and a projection of another format or shape is refused, nothing changed.
#[test]
fn gguf_block_experts_take_one_more_expert_of_their_formats_only() {
    use common::quantized::{experts, Format};
    use glm5_ops::gguf_matmul::{GgufFormat, GgufWeight};
    use glm5_ops::moe::{QuantizedExperts, StackedGgufBlocks};
    let mut r = rng(4903);
    let (n_experts, h, i) = (4, 512, 256);
    let format = Format::GgufBlocks {
        gate_up: GgufFormat::Q4K,
        down: GgufFormat::Q6K,
    };
    let (all, _, _) = experts(&mut r, &format, (n_experts + 1, h, i), &Device::Cpu);
    let QuantizedExperts::GgufBlocks { gate, up, down } = &all else {
        panic!("GGUF blocks");
    };
    let first = |s: &StackedGgufBlocks| StackedGgufBlocks {
        blocks: s.blocks.narrow(0, 0, n_experts).unwrap(),
        ..s.clone()
    };
    let last = |s: &StackedGgufBlocks| {
        GgufWeight::new(s.format, s.blocks.get(n_experts).unwrap(), s.k).unwrap()
    };
    let mut routed = QuantizedExperts::GgufBlocks {
        gate: first(gate),
        up: first(up),
        down: first(down),
    };
    let (g, u, d) = (last(gate), last(up), last(down));
    let bytes = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<u8>().unwrap();
    let stacks = |e: &QuantizedExperts| match e {
        QuantizedExperts::GgufBlocks { gate, up, down } => {
            [gate, up, down].map(|s| bytes(&s.blocks))
        }
        _ => panic!("GGUF blocks"),
    };
    // Gate's Q4_K rows as down (not the stacked Q6_K), then down with half its rows: refused, unchanged.
    let before = stacks(&routed);
    assert!(!routed.push_gguf_expert([&g, &u, &g]).unwrap());
    let half_down =
        GgufWeight::new(d.format, d.blocks.narrow(0, 0, h / 2).unwrap(), d.in_dim).unwrap();
    assert!(!routed.push_gguf_expert([&g, &u, &half_down]).unwrap());
    assert_eq!(stacks(&routed), before);
    assert!(routed.push_gguf_expert([&g, &u, &d]).unwrap());
    assert_eq!(routed.dims().unwrap(), (n_experts + 1, h, i));
    assert_eq!(stacks(&routed), stacks(&all));
}
