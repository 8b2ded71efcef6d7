//! Sampling, stopping and streaming on the embedded tiny model, checked against forward() and hand-made
//! logits.

use glm5::candle_core::{Device, Tensor};
use glm5::generate::{apply_min_p, argmax, Sampler};
use glm5::{Error, FinishReason, GenerationParams, Glm5, LoadOptions, SequenceCache};

fn model() -> Glm5 {
    Glm5::embedded(&LoadOptions::default()).expect("embedded model loads")
}

const PROMPT: &str = "The quick brown fox jumps over the lazy dog.";

fn run(model: &Glm5, params: &GenerationParams) -> (Vec<u32>, String, FinishReason) {
    let mut generation = model.generate(PROMPT, params).unwrap();
    let mut text = String::new();
    for token in generation.by_ref() {
        text.push_str(&token.unwrap().text);
    }
    let finish = generation.finish_reason().cloned().expect("finished");
    (generation.generated().to_vec(), text, finish)
}

#[test]
fn greedy_equals_argmax_of_forward() {
    let model = model();
    let params = GenerationParams {
        max_new_tokens: 12,
        ..Default::default()
    };
    let (generated, _, _) = run(&model, &params);

    let mut ids = model.tokenizer().encode(PROMPT).unwrap();
    let mut cache = model.new_cache(ids.len() + 12).unwrap();
    let mut logits = model.forward(&ids, 0, &mut cache).unwrap();
    let mut expected = Vec::new();
    while expected.len() < generated.len() {
        let next = argmax(&logits.get(logits.dim(0).unwrap() - 1).unwrap()).unwrap();
        if model.eos_token_ids().contains(&next) {
            break;
        }
        expected.push(next);
        ids.push(next);
        logits = model.forward(&[next], ids.len() - 1, &mut cache).unwrap();
    }
    assert_eq!(generated, expected);
    assert!(!generated.is_empty());
}

#[test]
fn seeded_sampling_is_deterministic() {
    let model = model();
    let params = GenerationParams {
        max_new_tokens: 16,
        temperature: 1.0,
        top_p: Some(0.95),
        seed: 7,
        ..Default::default()
    };
    let first = run(&model, &params);
    assert_eq!(first, run(&model, &params));
    let others: Vec<_> = (8..12)
        .map(|seed| {
            run(
                &model,
                &GenerationParams {
                    seed,
                    ..params.clone()
                },
            )
            .0
        })
        .collect();
    assert!(
        others.iter().any(|o| *o != first.0),
        "different seeds should give different samples"
    );
}

fn logits(values: &[f32]) -> Tensor {
    Tensor::new(values, &Device::Cpu).unwrap()
}

/// Which tokens `params` can ever sample from `values` (over many draws).
fn sampled_set(values: &[f32], params: &GenerationParams) -> std::collections::BTreeSet<u32> {
    let mut sampler = Sampler::new(params);
    (0..400)
        .map(|_| sampler.sample(&logits(values), &[]).unwrap())
        .collect()
}

#[test]
fn top_k_top_p_min_p_masks() {
    // probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1
    let values: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
    let base = GenerationParams {
        temperature: 1.0,
        ..Default::default()
    };
    assert_eq!(sampled_set(&values, &base), [0, 1, 2, 3].into());
    assert_eq!(
        sampled_set(
            &values,
            &GenerationParams {
                top_k: Some(2),
                ..base.clone()
            }
        ),
        [0, 1].into()
    );
    assert_eq!(
        sampled_set(
            &values,
            &GenerationParams {
                top_p: Some(0.7),
                ..base.clone()
            }
        ),
        [0, 1].into()
    );
    assert_eq!(
        sampled_set(
            &values,
            &GenerationParams {
                top_p: Some(0.85),
                ..base.clone()
            }
        ),
        [0, 1, 2].into()
    );
    assert_eq!(
        sampled_set(
            &values,
            &GenerationParams {
                min_p: Some(0.25),
                ..base.clone()
            }
        ),
        [0, 1, 2].into()
    );
    assert_eq!(
        sampled_set(
            &values,
            &GenerationParams {
                top_k: Some(1),
                ..base
            }
        ),
        [0].into()
    );

    let mut probs = [0.5f32, 0.3, 0.1, 0.05];
    apply_min_p(&mut probs, 0.25);
    assert_eq!(probs, [0.5, 0.3, 0.0, 0.0]);
}

#[test]
fn repetition_penalty_demotes_seen_tokens() {
    let values = [2.0f32, 1.9, -1.0];
    let mut greedy = Sampler::new(&GenerationParams::default());
    assert_eq!(greedy.sample(&logits(&values), &[0]).unwrap(), 0);
    let mut penalised = Sampler::new(&GenerationParams {
        repetition_penalty: 2.0,
        ..Default::default()
    });
    assert_eq!(penalised.sample(&logits(&values), &[0]).unwrap(), 1);
}

/// OpenAI's presence and frequency penalties, `logit − count · frequency − (count > 0) · presence` over the
/// tokens the sampler generated (not the prompt's), against that formula run here step by step.
#[test]
fn presence_and_frequency_penalties_follow_openais_formula() {
    // No two penalised logits within rounding of each other at any step (the order of the f32 sums differs).
    let values = [2.0f32, 1.9, 1.13, -1.0];
    for (presence, frequency) in [(0.5f32, 0.0f32), (0.0, 0.3), (0.2, 0.25), (-0.5, 0.0)] {
        let mut sampler = Sampler::new(&GenerationParams {
            presence_penalty: presence,
            frequency_penalty: frequency,
            ..Default::default()
        });
        let mut counts = [0u32; 4];
        // The prompt holds token 0: it does not count.
        let mut history = vec![0u32];
        for step in 0..8 {
            let penalised: Vec<f32> = values
                .iter()
                .zip(&counts)
                .map(|(&v, &c)| v - c as f32 * frequency - if c > 0 { presence } else { 0.0 })
                .collect();
            let mut order: Vec<usize> = (0..4).collect();
            order.sort_by(|&a, &b| penalised[b].total_cmp(&penalised[a]));
            assert!(
                penalised[order[0]] - penalised[order[1]] > 1e-3,
                "a near tie would make the test depend on rounding: {penalised:?}"
            );
            let want = order[0] as u32;
            let got = sampler.sample(&logits(&values), &history).unwrap();
            assert_eq!(
                got, want,
                "presence {presence}, frequency {frequency}, step {step}: {penalised:?}"
            );
            counts[got as usize] += 1;
            history.push(got);
        }
        if presence > 0.0 || frequency > 0.0 {
            assert!(counts[1] > 0, "the penalty moved the choice: {counts:?}");
        }
    }
    // Out of OpenAI's range: a typed error.
    let params = GenerationParams {
        presence_penalty: 2.5,
        ..Default::default()
    };
    assert!(params.validate().is_err());
}

#[test]
fn stop_token_ids_and_max_tokens_end_generation() {
    let model = model();
    let (greedy, _, finish) = run(
        &model,
        &GenerationParams {
            max_new_tokens: 6,
            ..Default::default()
        },
    );
    assert_eq!(greedy.len(), 6);
    assert_eq!(finish, FinishReason::MaxTokens);
    let stop_at = greedy[3];
    let first = greedy.iter().position(|t| *t == stop_at).unwrap();
    let (ids, _, finish) = run(
        &model,
        &GenerationParams {
            max_new_tokens: 6,
            stop_token_ids: vec![stop_at],
            ..Default::default()
        },
    );
    assert_eq!(ids, greedy[..first]);
    assert_eq!(finish, FinishReason::EndOfSequence(stop_at));
}

#[test]
fn stop_strings_end_generation_before_the_string() {
    let model = model();
    let (_, text, _) = run(
        &model,
        &GenerationParams {
            max_new_tokens: 24,
            ..Default::default()
        },
    );
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 8, "need some text to cut: {text:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let expected = &text[..text.find(&stop).unwrap()];
    let params = GenerationParams {
        max_new_tokens: 24,
        stop_strings: vec![stop.clone()],
        ..Default::default()
    };
    let (_, cut, finish) = run(&model, &params);
    assert_eq!(cut, expected);
    assert_eq!(finish, FinishReason::StopString(stop));
}

#[test]
fn prompt_longer_than_the_context_fails_before_any_work() {
    let model = model();
    let max = model.model().config().max_position_embeddings;
    let long = "a ".repeat(max * 2);
    assert!(model.tokenizer().encode(&long).unwrap().len() > max);
    assert!(matches!(
        model.generate(&long, &GenerationParams::default()),
        Err(Error::PromptTooLong { .. })
    ));
    let small = SequenceCache::new(model.new_cache(4).unwrap());
    let ids = model.tokenizer().encode(PROMPT).unwrap();
    assert!(matches!(
        model.generate_ids(ids, &GenerationParams::default(), small),
        Err(Error::PromptTooLong { .. })
    ));
    let bad = GenerationParams {
        top_p: Some(1.5),
        ..Default::default()
    };
    assert!(matches!(
        model.generate(PROMPT, &bad),
        Err(Error::InvalidParams(_))
    ));
}

#[test]
fn a_follow_up_turn_reusing_the_cache_equals_a_fresh_run() {
    let model = model();
    let params = GenerationParams {
        max_new_tokens: 5,
        ..Default::default()
    };
    let turn1 = model.tokenizer().encode(PROMPT).unwrap();
    let mut generation = model
        .generate_ids(
            turn1.clone(),
            &params,
            SequenceCache::new(model.new_cache(128).unwrap()),
        )
        .unwrap();
    generation.by_ref().for_each(|t| drop(t.unwrap()));
    let reply = generation.generated().to_vec();
    let sequence = generation.into_sequence();
    assert_eq!(sequence.tokens[..turn1.len()], turn1[..]);

    let turn2: Vec<u32> = turn1
        .iter()
        .chain(&reply)
        .chain(&model.tokenizer().encode(" And then?").unwrap())
        .copied()
        .collect();
    let reused: Vec<u32> = model
        .generate_ids(turn2.clone(), &params, sequence)
        .unwrap()
        .filter_map(|t| t.unwrap().id)
        .collect();
    let fresh: Vec<u32> = model
        .generate_ids(
            turn2,
            &params,
            SequenceCache::new(model.new_cache(128).unwrap()),
        )
        .unwrap()
        .filter_map(|t| t.unwrap().id)
        .collect();
    assert_eq!(reused, fresh);
}

/// A graphed sequence (a paged pool of its own, decode steps through `forward_batch_graphed`, eager on the
/// CPU) generates the tokens of a contiguous one, with sampling, and reuses its cache across turns the same
/// way: each turn's tokens equal a fresh contiguous run's.
#[test]
fn graphed_sequences_generate_the_tokens_of_contiguous_ones() {
    let model = model();
    let params = GenerationParams {
        max_new_tokens: 9,
        temperature: 0.8,
        top_p: Some(0.9),
        seed: 7,
        ..Default::default()
    };
    let tokens = |generation: glm5::Generation<'_>| -> (Vec<u32>, SequenceCache) {
        let mut generation = generation;
        generation.by_ref().for_each(|t| drop(t.unwrap()));
        (generation.generated().to_vec(), generation.into_sequence())
    };
    let (contiguous, _) = tokens(model.generate(PROMPT, &params).unwrap());
    let (graphed, sequence) = tokens(model.generate_graphed(PROMPT, &params).unwrap());
    assert_eq!(graphed, contiguous);
    let stats = sequence.graph_stats().expect("a graphed sequence").clone();
    assert_eq!(
        stats.eager,
        graphed.len(),
        "on the CPU every step is eager: {stats:?}"
    );
    assert!(stats
        .last_eager_reason
        .is_some_and(|why| why.contains("CUDA")));

    // Turn one in a graphed sequence with room for a second.
    let turn1 = model.tokenizer().encode(PROMPT).unwrap();
    let graphed_cache = SequenceCache::graphed(model.model(), 128).unwrap();
    let (reply, sequence) = tokens(model.generate_ids(turn1, &params, graphed_cache).unwrap());
    assert_eq!(reply, contiguous);

    // A second turn in the same graphed sequence, against a fresh contiguous run of it.
    let turn2: Vec<u32> = sequence
        .tokens
        .iter()
        .copied()
        .chain(model.tokenizer().encode(" And then?").unwrap())
        .collect();
    let reused_len = sequence.len();
    assert_eq!(reused_len, sequence.tokens.len());
    let (reused, sequence) = tokens(
        model
            .generate_ids(turn2.clone(), &params, sequence)
            .unwrap(),
    );
    let fresh_cache = SequenceCache::new(model.new_cache(128).unwrap());
    let (fresh, _) = tokens(
        model
            .generate_ids(turn2.clone(), &params, fresh_cache)
            .unwrap(),
    );
    assert_eq!(reused, fresh);
    assert!(sequence.len() > reused_len);
}

/// Logits of `vocab` tokens from a small generator: `spread` scales them (large: a few likely tokens; small:
/// a flat distribution), and `levels` > 0 rounds them to that many steps so that equal values (ties) occur.
fn random_logits(vocab: usize, spread: f32, levels: f32, state: &mut u64) -> Vec<f32> {
    (0..vocab)
        .map(|_| {
            *state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (*state >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
            let v = spread * (u * 2.0 - 1.0).powi(3);
            if levels > 0.0 {
                (v * levels).round() / levels
            } else {
                v
            }
        })
        .collect()
}

/// glm5's sampler draws the same tokens as candle-transformers' LogitsProcessor for the same seed, in every
/// rule: its top-p sorts only candidates above a threshold (lowered until the walk decides) instead of the
/// whole vocabulary, which must keep exactly the same tokens, ties included.
#[test]
fn sampler_draws_logits_processors_tokens() {
    use candle_transformers::generation::{LogitsProcessor, Sampling};
    let mut state = 7u64;
    let mut cases = 0;
    for (vocab, spread, levels) in [
        (5, 3.0, 0.0),
        (1000, 12.0, 0.0),
        (1000, 0.5, 0.0),
        (4096, 20.0, 2.0),
        (4096, 8.0, 1.0),
        (30_000, 25.0, 0.0),
    ] {
        let values = random_logits(vocab, spread, levels, &mut state);
        let rules: Vec<(Option<usize>, Option<f64>, Option<f64>)> = vec![
            (None, None, None),
            (None, Some(0.1), None),
            (None, Some(0.5), None),
            (None, Some(0.9), None),
            (None, Some(0.95), None),
            (None, Some(0.999), None),
            (Some(3), None, None),
            (Some(50), Some(0.8), None),
            (Some(50), Some(1.0), None),
            (Some(vocab + 1), Some(0.7), None),
            (None, Some(0.95), Some(0.05)),
        ];
        for (top_k, top_p, min_p) in rules {
            for temperature in [0.7, 1.0, 1.6] {
                let params = GenerationParams {
                    temperature,
                    top_k,
                    top_p,
                    min_p,
                    seed: cases,
                    ..Default::default()
                };
                let sampling = match (top_k, top_p) {
                    (None, None) => Sampling::All { temperature },
                    (Some(k), None) => Sampling::TopK { k, temperature },
                    (None, Some(p)) => Sampling::TopP { p, temperature },
                    (Some(k), Some(p)) => Sampling::TopKThenTopP { k, p, temperature },
                };
                let mut reference = LogitsProcessor::from_sampling(cases, sampling);
                let mut sampler = Sampler::new(&params);
                let tensor = logits(&values);
                for draw in 0..40 {
                    let expected = reference
                        .sample_f(&tensor, |probs| {
                            if let Some(min_p) = min_p {
                                apply_min_p(probs, min_p);
                            }
                        })
                        .unwrap();
                    assert_eq!(
                        sampler.sample(&tensor, &[]).unwrap(),
                        expected,
                        "vocab {vocab}, spread {spread}, levels {levels}, top_k {top_k:?}, top_p {top_p:?}, \
                         min_p {min_p:?}, temperature {temperature}, draw {draw}"
                    );
                }
                cases += 1;
            }
        }
    }
}

/// `keep_top_p` zeroes what sorting the whole vector and walking it zeroes: the smallest prefix (by
/// probability, equal ones in index order) whose running sum reaches p, on vectors whose nucleus lies below
/// the first thresholds too (a flat tail holding most of the mass).
#[test]
fn keep_top_p_equals_the_whole_sort() {
    let reference = |probs: &[f32], p: f32| {
        let mut order: Vec<usize> = (0..probs.len()).collect();
        order.sort_by(|&i, &j| probs[j].total_cmp(&probs[i]));
        let mut out = probs.to_vec();
        let mut sum = 0.0f32;
        for i in order {
            if sum >= p {
                out[i] = 0.0;
            } else {
                sum += probs[i];
            }
        }
        out
    };
    let mut state = 11u64;
    for (head, tail) in [(1, 5000), (3, 100_000), (10, 40), (0, 2000)] {
        // `head` tokens of 0.2 / head each, the rest of the mass spread flat (ties) or randomly over `tail`.
        for flat in [true, false] {
            let noise = random_logits(tail, 1.0, 0.0, &mut state);
            let mut probs: Vec<f32> = (0..head).map(|_| 0.2 / head as f32).collect();
            let tail_mass = if head == 0 { 1.0 } else { 0.8 };
            let weights: Vec<f32> = noise
                .iter()
                .map(|v| if flat { 1.0 } else { v.abs() + 0.01 })
                .collect();
            let total: f32 = weights.iter().sum();
            probs.extend(weights.iter().map(|w| tail_mass * w / total));
            for p in [0.05, 0.19, 0.2, 0.21, 0.5, 0.95, 1.0] {
                let mut fast = probs.clone();
                glm5::sampling::keep_top_p(&mut fast, p);
                assert_eq!(
                    fast,
                    reference(&probs, p),
                    "head {head}, tail {tail}, flat {flat}, p {p}"
                );
            }
        }
    }
}

/// One step's rows sampled together (one read-back for the greedy rows, one for the sampled ones) give
/// each row's sampler the tokens it draws alone, row by row, penalised rows included.
#[test]
fn sample_rows_equals_each_row_alone() {
    use glm5::sampling::sample_rows;
    let mut state = 3u64;
    let (rows, vocab) = (7, 3000);
    let all: Vec<f32> = (0..rows)
        .flat_map(|r| random_logits(vocab, 4.0 + r as f32 * 2.0, 0.0, &mut state))
        .collect();
    let batch = Tensor::from_vec(all, (rows, vocab), &Device::Cpu).unwrap();
    let params: Vec<GenerationParams> = (0..rows)
        .map(|r| GenerationParams {
            temperature: [0.0, 1.0, 0.6, 0.0, 1.3, 1.0, 0.8][r],
            top_p: [None, Some(0.9), None, None, Some(0.5), None, Some(0.95)][r],
            top_k: [None, None, Some(20), None, None, None, None][r],
            repetition_penalty: if r == 5 { 1.3 } else { 1.0 },
            seed: 100 + r as u64,
            ..Default::default()
        })
        .collect();
    let histories: Vec<Vec<u32>> = (0..rows).map(|r| vec![r as u32, 17, 2999]).collect();
    let all_rows: Vec<usize> = (0..rows).collect();
    let mut together: Vec<Sampler> = params.iter().map(Sampler::new).collect();
    let mut alone: Vec<Sampler> = params.iter().map(Sampler::new).collect();
    for step in 0..20 {
        let mut refs: Vec<&mut Sampler> = together.iter_mut().collect();
        let history_refs: Vec<&[u32]> = histories.iter().map(Vec::as_slice).collect();
        let ids = sample_rows(&mut refs, &batch, &all_rows, &history_refs).unwrap();
        for (r, id) in ids.into_iter().enumerate() {
            let expected = alone[r]
                .sample(&batch.get(r).unwrap(), &histories[r])
                .unwrap();
            assert_eq!(id.unwrap(), expected, "row {r}, step {step}");
        }
    }
    // Some of the step's rows, out of order (as the server passes the sequences whose tokens are all
    // computed): each sampler reads its own row.
    let picked = [6usize, 3, 1, 0];
    let mut subset: Vec<Sampler> = picked.iter().map(|&r| Sampler::new(&params[r])).collect();
    let mut subset_alone: Vec<Sampler> = picked.iter().map(|&r| Sampler::new(&params[r])).collect();
    let picked_histories: Vec<&[u32]> = picked.iter().map(|&r| histories[r].as_slice()).collect();
    for step in 0..10 {
        let mut refs: Vec<&mut Sampler> = subset.iter_mut().collect();
        let ids = sample_rows(&mut refs, &batch, &picked, &picked_histories).unwrap();
        for ((j, id), &r) in ids.into_iter().enumerate().zip(&picked) {
            let expected = subset_alone[j]
                .sample(&batch.get(r).unwrap(), &histories[r])
                .unwrap();
            assert_eq!(id.unwrap(), expected, "picked row {r}, step {step}");
        }
    }
    let mut refs: Vec<&mut Sampler> = together.iter_mut().collect();
    assert!(matches!(
        sample_rows(&mut refs[..2], &batch, &all_rows, &[&[], &[]]),
        Err(Error::Sampling(_))
    ));
    assert!(matches!(
        sample_rows(&mut refs[..1], &batch, &[rows], &[&[]]),
        Err(Error::Sampling(_))
    ));
}
