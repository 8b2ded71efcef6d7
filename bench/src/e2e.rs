//! `glm5-bench e2e`: the whole model step on one GPU, GLM-5's first `--layers` layers at real sizes with
//! random weights (`--weights`: bf16; fp8 / nvfp4 where the published GLM-5-FP8 / NVFP4 checkpoints
//! quantise; or Q4_K blocks where a Q4_K_M file quantises), through the public API
//! (`forward`, the argmax read back each step as a generation loop does). Per row: ms per step, tokens/s,
//! the weight bytes the step must read over the copy bandwidth measured in the same run (the floor), the
//! per-part split from a profiled pass, and, with `--hf`, HF transformers on the same slice in the same GPU
//! call. The last line projects the full model.

use std::process::Command;
use std::time::Instant;

use glm5::candle_core::{DType, Device, Result, Tensor};
use glm5::models::profile;
use glm5::models::sizes::{self, TensorInfo};
use glm5::models::weights::random_iq::RandomIqSource;
use glm5::models::weights::random_q4k::RandomQ4kSource;
use glm5::models::weights::Format;
use glm5::models::{DecodeGraphs, PagedCacheOptions, RowOps, SeqChunk, SeqId, DEFAULT_BLOCK_SIZE};
use glm5::ops::gguf_matmul::GgufFormat;
use glm5::{AttentionMode, Checkpoint, Config, DeviceDesc, Glm5ForCausalLM, Plan, PlanOptions};

use crate::cuda;
use crate::slice::glm5_slice;
use crate::timing::median;
use crate::Greedy;

/// The weights the random slice is built with (`--weights`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    Bf16,
    /// Every linear layer a llama.cpp Q4_K_M file quantises as random Q4_K blocks, lm_head in bf16
    /// (`glm5::models::weights::random_q4k`), multiplied by glm5's kernels as a GGUF file's Q4_K tensors are.
    Q4K,
    /// The same blocks through candle's `QMatMul` and candle-nn's GGUF MoE kernels (the peer).
    Q4kCandle,
    /// Q4_K_M's mix (`RandomQ4kSource::q4_k_m`): Q4_K, with Q6_K for lm_head and the even layers'
    /// `down_proj`s, through glm5's kernels.
    Q4kM,
    /// The same mix through candle's kernels.
    Q4kMCandle,
    /// Block-scaled FP8 as `zai-org/GLM-5-FP8` (128x128 blocks) where that recipe quantises.
    Fp8,
    /// NVFP4 as ModelOpt exports it (groups of 16) where that recipe quantises.
    Nvfp4,
    /// One of llama.cpp's i-quant formats for every linear layer Q4_K covers
    /// (`glm5::models::weights::random_iq`).
    GgufBlocks(GgufFormat),
}

impl std::str::FromStr for WeightFormat {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" => Ok(Self::Bf16),
            "q4k" | "q4_k" => Ok(Self::Q4K),
            "q4k-candle" => Ok(Self::Q4kCandle),
            "q4_k_m" | "q4k_m" => Ok(Self::Q4kM),
            "q4_k_m-candle" | "q4k_m-candle" => Ok(Self::Q4kMCandle),
            "fp8" => Ok(Self::Fp8),
            "nvfp4" => Ok(Self::Nvfp4),
            other => GgufFormat::ALL
                .into_iter()
                .find(|f| f.name().eq_ignore_ascii_case(other))
                .map(Self::GgufBlocks)
                .ok_or_else(|| {
                    format!(
                        "unknown weight format {other:?} (bf16, q4k, q4k-candle, q4_k_m, q4_k_m-candle, fp8, nvfp4, or an i-quant: iq1_s, iq1_m, \
                         iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s, iq4_nl, iq4_xs)"
                    )
                }),
        }
    }
}

impl WeightFormat {
    /// As the output names the weights.
    fn label(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::Q4K => "Q4_K",
            Self::Q4kCandle => "Q4_K (candle)",
            Self::Q4kM => "Q4_K_M (Q4_K + Q6_K)",
            Self::Q4kMCandle => "Q4_K_M (Q4_K + Q6_K, candle)",
            Self::Fp8 => "FP8 (128x128 blocks)",
            Self::Nvfp4 => "NVFP4",
            Self::GgufBlocks(format) => format.name(),
        }
    }

    /// The published safetensors recipe's quantisation (FP8, NVFP4; `None` otherwise).
    fn quantization(self) -> Option<glm5::models::Quantization> {
        match self {
            Self::Bf16
            | Self::Q4K
            | Self::Q4kCandle
            | Self::Q4kM
            | Self::Q4kMCandle
            | Self::GgufBlocks(_) => None,
            Self::Fp8 => Some(glm5::models::Quantization::Fp8Block {
                block: [128, 128],
                modules_to_not_convert: vec![],
            }),
            // The published ModelOpt export's exclude list: attention, the router, the dense layers' MLPs,
            // the MTP layer and lm_head stay bf16.
            Self::Nvfp4 => Some(glm5::models::Quantization::Nvfp4 {
                group_size: 16,
                exclude_modules: [
                    "lm_head",
                    "model.layers.*.self_attn*",
                    "model.layers.*.mlp.gate",
                    "model.layers.0.mlp*",
                    "model.layers.1.mlp*",
                    "model.layers.2.mlp*",
                    "model.layers.78*",
                ]
                .map(String::from)
                .to_vec(),
            }),
        }
    }
}

/// The random GLM-5 weights in `format` (the same seed and scale for every format).
pub fn random_checkpoint(format: WeightFormat) -> Checkpoint {
    let (seed, std) = (2026, 0.02);
    match format {
        WeightFormat::Bf16 => Checkpoint::random(seed, std),
        WeightFormat::Q4K => {
            Checkpoint::from_source(Box::new(RandomQ4kSource::new(seed, std)), Format::Random)
        }
        WeightFormat::Q4kCandle => {
            Checkpoint::from_source(Box::new(RandomQ4kSource::candle(seed, std)), Format::Random)
        }
        WeightFormat::Q4kM => {
            Checkpoint::from_source(Box::new(RandomQ4kSource::q4_k_m(seed, std)), Format::Random)
        }
        WeightFormat::Q4kMCandle => Checkpoint::from_source(
            Box::new(RandomQ4kSource {
                via_candle: true,
                ..RandomQ4kSource::q4_k_m(seed, std)
            }),
            Format::Random,
        ),
        WeightFormat::GgufBlocks(iq) => {
            Checkpoint::from_source(Box::new(RandomIqSource::new(seed, std, iq)), Format::Random)
        }
        WeightFormat::Fp8 | WeightFormat::Nvfp4 => Checkpoint::random_quantized(
            seed,
            std,
            format.quantization().expect("a safetensors quantisation"),
        ),
    }
}

pub struct E2eArgs {
    pub weights: WeightFormat,
    pub layers: usize,
    pub contexts: Vec<usize>,
    pub steps: usize,
    pub prefill: usize,
    /// Sequences per batched decode step (at the first context).
    pub batches: Vec<usize>,
    /// HF transformers' timing script (`bench/hf_e2e.py`), run after glm5 in the same call.
    pub hf_script: Option<String>,
    /// Also time speculative decoding's steps with the MTP layer ([`mtp_rows`]).
    pub mtp: bool,
    /// Quantise the unquantised projections to FP8 at load (`--fp8-projections`).
    pub fp8_projections: bool,
}

/// Bytes of the tensors a batch-1 decode step reads: every non-expert weight of every layer, `top_k` routed
/// experts and the shared expert per MoE layer, the final norm and lm_head (the embedding row is noise), each
/// at its size in `checkpoint` (quantised sizes for quantised matrices).
fn decode_weight_bytes(
    config: &Config,
    dtype: DType,
    checkpoint: &Checkpoint,
    fp8_projections: bool,
) -> (u64, u64) {
    let bytes = |t: &TensorInfo| {
        fp8_projections
            .then(|| sizes::fp8_at_load_bytes(config, t))
            .flatten()
            .unwrap_or_else(|| checkpoint.resident_bytes(&t.name, &t.shape, t.dtype))
    };
    let mut total = 0u64;
    let mut head = 0u64;
    for layer in 0..config.num_hidden_layers {
        let tensors = sizes::layer_tensors(config, layer, dtype);
        let (experts, rest): (Vec<_>, Vec<_>) = tensors
            .iter()
            .partition(|t| t.name.contains(".mlp.experts."));
        total += rest.iter().map(|t| bytes(t)).sum::<u64>();
        total += expert_bytes(&experts, &bytes) * config.num_experts_per_tok as u64;
    }
    for t in sizes::head_tensors(config, dtype) {
        head += bytes(&t);
    }
    (total + head, head)
}

/// Bytes of one routed expert (expert 0's projections among `tensors`).
fn expert_bytes(tensors: &[&TensorInfo], bytes: &dyn Fn(&TensorInfo) -> u64) -> u64 {
    tensors
        .iter()
        .filter(|t| t.name.contains(".mlp.experts.0."))
        .map(|t| bytes(t))
        .sum()
}

/// Dense bf16 GEMM rate (candle's matmul, cuBLAS) in flop/s: the prefill ceiling.
pub fn gemm_peak(device: &Device) -> Result<f64> {
    let n = 8192;
    let a = Tensor::randn(0f32, 1.0, (n, n), device)?.to_dtype(DType::BF16)?;
    let b = Tensor::randn(0f32, 1.0, (n, n), device)?.to_dtype(DType::BF16)?;
    let seconds = crate::timing::median_seconds(device, 5, 4, || a.matmul(&b).map(|_| ()))?;
    Ok(2.0 * (n as f64).powi(3) / seconds)
}

/// `config` (a GLM-5 slice) with `weights` on `device`, sparse attention, planned for `context` tokens: the
/// model of `glm5-bench e2e` and `glm5-bench serve`.
pub fn load_slice(
    config: &Config,
    weights: &Checkpoint,
    device: &Device,
    context: usize,
    mtp: bool,
    fp8_projections: bool,
) -> Result<Glm5ForCausalLM> {
    let mut options = PlanOptions::new(DType::BF16, AttentionMode::Sparse);
    options.context = Some(context);
    options.mtp = mtp;
    options.fp8_projections = fp8_projections;
    let plan = Plan::build(
        config,
        vec![DeviceDesc::of(device).map_err(cuda)?],
        &options,
        &glm5::Registry::builtin(),
    )
    .map_err(cuda)?;
    Glm5ForCausalLM::load_planned(config, weights, plan, std::slice::from_ref(device)).map_err(cuda)
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The GPU's name as its driver reports it (the rows are that card's).
pub fn gpu_name(device: &Device) -> String {
    match device {
        Device::Cuda(dev) => dev
            .cuda_stream()
            .context()
            .name()
            .unwrap_or_else(|e| format!("GPU (name unread: {e})")),
        _ => "CPU".to_string(),
    }
}

/// Sets the release threshold of `device`'s default memory pool, which candle's stream-ordered allocations
/// draw from: 0 (the driver's default) hands freed memory back at every synchronisation, so the next step's
/// allocations map it again; `u64::MAX` keeps it for reuse.
fn set_pool_release_threshold(device: &Device, bytes: u64) -> Result<()> {
    use glm5::candle_core::cuda_backend::cudarc::driver::sys;
    let Device::Cuda(dev) = device else {
        return Ok(());
    };
    let context = dev.cuda_stream().context().clone();
    let mut pool = std::ptr::null_mut();
    let mut value = bytes;
    // SAFETY: `pool` receives the device's default pool handle; the attribute takes a pointer to a u64.
    let status = unsafe {
        match sys::cuDeviceGetDefaultMemPool(&mut pool, context.cu_device()) {
            sys::CUresult::CUDA_SUCCESS => sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut value as *mut u64).cast(),
            ),
            other => other,
        }
    };
    match status {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        other => Err(cuda(format!(
            "the memory pool's release threshold: {other:?}"
        ))),
    }
}

/// Speculative decoding's parts at batch 1 after a prefill of `context` tokens, median ms over `steps`
/// each: the plain one-token step, the two-token step that checks a draft (both rows' argmax read back,
/// as `Generation` samples them), and the MTP layer's draft over 1 row (after a dropped draft) and 2 rows
/// (after a standing one). With acceptance `a`, a step gives `1 + a` tokens in `verify + a·mtp2 +
/// (1 - a)·mtp1`: the rows project tokens/s at a few rates (the drafts of random weights never stand, so
/// the rate is the real model's, not measurable here).
fn mtp_rows(
    model: &Glm5ForCausalLM,
    vocab: usize,
    context: usize,
    steps: usize,
    full_model_step_ms: Option<f64>,
) -> Result<()> {
    let ids: Vec<u32> = (0..context + 4 * steps + 16)
        .map(|i| (i * 7919 % vocab) as u32)
        .collect();
    let mut cache = model.new_cache(ids.len()).map_err(cuda)?;
    let mut draft_cache = model.new_mtp_cache(ids.len()).map_err(cuda)?;
    let (_, hidden) = model
        .forward_with_hidden(&ids[..context], 0, &mut cache)
        .map_err(cuda)?;
    // The draft's rows of the prompt, as the first speculative step runs them.
    model
        .forward_mtp(
            &ids[1..context],
            &hidden.narrow(0, 0, context - 1)?,
            0,
            &mut draft_cache,
        )
        .map_err(cuda)?;
    let mut pos = context;
    let (mut plain, mut verify, mut one_row, mut two_rows) = (vec![], vec![], vec![], vec![]);
    for round in 0..steps + 2 {
        // One plain step and one checking step per round, and the draft's rows after them (one position
        // behind the main cache, as in generation; the hidden states stand in by shape: this times them).
        let start = Instant::now();
        let (_, h1) = model
            .forward_with_hidden(&ids[pos..pos + 1], pos, &mut cache)
            .map_err(cuda)?;
        h1.greedy()?;
        let plain_s = start.elapsed().as_secs_f64();
        let start = Instant::now();
        let (logits, h2) = model
            .forward_with_hidden(&ids[pos + 1..pos + 3], pos + 1, &mut cache)
            .map_err(cuda)?;
        logits.greedy()?;
        let verify_s = start.elapsed().as_secs_f64();
        let start = Instant::now();
        model
            .forward_mtp(
                &ids[pos..pos + 1],
                &hidden_row(&h1)?,
                pos - 1,
                &mut draft_cache,
            )
            .map_err(cuda)?
            .greedy()?;
        let one_s = start.elapsed().as_secs_f64();
        let start = Instant::now();
        model
            .forward_mtp(&ids[pos + 1..pos + 3], &h2, pos, &mut draft_cache)
            .map_err(cuda)?
            .greedy()?;
        let two_s = start.elapsed().as_secs_f64();
        if round >= 2 {
            plain.push(plain_s);
            verify.push(verify_s);
            one_row.push(one_s);
            two_rows.push(two_s);
        }
        pos += 3;
    }
    let (plain, verify, one_row, two_rows) = (
        median(plain) * 1e3,
        median(verify) * 1e3,
        median(one_row) * 1e3,
        median(two_rows) * 1e3,
    );
    println!(
        "speculative decoding with the MTP layer, batch 1, context {context}: plain step {plain:.2} ms; \
         checking step (2 tokens) {verify:.2} ms; MTP draft {one_row:.2} ms over 1 row, {two_rows:.2} ms over 2"
    );
    // Tokens/s at acceptance 0.6 / 0.8 / 0.9 for a checking step of `verify` ms against a plain one of
    // `plain` ms, the draft's steps as measured; `digits` after the point.
    let rates = |verify: f64, plain: f64, digits: usize| -> String {
        [0.6, 0.8, 0.9]
            .iter()
            .map(|a| {
                let step = verify + a * two_rows + (1.0 - a) * one_row;
                format!(
                    "{a}: {:.digits$} tok/s ({:.2}x)",
                    (1.0 + a) / step * 1e3,
                    (1.0 + a) / step * plain
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "  projected at acceptance {} against {:.0} tok/s plain",
        rates(verify, plain, 0),
        1e3 / plain
    );
    // The whole model: the checking step costs the projected plain step times the slice's checking/plain
    // ratio (the second token's extra experts and rows grow with the layers); the draft does not grow.
    if let Some(full_plain) = full_model_step_ms {
        let full_verify = full_plain * verify / plain;
        println!(
            "  all layers (plain step {full_plain:.1} ms as projected above, checking step {full_verify:.1} ms): at acceptance {} against {:.1} tok/s plain",
            rates(full_verify, full_plain, 1),
            1e3 / full_plain
        );
    }
    Ok(())
}

/// The last row of `hidden`, `[1, hidden]`.
fn hidden_row(hidden: &glm5::candle_core::Tensor) -> Result<glm5::candle_core::Tensor> {
    hidden.narrow(0, hidden.dim(0)? - 1, 1)
}

/// Median ms of `steps` batch-1 decode steps (argmax read back) after a prefill of `context` tokens.
fn batch1_step_ms(
    model: &Glm5ForCausalLM,
    vocab: usize,
    context: usize,
    steps: usize,
) -> Result<f64> {
    let ids: Vec<u32> = (0..context + steps + 3)
        .map(|i| (i * 7919 % vocab) as u32)
        .collect();
    let mut cache = model.new_cache(ids.len()).map_err(cuda)?;
    model
        .forward(&ids[..context], 0, &mut cache)
        .map_err(cuda)?;
    let mut times = Vec::new();
    for pos in context..context + steps + 3 {
        let start = Instant::now();
        model
            .forward(&ids[pos..pos + 1], pos, &mut cache)
            .map_err(cuda)?
            .greedy()?;
        if pos >= context + 3 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    Ok(median(times) * 1e3)
}

pub fn e2e_rows(args: &E2eArgs) -> Result<()> {
    let device = Device::new_cuda(0)?;
    let copy = crate::ceilings::copy_bandwidth(&device)?;
    let gemm = gemm_peak(&device)?;
    let mut config = glm5_slice(args.layers)?;
    config.quantization = args.weights.quantization();
    let dense_layers = config
        .mlp_layer_types
        .iter()
        .filter(|k| matches!(k, glm5::models::MlpKind::Dense))
        .count();
    let max_context = args
        .contexts
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .max(args.prefill);
    // Each context's decode takes 3 warm-up, twice `steps` timed (fused and candle row ops), 4 profiled and
    // up to 8 issue-timed steps.
    let checkpoint = random_checkpoint(args.weights);
    // cudarc's event tracking, on for a new device: every allocation gets two events, and every launch waits
    // on and records the events of each buffer it touches. glm5's CLI turns it off
    // (`without_event_tracking`); a batch-1 step both ways, on a model loaded with tracking on,
    // then the same without.
    let tracking_context = args.prefill.min(max_context).max(1);
    let tracked_ms = {
        let model = load_slice(
            &config,
            &checkpoint,
            &device,
            tracking_context + args.steps + 8,
            false,
            args.fp8_projections,
        )?;
        batch1_step_ms(&model, config.vocab_size, tracking_context, args.steps)?
    };
    if let Device::Cuda(dev) = &device {
        device.synchronize()?;
        // SAFETY: from here on one thread runs everything on the device's one stream.
        unsafe { dev.disable_event_tracking() };
    }
    let load_start = Instant::now();
    let model = load_slice(
        &config,
        &checkpoint,
        &device,
        max_context + 2 * args.steps + 16,
        args.mtp,
        args.fp8_projections,
    )?;
    device.synchronize()?;
    let untracked_ms = batch1_step_ms(&model, config.vocab_size, tracking_context, args.steps)?;
    // And with the default memory pool holding freed memory (not yet how the CLI runs: the rows below don't).
    set_pool_release_threshold(&device, u64::MAX)?;
    let held_ms = batch1_step_ms(&model, config.vocab_size, tracking_context, args.steps)?;
    set_pool_release_threshold(&device, 0)?;
    let weights = match args.weights {
        WeightFormat::Bf16 => "random bf16 weights".to_string(),
        WeightFormat::Q4kM | WeightFormat::Q4kMCandle => format!(
            "random weights: linear layers {} as a llama.cpp Q4_K_M file quantises them (lm_head and the even layers' down_proj Q6_K), embeddings / kv_b bf16, router f32",
            args.weights.label()
        ),
        WeightFormat::Q4K | WeightFormat::Q4kCandle | WeightFormat::GgufBlocks(_) => format!(
            "random weights: linear layers {} as a llama.cpp Q4_K_M file quantises them, lm_head / embeddings / kv_b bf16, router f32",
            args.weights.label()
        ),
        WeightFormat::Fp8 => format!(
            "random weights: linear layers {} as the published checkpoint quantises them, embeddings / norms / router / indexer weights_proj / kv_b / lm_head bf16",
            args.weights.label()
        ),
        WeightFormat::Nvfp4 => format!(
            "random weights: the MoE layers' experts {} as the published export quantises them; attention, the dense layers' MLPs, embeddings, router and lm_head bf16",
            args.weights.label()
        ),
    };
    let weights = match args.fp8_projections {
        true => format!("{weights}; the unquantised projections FP8 at load (--fp8-projections)"),
        false => weights,
    };
    println!(
        "GLM-5 slice: {} layers ({dense_layers} dense + {} MoE) at real sizes, {weights}, one {} (loaded in {:.1} s)",
        args.layers,
        args.layers - dense_layers,
        gpu_name(&device),
        load_start.elapsed().as_secs_f64()
    );
    println!(
        "device: copy {:.0} GB/s, bf16 GEMM (cuBLAS 8192³) {:.0} TFLOP/s",
        copy / 1e9,
        gemm / 1e12
    );
    for b in model.layer_backends() {
        println!("  {b}");
    }
    println!(
        "(batch-1 step at context {tracking_context}: {tracked_ms:.2} ms with cudarc's event tracking, {untracked_ms:.2} ms without, as glm5's CLI runs and every row below; {held_ms:.2} ms without and with the memory pool keeping freed memory, which the rows below don't)"
    );
    let (step_bytes, head_bytes) =
        decode_weight_bytes(&config, DType::BF16, &checkpoint, args.fp8_projections);
    // The weights one token multiplies, counted at bf16's 2 bytes a parameter.
    let (bf16_step_bytes, _) = decode_weight_bytes(
        &config,
        DType::BF16,
        &random_checkpoint(WeightFormat::Bf16),
        false,
    );
    let floor = step_bytes as f64 / copy;
    let fp8_peak = if args.weights == WeightFormat::Fp8 {
        let mma = crate::ceilings::mma_e4m3_peak(&device)?;
        let (plain, fast) = crate::fp8_prefill::fp8_peak(&device)?;
        println!(
            "device: FP8 GEMM (cuBLASLt, per-tensor scales, 8192³) {:.0} TFLOP/s, {:.0} with fast accumulation; \
             mma.sync e4m3 {:.0} TFLOP/s (the legacy tensor-core path)",
            plain / 1e12,
            fast / 1e12,
            mma / 1e12
        );
        Some(plain.max(fast))
    } else {
        None
    };
    // Quantised formats: a last column, the weight bytes per step over the step time as % of copy.
    let quantised = args.weights != WeightFormat::Bf16;
    let percent_of_copy = |step_s: f64, floor_s: f64| {
        if quantised {
            format!(" {:.1}% |", 100.0 * floor_s / step_s)
        } else {
            String::new()
        }
    };
    let ids: Vec<u32> = (0..max_context + 2 * args.steps + 16)
        .map(|i| (i * 7919 % config.vocab_size) as u32)
        .collect();

    // One prefill of `prefill` tokens from an empty cache, in ms (`profiled`: with a profile active).
    let prefill = |profiled: bool| -> Result<f64> {
        let mut cache = model.new_cache(args.prefill + 1).map_err(cuda)?;
        device.synchronize()?;
        if profiled {
            profile::start();
        }
        let start = Instant::now();
        model
            .forward(&ids[..args.prefill], 0, &mut cache)
            .map_err(cuda)?
            .greedy()?;
        Ok(start.elapsed().as_secs_f64() * 1e3)
    };
    // The second of two runs.
    prefill(false)?;
    let prefill_ms = prefill(false)?;
    let active_params: u64 = bf16_step_bytes / 2;
    let prefill_flops = 2.0 * active_params as f64 * args.prefill as f64;
    println!(
        "prefill {} tokens: {prefill_ms:.1} ms, {:.0} tok/s, {:.1} TFLOP/s in the weight GEMMs = {:.1}% of the bf16 GEMM rate",
        args.prefill,
        args.prefill as f64 / prefill_ms * 1e3,
        prefill_flops / prefill_ms / 1e9,
        100.0 * prefill_flops / (prefill_ms / 1e3) / gemm
    );
    // A third, profiled prefill: where its time goes (each part synchronised around itself, which costs a
    // prefill little next to its length).
    {
        let total_ms = prefill(true)?;
        let parts = profile::finish().unwrap_or_default();
        println!(
            "prefill split (ms, one profiled run of {total_ms:.1}): attention {:.1}, indexer {:.1}, MoE {:.1}, dense MLP {:.1}, rest {:.1}",
            ms(parts.attention_without_indexer()),
            ms(parts.indexer),
            ms(parts.moe),
            ms(parts.dense_mlp),
            total_ms - ms(parts.layers())
        );
    }
    if let Some(peak) = fp8_peak {
        // The prefill backend the model's FP8 projections got (q_a_proj's shape stands for them).
        let Some(glm5::models::Quantization::Fp8Block { block, .. }) = &config.quantization else {
            unreachable!("FP8 weights have an FP8 quantisation")
        };
        let shape = glm5::ops::weight_only::WeightShape {
            out_dim: config.q_lora_rank,
            in_dim: config.hidden_size,
            block_in: block[1],
            block_out: block[0],
        };
        let desc = DeviceDesc::of(&device).map_err(cuda)?;
        let backend = glm5::ops::weight_only::dispatch_rows(
            "fp8_matmul",
            glm5::ops::fp8_matmul::backends(),
            &shape,
            &desc,
        )
        .map_err(cuda)?
        .prefill
        .name;
        println!(
            "prefill with FP8 weights: {:.1} TFLOP/s = {:.1}% of the FP8 GEMM peak measured in this run ({:.0} TFLOP/s; \
             the FP8 projections' prefill backend: {backend}; W8A8 alone: glm5-bench fp8-prefill)",
            prefill_flops / prefill_ms / 1e9,
            100.0 * prefill_flops / (prefill_ms / 1e3) / peak,
            peak / 1e12,
        );
    }

    println!(
        "decode, batch 1: weight bytes per step {:.2} GB as stored (lm_head + norm {:.2} GB), floor {:.3} ms at {:.0} GB/s",
        step_bytes as f64 / 1e9,
        head_bytes as f64 / 1e9,
        floor * 1e3,
        copy / 1e9
    );
    let (extra_head, extra_rule) = if quantised {
        (" weight bytes / step time, % of copy |", "---|")
    } else {
        ("", "")
    };
    println!("| context | batch | ms/step | tok/s | floor ms | measured/floor | attention ms | indexer ms | MoE ms | dense MLP ms | rest ms |{extra_head}");
    println!("|---|---|---|---|---|---|---|---|---|---|---|{extra_rule}");
    let mut decode_ms_by_context = Vec::new();
    let mut issue_ms_by_context = Vec::new();
    let mut row_ops_by_context = Vec::new();
    for &context in &args.contexts {
        let mut cache = model
            .new_cache(context + 2 * args.steps + 16)
            .map_err(cuda)?;
        let mut pos = 0;
        while pos < context {
            let chunk = args.prefill.min(context - pos);
            model
                .forward(&ids[pos..pos + chunk], pos, &mut cache)
                .map_err(cuda)?;
            pos += chunk;
        }
        let mut step = |pos: usize| -> Result<()> {
            model
                .forward(&ids[pos..pos + 1], pos, &mut cache)
                .map_err(cuda)?
                .greedy()?;
            Ok(())
        };
        for _ in 0..3 {
            step(pos)?;
            pos += 1;
        }
        let mut times = Vec::new();
        for _ in 0..args.steps {
            let start = Instant::now();
            step(pos)?;
            times.push(start.elapsed().as_secs_f64());
            pos += 1;
        }
        let step_s = median(times);
        // The same steps with the attention's row-wise steps as the candle-op chains the fused ops replace:
        // what the fusion saves, in this run.
        model.set_row_ops(RowOps::CandleOps);
        let mut candle_times = Vec::new();
        for _ in 0..args.steps {
            let start = Instant::now();
            step(pos)?;
            candle_times.push(start.elapsed().as_secs_f64());
            pos += 1;
        }
        model.set_row_ops(RowOps::Fused);
        row_ops_by_context.push((context, step_s * 1e3, median(candle_times) * 1e3));
        // One profiled pass: each part synchronises around itself, so the split is of a slower step; it is
        // scaled to the measured one.
        profile::start();
        let profiled_start = Instant::now();
        let profiled_steps = 4;
        for _ in 0..profiled_steps {
            step(pos)?;
            pos += 1;
        }
        let profiled_s = profiled_start.elapsed().as_secs_f64() / profiled_steps as f64;
        let parts = profile::finish().unwrap_or_default();
        // How long the host takes to issue a step (forward returns before the GPU is done; the argmax read
        // back waits for it): close to the step time means the step is bound by issuing its launches.
        let mut issue = Vec::new();
        for _ in 0..args.steps.min(8) {
            device.synchronize()?;
            let start = Instant::now();
            let logits = model
                .forward(&ids[pos..pos + 1], pos, &mut cache)
                .map_err(cuda)?;
            issue.push(start.elapsed().as_secs_f64());
            logits.greedy()?;
            pos += 1;
        }
        let issue_s = median(issue);
        let per = |d: std::time::Duration| ms(d) / profiled_steps as f64;
        let rest = profiled_s * 1e3 - per(parts.layers());
        println!(
            "| {context} | 1 | {:.2} | {:.1} | {:.3} | {:.2}x | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |{}",
            step_s * 1e3,
            1.0 / step_s,
            floor * 1e3,
            step_s / floor,
            per(parts.attention_without_indexer()),
            per(parts.indexer),
            per(parts.moe),
            per(parts.dense_mlp),
            rest,
            percent_of_copy(step_s, floor)
        );
        issue_ms_by_context.push((context, issue_s * 1e3, step_s * 1e3));
        decode_ms_by_context.push((context, step_s * 1e3));
    }
    println!("(the split is from {} profiled steps that synchronise around each part: it adds up to a slower step than the row's)", 4);
    for (context, issue, step) in issue_ms_by_context {
        println!("(context {context}: the host issues a batch-1 step's launches in {issue:.2} ms of its {step:.2} ms)");
    }
    for (context, fused, candle) in row_ops_by_context {
        println!("(context {context}: batch-1 step {fused:.2} ms with the attention's fused row ops, {candle:.2} ms with the candle-op chains they replace)");
    }

    // Batched decode over the paged pool: `batch` sequences of `context` tokens, one token each per step.
    let context = args.contexts.first().copied().unwrap_or(4096);
    let n_moe = (args.layers - dense_layers) as f64;
    let per_expert = {
        let moe_layer = config
            .mlp_layer_types
            .iter()
            .position(|k| matches!(k, glm5::models::MlpKind::MoE))
            .unwrap_or(0);
        let tensors = sizes::layer_tensors(&config, moe_layer, DType::BF16);
        let refs: Vec<&TensorInfo> = tensors.iter().collect();
        expert_bytes(&refs, &|t: &TensorInfo| {
            checkpoint.resident_bytes(&t.name, &t.shape, t.dtype)
        }) as f64
    };
    let (e, k) = (
        config.n_routed_experts as f64,
        config.num_experts_per_tok as f64,
    );
    // Batch 1 over the pool too: its eager row against the same step replayed from a CUDA graph.
    let batches: Vec<usize> = std::iter::once(1)
        .chain(args.batches.iter().copied().filter(|&b| b != 1))
        .collect();
    let mut graph_notes = Vec::new();
    // The batch-1 step's measured/floor at its best (eager or replayed), for the full model's projection.
    let mut best_batch1_ratio = f64::INFINITY;
    for &batch in &batches {
        let mut pool = model
            .new_paged_cache(PagedCacheOptions {
                num_blocks: batch * (context + 2 * args.steps + 16).div_ceil(DEFAULT_BLOCK_SIZE),
                block_size: DEFAULT_BLOCK_SIZE,
            })
            .map_err(cuda)?;
        let seqs: Vec<SeqId> = (0..batch).map(|_| pool.add_sequence()).collect();
        // Each sequence its own tokens: identical sequences would route every token to the same experts, and
        // the step would read 8 experts a layer, not the ones a batch of different sequences touches.
        let seq_ids: Vec<Vec<u32>> = (0..batch)
            .map(|i| {
                ids.iter()
                    .map(|&id| ((id as usize + i * 104_729) % config.vocab_size) as u32)
                    .collect()
            })
            .collect();
        for (&seq, ids) in seqs.iter().zip(&seq_ids) {
            let mut pos = 0;
            while pos < context {
                let chunk = args.prefill.min(context - pos);
                model
                    .forward_batch(
                        &[SeqChunk {
                            seq,
                            tokens: &ids[pos..pos + chunk],
                            start_pos: pos,
                        }],
                        &mut pool,
                    )
                    .map_err(cuda)?;
                pos += chunk;
            }
        }
        let mut pos = context;
        let mut graphs = DecodeGraphs::new(4);
        let mut step = |pos: usize, graphs: Option<&mut DecodeGraphs>| -> Result<()> {
            let chunks: Vec<SeqChunk> = seqs
                .iter()
                .zip(&seq_ids)
                .map(|(&seq, ids)| SeqChunk {
                    seq,
                    tokens: &ids[pos..pos + 1],
                    start_pos: pos,
                })
                .collect();
            match graphs {
                Some(graphs) => model.forward_batch_graphed(graphs, &chunks, &mut pool),
                None => model.forward_batch(&chunks, &mut pool),
            }
            .map_err(cuda)?
            .greedy()?;
            Ok(())
        };
        // Experts touched: expected under uniform routing (random weights route near-uniformly).
        let touched = e * (1.0 - (1.0 - k / e).powf(batch as f64));
        let bytes = step_bytes as f64 + n_moe * per_expert * (touched - k);
        let floor_b = bytes / copy;
        for graphed in [false, true] {
            // Three warm-up steps (the graphed run captures its graph in the first).
            for _ in 0..3 {
                step(pos, graphed.then_some(&mut graphs))?;
                pos += 1;
            }
            let mut times = Vec::new();
            for _ in 0..args.steps {
                let start = Instant::now();
                step(pos, graphed.then_some(&mut graphs))?;
                times.push(start.elapsed().as_secs_f64());
                pos += 1;
            }
            let step_s = median(times);
            if batch == 1 {
                best_batch1_ratio = best_batch1_ratio.min(step_s / floor_b);
            }
            println!(
                "| {context} | {batch}{} | {:.2} | {:.0} | {:.3} | {:.2}x | | | | | |{}",
                if graphed { " graph" } else { "" },
                step_s * 1e3,
                batch as f64 / step_s,
                floor_b * 1e3,
                step_s / floor_b,
                percent_of_copy(step_s, floor_b)
            );
        }
        let stats = graphs.stats();
        graph_notes.push(match &stats.last_eager_reason {
            Some(why) if stats.replayed == 0 => {
                format!("batch {batch}: no graph, every step eager: {why}")
            }
            _ => format!(
                "batch {batch}: {} graph(s) captured, {} steps replayed, {} eager",
                stats.captured, stats.replayed, stats.eager
            ),
        });
    }
    for note in graph_notes {
        println!("({note})");
    }
    println!("(pool rows: paged pool, blocks of {DEFAULT_BLOCK_SIZE}, eager and `graph` (forward_batch_graphed: each step replayed from a CUDA graph); tok/s counts every sequence's token; the floor takes the experts a uniform router touches in expectation)");

    // Projection to the full model: its weight-byte floor times the slice's batch-1 measured/floor. (The
    // profiled split would scale every part alike, but its synchronisations slow the launch-bound parts
    // most, which put the projection below the floor.)
    let mut full = glm5::Config::from_json(include_str!("../../tests/assets/glm5_config.json"))
        .map_err(cuda)?;
    full.quantization = config.quantization.clone();
    let (full_bytes, _) =
        decode_weight_bytes(&full, DType::BF16, &checkpoint, args.fp8_projections);
    let full_floor_ms = full_bytes as f64 / copy * 1e3;
    let projected_ms = full_floor_ms * best_batch1_ratio;
    if best_batch1_ratio.is_finite() {
        println!(
            "projection, all {} layers, batch 1: {projected_ms:.1} ms/token ({:.1} tok/s) = the floor ({full_floor_ms:.1} ms for {:.0} GB of {} at this GPU's copy rate) x the slice's best batch-1 measured/floor ({best_batch1_ratio:.2}x); over 8 GPUs by layers the same time per token plus 7 hidden-state hops",
            full.num_hidden_layers,
            1e3 / projected_ms,
            full_bytes as f64 / 1e9,
            args.weights.label()
        );
    }

    if args.mtp {
        let context = args.contexts.first().copied().unwrap_or(args.prefill);
        let projected = best_batch1_ratio.is_finite().then_some(projected_ms);
        mtp_rows(&model, config.vocab_size, context, args.steps, projected)?;
    }

    if let Some(script) = &args.hf_script {
        drop(model);
        device.synchronize()?;
        let out = Command::new("python3")
            .arg(script)
            .arg("--layers")
            .arg(args.layers.to_string())
            .arg("--context")
            .arg(args.contexts.first().copied().unwrap_or(4096).to_string())
            .arg("--steps")
            .arg(args.steps.to_string())
            .arg("--prefill")
            .arg(args.prefill.to_string())
            .output()
            .map_err(cuda)?;
        let text = String::from_utf8_lossy(&out.stdout);
        print!("{text}");
        if !out.status.success() {
            println!("HF run failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        // The script's last line: {"context": C, "decode_ms": D, "prefill_ms": P}.
        let last = text.lines().last().unwrap_or("");
        if let Ok(hf) = serde_json::from_str::<serde_json::Value>(last) {
            let context = hf["context"].as_u64().unwrap_or(0) as usize;
            if let (Some(hf_decode), Some((_, ours))) = (
                hf["decode_ms"].as_f64(),
                decode_ms_by_context.iter().find(|(c, _)| *c == context),
            ) {
                println!(
                    "vs HF transformers, decode batch 1 at context {context}: HF {hf_decode:.2} ms, glm5 {ours:.2} ms: glm5 {:.2}x faster",
                    hf_decode / ours
                );
            }
            if let Some(hf_prefill) = hf["prefill_ms"].as_f64() {
                println!(
                    "vs HF transformers, prefill {}: HF {hf_prefill:.1} ms, glm5 {prefill_ms:.1} ms: glm5 {:.2}x faster",
                    args.prefill,
                    hf_prefill / prefill_ms
                );
            }
        }
    }
    Ok(())
}
