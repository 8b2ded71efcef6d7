//! The runtime side of the graph-build pass: reading what the user asks for (devices, real or assumed,
//! a per-layer device map, forced backends from the CLI or `GLM5_BACKEND`) and printing a [`Plan`] as
//! `glm5 plan` does. The pass itself (placement + dispatch) is `glm5_models::plan`; the registry
//! `glm5_ops::registry`.
//!
//! Formats:
//! * assumed devices: comma-separated groups `ARCH:SIZE[ xCOUNT]`, e.g. `sm_120:96GB x8`,
//!   `sm_90:141GB x2,cpu:512GB`; CUDA devices are numbered `cuda:0..` in order.
//! * real devices: `cpu`, `cuda:N`, comma-separated.
//! * layer map: comma-separated `FIRST-LAST=DEVICE` or `LAYER=DEVICE`, DEVICE a name from the device list
//!   (its first occurrence) or `#INDEX`; every layer must be mapped.
//! * forced backends: `OP=NAME`, repeatable on the CLI, comma-separated in `GLM5_BACKEND`. The CLI (or the
//!   API's `LoadOptions::backends`) wins over the variable for the same op.

use glm5_ops::KeyFormat;
use std::collections::BTreeMap;
use std::fmt::Write;

use candle_core::Device;
use glm5_models::{fmt_bytes, Config, Plan};
use glm5_ops::registry::{dtype_name, parse_forced};
use glm5_ops::{DeviceDesc, DeviceFamily, Op, Registry};

use crate::error::{Error, Result};
use crate::AttentionMode;

/// The environment variable naming forced backends (`sparse_mla=reference,dsa_indexer=reference`).
pub const BACKEND_ENV: &str = "GLM5_BACKEND";

fn invalid(what: &str, text: &str, reason: impl std::fmt::Display) -> Error {
    Error::InvalidOption(format!("{what} {text:?}: {reason}"))
}

/// Most devices `--assume` may describe (a rack of 8-GPU hosts is far below).
pub const MAX_ASSUMED_DEVICES: usize = 4096;

/// Parses assumed devices (module docs).
pub fn parse_assumed(text: &str) -> Result<Vec<DeviceDesc>> {
    let mut devices = Vec::new();
    let mut ordinal = 0;
    for group in text.split(',').map(str::trim).filter(|g| !g.is_empty()) {
        let (spec, count) = match group.rsplit_once(['x', 'X']) {
            Some((spec, n))
                if !n.trim().is_empty() && n.trim().chars().all(|c| c.is_ascii_digit()) =>
            {
                let count: usize = n
                    .trim()
                    .parse()
                    .map_err(|e| invalid("--assume", group, e))?;
                (spec.trim(), count)
            }
            _ => (group, 1),
        };
        if count == 0 {
            return Err(invalid("--assume", group, "the count must be at least 1"));
        }
        // A plan is built per device: an absurd count would allocate and place without end.
        if count > MAX_ASSUMED_DEVICES - devices.len() {
            return Err(invalid(
                "--assume",
                group,
                format!("more than {MAX_ASSUMED_DEVICES} devices in all"),
            ));
        }
        for _ in 0..count {
            let device = DeviceDesc::assume(spec, ordinal)?;
            if !device.is_cpu() {
                ordinal += 1;
            }
            devices.push(device);
        }
    }
    if devices.is_empty() {
        return Err(invalid("--assume", text, "no device given"));
    }
    Ok(devices)
}

/// Parses one real device: `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(spec: &str) -> Result<Device> {
    let spec = spec.trim();
    if spec == "cpu" {
        return Ok(Device::Cpu);
    }
    let ordinal = spec
        .strip_prefix("cuda:")
        .or_else(|| (spec == "cuda").then_some("0"))
        .and_then(|n| n.parse::<usize>().ok())
        .ok_or_else(|| invalid("device", spec, "expected cpu or cuda:N"))?;
    if !candle_core::utils::cuda_is_available() {
        return Err(invalid(
            "device",
            spec,
            "this glm5 was built without CUDA (rebuild with --features cuda)",
        ));
    }
    Device::new_cuda(ordinal).map_err(|e| invalid("device", spec, e))
}

/// Turns cudarc's event tracking off on every CUDA device of `devices`. Tracking makes every allocation
/// create two CUDA events and every launch wait on and record the events of each buffer it touches: driver
/// calls on the host's critical path of a decode step. glm5 needs none of it: each GPU's work runs on one
/// thread's stream (`glm5 serve` synchronises before its engine thread takes the model), and the model
/// orders its hidden-state copies between GPUs itself (the receiving stream waits for the sender's work,
/// the sender for the copy).
pub fn without_event_tracking(devices: &[Device]) {
    for device in devices {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(cuda) = device {
            // SAFETY: per the rule above, no tensor is used on two streams without an ordering between.
            unsafe { cuda.disable_event_tracking() };
        }
        let _ = device;
    }
}

/// Parses a comma-separated device list.
pub fn parse_devices(text: &str) -> Result<Vec<Device>> {
    text.split(',')
        .filter(|d| !d.trim().is_empty())
        .map(parse_device)
        .collect()
}

/// Parses a layer map against the device names (module docs) into a device index per layer.
pub fn parse_layer_map(text: &str, device_names: &[String], layers: usize) -> Result<Vec<usize>> {
    let mut map: Vec<Option<usize>> = vec![None; layers];
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (range, device) = part
            .split_once('=')
            .ok_or_else(|| invalid("--layer-map", part, "expected LAYERS=DEVICE"))?;
        let device = device.trim();
        let index = match device.strip_prefix('#') {
            Some(i) => i.parse::<usize>().ok().filter(|&i| i < device_names.len()),
            None => device_names.iter().position(|n| n == device),
        }
        .ok_or_else(|| {
            invalid(
                "--layer-map",
                part,
                format!("no device {device:?} among [{}]", device_names.join(", ")),
            )
        })?;
        let bound = |s: &str| {
            s.trim()
                .parse::<usize>()
                .ok()
                .filter(|&l| l < layers)
                .ok_or_else(|| {
                    invalid(
                        "--layer-map",
                        part,
                        format!("layers are numbered 0..{layers}"),
                    )
                })
        };
        let (first, last) = match range.split_once('-') {
            Some((a, b)) => (bound(a)?, bound(b)?),
            None => (bound(range)?, bound(range)?),
        };
        if first > last {
            return Err(invalid("--layer-map", part, "the range is reversed"));
        }
        for slot in &mut map[first..=last] {
            *slot = Some(index);
        }
    }
    map.iter()
        .enumerate()
        .map(|(layer, d)| {
            d.ok_or_else(|| invalid("--layer-map", text, format!("layer {layer} is not mapped")))
        })
        .collect()
}

/// Forced backends: `explicit` (CLI / API) over the comma-separated `env` value (of [`BACKEND_ENV`]).
pub fn forced_backends(
    explicit: &BTreeMap<Op, String>,
    env: Option<&str>,
) -> Result<BTreeMap<Op, String>> {
    let mut forced = BTreeMap::new();
    for item in env
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|i| !i.is_empty())
    {
        let (op, name) = parse_forced(item)?;
        forced.insert(op, name);
    }
    forced.extend(explicit.iter().map(|(op, name)| (*op, name.clone())));
    Ok(forced)
}

/// `0-4, 7, 9-12`.
fn ranges(items: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < items.len() {
        let mut j = i;
        while j + 1 < items.len() && items[j + 1] == items[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            items[i].to_string()
        } else {
            format!("{}-{}", items[i], items[j])
        });
        i = j + 1;
    }
    out.join(", ")
}

fn count(n: u64) -> String {
    let n = n as f64;
    for (unit, scale) in [("B", 1e9), ("M", 1e6), ("K", 1e3)] {
        if n >= scale {
            return format!("{:.2} {unit}", n / scale);
        }
    }
    format!("{n}")
}

/// The plan as `glm5 plan` prints it: header, one row per layer, why every other backend was not chosen
/// (grouped over the layers that share the reasons), the priority orders used, and totals per device.
pub fn render(plan: &Plan, config: &Config, label: &str, registry: &Registry) -> String {
    let mut s = String::new();
    let n = plan.layers.len();
    let attention = match plan.attention {
        AttentionMode::Sparse => "sparse attention (DSA)".to_string(),
        AttentionMode::Dense => {
            "DENSE attention (debug / quality-comparison mode, not the model as trained)"
                .to_string()
        }
    };
    let _ = writeln!(
        s,
        "plan for {label}: {n} layers, {} weights and KV cache ({} indexer keys), {attention}, KV cache reserved for {} tokens",
        dtype_name(plan.dtype),
        match plan.index_keys {
            KeyFormat::Float => dtype_name(plan.dtype),
            KeyFormat::Fp8E4m3 => "FP8".to_string(),
        },
        plan.context
    );
    let _ = writeln!(s, "devices:");
    for d in &plan.devices {
        let _ = writeln!(s, "  {d}: {}", fmt_bytes(d.memory_bytes));
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "{:>5}  {:<8} {:<6} {:<5} {:>10} {:>10} {:>11}  {:<16} dsa_indexer",
        "layer", "device", "mlp", "dtype", "params", "weights", "KV/1K tok", "sparse_mla"
    );
    for l in plan.all_layers() {
        let backend = |op| l.op(op).map_or("-", |o| o.backend());
        let _ = writeln!(
            s,
            "{:>5}  {:<8} {:<6} {:<5} {:>10} {:>10} {:>11}  {:<16} {}",
            match l.layer == n {
                true => format!("MTP {n}"),
                false => l.layer.to_string(),
            },
            plan.devices[l.device].name,
            format!("{:?}", l.mlp).to_lowercase(),
            dtype_name(l.dtype),
            count(l.params),
            fmt_bytes(l.weight_bytes),
            fmt_bytes(l.cache_bytes_per_token * 1000),
            backend(Op::SparseMla),
            backend(Op::DsaIndexer),
        );
    }
    let _ = writeln!(
        s,
        "embeddings on {}, final norm + lm_head{} on {}",
        plan.devices[plan.embed_device].name,
        if plan.mtp.is_some() {
            " + the MTP layer (speculative decoding's draft)"
        } else {
            ""
        },
        plan.devices[plan.head_device].name
    );
    for (at, from, to) in plan.boundaries() {
        let what = if at == n {
            "lm_head".to_string()
        } else {
            format!("layer {at}")
        };
        let _ = writeln!(
            s,
            "  hidden state moves {} -> {} before {what}",
            plan.devices[from].name, plan.devices[to].name
        );
    }

    // Why the other backends were not chosen, grouped by identical text.
    let _ = writeln!(s, "\nbackends not chosen, and why:");
    for op in Op::ALL {
        let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
        for l in plan.all_layers() {
            let text = match l.op(op).and_then(|o| o.choice.as_ref()) {
                None => "    (not run: dense mode skips the indexer)\n".to_string(),
                Some(choice) if choice.rejected.is_empty() => {
                    format!(
                        "    (none: {} is the only {op} backend)\n",
                        choice.entry.name
                    )
                }
                Some(choice) => {
                    let mut t = String::new();
                    if choice.forced {
                        let _ = writeln!(t, "    {} was forced", choice.entry.name);
                    }
                    for r in &choice.rejected {
                        let _ = writeln!(t, "    {r}");
                    }
                    t
                }
            };
            match groups.iter_mut().find(|(t, _)| *t == text) {
                Some((_, layers)) => layers.push(l.layer),
                None => groups.push((text, vec![l.layer])),
            }
        }
        for (text, layers) in groups {
            let _ = write!(s, "  {op}, layers {}:\n{text}", ranges(&layers));
        }
    }
    let mut families: Vec<DeviceFamily> = plan.devices.iter().map(DeviceDesc::family).collect();
    families.sort();
    families.dedup();
    for family in families {
        let orders: Vec<String> = Op::ALL
            .iter()
            .map(|&op| {
                let names: Vec<&str> = registry.order(op, family).iter().map(|e| e.name).collect();
                format!("{op}: {}", names.join(" > "))
            })
            .collect();
        let _ = writeln!(s, "priority on {family}: {}", orders.join("; "));
    }

    let _ = writeln!(s, "\nper device:");
    let _ = writeln!(
        s,
        "{:<8} {:<10} {:>10} {:>10} {:>14} {:>10} {:>14}",
        "device",
        "layers",
        "params",
        "weights",
        format!("KV {} tok", plan.context),
        "free",
        "max context"
    );
    let usage = plan.device_usage();
    for u in &usage {
        let _ = writeln!(
            s,
            "{:<8} {:<10} {:>10} {:>10} {:>14} {:>10} {:>14}",
            plan.devices[u.device].name,
            if u.layers.is_empty() {
                "-".to_string()
            } else {
                ranges(&u.layers)
            },
            count(u.params),
            fmt_bytes(u.weight_bytes),
            fmt_bytes(u.cache_bytes),
            fmt_bytes(u.free_bytes),
            u.max_context_tokens
                .map_or("-".to_string(), |t| format!("{t} tok")),
        );
    }
    let free: u64 = usage.iter().map(|u| u.free_bytes).sum();
    let _ = writeln!(
        s,
        "{:<8} {:<10} {:>10} {:>10} {:>14} {:>10}",
        "total",
        format!("0-{}", n.saturating_sub(1)),
        count(plan.params()),
        fmt_bytes(plan.weight_bytes()),
        fmt_bytes(plan.cache_bytes_per_token() * plan.context as u64),
        fmt_bytes(free),
    );
    let _ = writeln!(
        s,
        "weights: {} B ({:.3} TB decimal) for {} parameters ({:.4} bytes each)",
        plan.weight_bytes(),
        plan.weight_bytes() as f64 / 1e12,
        plan.params(),
        plan.weight_bytes() as f64 / plan.params().max(1) as f64
    );
    let context_limit = usage
        .iter()
        .filter_map(|u| u.max_context_tokens)
        .min()
        .unwrap_or(0);
    let _ = writeln!(
        s,
        "KV cache: {} per token, {} per 1K tokens (all layers); the memory left holds up to {} tokens of context{}",
        fmt_bytes(plan.cache_bytes_per_token()),
        fmt_bytes(plan.cache_bytes_per_token() * 1000),
        context_limit,
        if context_limit > config.max_position_embeddings as u64 {
            format!(
                "; the model's own limit is {} tokens",
                config.max_position_embeddings
            )
        } else {
            String::new()
        }
    );
    if plan.devices.iter().any(|d| !d.is_cpu()) {
        use glm5_ops::moe::{GGUF_MATVEC_MAX_TOKENS, GROUPED_GEMM_MIN_TOKENS, MATVEC_MAX_TOKENS};
        let _ = writeln!(
            s,
            "\nMoE experts on CUDA, by tokens a step: bf16/f32 experts by glm5's grouped mat-vecs below \
             {GROUPED_GEMM_MIN_TOKENS}, cuBLAS's grouped GEMM from {GROUPED_GEMM_MIN_TOKENS}; FP8 / NVFP4 / \
             i-quant / Q4_K experts by the mat-vecs up to {MATVEC_MAX_TOKENS} (Q4_K with bf16 activations on the \
             tensor cores), then dequantised + the grouped GEMM; the other GGUF K-quants and Q8_0 (and a layer \
             mixing them with Q4_K) by candle-nn's GGUF MoE kernels (mat-vec up to {GGUF_MATVEC_MAX_TOKENS}, \
             WMMA above)"
        );
        let mut used: Vec<usize> = plan.layers.iter().map(|l| l.device).collect();
        used.sort_unstable();
        used.dedup();
        let on_cpu = used.iter().filter(|&&d| plan.devices[d].is_cpu()).count();
        let _ = writeln!(
            s,
            "decode steps on CUDA: generate and serve replay them from CUDA graphs (one per batch size \
             and block-table width, a graph per GPU's run of layers{}) when every layer is on a GPU and the \
             step's experts run on the mat-vecs (the grouped GEMM counts each expert's rows on the host); \
             otherwise, or with `--enforce-eager`, each op is launched from the host (eager){}",
            match used.len() {
                1 => String::new(),
                n => format!("; here {n} devices, the hidden state handed between their graphs"),
            },
            match on_cpu {
                0 => String::new(),
                _ => "; here eager: layers on the CPU".to_string(),
            }
        );
    }
    s
}

/// One quantised weight format a model multiplies by, as `glm5 plan` reports its backends: the format, how
/// many tensors use it, and one tensor's `[out, in]` (backends limit `in`).
#[derive(Debug, Clone)]
pub struct QuantisedWeights {
    /// The format.
    pub format: WeightFormat,
    /// Tensors stored in it.
    pub tensors: usize,
    /// Rows of one of them.
    pub out_dim: usize,
    /// Columns (the reduction) of one of them.
    pub in_dim: usize,
}

/// The quantised formats the ops serve.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum WeightFormat {
    /// A GGUF block type candle's `QMatMul` computes with, and its ggml name.
    Gguf(candle_core::quantized::GgmlDType, &'static str),
    /// A GGUF i-quant (`gguf_matmul`).
    GgufBlocks(glm5_ops::gguf_matmul::GgufFormat),
    /// Block-scaled FP8 (`fp8_matmul`).
    Fp8 {
        /// `[block_out, block_in]`.
        block: [usize; 2],
    },
    /// NVFP4 (`nvfp4_matmul`).
    Nvfp4,
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WeightFormat::Gguf(_, name) => f.write_str(name),
            WeightFormat::GgufBlocks(t) => write!(f, "{t}"),
            WeightFormat::Fp8 { block } => write!(f, "FP8 ({}x{} blocks)", block[0], block[1]),
            WeightFormat::Nvfp4 => write!(f, "NVFP4"),
        }
    }
}

/// The backend of each quantised weight format on each kind of device, and why the others were not chosen
/// (the dispatch the model runs per weight when it is built), as the lines `glm5 plan` prints.
pub fn render_weight_backends(devices: &[DeviceDesc], weights: &[QuantisedWeights]) -> String {
    use glm5_ops::weight_only::{self, Rows, WeightShape};
    let mut out = String::new();
    if weights.is_empty() {
        return out;
    }
    // Devices of one kind get one line.
    let mut kinds: Vec<(DeviceDesc, Vec<String>)> = Vec::new();
    for d in devices {
        match kinds
            .iter_mut()
            .find(|(k, _)| k.family() == d.family() && k.capability() == d.capability())
        {
            Some((_, names)) => names.push(d.name.clone()),
            None => kinds.push((d.clone(), vec![d.name.clone()])),
        }
    }
    let reasons_text = |reasons: &[glm5_ops::Reason]| {
        reasons
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    };
    let _ = writeln!(
        out,
        "\nquantised weights (a backend per format and device, chosen when the model is built):"
    );
    for w in weights {
        for (device, names) in &kinds {
            let on = format!("{} on {}", w.format, names.join(","));
            let count = format!(
                "{} tensor{}",
                w.tensors,
                if w.tensors == 1 { "" } else { "s" }
            );
            let line = match w.format {
                WeightFormat::Gguf(format, _) => {
                    match glm5_ops::quantized_matmul::dispatch(format, device) {
                        Ok(chosen) => {
                            let others: Vec<String> = glm5_ops::quantized_matmul::backends()
                                .into_iter()
                                .filter(|b| b.name != chosen.name)
                                .map(|b| match b.validate(format, device) {
                                    Ok(()) => format!("{}: ranked below", b.name),
                                    Err(r) => format!("{}: {}", b.name, reasons_text(&r)),
                                })
                                .collect();
                            format!(
                                "{on} ({count}): {} (not chosen: {})",
                                chosen.name,
                                others.join(" | ")
                            )
                        }
                        Err(e) => format!("{on} ({count}): CANNOT RUN: {e}"),
                    }
                }
                _ => {
                    let (op, backends, [block_out, block_in]) = match w.format {
                        WeightFormat::GgufBlocks(f) => (
                            "gguf_matmul",
                            glm5_ops::gguf_matmul::backends(),
                            [1, f.block_values()],
                        ),
                        WeightFormat::Fp8 { block } => {
                            ("fp8_matmul", glm5_ops::fp8_matmul::backends(), block)
                        }
                        WeightFormat::Nvfp4 => (
                            "nvfp4_matmul",
                            glm5_ops::nvfp4_matmul::backends(),
                            [1, glm5_ops::nvfp4_matmul::GROUP],
                        ),
                        WeightFormat::Gguf(..) => unreachable!("handled above"),
                    };
                    let shape = WeightShape {
                        out_dim: w.out_dim,
                        in_dim: w.in_dim,
                        block_in,
                        block_out,
                    };
                    match weight_only::dispatch_rows(op, backends.clone(), &shape, device) {
                        Ok(choice) => {
                            // (backend, why, row classes it was not chosen for), one entry per reason.
                            let mut rejected: Vec<(&str, String, Vec<Rows>)> = Vec::new();
                            for rows in Rows::ALL {
                                let chosen = choice.for_rows(rows).name;
                                for b in backends.iter().filter(|b| b.name != chosen) {
                                    let why = match b.validate(&shape, device, rows) {
                                        Ok(()) => "ranked below".to_string(),
                                        Err(r) => reasons_text(&r),
                                    };
                                    match rejected
                                        .iter_mut()
                                        .find(|(n, w, _)| *n == b.name && *w == why)
                                    {
                                        Some((_, _, classes)) => classes.push(rows),
                                        None => rejected.push((b.name, why, vec![rows])),
                                    }
                                }
                            }
                            let others: Vec<String> = rejected
                                .into_iter()
                                .map(|(name, why, classes)| {
                                    if classes.len() == Rows::ALL.len() {
                                        format!("{name}: {why}")
                                    } else {
                                        format!("{name} for {}: {why}", classes[0])
                                    }
                                })
                                .collect();
                            format!(
                                "{on} ({count}): decode {}, prefill {} (not chosen: {})",
                                choice.decode.name,
                                choice.prefill.name,
                                others.join(" | ")
                            )
                        }
                        Err(e) => format!("{on} ({count}): CANNOT RUN: {e}"),
                    }
                }
            };
            let _ = writeln!(out, "  {line}");
        }
    }
    out
}
