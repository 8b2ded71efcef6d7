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
