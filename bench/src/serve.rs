//! `glm5-bench serve`: `glm5 serve` on one GPU under 1, 8, 32 and 64 concurrent streaming clients. The model
//! is `glm5-bench e2e`'s (GLM-5's first `--layers` layers at real sizes, random bf16 weights); the server is
//! the real stack (routes, scheduler, one batched forward per step over a paged pool sized for the largest
//! level) in this process on a loopback port, and the clients are `glm5_bench::serve_load`'s, over HTTP.
//! Next to the rows: the batch-1 decode step of the same model measured directly through `forward`.

use std::time::{Duration, Instant};

use glm5::candle_core::{Device, Result, Tensor};
use glm5::serve::{ModelInfo, ServeOptions};
use glm5::{GenerationParams, Glm5ForCausalLM};
use glm5_bench::serve_load::{
    serve_options, word_tokenizer, InProcessServer, LevelReport, LoadGenerator, LoadSpec,
};

use crate::cuda;
use crate::e2e::load_slice;
use crate::slice::glm5_slice;
use crate::timing::median;
use crate::Greedy;

const MODEL: &str = "glm5-slice";

pub struct ServeArgs {
    pub layers: usize,
    /// Concurrent clients of each level.
    pub streams: Vec<usize>,
    pub prompt_tokens: usize,
    pub max_tokens: usize,
    /// Requests each client sends, one after another.
    pub requests: usize,
    pub prefill_chunk: usize,
    /// Decode graphs on (the server's default; off: --enforce-eager).
    pub cuda_graphs: bool,
    /// Requests sample (temperature 1, top-p 0.95) instead of greedily.
    pub sampled: bool,
    /// Devices sharing GPU 0 (a stream each) the layers are split over, evenly.
    pub stages: usize,
    /// The server's `--micro-batches` (`None`: one per stage).
    pub micro_batches: Option<usize>,
}

/// Median time of a batch-1 decode step through `forward` (the argmax read back every step, as
/// `glm5-bench e2e` and a generation loop do) over one request's tokens: `prompt` prefilled, then
/// `max_tokens` steps each feeding the last argmax. The second of two runs.
fn direct_decode_step(
    model: &Glm5ForCausalLM,
    device: &Device,
    prompt: &[u32],
    max_tokens: usize,
) -> Result<Duration> {
    let mut step = Duration::ZERO;
    for _ in 0..2 {
        let mut cache = model.new_cache(prompt.len() + max_tokens).map_err(cuda)?;
        // The argmax of the last position's logits, read back.
        let last_argmax = |logits: Tensor| -> Result<u32> {
            let ids = logits.greedy()?;
            ids.last()
                .copied()
                .ok_or_else(|| cuda("forward returned no logits"))
        };
        let mut next = last_argmax(model.forward(prompt, 0, &mut cache).map_err(cuda)?)?;
        device.synchronize()?;
        let mut times = Vec::with_capacity(max_tokens);
        for pos in prompt.len()..prompt.len() + max_tokens.saturating_sub(1) {
            let start = Instant::now();
            next = last_argmax(model.forward(&[next], pos, &mut cache).map_err(cuda)?)?;
            times.push(start.elapsed().as_secs_f64());
        }
        if !times.is_empty() {
            step = Duration::from_secs_f64(median(times));
        }
    }
    Ok(step)
}

/// The slice with its layers split evenly over `devices` (in order), as `load_slice` builds it on one.
fn load_stages(
    config: &glm5::Config,
    weights: &glm5::Checkpoint,
    devices: &[Device],
    context: usize,
) -> Result<Glm5ForCausalLM> {
    let mut options =
        glm5::PlanOptions::new(glm5::candle_core::DType::BF16, glm5::AttentionMode::Sparse);
    options.context = Some(context);
    let layers = config.num_hidden_layers;
    options.layer_devices = Some((0..layers).map(|l| l * devices.len() / layers).collect());
    let descs = devices
        .iter()
        .map(glm5::DeviceDesc::of)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(cuda)?;
    let plan =
        glm5::Plan::build(config, descs, &options, &glm5::Registry::builtin()).map_err(cuda)?;
    Glm5ForCausalLM::load_planned(config, weights, plan, devices).map_err(cuda)
}

pub fn serve_rows(args: &ServeArgs) -> Result<()> {
    let max_streams = args.streams.iter().copied().max().unwrap_or(0);
    if args.streams.contains(&0) || max_streams == 0 || args.requests == 0 {
        return Err(cuda("--streams and --requests must be at least 1"));
    }
    if args.prompt_tokens == 0 || args.max_tokens < 2 {
        return Err(cuda(
            "--prompt-tokens must be at least 1 and --max-tokens at least 2",
        ));
    }
    if args.stages == 0 || args.stages > args.layers || args.micro_batches == Some(0) {
        return Err(cuda(
            "--stages must be 1 to --layers, --micro-batches at least 1",
        ));
    }
    let device = Device::new_cuda(0)?;
    // The stages: devices sharing GPU 0, a stream each (the first the one the direct step runs on).
    let mut devices = vec![device.clone()];
    for _ in 1..args.stages {
        devices.push(Device::new_cuda_with_stream(0)?);
    }
    // As `glm5 serve` runs (src/plan_cli.rs: without_event_tracking).
    glm5::plan_cli::without_event_tracking(&devices);
    let config = glm5_slice(args.layers)?;
    let context = args.prompt_tokens + args.max_tokens;
    let load_start = Instant::now();
    let weights = glm5::Checkpoint::random(2026, 0.02);
    let model = if args.stages == 1 {
        load_slice(&config, &weights, &device, context, false, false)?
    } else {
        load_stages(&config, &weights, &devices, context)?
    };
    for d in &devices {
        d.synchronize()?;
    }
    println!(
        "GLM-5 slice: {} layers at real sizes, random bf16 weights, one GPU{} (loaded in {:.1} s); \
         prompts of {} token ids, {} greedy tokens per request (ignore_eos), {} requests per client",
        args.layers,
        match args.stages {
            1 => String::new(),
            n => format!(", the layers over {n} streams of it"),
        },
        load_start.elapsed().as_secs_f64(),
        args.prompt_tokens,
        args.max_tokens,
        args.requests
    );
    for b in model.layer_backends() {
        println!("  {b}");
    }

    let spec = |streams: usize| LoadSpec {
        streams,
        requests_per_stream: args.requests,
        prompt_tokens: args.prompt_tokens,
        max_tokens: args.max_tokens,
        vocab_size: config.vocab_size,
        model: MODEL.into(),
        seed: 2026,
        sampled: args.sampled,
    };
    let direct = direct_decode_step(&model, &device, &spec(1).prompt(0, 0), args.max_tokens)?;
    println!(
        "single stream, batch-1 decode through `forward` (context {}..{}): {:.2} ms/step = {:.1} tok/s",
        args.prompt_tokens,
        context,
        direct.as_secs_f64() * 1e3,
        1.0 / direct.as_secs_f64()
    );

    let info = ModelInfo {
        tokenizer: word_tokenizer(config.vocab_size).map_err(cuda)?,
        chat_template: None,
        eos_token_ids: config.eos_token_ids.clone(),
        sampling_defaults: GenerationParams::default(),
        context: config.max_position_embeddings,
    };
    let options = ServeOptions {
        cuda_graphs: args.cuda_graphs,
        micro_batches: args.micro_batches,
        ..serve_options(
            MODEL,
            max_streams,
            args.prompt_tokens,
            args.max_tokens,
            args.prefill_chunk,
        )
    };
    let kv_budget = options.kv_budget.unwrap_or_default();
    let server = InProcessServer::start(model, info, options).map_err(cuda)?;
    let load = LoadGenerator::new(server.url()).map_err(cuda)?;
    println!(
        "glm5 serve in-process at {} (--max-seqs {max_streams}, --kv-budget {kv_budget}, --prefill-chunk {}{}); \
         requests {}; each level first runs one unmeasured round of 2-token requests",
        server.url(),
        args.prefill_chunk,
        if args.cuda_graphs { "" } else { ", --enforce-eager" },
        if args.sampled { "sampled at temperature 1, top-p 0.95" } else { "greedy" }
    );
    println!("{}", LevelReport::markdown_header());
    let mut failures = Vec::new();
    for &streams in &args.streams {
        let spec = spec(streams);
        load.run(&spec.warm_up()).map_err(cuda)?;
        let report = load.run(&spec).map_err(cuda)?;
        println!("{}", report.markdown_row(Some(direct)));
        failures.extend(
            report
                .outcomes
                .iter()
                .filter_map(|o| o.result.as_ref().err())
                .take(1)
                .map(|e| format!("{streams} streams: {e}")),
        );
    }
    println!(
        "(tok/s, all streams: generated tokens over the level's wall time, prefills included; per stream: \
         each request's tokens after its first over their span, averaged; TTFT from sending the request; \
         inter-token: gaps between a stream's token events as the client read them; server step: \
         glm5_step_seconds sum over count for the level; of which sampling: glm5_sample_seconds, the host's \
         picking of the next tokens after the device's work, per step; last column: all streams' tok/s over the batch-1 \
         `forward` rate)"
    );
    for failure in &failures {
        println!("first failure at {failure}");
    }
    server.stop().map_err(cuda)?;
    Ok(())
}
