//! Speculative decoding with the MTP layer, on the embedded tiny model (whose checkpoint has one): greedy
//! tokens equal plain decoding's whether the drafts stand or not, the MTP layer's rows are the same run
//! together or one by one, and a draft checked by sampling leaves the sampled distribution unchanged
//! (counted against the distribution worked out here from the rules).

use std::collections::HashMap;
use std::path::Path;

use glm5::candle_core::{Device, Tensor};
use glm5::generate::Sampler;
use glm5::{GenerationParams, Glm5, LoadOptions, SequenceCache};

const PROMPTS: [&str; 3] = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello!",
    "What is the capital of France? Paris is the capital of France.",
];

/// The embedded model's files in `dir`, with `change` applied to its weights first.
fn write_variant(dir: &Path, change: impl Fn(&mut HashMap<String, Tensor>)) {
    let source = glm5::embedded::materialize().unwrap();
    for entry in std::fs::read_dir(&source).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let mut weights =
        glm5::candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    change(&mut weights);
    glm5::candle_core::safetensors::save(&weights, dir.join("model.safetensors")).unwrap();
}

fn load(dir: &Path, mtp: bool) -> Glm5 {
    let options = LoadOptions {
        mtp,
        ..Default::default()
    };
    Glm5::from_pretrained(dir.to_str().unwrap(), &options).unwrap()
}

/// Zeros of `name`'s shape and dtype.
fn zero(weights: &mut HashMap<String, Tensor>, name: &str) {
    let t = &weights[name];
    let zeros = t.zeros_like().unwrap();
    weights.insert(name.to_string(), zeros);
}

/// What a generation gave: its tokens, text and finish reason.
type Output = (Vec<u32>, String, Option<glm5::FinishReason>);

/// The generation's output and the (drafted, accepted) counts.
fn generate(model: &Glm5, prompt: &str, params: &GenerationParams) -> (Output, usize, usize) {
    let mut generation = model.generate(prompt, params).unwrap();
    let mut text = String::new();
    for token in generation.by_ref() {
        text.push_str(&token.unwrap().text);
    }
    let stats = generation.stats().clone();
    let output = (
        generation.generated().to_vec(),
        text,
        generation.finish_reason().cloned(),
    );
    (output, stats.draft_tokens, stats.accepted_draft_tokens)
}

/// Greedy output with and without the MTP layer, every prompt and a few lengths (odd and even, so that
/// generations end both right after a standing draft and right before one), and stopped by a token the
/// plain run generates mid-way; returns the drafts' totals.
fn compare_greedy(dir: &Path) -> (usize, usize) {
    let (plain, speculative) = (load(dir, false), load(dir, true));
    let (mut drafted, mut accepted) = (0, 0);
    for prompt in PROMPTS {
        for max_new_tokens in [1, 2, 7, 40] {
            let params = GenerationParams {
                max_new_tokens,
                ..Default::default()
            };
            let (want, none, _) = generate(&plain, prompt, &params);
            assert_eq!(none, 0, "no drafts without the MTP layer");
            let mut runs = vec![(params.clone(), want.clone())];
            if let Some(&stop) = want.0.get(5) {
                let stopped = GenerationParams {
                    stop_token_ids: vec![stop],
                    ..params
                };
                let (want, _, _) = generate(&plain, prompt, &stopped);
                runs.push((stopped, want));
            }
            for (params, want) in runs {
                let (got, d, a) = generate(&speculative, prompt, &params);
                assert_eq!(got, want, "{prompt:?}, {params:?}");
                assert!(a <= d);
                drafted += d;
                accepted += a;
            }
        }
    }
    (drafted, accepted)
}

#[test]
fn greedy_tokens_equal_plain_decoding_whatever_the_drafts() {
    // As shipped: random MTP weights, whose drafts seldom stand.
    let dir = tempfile::tempdir().unwrap();
    write_variant(dir.path(), |_| {});
    let (drafted, _) = compare_greedy(dir.path());
    assert!(drafted > 0);

    // Both heads' norms zero: every logit is 0, both pick token 0 every time, every draft stands.
    let dir = tempfile::tempdir().unwrap();
    write_variant(dir.path(), |w| {
        zero(w, "model.norm.weight");
        zero(w, "model.layers.3.shared_head.norm.weight");
    });
    let (drafted, accepted) = compare_greedy(dir.path());
    assert!(
        drafted > 0 && accepted == drafted,
        "{accepted} of {drafted}"
    );

    // The draft always token 0, which the model picks some of the time (its lm_head row made long).
    let dir = tempfile::tempdir().unwrap();
    write_variant(dir.path(), |w| {
        zero(w, "model.layers.3.shared_head.norm.weight");
        let head = &w["lm_head.weight"];
        let mut boost = vec![1.0f32; head.dim(0).unwrap()];
        boost[0] = 2.5;
        let boost = Tensor::from_vec(boost, head.dim(0).unwrap(), &Device::Cpu)
            .unwrap()
            .to_dtype(head.dtype())
            .unwrap()
            .unsqueeze(1)
            .unwrap();
        let boosted = head.broadcast_mul(&boost).unwrap();
        w.insert("lm_head.weight".into(), boosted);
    });
    let (drafted, accepted) = compare_greedy(dir.path());
    assert!(
        accepted > 0 && accepted < drafted,
        "a mix of standing and dropped drafts: {accepted} of {drafted}"
    );
}

#[test]
fn a_chat_turn_reuses_the_drafts_rows_and_keeps_greedy_tokens() {
    let dir = tempfile::tempdir().unwrap();
    write_variant(dir.path(), |w| {
        zero(w, "model.layers.3.shared_head.norm.weight");
    });
    let params = GenerationParams {
        max_new_tokens: 12,
        ..Default::default()
    };
    let turns = |model: &Glm5| -> Vec<Vec<u32>> {
        let mut sequence = Some(model.new_sequence(256).unwrap());
        let mut prompt = model.tokenizer().encode(PROMPTS[0]).unwrap();
        let mut replies = Vec::new();
        for turn in [PROMPTS[1], PROMPTS[2]] {
            let mut generation = model
                .generate_ids(prompt.clone(), &params, sequence.take().unwrap())
                .unwrap();
            for token in generation.by_ref() {
                token.unwrap();
            }
            let reply = generation.generated().to_vec();
            // The next turn re-sends the conversation: the last prompt, the reply, and more.
            prompt.extend(&reply);
            prompt.extend(model.tokenizer().encode(turn).unwrap());
            sequence = Some(generation.into_sequence());
            replies.push(reply);
        }
        replies
    };
    let speculative = load(dir.path(), true);
    assert!(speculative.new_sequence(8).unwrap().is_speculative());
    assert_eq!(turns(&speculative), turns(&load(dir.path(), false)));
}

#[test]
fn mtp_rows_together_equal_rows_one_by_one() {
    let model = Glm5::embedded(&LoadOptions {
        mtp: true,
        ..Default::default()
    })
    .unwrap();
    let model = model.model();
    let vocab = model.config().vocab_size;
    let ids: Vec<u32> = (0..20).map(|i| (i * 37 % vocab) as u32).collect();
    let mut cache = model.new_cache(ids.len()).unwrap();
    let (_, hidden) = model.forward_with_hidden(&ids, 0, &mut cache).unwrap();
    let rows = ids.len() - 1;
    let next = &ids[1..];
    let mut together = model.new_mtp_cache(rows).unwrap();
    let all = model
        .forward_mtp(next, &hidden.narrow(0, 0, rows).unwrap(), 0, &mut together)
        .unwrap();
    let mut one_by_one = model.new_mtp_cache(rows).unwrap();
    for i in 0..rows {
        let row = model
            .forward_mtp(
                &next[i..i + 1],
                &hidden.narrow(0, i, 1).unwrap(),
                i,
                &mut one_by_one,
            )
            .unwrap();
        let worst = max_abs(&(all.get(i).unwrap() - row.get(0).unwrap()).unwrap());
        assert!(worst < 1e-4, "row {i}: {worst}");
    }
    assert_eq!(together.len(), rows);
    // A hidden state per token, and the cache continued in order: typed errors.
    let mut fresh = model.new_mtp_cache(rows).unwrap();
    assert!(model
        .forward_mtp(next, &hidden.narrow(0, 0, 2).unwrap(), 0, &mut fresh)
        .is_err());
    assert!(model
        .forward_mtp(&next[..1], &hidden.narrow(0, 0, 1).unwrap(), 3, &mut fresh)
        .is_err());
}

/// The largest |value| of `t`.
fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// RMSNorm of every row of `x` `[rows, d]` times `w`, in f32 (the model's epsilon).
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let ms = x.sqr().unwrap().mean_keepdim(1).unwrap();
    x.broadcast_div(&(ms + eps).unwrap().sqrt().unwrap())
        .unwrap()
        .broadcast_mul(w)
        .unwrap()
}

#[test]
fn mtp_logits_equal_the_formula_where_its_block_adds_nothing() {
    // The block's attention output and every expert's down projection zero: the block passes its input
    // through, and the MTP layer is its formula alone (mtp.rs), worked out here from the weights.
    let dir = tempfile::tempdir().unwrap();
    write_variant(dir.path(), |w| {
        let p = "model.layers.3";
        let names: Vec<String> = w
            .keys()
            .filter(|n| {
                n.starts_with(p)
                    && (n.ends_with("o_proj.weight") || n.ends_with("down_proj.weight"))
            })
            .cloned()
            .collect();
        assert!(names.len() > 2);
        for name in names {
            zero(w, &name);
        }
        // Norm weights unlike each other, so that a swapped input or norm shows.
        for (norm, offset) in [("enorm", 0.5f32), ("hnorm", 1.5), ("shared_head.norm", 1.0)] {
            let name = format!("{p}.{norm}.weight");
            let n = w[&name].dim(0).unwrap();
            let values: Vec<f32> = (0..n)
                .map(|i| offset + (i as f32 * 0.37).sin() * 0.4)
                .collect();
            let t = Tensor::from_vec(values, n, &Device::Cpu).unwrap();
            w.insert(
                name,
                t.to_dtype(w[&format!("{p}.enorm.weight")].dtype()).unwrap(),
            );
        }
    });
    let glm5 = load(dir.path(), true);
    let model = glm5.model();
    let config = model.config();
    let ids: Vec<u32> = (0..9)
        .map(|i| (i * 53 % config.vocab_size) as u32)
        .collect();
    let mut cache = model.new_cache(ids.len()).unwrap();
    let (_, hidden) = model.forward_with_hidden(&ids, 0, &mut cache).unwrap();
    let weights =
        glm5::candle_core::safetensors::load(dir.path().join("model.safetensors"), &Device::Cpu)
            .unwrap();
    let f32 = |name: &str| {
        weights[name]
            .to_dtype(glm5::candle_core::DType::F32)
            .unwrap()
    };
    let eps = config.rms_norm_eps;
    for start in [0usize, 3] {
        let rows = ids.len() - 1 - start;
        let next = &ids[start + 1..];
        let h = hidden.narrow(0, start, rows).unwrap();
        let mut mtp_cache = model.new_mtp_cache(ids.len()).unwrap();
        if start > 0 {
            // The rows before `start` first, so that this call continues the cache.
            model
                .forward_mtp(
                    &ids[1..start + 1],
                    &hidden.narrow(0, 0, start).unwrap(),
                    0,
                    &mut mtp_cache,
                )
                .unwrap();
        }
        let got = model.forward_mtp(next, &h, start, &mut mtp_cache).unwrap();

        let index = Tensor::new(next, &Device::Cpu).unwrap();
        let mut embedded = f32("model.embed_tokens.weight")
            .index_select(&index, 0)
            .unwrap();
        if start == 0 {
            let zeros =
                Tensor::zeros((1, config.hidden_size), embedded.dtype(), &Device::Cpu).unwrap();
            embedded =
                Tensor::cat(&[&zeros, &embedded.narrow(0, 1, rows - 1).unwrap()], 0).unwrap();
        }
        let joined = Tensor::cat(
            &[
                rms_norm(&embedded, &f32("model.layers.3.enorm.weight"), eps),
                rms_norm(&h, &f32("model.layers.3.hnorm.weight"), eps),
            ],
            1,
        )
        .unwrap();
        let x = joined
            .matmul(&f32("model.layers.3.eh_proj.weight").t().unwrap())
            .unwrap();
        let want = rms_norm(&x, &f32("model.layers.3.shared_head.norm.weight"), eps)
            .matmul(&f32("lm_head.weight").t().unwrap())
            .unwrap();
        let (worst, scale) = (max_abs(&(got - &want).unwrap()), max_abs(&want));
        assert!(
            worst <= 1e-4 * scale,
            "start {start}: {worst} (logits up to {scale})"
        );
    }
}

#[test]
fn a_checkpoint_without_the_mtp_tensors_is_a_typed_error_naming_one() {
    // The config says there is an MTP layer; the weights lack it.
    let dir = tempfile::tempdir().unwrap();
    write_variant(dir.path(), |w| {
        w.retain(|name, _| !name.starts_with("model.layers.3."))
    });
    let options = LoadOptions {
        mtp: true,
        ..Default::default()
    };
    let err = Glm5::from_pretrained(dir.path().to_str().unwrap(), &options)
        .err()
        .expect("the MTP layer is missing");
    assert!(err.to_string().contains("model.layers.3."), "{err}");
    // Without --mtp the same checkpoint loads.
    assert!(!load(dir.path(), false).model().has_mtp());
}

#[test]
fn without_the_mtp_layer_drafting_is_a_typed_error() {
    let model = Glm5::embedded(&LoadOptions::default()).unwrap();
    assert!(!model.model().has_mtp());
    assert!(model.model().new_mtp_cache(8).is_err());
    assert!(SequenceCache::speculative(model.model(), 8).is_err());
    assert!(!model.new_sequence(8).unwrap().is_speculative());
}

/// The distribution a sampler with `params` draws from `logits`, worked out here: softmax over the
/// temperature, min-p, then the k largest (ties to the lower index), then the smallest prefix of those
/// (largest first) whose sum reaches top-p, renormalised.
fn expected_distribution(logits: &[f32], params: &GenerationParams) -> Vec<f64> {
    let scaled: Vec<f64> = logits
        .iter()
        .map(|&l| l as f64 / params.temperature)
        .collect();
    let max = scaled.iter().copied().fold(f64::MIN, f64::max);
    let exp: Vec<f64> = scaled.iter().map(|s| (s - max).exp()).collect();
    let sum: f64 = exp.iter().sum();
    let mut p: Vec<f64> = exp.iter().map(|e| e / sum).collect();
    if let Some(min_p) = params.min_p {
        let top = p.iter().copied().fold(0.0, f64::max);
        p.iter_mut()
            .filter(|v| **v < top * min_p)
            .for_each(|v| *v = 0.0);
    }
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    let k = params.top_k.unwrap_or(p.len());
    let mut kept = vec![false; p.len()];
    let mut running = 0.0;
    for &i in order.iter().take(k) {
        if params.top_p.is_some_and(|top_p| running >= top_p) {
            break;
        }
        running += p[i];
        kept[i] = true;
    }
    let total: f64 = (0..p.len()).filter(|&i| kept[i]).map(|i| p[i]).sum();
    (0..p.len())
        .map(|i| if kept[i] { p[i] / total } else { 0.0 })
        .collect()
}

#[test]
fn a_checked_draft_leaves_the_sampled_distribution_unchanged() {
    let logits = [2.0f32, 1.5, 1.2, 0.3, 0.0, -0.5, -1.0, -3.0];
    let tensor = Tensor::new(&logits, &Device::Cpu).unwrap();
    let base = GenerationParams {
        temperature: 0.8,
        seed: 11,
        ..Default::default()
    };
    let cases = [
        base.clone(),
        GenerationParams {
            top_k: Some(3),
            ..base.clone()
        },
        GenerationParams {
            top_p: Some(0.7),
            ..base.clone()
        },
        GenerationParams {
            top_k: Some(4),
            top_p: Some(0.8),
            ..base.clone()
        },
        GenerationParams {
            min_p: Some(0.2),
            ..base.clone()
        },
    ];
    let draws = 40_000;
    for params in &cases {
        let want = expected_distribution(&logits, params);
        // A likely draft, an unlikely one, and one the rules drop.
        for draft in [0u32, 3, 7] {
            let mut sampler = Sampler::new(params);
            let mut counts = [0usize; 8];
            let mut stood = 0;
            for _ in 0..draws {
                let (id, stands) = sampler.sample_draft(&tensor, &[], draft).unwrap();
                assert_eq!(stands, id == draft);
                counts[id as usize] += 1;
                stood += usize::from(stands);
            }
            for (token, (&count, &p)) in counts.iter().zip(&want).enumerate() {
                let freq = count as f64 / draws as f64;
                // Five standard deviations of a binomial count (and nothing where p is 0).
                let sigma = (p * (1.0 - p) / draws as f64).sqrt();
                assert!(
                    (freq - p).abs() <= 5.0 * sigma + 1e-12,
                    "{params:?}, draft {draft}: token {token} drawn {freq:.4}, expected {p:.4}"
                );
            }
            let q = want[draft as usize];
            let sigma = (q * (1.0 - q) / draws as f64).sqrt();
            let rate = stood as f64 / draws as f64;
            assert!(
                (rate - q).abs() <= 5.0 * sigma + 1e-12,
                "draft {draft} stood {rate:.4}, its probability is {q:.4}"
            );
        }
    }
    // Greedy: the argmax, the draft standing exactly where it is the argmax.
    let mut greedy = Sampler::new(&GenerationParams::default());
    assert_eq!(greedy.sample_draft(&tensor, &[], 0).unwrap(), (0, true));
    assert_eq!(greedy.sample_draft(&tensor, &[], 2).unwrap(), (0, false));
    // A draft outside the vocabulary is a typed error, greedy or not.
    assert!(greedy.sample_draft(&tensor, &[], 8).is_err());
    let mut sampled = Sampler::new(&base);
    assert!(sampled.sample_draft(&tensor, &[], 8).is_err());
}
