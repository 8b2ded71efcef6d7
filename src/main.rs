//! The `glm5` command line: `glm5 generate` downloads (or opens) a model, applies its chat template and
//! streams tokens.

use std::io::{BufRead, Write};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use glm5::candle_core::{DType, Device};
use glm5::hub::HubOptions;
use glm5::{
    AttentionMode, ChatOptions, Generation, GenerationParams, Glm5, LoadOptions, Message,
    SequenceCache,
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
}

#[derive(Clone, Copy, ValueEnum)]
enum DTypeArg {
    F32,
    Bf16,
    F16,
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
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Weights and activations dtype (default: f32 on CPU, bf16 on GPU).
    #[arg(long, value_enum)]
    dtype: Option<DTypeArg>,
    #[arg(long, value_enum, default_value = "sparse")]
    attention: AttentionArg,
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

fn parse_device(spec: &str) -> Result<Device, String> {
    match spec {
        "cpu" => Ok(Device::Cpu),
        _ => {
            let ordinal = spec
                .strip_prefix("cuda:")
                .or_else(|| (spec == "cuda").then_some("0"))
                .and_then(|n| n.parse::<usize>().ok())
                .ok_or_else(|| format!("--device {spec:?}: expected cpu or cuda:N"))?;
            if !glm5::candle_core::utils::cuda_is_available() {
                return Err(format!("--device {spec}: this glm5 was built without CUDA (rebuild with --features cuda)"));
            }
            Device::new_cuda(ordinal).map_err(|e| format!("--device {spec}: {e}"))
        }
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
    let options = LoadOptions {
        device: parse_device(&args.device)?,
        dtype: args.dtype.map(|d| match d {
            DTypeArg::F32 => DType::F32,
            DTypeArg::Bf16 => DType::BF16,
            DTypeArg::F16 => DType::F16,
        }),
        attention: match args.attention {
            AttentionArg::Sparse => AttentionMode::Sparse,
            AttentionArg::Dense => AttentionMode::Dense,
        },
        hub,
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
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
