//! `glm5-bench serve`'s load generator and in-process server on CPU, against the embedded model: a few
//! concurrent streams, every request generating exactly `max_tokens` tokens (one streamed event each), each
//! stream's tokens equal to the library's solo greedy tokens for its prompt, the server's own counters
//! agreeing with the clients'. Expected tokens come from the library (`Glm5::forward` and argmax), never
//! from the server.

use glm5::candle_core::{IndexOp, D};
use glm5::serve::ModelInfo;
use glm5::{Glm5, LoadOptions};
use glm5_bench::serve_load::{
    serve_options, word_ids, word_tokenizer, InProcessServer, LevelReport, LoadGenerator, LoadSpec,
};

const MODEL: &str = "glm5-tiny";

/// The library's greedy continuation of `prompt`: `max_tokens` argmax tokens, end-of-sequence ids included
/// (the requests set `ignore_eos`).
fn solo_greedy(model: &Glm5, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let mut cache = model.new_cache(prompt.len() + max_tokens).unwrap();
    let mut logits = model.forward(prompt, 0, &mut cache).unwrap();
    let mut out = Vec::new();
    while out.len() < max_tokens {
        let last = logits.dim(0).unwrap() - 1;
        let next = logits
            .i(last)
            .unwrap()
            .argmax(D::Minus1)
            .unwrap()
            .to_scalar::<u32>()
            .unwrap();
        out.push(next);
        if out.len() < max_tokens {
            let pos = prompt.len() + out.len() - 1;
            logits = model.forward(&[next], pos, &mut cache).unwrap();
        }
    }
    out
}

#[test]
fn concurrent_streams_generate_max_tokens_each_equal_to_their_solo_greedy_tokens() {
    let model = Glm5::embedded(&LoadOptions::default()).unwrap();
    let config = model.model().config().clone();
    let (prompt_tokens, max_tokens, requests_per_stream) = (40, 16, 2);
    let levels = [1usize, 4];
    let specs: Vec<LoadSpec> = levels
        .iter()
        .map(|&streams| LoadSpec {
            streams,
            requests_per_stream,
            prompt_tokens,
            max_tokens,
            vocab_size: config.vocab_size,
            model: MODEL.into(),
            seed: 48,
            sampled: false,
        })
        .collect();
    // Expected tokens of every prompt, before the model moves into the server.
    let expected: Vec<Vec<(Vec<u32>, Vec<u32>)>> = specs
        .iter()
        .map(|spec| {
            (0..spec.streams)
                .flat_map(|s| (0..requests_per_stream).map(move |i| (s, i)))
                .map(|(s, i)| {
                    let prompt = spec.prompt(s, i);
                    let tokens = solo_greedy(&model, &prompt, max_tokens);
                    (prompt, tokens)
                })
                .collect()
        })
        .collect();
    let info = ModelInfo {
        tokenizer: word_tokenizer(config.vocab_size).unwrap(),
        chat_template: None,
        // The model's own end-of-sequence ids: `ignore_eos` must be what keeps every request going.
        eos_token_ids: model.eos_token_ids().to_vec(),
        sampling_defaults: model.sampling_defaults().clone(),
        context: config.max_position_embeddings,
    };
    assert!(!info.eos_token_ids.is_empty());
    let options = serve_options(MODEL, 4, prompt_tokens, max_tokens, 512);
    let server = InProcessServer::start(model, info, options).unwrap();
    let load = LoadGenerator::new(server.url()).unwrap();

    println!("{}", LevelReport::markdown_header());
    for (spec, expected) in specs.iter().zip(&expected) {
        let report = load.run(spec).unwrap();
        println!("{}", report.markdown_row(None));
        assert_eq!(report.outcomes.len(), spec.streams * requests_per_stream);
        assert_eq!(report.failed(), 0, "{:?}", report.outcomes);
        for outcome in &report.outcomes {
            let completion = outcome.result.as_ref().unwrap();
            let (prompt, tokens) = &expected[outcome.stream * requests_per_stream + outcome.index];
            assert_eq!(&outcome.prompt, prompt);
            assert_eq!(completion.completion_tokens, Some(max_tokens));
            assert_eq!(completion.text_events, max_tokens, "{completion:?}");
            assert_eq!(completion.gaps.len(), max_tokens - 1);
            assert_eq!(completion.finish_reason.as_deref(), Some("length"));
            assert_eq!(
                word_ids(&completion.text).as_ref(),
                Some(tokens),
                "stream {} request {}",
                outcome.stream,
                outcome.index
            );
            assert!(completion.decode_rate().is_some_and(|r| r > 0.0));
        }
        let total = spec.streams * requests_per_stream * max_tokens;
        assert_eq!(report.generated_tokens(), total);
        assert_eq!(report.server_generated_tokens(), total as u64);
        assert_eq!(report.preemptions(), 0);
        // At least one step per token of a client's requests, one after another.
        assert!(report.server_steps() >= (requests_per_stream * max_tokens) as u64);
        assert!(report.server_step().is_some_and(|d| !d.is_zero()));
        assert!(report.tokens_per_second() > 0.0);
        let row = report.markdown_row(None);
        assert!(
            row.starts_with(&format!(
                "| {} | {} / 0 |",
                spec.streams,
                spec.streams * requests_per_stream
            )),
            "{row}"
        );
    }
    server.stop().unwrap();
}

#[test]
fn a_server_that_cannot_start_says_why() {
    let model = Glm5::embedded(&LoadOptions::default()).unwrap();
    let config = model.model().config().clone();
    let info = ModelInfo {
        tokenizer: word_tokenizer(config.vocab_size).unwrap(),
        chat_template: None,
        eos_token_ids: Vec::new(),
        sampling_defaults: Default::default(),
        context: config.max_position_embeddings,
    };
    // A context beyond the model's.
    let options = serve_options(MODEL, 1, config.max_position_embeddings, 1, 512);
    let error = InProcessServer::start(model, info, options).err().unwrap();
    assert!(error.to_string().contains("--max-model-len"), "{error}");
}
