//! The `glm5` command line: `glm5 generate` downloads (or opens) a model, applies its chat template and
//! streams tokens; `glm5 plan` prints where every layer would run and with which backends, from config.json
//! alone, for real or assumed devices.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use glm5::candle_core::{DType, Device};
use glm5::hub::{resolve_config, HubOptions};
use glm5::ops::registry::parse_forced;
use glm5::plan_cli::{
    forced_backends, parse_assumed, parse_device, parse_devices, parse_layer_map, render,
    BACKEND_ENV,
};
use glm5::{
    AttentionMode, ChatOptions, Config, DeviceDesc, Generation, GenerationParams, Glm5, KeyFormat,
    LoadOptions, Message, Op, Plan, PlanOptions, Registry, SequenceCache,
};

#[derive(Parser)]
#[command(name = "glm5", version, about = "Run GLM-5 (glm_moe_dsa) with candle")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log what glm5 does (tracing, to stderr); repeat for more.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, or chat interactively.
    Generate(GenerateArgs),
    /// Show where every layer would run and with which backends (reads config.json only).
    Plan(PlanArgs),
}

#[derive(Args)]
struct PlanArgs {
    /// Local model directory or Hugging Face repo id (only config.json is fetched). Default: the embedded
    /// tiny model.
    #[arg(long)]
    model: Option<String>,
    #[arg(long)]
    revision: Option<String>,
    #[arg(long)]
    offline: bool,
    /// Real devices, comma-separated: cpu, cuda:0, ... (default: cpu).
    #[arg(long, conflicts_with = "assume")]
    devices: Option<String>,
    /// Describe devices instead of using real ones: ARCH:SIZE[ xCOUNT], comma-separated
    /// (e.g. "sm_120:96GB x8", "sm_90:141GB x2,cpu:512GB").
    #[arg(long)]
    assume: Option<String>,
    /// Per-layer device map: FIRST-LAST=DEVICE, comma-separated (DEVICE: a device name or #INDEX).
    #[arg(long)]
    layer_map: Option<String>,
    /// Force a backend: OP=NAME (repeatable), e.g. sparse_mla=reference. Also GLM5_BACKEND.
    #[arg(long = "backend")]
    backends: Vec<String>,
    #[arg(long, value_enum, default_value = "sparse")]
    attention: AttentionArg,
    /// How the DSA indexer's key cache stores keys.
    #[arg(long, value_enum, default_value = "float")]
    index_cache: IndexCacheArg,
    /// Weights, activations and KV-cache dtype (default: bf16 when any device is CUDA, else f32).
    #[arg(long, value_enum)]
    dtype: Option<DTypeArg>,
    /// Tokens of KV cache to reserve per layer (default: min(8192, the model's context)).
    #[arg(long)]
    context: Option<usize>,
}

#[derive(Clone, Copy, ValueEnum)]
enum DTypeArg {
    F32,
    Bf16,
    F16,
}

#[derive(Clone, Copy, PartialEq, ValueEnum)]
enum IndexCacheArg {
    /// The model's dtype.
    Float,
    /// FP8 e4m3 with one f32 scale per key (132 bytes per token for GLM-5's 128-wide keys).
    Fp8,
}

fn index_cache(arg: IndexCacheArg) -> KeyFormat {
    match arg {
        IndexCacheArg::Float => KeyFormat::Float,
        IndexCacheArg::Fp8 => KeyFormat::Fp8E4m3,
    }
}

#[derive(Clone, Copy, PartialEq, ValueEnum)]
enum AttentionArg {
    /// DeepSeek Sparse Attention, as the model was trained.
    Sparse,
    /// Every causal position (debugging / quality comparison only).
    Dense,
}

#[derive(Args)]
struct GenerateArgs {
    /// Local model directory or Hugging Face repo id (e.g. zai-org/GLM-5-FP8). Default: the embedded tiny model.
    #[arg(long)]
    model: Option<String>,
    /// Hub revision (branch, tag or commit).
    #[arg(long)]
    revision: Option<String>,
    /// Use only the local Hugging Face cache (also HF_HUB_OFFLINE=1).
    #[arg(long)]
    offline: bool,
    /// The user message (rendered with the chat template unless --raw).
    #[arg(long, conflicts_with = "chat", required_unless_present = "chat")]
    prompt: Option<String>,
    /// Interactive chat on stdin, keeping the conversation.
    #[arg(long)]
    chat: bool,
    /// System message for the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Feed --prompt to the model as is, without the chat template.
    #[arg(long, requires = "prompt")]
    raw: bool,
    /// Turn the model's thinking off (chat template kwarg enable_thinking=false).
    #[arg(long)]
    no_think: bool,
    /// cpu or cuda:N.
    #[arg(long, default_value = "cpu", conflicts_with = "devices")]
    device: String,
    /// Several devices, comma-separated (cuda:0,cuda:1,...): the layers are split over them.
    #[arg(long)]
    devices: Option<String>,
    /// Per-layer device map: FIRST-LAST=DEVICE, comma-separated (DEVICE: a name from --devices or #INDEX).
    #[arg(long, requires = "devices")]
    layer_map: Option<String>,
    /// Force a backend: OP=NAME (repeatable), e.g. sparse_mla=reference. Also GLM5_BACKEND.
    #[arg(long = "backend")]
    backends: Vec<String>,
    /// Weights and activations dtype (default: f32 on CPU, bf16 on GPU).
    #[arg(long, value_enum)]
    dtype: Option<DTypeArg>,
    #[arg(long, value_enum, default_value = "sparse")]
    attention: AttentionArg,
    /// How the DSA indexer's key cache stores keys.
    #[arg(long, value_enum, default_value = "float")]
    index_cache: IndexCacheArg,
    #[arg(long, default_value_t = 256)]
    max_new_tokens: usize,
    /// 0 = greedy. Default: the model's generation_config.json, else greedy.
    #[arg(long)]
    temperature: Option<f64>,
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long)]
    top_p: Option<f64>,
    #[arg(long)]
    min_p: Option<f64>,
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    #[arg(long, default_value_t = 299_792_458)]
    seed: u64,
    /// Stop when the text contains this string (repeatable).
    #[arg(long = "stop")]
    stop: Vec<String>,
    /// KV cache size in tokens for --chat (default: min(8192, the model's context)).
    #[arg(long)]
    max_context: Option<usize>,
}

fn dtype(arg: DTypeArg) -> DType {
    match arg {
        DTypeArg::F32 => DType::F32,
        DTypeArg::Bf16 => DType::BF16,
        DTypeArg::F16 => DType::F16,
    }
}

fn attention(arg: AttentionArg) -> AttentionMode {
    match arg {
        AttentionArg::Sparse => AttentionMode::Sparse,
        AttentionArg::Dense => AttentionMode::Dense,
    }
}

/// `--backend OP=NAME` flags.
fn backend_flags(flags: &[String]) -> Result<BTreeMap<Op, String>, Box<dyn std::error::Error>> {
    let mut forced = BTreeMap::new();
    for flag in flags {
        let (op, name) = parse_forced(flag)?;
        forced.insert(op, name);
    }
    Ok(forced)
}

/// Names of real devices as plans write them.
fn device_names(devices: &[Device]) -> Result<Vec<String>, Box<dyn std::error::Error>> {
    Ok(devices
        .iter()
        .map(DeviceDesc::of)
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .map(|d| d.name)
        .collect())
}

fn plan(args: PlanArgs) -> Result<(), Box<dyn std::error::Error>> {
    let mut hub = HubOptions::from_env();
    hub.revision = args.revision.clone().or(hub.revision);
    hub.offline |= args.offline;
    let (config, label) = match &args.model {
        Some(id) => (Config::from_file(resolve_config(id, &hub)?)?, id.clone()),
        None => (
            Config::from_json(glm5::embedded::CONFIG_JSON)?,
            format!("{} (embedded)", glm5::embedded::NAME),
        ),
    };
    let devices = match (&args.assume, &args.devices) {
        (Some(assumed), _) => parse_assumed(assumed)?,
        (None, Some(list)) => parse_devices(list)?
            .iter()
            .map(DeviceDesc::of)
            .collect::<Result<Vec<_>, _>>()?,
        (None, None) => vec![DeviceDesc::of(&Device::Cpu)?],
    };
    let any_cuda = devices.iter().any(|d| !d.is_cpu());
    let names: Vec<String> = devices.iter().map(|d| d.name.clone()).collect();
    let options = PlanOptions {
        dtype: args
            .dtype
            .map(dtype)
            .unwrap_or(if any_cuda { DType::BF16 } else { DType::F32 }),
        attention: attention(args.attention),
        context: args.context,
        forced: forced_backends(
            &backend_flags(&args.backends)?,
            std::env::var(BACKEND_ENV).ok().as_deref(),
        )?,
        layer_devices: args
            .layer_map
            .as_deref()
            .map(|m| parse_layer_map(m, &names, config.num_hidden_layers))
            .transpose()?,
        index_keys: index_cache(args.index_cache),
    };
    let registry = Registry::builtin();
    match Plan::build(&config, devices, &options, &registry) {
        Ok(plan) => {
            print!("{}", render(&plan, &config, &label, &registry));
            Ok(())
        }
        Err(e @ glm5::models::PlanError::DoesNotFit { .. }) => {
            let params: u64 = glm5::models::sizes::params(&glm5::models::sizes::embedding_tensors(
                &config,
                options.dtype,
            )) + glm5::models::sizes::params(&glm5::models::sizes::head_tensors(
                &config,
                options.dtype,
            )) + (0..config.num_hidden_layers)
                .map(|l| {
                    glm5::models::sizes::params(&glm5::models::sizes::layer_tensors(
                        &config,
                        l,
                        options.dtype,
                    ))
                })
                .sum::<u64>();
            Err(format!(
                "{e}\nhint: the model has {params} parameters, {} at 1 byte each ({params} B: an FP8 checkpoint, which glm5 cannot load yet); more or larger devices, or a smaller --context, are the other ways out",
                glm5::models::fmt_bytes(params)
            )
            .into())
        }
        Err(e) => Err(e.into()),
    }
}

fn generation_params(args: &GenerateArgs, defaults: &GenerationParams) -> GenerationParams {
    GenerationParams {
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature.unwrap_or(defaults.temperature),
        top_k: args.top_k.or(defaults.top_k),
        top_p: args.top_p.or(defaults.top_p),
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        stop_strings: args.stop.clone(),
        ..defaults.clone()
    }
}

/// Prints the stream as it decodes; returns the text.
fn stream(generation: &mut Generation) -> Result<String, Box<dyn std::error::Error>> {
    let mut stdout = std::io::stdout().lock();
    let mut text = String::new();
    for token in generation.by_ref() {
        let token = token?;
        stdout.write_all(token.text.as_bytes())?;
        stdout.flush()?;
        text.push_str(&token.text);
    }
    writeln!(stdout)?;
    let stats = generation.stats();
    eprintln!(
        "[prompt: {} tokens, {:.1} tok/s | generation: {} tokens, {:.1} tok/s | stop: {:?}]",
        stats.prompt_tokens,
        stats.prompt_tokens_per_second(),
        stats.generated_tokens,
        stats.generation_tokens_per_second(),
        generation.finish_reason(),
    );
    Ok(text)
}

fn generate(args: GenerateArgs) -> Result<(), Box<dyn std::error::Error>> {
    let mut hub = HubOptions::from_env();
    hub.revision = args.revision.clone().or(hub.revision);
    hub.offline |= args.offline;
    let devices = match &args.devices {
        Some(list) => parse_devices(list)?,
        None => vec![parse_device(&args.device)?],
    };
    // A layer map needs the layer count: config.json alone is read (or fetched) first.
    let layer_map = match &args.layer_map {
        Some(map) => {
            let config = match &args.model {
                Some(id) => Config::from_file(resolve_config(id, &hub)?)?,
                None => Config::from_json(glm5::embedded::CONFIG_JSON)?,
            };
            Some(parse_layer_map(
                map,
                &device_names(&devices)?,
                config.num_hidden_layers,
            )?)
        }
        None => None,
    };
    let options = LoadOptions {
        device: devices[0].clone(),
        devices: devices.clone(),
        backends: backend_flags(&args.backends)?,
        dtype: args.dtype.map(dtype),
        attention: attention(args.attention),
        index_keys: index_cache(args.index_cache),
        layer_map,
        hub,
        ..Default::default()
    };
    let model = match &args.model {
        Some(id) => Glm5::from_pretrained(id, &options)?,
        None => Glm5::embedded(&options)?,
    };
    eprintln!(
        "[model: {}{}]",
        model.label(),
        if args.attention == AttentionArg::Dense {
            ", DENSE attention (debug mode)"
        } else {
            ""
        }
    );
    let params = generation_params(&args, model.sampling_defaults());
    let chat_options = ChatOptions {
        add_generation_prompt: true,
        enable_thinking: !args.no_think,
    };
    let mut messages: Vec<Message> = args.system.iter().map(Message::system).collect();

    if let Some(prompt) = &args.prompt {
        let text = if args.raw {
            prompt.clone()
        } else {
            messages.push(Message::user(prompt));
            model.apply_chat_template(&messages, &chat_options)?
        };
        stream(&mut model.generate(&text, &params)?)?;
        return Ok(());
    }

    let context = args
        .max_context
        .unwrap_or(8192)
        .min(model.model().config().max_position_embeddings);
    let mut sequence = SequenceCache::new(model.new_cache(context)?);
    let stdin = std::io::stdin();
    loop {
        eprint!("> ");
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 || line.trim() == "/exit" {
            return Ok(());
        }
        messages.push(Message::user(line.trim_end()));
        let prompt = model
            .tokenizer()
            .encode(&model.apply_chat_template(&messages, &chat_options)?)?;
        let mut generation = model.generate_ids(prompt, &params, sequence)?;
        let reply = stream(&mut generation)?;
        sequence = generation.into_sequence();
        messages.push(Message::assistant(&reply));
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let message = e.to_string();
            eprintln!(
                "{}",
                message.lines().next().unwrap_or("error: invalid arguments")
            );
            return ExitCode::from(2);
        }
    };
    if cli.verbose > 0 {
        let level = if cli.verbose > 1 {
            "glm5=trace"
        } else {
            "glm5=debug"
        };
        tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_env_filter(level)
            .init();
    }
    let result = match cli.command {
        Command::Generate(args) => generate(args),
        Command::Plan(args) => plan(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
