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
pub(crate) struct Cli {
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
    /// Serve an OpenAI-compatible HTTP API (chat and text completions, streaming) with continuous batching.
    Serve(ServeArgs),
}

#[derive(Args)]
struct PlanArgs {
    /// Local model directory, Hugging Face repo id (only config.json is fetched), or a GGUF file / folder of
    /// split parts (only the headers are read; quantised tensors count at their stored size). Default: the
    /// embedded tiny model.
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
    /// Place the MTP layer too (speculative decoding's draft; generate --mtp).
    #[arg(long)]
    mtp: bool,
    /// Size the checkpoint's unquantised projections as FP8 (generate/serve --fp8-projections).
    #[arg(long)]
    fp8_projections: bool,
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

/// What to load and where: shared by `generate` and `serve`.
#[derive(Args)]
struct ModelArgs {
    /// Local model directory or Hugging Face repo id (e.g. zai-org/GLM-5-FP8), a GGUF file or folder of split
    /// parts, or a GGUF repo with --quant (or as OWNER/NAME:QUANT). Default: the embedded tiny model.
    #[arg(long)]
    model: Option<String>,
    /// The quantisation to download from the GGUF repo given as --model (e.g. UD-Q2_K_XL): its files only.
    #[arg(long, requires = "model")]
    quant: Option<String>,
    /// Hub revision (branch, tag or commit).
    #[arg(long)]
    revision: Option<String>,
    /// Use only the local Hugging Face cache (also HF_HUB_OFFLINE=1).
    #[arg(long)]
    offline: bool,
    /// cpu or cuda:N.
    #[arg(long, default_value = "cpu", conflicts_with = "devices")]
    device: String,
    /// Several devices, comma-separated (cuda:0,cuda:1,...): the layers are split over them.
    #[arg(long)]
    devices: Option<String>,
    /// Per-layer device map: FIRST-LAST=DEVICE, comma-separated (DEVICE: a name from --devices or #INDEX);
    /// needs --devices.
    #[arg(long)]
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
    /// Quantise the checkpoint's unquantised projections (attention, indexer, dense MLPs; not the routed
    /// experts) to block-scaled FP8 (128x128, as GLM-5-FP8) while loading: an NVFP4 export keeps its attention
    /// bf16, which is then half the bytes each token reads.
    #[arg(long)]
    fp8_projections: bool,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
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
    /// Subtracted from the logit of every token already generated (OpenAI's presence_penalty, in [-2, 2]).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    presence_penalty: f32,
    /// Subtracted from a generated token's logit once per time it was generated (in [-2, 2]).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    frequency_penalty: f32,
    #[arg(long, default_value_t = 299_792_458)]
    seed: u64,
    /// Stop when the text contains this string (repeatable).
    #[arg(long = "stop")]
    stop: Vec<String>,
    /// KV cache size in tokens for --chat (default: min(8192, the model's context)).
    #[arg(long)]
    max_context: Option<usize>,
    /// Launch every op of a decode step from the host instead of replaying the step from CUDA graphs
    /// (graphs are the default where every layer is on a GPU; stderr says when they cannot be).
    #[arg(long)]
    enforce_eager: bool,
    /// Speculative decoding with the checkpoint's MTP layer: it drafts the token after next, checked in the
    /// same model step as the next token (greedy output unchanged; sampled output from the same
    /// distribution). Loads the MTP layer (one more MoE layer of weights and KV cache). Its steps run
    /// eagerly.
    #[arg(long)]
    mtp: bool,
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

/// The quantised weight formats the model would multiply by: a GGUF file's linear tensors by type (the
/// tensors the loader expands, and the MTP block, left out), or an FP8 / NVFP4 checkpoint's recipe.
fn quantised_weights(
    config: &Config,
    gguf: Option<&glm5::models::weights::gguf_source::GgufSource>,
    dtype: DType,
) -> Vec<glm5::plan_cli::QuantisedWeights> {
    use glm5::ops::gguf_matmul::GgufFormat;
    use glm5::plan_cli::{QuantisedWeights, WeightFormat};
    let mut out: Vec<QuantisedWeights> = Vec::new();
    if let Some(gguf) = gguf {
        let expanded = |name: &str| {
            name == "token_embd.weight"
                || name.ends_with("attn_k_b.weight")
                || name.ends_with("attn_v_b.weight")
        };
        let mut tensors: Vec<_> = gguf.model().tensors.values().collect();
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        for t in tensors {
            if t.ggml_type.is_float()
                || expanded(&t.name)
                || gguf.is_mtp(&t.name)
                || t.dims.len() < 2
            {
                continue;
            }
            // glm5's own block kernels first (the K-quants, which candle also has, run on them), then candle's.
            let format = match (
                GgufFormat::from_ggml_id(t.ggml_type.id),
                t.ggml_type.candle(),
            ) {
                (Some(iq), _) => WeightFormat::GgufBlocks(iq),
                (None, Some(c)) => WeightFormat::Gguf(c, t.ggml_type.name),
                (None, None) => continue, // the header note says the file cannot run
            };
            match out.iter_mut().find(|w| w.format == format) {
                Some(w) => w.tensors += 1,
                None => out.push(QuantisedWeights {
                    format,
                    tensors: 1,
                    out_dim: t.dims[1] as usize,
                    in_dim: t.dims[0] as usize,
                }),
            }
        }
        return out;
    }
    let Some(q) = &config.quantization else {
        return out;
    };
    let format = match q {
        glm5::models::Quantization::Fp8Block { block, .. } => WeightFormat::Fp8 { block: *block },
        glm5::models::Quantization::Nvfp4 { .. } => WeightFormat::Nvfp4,
    };
    let mut quantised = glm5::models::sizes::head_tensors(config, dtype);
    for layer in 0..config.num_hidden_layers {
        quantised.extend(glm5::models::sizes::layer_tensors(config, layer, dtype));
    }
    let matrices: Vec<_> = quantised
        .iter()
        .filter(|t| {
            t.shape.len() == 2 && q.quantizes(&t.name) && !t.name.ends_with("kv_b_proj.weight")
        })
        .collect();
    if let Some(first) = matrices.first() {
        out.push(QuantisedWeights {
            format,
            tensors: matrices.len(),
            out_dim: first.shape[0],
            in_dim: first.shape[1],
        });
    }
    out
}

fn plan(args: PlanArgs) -> Result<(), Box<dyn std::error::Error>> {
    let mut hub = HubOptions::from_env();
    hub.revision = args.revision.clone().or(hub.revision);
    hub.offline |= args.offline;
    let gguf = match &args.model {
        Some(path) if glm5::gguf::is_gguf(std::path::Path::new(path)) => {
            Some(glm5::models::weights::gguf_source::GgufSource::new(
                glm5::models::weights::gguf::GgufModel::open(path)?,
            )?)
        }
        _ => None,
    };
    if gguf.is_some() && args.fp8_projections {
        return Err("--fp8-projections: a GGUF file's matrices are already quantised".into());
    }
    let (config, label) = match (&args.model, &gguf) {
        (Some(path), Some(gguf)) => {
            let note = match gguf.check_types() {
                Ok(()) => String::new(),
                Err(e) => format!("; cannot run yet: {e}"),
            };
            (gguf.config().clone(), format!("{path} (GGUF{note})"))
        }
        (Some(id), None) => (Config::from_file(resolve_config(id, &hub)?)?, id.clone()),
        (None, _) => (
            Config::from_json(glm5::embedded::CONFIG_JSON)?,
            format!("{} (embedded)", glm5::embedded::NAME),
        ),
    };
    let label = match &config.quantization {
        Some(q) => format!("{label} ({})", q.describe()),
        None => label,
    };
    let devices = match (&args.assume, &args.devices) {
        (Some(assumed), _) => parse_assumed(assumed)?,
        (None, Some(list)) => nonempty_devices(list)?
            .iter()
            .map(DeviceDesc::of)
            .collect::<Result<Vec<_>, _>>()?,
        (None, None) => vec![DeviceDesc::of(&Device::Cpu)?],
    };
    if let Some(context) = args.context {
        check_range(
            "--context",
            context,
            1,
            config.max_position_embeddings,
            "the model's max_position_embeddings",
        )?;
    }
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
        mtp: args.mtp,
        fp8_projections: args.fp8_projections,
    };
    let registry = Registry::builtin();
    // A GGUF file's tensors count at the size they are kept in (quantised matrices stay quantised), as do
    // those of an FP8 / NVFP4 checkpoint (from its config's quantisation).
    let resident = |t: &glm5::models::sizes::TensorInfo| match &gguf {
        Some(gguf) => glm5::models::TensorSource::resident_bytes(gguf, &t.name, &t.shape, t.dtype),
        None => glm5::models::sizes::resident_bytes(&config, t),
    };
    let weights = quantised_weights(&config, gguf.as_ref(), options.dtype);
    match Plan::build_sized(&config, devices, &options, &registry, &resident) {
        Ok(plan) => {
            print!("{}", render(&plan, &config, &label, &registry));
            print!(
                "{}",
                glm5::plan_cli::render_weight_backends(&plan.devices, &weights)
            );
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
                "{e}\nhint: the model has {params} parameters, {} at 1 byte each ({params} B: an FP8 checkpoint); more or larger devices, or a smaller --context, are the other ways out",
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
        presence_penalty: args.presence_penalty,
        frequency_penalty: args.frequency_penalty,
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
    if let Some(graphs) = generation.graph_stats() {
        eprintln!(
            "[decode graphs: {} captured, {} replayed, {} eager{}]",
            graphs.captured,
            graphs.replayed,
            graphs.eager,
            match &graphs.last_eager_reason {
                Some(why) => format!(" (last: {why})"),
                None => String::new(),
            }
        );
    }
    if stats.draft_tokens > 0 {
        eprintln!(
            "[MTP drafts: {} of {} accepted ({:.0}%)]",
            stats.accepted_draft_tokens,
            stats.draft_tokens,
            100.0 * stats.accepted_draft_tokens as f64 / stats.draft_tokens as f64
        );
    }
    Ok(text)
}

/// Loads the model `--model` names (default: the embedded one) on the devices the arguments give, and
/// says on stderr what was loaded.
/// `mtp`: with the MTP layer, for speculative decoding.
fn load_model(args: &ModelArgs, mtp: bool) -> Result<Glm5, Box<dyn std::error::Error>> {
    let mut hub = HubOptions::from_env();
    hub.revision = args.revision.clone().or(hub.revision);
    hub.offline |= args.offline;
    if args.layer_map.is_some() && args.devices.is_none() {
        return Err(
            "--layer-map needs --devices: it maps layers to the devices --devices lists".into(),
        );
    }
    let devices = match &args.devices {
        Some(list) => nonempty_devices(list)?,
        None => vec![parse_device(&args.device)?],
    };
    glm5::plan_cli::without_event_tracking(&devices);
    // A layer map needs the layer count: config.json alone is read (or fetched) first.
    let layer_map = match &args.layer_map {
        Some(map) => {
            let config = match &args.model {
                Some(path) if glm5::gguf::is_gguf(std::path::Path::new(path)) => {
                    glm5::models::weights::gguf_source::GgufSource::new(
                        glm5::models::weights::gguf::GgufModel::open(path)?,
                    )?
                    .config()
                    .clone()
                }
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
        mtp,
        fp8_projections: args.fp8_projections,
        layer_map,
        hub,
        ..Default::default()
    };
    let model = match (&args.model, &args.quant) {
        (Some(id), Some(quant)) => Glm5::from_pretrained(&format!("{id}:{quant}"), &options)?,
        (Some(id), None) => Glm5::from_pretrained(id, &options)?,
        (None, _) => Glm5::embedded(&options)?,
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
    Ok(model)
}

fn generate(args: GenerateArgs) -> Result<(), Box<dyn std::error::Error>> {
    let model = load_model(&args.model, args.mtp)?;
    let params = generation_params(&args, model.sampling_defaults());
    let chat_options = ChatOptions {
        add_generation_prompt: true,
        enable_thinking: !args.no_think,
    };
    let mut messages: Vec<Message> = args.system.iter().map(Message::system).collect();
    let cuda_graphs = use_cuda_graphs(&model, args.enforce_eager, args.mtp);
    if cuda_graphs {
        eprintln!("[decode steps replayed from CUDA graphs]");
    }

    if let Some(prompt) = &args.prompt {
        let text = if args.raw {
            prompt.clone()
        } else {
            messages.push(Message::user(prompt));
            model.apply_chat_template(&messages, &chat_options)?
        };
        let mut generation = match cuda_graphs {
            true => model.generate_graphed(&text, &params)?,
            false => model.generate(&text, &params)?,
        };
        stream(&mut generation)?;
        return Ok(());
    }

    let max_positions = model.model().config().max_position_embeddings;
    let context = match args.max_context {
        // A turn needs one token of prompt and one of answer.
        Some(n) => check_range(
            "--max-context",
            n,
            2,
            max_positions,
            "the model's max_position_embeddings",
        )?,
        None => 8192.min(max_positions),
    };
    let new_sequence = |model: &Glm5| -> Result<SequenceCache, Box<dyn std::error::Error>> {
        Ok(match cuda_graphs {
            true => SequenceCache::graphed(model.model(), context)?,
            false => model.new_sequence(context)?,
        })
    };
    let mut sequence = Some(new_sequence(&model)?);
    let stdin = std::io::stdin();
    let first_turn = messages.len();
    loop {
        eprint!("> ");
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 || line.trim() == "/exit" {
            return Ok(());
        }
        if line.trim() == "/reset" {
            messages.truncate(first_turn);
            sequence = None;
            eprintln!("[conversation cleared]");
            continue;
        }
        messages.push(Message::user(line.trim_end()));
        let turn = chat_turn(
            &model,
            &messages,
            &chat_options,
            &params,
            context,
            &mut sequence,
            &new_sequence,
        );
        match turn {
            Ok(reply) => messages.push(Message::assistant(&reply)),
            // One turn failed (too long, the context full, a model error): the conversation goes on
            // without it.
            Err(e) => {
                messages.pop();
                eprintln!("error: {e}\n[this turn was dropped; /reset clears the conversation, /exit ends it]");
            }
        }
    }
}

#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0: any free port; the address is printed).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on /v1 routes (also GLM5_API_KEY).
    #[arg(long)]
    api_key: Option<String>,
    /// Model name for /v1/models and the requests' `model` (default: --model, or "glm5-tiny").
    #[arg(long)]
    served_model_name: Option<String>,
    /// Most sequences generated at once.
    #[arg(long, default_value_t = 32)]
    max_seqs: usize,
    /// Most sequences waiting for a slot; more requests are answered 429.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Context per sequence, prompt plus output (default: min(8192, the model's context)).
    #[arg(long)]
    max_model_len: Option<usize>,
    /// KV cache tokens over all sequences (default: max-seqs x max-model-len).
    #[arg(long)]
    kv_budget: Option<usize>,
    /// Most prompt tokens a sequence feeds per step (long prompts are chunked so decodes keep flowing).
    #[arg(long, default_value_t = 512)]
    prefill_chunk: usize,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 8 << 20)]
    max_body_bytes: usize,
    /// Seconds a client may take to send its request headers, and then its body.
    #[arg(long, default_value_t = 30.0)]
    read_timeout: f64,
    /// Seconds running requests may take to finish after SIGTERM / ctrl-c before they are cancelled.
    #[arg(long, default_value_t = 30.0)]
    shutdown_grace: f64,
    /// Launch every op of a step from the host. By default decode steps replay CUDA graphs (one per batch
    /// size and block-table width, a graph per GPU's run of layers) where every layer is on a GPU; steps
    /// with prompt chunks, or that the graphs cannot take, run eagerly (/metrics counts both).
    #[arg(long)]
    enforce_eager: bool,
    /// Forward calls a step's sequences are split into, all queued before the first is read back, so that
    /// with the layers over several devices the devices work on different micro-batches at once (default:
    /// one per run of layers on one device; 1 on one device).
    #[arg(long)]
    micro_batches: Option<usize>,
}

fn serve(args: ServeArgs) -> Result<(), Box<dyn std::error::Error>> {
    // Request logs go to stderr at info level unless -v asked for more (or RUST_LOG says otherwise).
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("glm5=info")),
        )
        .try_init();
    let seconds = |name: &str, value: f64| {
        (value.is_finite() && value > 0.0)
            .then(|| std::time::Duration::from_secs_f64(value))
            .ok_or_else(|| format!("--{name} must be a positive number of seconds, got {value}"))
    };
    let read_timeout = seconds("read-timeout", args.read_timeout)?;
    let shutdown_grace = seconds("shutdown-grace", args.shutdown_grace)?;
    let host: std::net::IpAddr = args
        .host
        .parse()
        .map_err(|_| format!("--host must be an IP address, got {:?}", args.host))?;
    let model = load_model(&args.model, false)?;
    let context = model.model().config().max_position_embeddings;
    let name = args
        .served_model_name
        .clone()
        .or(args.model.model.clone())
        .unwrap_or_else(|| "glm5-tiny".to_string());
    let options = glm5::serve::ServeOptions {
        api_key: args
            .api_key
            .clone()
            .or_else(|| std::env::var("GLM5_API_KEY").ok())
            .filter(|k| !k.is_empty()),
        max_seqs: args.max_seqs,
        max_queue: args.max_queue,
        max_model_len: args.max_model_len.unwrap_or(8192.min(context)),
        kv_budget: args.kv_budget,
        prefill_chunk: args.prefill_chunk,
        max_body_bytes: args.max_body_bytes,
        read_timeout,
        shutdown_grace,
        cuda_graphs: !args.enforce_eager,
        micro_batches: args.micro_batches,
        ..glm5::serve::ServeOptions::new((host, args.port).into(), name)
    };
    if use_cuda_graphs(&model, args.enforce_eager, false) {
        eprintln!("glm5 serve: decode steps replayed from CUDA graphs");
    }
    glm5::serve::run(model, options, |addr| {
        eprintln!("glm5 serve: listening on http://{addr}");
    })?;
    Ok(())
}

/// Whether decode steps replay CUDA graphs: the default where every layer is on a GPU and the graphs can
/// take a step, unless `--enforce-eager` or `--mtp` (whose steps run eagerly) says otherwise. Where the
/// model is on a GPU and they cannot be used, stderr says why.
fn use_cuda_graphs(model: &Glm5, enforce_eager: bool, mtp: bool) -> bool {
    let on_gpu = model.model().plan().devices.iter().any(|d| !d.is_cpu());
    if enforce_eager || !on_gpu {
        return false;
    }
    let blocker = match mtp {
        true => Some("speculative decoding (--mtp) runs its steps eagerly".to_string()),
        false => model.model().decode_graph_blocker(1),
    };
    if let Some(why) = &blocker {
        eprintln!("[decode steps run eagerly: {why}]");
    }
    blocker.is_none()
}

/// Makes an empty sequence for a chat (graphed or contiguous, as decode steps run).
type NewSequence<'a> = dyn Fn(&Glm5) -> Result<SequenceCache, Box<dyn std::error::Error>> + 'a;

/// One `--chat` turn: the conversation rendered and tokenised (the new line refused first when its bytes
/// alone cannot fit), then the answer streamed. `sequence` keeps the KV cache across turns; a failed
/// generation leaves it `None`, and the next turn starts a fresh one.
fn chat_turn(
    model: &Glm5,
    messages: &[Message],
    chat_options: &ChatOptions,
    params: &GenerationParams,
    context: usize,
    sequence: &mut Option<SequenceCache>,
    new_sequence: &NewSequence<'_>,
) -> Result<String, Box<dyn std::error::Error>> {
    let line = messages.last().map_or("", |m| m.content.as_str());
    let tokenizer = model.tokenizer();
    // The line alone, before the whole conversation is rendered and tokenised.
    if line.len() > context.saturating_mul(glm5::tokenizer::MAX_BYTES_PER_TOKEN) {
        return Err(glm5::tokenizer::TokenizerError::TooLong {
            what: "the chat turn".into(),
            bytes: line.len(),
            limit: context,
        }
        .into());
    }
    let text = model.apply_chat_template(messages, chat_options)?;
    let prompt = tokenizer.encode_bounded(&text, context, "the conversation")?;
    if prompt.len() >= context {
        return Err(format!(
            "the conversation with this turn has {} tokens, but --max-context is {context} (prompt plus at least one new token)",
            prompt.len()
        )
        .into());
    }
    let cache = match sequence.take() {
        Some(cache) => cache,
        None => new_sequence(model)?,
    };
    let mut generation = model.generate_ids(prompt, params, cache)?;
    let reply = stream(&mut generation);
    *sequence = Some(generation.into_sequence());
    reply
}

/// `--devices`: at least one.
fn nonempty_devices(list: &str) -> Result<Vec<Device>, Box<dyn std::error::Error>> {
    let devices = parse_devices(list)?;
    if devices.is_empty() {
        return Err(format!("--devices {list:?}: no device given (e.g. cuda:0,cuda:1)").into());
    }
    Ok(devices)
}

/// A numeric argument within `min..=max` (`what_max` says where the upper bound comes from).
fn check_range(
    flag: &str,
    value: usize,
    min: usize,
    max: usize,
    what_max: &str,
) -> Result<usize, Box<dyn std::error::Error>> {
    if value < min || value > max {
        return Err(
            format!("{flag} {value}: must be in {min}..={max} ({what_max} is {max})").into(),
        );
    }
    Ok(value)
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            // One line that names the argument: clap puts it on the lines after the first (e.g. the
            // missing one), so everything before the usage is joined.
            let message = e.to_string();
            let line: Vec<&str> = message
                .lines()
                .take_while(|l| !l.starts_with("Usage:"))
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect();
            eprintln!("{}", line.join(" "));
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
        Command::Serve(args) => serve(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
