//! The backend registry and the dispatch rule (`docs/architecture.md`, "Choosing a backend").
//!
//! # Contract
//!
//! * Every implementation of every op is one [`Entry`]: its name, the function that runs it ([`Kernel`],
//!   which also fixes the [`Op`]), what it serves ([`Serves`]: devices and compute capabilities, dtypes,
//!   head counts, head dims, value dims, top-k, cache layouts and block sizes), an optional extra check for
//!   limits that depend on the device (shared memory), and its rank in the priority order of each
//!   [`DeviceFamily`] (lower runs first; a family it does not list uses it only when forced).
//! * [`Entry::validate`] answers `Ok(())` or **every** [`Reason`] it cannot serve an [`OpSpec`] on a
//!   [`DeviceDesc`], never just a bool.
//! * [`Registry::dispatch`] is the one rule, a pure function of (registry, spec, device, forced name):
//!   a forced backend is used if it validates, else dispatch fails with its reasons; otherwise the valid
//!   entry of lowest rank for the device's family wins (ties: registration order); if none is valid,
//!   dispatch fails with every candidate's reasons. The result ([`Choice`]) carries, for every backend not
//!   chosen, why ([`Rejection`]). Nothing here falls back to another op (dense attention is the caller's
//!   explicit mode, never a dispatch outcome).
//! * [`Registry::builtin`] (`builtin.rs`) gathers the entries each op folder declares (`sparse_mla/entries.rs`,
//!   `dsa_indexer/entries.rs`); adding a backend is adding one entry there, or [`Registry::register`] from
//!   outside the crate. This file knows no op folder: they depend on it, not it on them. The ops' public
//!   functions dispatch over their own entries (`OpDispatch`).
//!
//! The model runs dispatch once per layer and op when its graph is built and keeps the chosen [`Kernel`]
//! function: the forward pass does no selection.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Mutex, OnceLock};

use candle_core::{DType, DeviceLocation, Tensor};

use crate::device::{DeviceDesc, DeviceFamily, DeviceKind};

/// The ops that have a registry entry per implementation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    SparseMla,
    DsaIndexer,
}

impl Op {
    pub const ALL: [Op; 2] = [Op::SparseMla, Op::DsaIndexer];

    /// The op's name as the CLI and the plan write it.
    pub fn name(self) -> &'static str {
        match self {
            Op::SparseMla => "sparse_mla",
            Op::DsaIndexer => "dsa_indexer",
        }
    }

    pub fn from_name(name: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|op| op.name() == name)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How the op reads its cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheLayout {
    /// One `[N, D]` tensor per sequence.
    Contiguous,
    /// Fixed-size blocks and a block table.
    Paged { block_size: usize },
}

impl fmt::Display for CacheLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CacheLayout::Contiguous => f.write_str("contiguous"),
            CacheLayout::Paged { block_size } => write!(f, "paged (block {block_size})"),
        }
    }
}

/// What one layer asks of one op.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OpSpec {
    pub op: Op,
    /// dtype of the inputs and the cache.
    pub dtype: DType,
    /// sparse_mla: query heads; dsa_indexer: indexer heads.
    pub heads: usize,
    /// sparse_mla: latent row width `D = kv_lora_rank + qk_rope_head_dim`; dsa_indexer: `index_head_dim`.
    pub head_dim: usize,
    /// sparse_mla: value width (`kv_lora_rank`); `None` for ops without values.
    pub value_dim: Option<usize>,
    /// Rows read per query: `index_topk`, or every cached position in dense mode.
    pub top_k: usize,
    pub layout: CacheLayout,
    /// dsa_indexer: how the key cache stores keys (float for ops without an indexer key cache).
    pub key_format: crate::KeyFormat,
}

/// A limit on one size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Limit {
    Any,
    OneOf(Vec<usize>),
    /// `min..=max`.
    Range {
        min: usize,
        max: usize,
    },
    MultipleOf(usize),
}

impl Limit {
    pub fn admits(&self, value: usize) -> bool {
        match self {
            Limit::Any => true,
            Limit::OneOf(values) => values.contains(&value),
            Limit::Range { min, max } => (*min..=*max).contains(&value),
            Limit::MultipleOf(n) => *n > 0 && value.is_multiple_of(*n),
        }
    }
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Limit::Any => f.write_str("any value"),
            Limit::OneOf(values) => {
                let list: Vec<String> = values.iter().map(usize::to_string).collect();
                write!(f, "∈ {{{}}}", list.join(","))
            }
            Limit::Range { min, max } => write!(f, "in {min}..={max}"),
            Limit::MultipleOf(n) => write!(f, "a multiple of {n}"),
        }
    }
}

/// Compute capabilities a CUDA backend runs on: `major.minor`, or every minor of `major` when `minor` is
/// `None` (PTX JIT-compiled within the major version).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arch {
    pub major: u32,
    pub minor: Option<u32>,
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.minor {
            Some(minor) => write!(f, "{}.{minor}", self.major),
            None => write!(f, "{}.x", self.major),
        }
    }
}

/// The devices a backend runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceMatch {
    /// Any device candle runs on (backends built from candle tensor ops).
    Any,
    Cpu,
    /// CUDA devices of these compute capabilities.
    Cuda(Vec<Arch>),
}

/// The declared capabilities of one backend.
#[derive(Debug, Clone, PartialEq)]
pub struct Serves {
    pub devices: DeviceMatch,
    pub dtypes: Vec<DType>,
    pub heads: Limit,
    pub head_dims: Limit,
    /// Ignored for ops without values.
    pub value_dims: Limit,
    pub top_k: Limit,
    pub contiguous_cache: bool,
    /// Block sizes of a paged cache it reads; `None`: no paged cache.
    pub paged_block_sizes: Option<Limit>,
    /// Key cache formats it reads (dsa_indexer).
    pub key_formats: Vec<crate::KeyFormat>,
}

impl Serves {
    /// Serves every shape and float dtype on every device (candle-op references).
    pub fn anything() -> Self {
        Self {
            devices: DeviceMatch::Any,
            dtypes: vec![DType::F32, DType::BF16, DType::F16, DType::F64],
            heads: Limit::Any,
            head_dims: Limit::Any,
            value_dims: Limit::Any,
            top_k: Limit::Any,
            contiguous_cache: true,
            paged_block_sizes: Some(Limit::Any),
            key_formats: vec![crate::KeyFormat::Float, crate::KeyFormat::Fp8E4m3],
        }
    }
}

/// One reason a backend cannot serve a spec on a device: "needs {what} {needs}, got {got}".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reason {
    pub what: &'static str,
    pub needs: String,
    pub got: String,
}

impl Reason {
    pub fn new(what: &'static str, needs: impl fmt::Display, got: impl fmt::Display) -> Self {
        Self {
            what,
            needs: needs.to_string(),
            got: got.to_string(),
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "needs {} {}, got {}", self.what, self.needs, self.got)
    }
}

/// `sparse_mla(q, latent_cache, indices, value_dim, softmax_scale) -> (out, lse)` (contract: `sparse_mla/mod.rs`).
pub type SparseMlaFn = fn(&Tensor, &Tensor, &Tensor, usize, f64) -> crate::Result<(Tensor, Tensor)>;
/// `dsa_indexer(q_index, head_weights, keys, visible_keys, top_k) -> indices` (contract: `dsa_indexer/mod.rs`).
pub type DsaIndexerFn =
    fn(&Tensor, &Tensor, crate::IndexKeys, &[usize], usize) -> crate::Result<Tensor>;
/// Limits that depend on the device as well as the spec (e.g. shared memory); returns every violated one.
pub type ExtraCheck = fn(&OpSpec, &DeviceDesc) -> Vec<Reason>;

/// The function a backend runs; its variant is the op it implements.
#[derive(Debug, Clone, Copy)]
pub enum Kernel {
    SparseMla(SparseMlaFn),
    DsaIndexer(DsaIndexerFn),
}

impl Kernel {
    pub fn op(&self) -> Op {
        match self {
            Kernel::SparseMla(_) => Op::SparseMla,
            Kernel::DsaIndexer(_) => Op::DsaIndexer,
        }
    }
}

/// One implementation of one op.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Unique per op; what `--backend op=name` names.
    pub name: &'static str,
    pub description: &'static str,
    pub kernel: Kernel,
    pub serves: Serves,
    pub extra_check: Option<ExtraCheck>,
    /// Rank per device family, lower first; a family not listed uses this backend only when forced.
    pub priority: Vec<(DeviceFamily, u32)>,
}

impl Entry {
    pub fn op(&self) -> Op {
        self.kernel.op()
    }

    /// Rank in `family`'s priority order, if listed there.
    pub fn rank(&self, family: DeviceFamily) -> Option<u32> {
        self.priority
            .iter()
            .find(|(f, _)| *f == family)
            .map(|&(_, rank)| rank)
    }

    /// `Ok` if this backend serves `spec` on `device`, else every reason it does not.
    pub fn validate(&self, spec: &OpSpec, device: &DeviceDesc) -> Result<(), Vec<Reason>> {
        let mut reasons = Vec::new();
        if spec.op != self.op() {
            reasons.push(Reason::new("op", self.op(), spec.op));
        }
        let s = &self.serves;
        match (&s.devices, device.kind) {
            (DeviceMatch::Any, _) | (DeviceMatch::Cpu, DeviceKind::Cpu) => {}
            (DeviceMatch::Cpu, DeviceKind::Cuda { .. }) => {
                reasons.push(Reason::new("device", "cpu", &device.name))
            }
            (DeviceMatch::Cuda(archs), DeviceKind::Cuda { capability, .. }) => {
                let ok = archs.iter().any(|a| {
                    a.major == capability.major && a.minor.is_none_or(|m| m == capability.minor)
                });
                if !ok {
                    reasons.push(Reason::new(
                        "compute capability",
                        format!("∈ {{{}}}", join(archs)),
                        format!("{}.{}", capability.major, capability.minor),
                    ));
                }
            }
            (DeviceMatch::Cuda(archs), DeviceKind::Cpu) => reasons.push(Reason::new(
                "device",
                format!("CUDA with compute capability ∈ {{{}}}", join(archs)),
                "cpu",
            )),
        }
        if !s.dtypes.contains(&spec.dtype) {
            let names: Vec<String> = s.dtypes.iter().map(|d| dtype_name(*d)).collect();
            reasons.push(Reason::new(
                "dtype",
                format!("∈ {{{}}}", names.join(",")),
                dtype_name(spec.dtype),
            ));
        }
        let mut limit = |what, limit: &Limit, value| {
            if !limit.admits(value) {
                reasons.push(Reason::new(what, limit, value));
            }
        };
        limit("heads", &s.heads, spec.heads);
        limit("head dim", &s.head_dims, spec.head_dim);
        if let Some(value_dim) = spec.value_dim {
            limit("value dim", &s.value_dims, value_dim);
        }
        limit("top-k", &s.top_k, spec.top_k);
        match (spec.layout, &s.paged_block_sizes) {
            (CacheLayout::Contiguous, _) if s.contiguous_cache => {}
            (CacheLayout::Contiguous, _) => {
                reasons.push(Reason::new("cache layout", "paged", "contiguous"))
            }
            (CacheLayout::Paged { block_size }, Some(sizes)) => {
                if !sizes.admits(block_size) {
                    reasons.push(Reason::new("block size", sizes, block_size));
                }
            }
            (CacheLayout::Paged { .. }, None) => {
                reasons.push(Reason::new("cache layout", "contiguous", spec.layout))
            }
        }
        if !s.key_formats.contains(&spec.key_format) {
            let formats: Vec<&str> = s.key_formats.iter().map(|f| f.name()).collect();
            reasons.push(Reason::new(
                "key cache format",
                format!("∈ {{{}}}", formats.join(",")),
                spec.key_format,
            ));
        }
        if let Some(check) = self.extra_check {
            reasons.extend(check(spec, device));
        }
        if reasons.is_empty() {
            Ok(())
        } else {
            Err(reasons)
        }
    }
}

/// `bf16`, `f32`, ... as users write them.
pub fn dtype_name(dtype: DType) -> String {
    format!("{dtype:?}").to_ascii_lowercase()
}

fn join(items: &[impl fmt::Display]) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Why a backend was not chosen.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// It cannot serve the spec on this device.
    Invalid(Vec<Reason>),
    /// Valid, but a backend ranked before it was chosen.
    Outranked { by: &'static str },
    /// Valid, but not in this family's priority order: used only when forced.
    NotListed { family: DeviceFamily },
    /// Valid, but the user forced another backend.
    NotForced { forced: &'static str },
}

/// A backend that was not chosen, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Rejection {
    pub backend: &'static str,
    pub verdict: Verdict,
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.backend)?;
        match &self.verdict {
            Verdict::Invalid(reasons) => f.write_str(&reasons_text(reasons)),
            Verdict::Outranked { by } => write!(f, "valid, ranked below {by}"),
            Verdict::NotListed { family } => {
                write!(
                    f,
                    "valid, not in the {family} priority order (used only when forced)"
                )
            }
            Verdict::NotForced { forced } => write!(f, "valid, not used: {forced} was forced"),
        }
    }
}

/// The outcome of dispatch for one op of one layer.
#[derive(Debug, Clone)]
pub struct Choice {
    pub entry: Entry,
    /// Chosen because the user forced it.
    pub forced: bool,
    /// Every other backend of the op, with why it was not chosen.
    pub rejected: Vec<Rejection>,
}

/// Why dispatch found no backend.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DispatchError {
    #[error("unknown op {name:?} (ops with backends: sparse_mla, dsa_indexer)")]
    UnknownOp { name: String },
    #[error("{op}: no backend named {name:?} (registered: {})", known.join(", "))]
    UnknownBackend {
        op: Op,
        name: String,
        known: Vec<&'static str>,
    },
    #[error(
        "{op}: the forced backend {name} cannot serve it on {device}: {}",
        reasons_text(reasons)
    )]
    ForcedInvalid {
        op: Op,
        name: &'static str,
        device: String,
        reasons: Vec<Reason>,
    },
    #[error("no valid {op} backend on {device}: {}", rejections_text(rejections))]
    NoValidBackend {
        op: Op,
        device: String,
        rejections: Vec<Rejection>,
    },
    #[error("backend {name:?} is registered twice for {op}")]
    Duplicate { op: Op, name: &'static str },
    #[error("--backend {text:?}: expected OP=NAME, e.g. sparse_mla=reference")]
    BadForce { text: String },
}

fn reasons_text(reasons: &[Reason]) -> String {
    reasons
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

fn rejections_text(rejections: &[Rejection]) -> String {
    if rejections.is_empty() {
        return "no backend is registered".into();
    }
    rejections
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(" | ")
}

/// Parses `op=name` (the CLI's `--backend` and the `GLM5_BACKEND` variable, comma-separated there).
pub fn parse_forced(text: &str) -> Result<(Op, String), DispatchError> {
    let (op, name) = text
        .split_once('=')
        .map(|(o, n)| (o.trim(), n.trim()))
        .filter(|(o, n)| !o.is_empty() && !n.is_empty())
        .ok_or_else(|| DispatchError::BadForce {
            text: text.to_string(),
        })?;
    let op = Op::from_name(op).ok_or_else(|| DispatchError::UnknownOp {
        name: op.to_string(),
    })?;
    Ok((op, name.to_string()))
}

/// Every backend of every op.
#[derive(Debug, Clone, Default)]
pub struct Registry {
    entries: Vec<Entry>,
}

impl Registry {
    pub fn empty() -> Self {
        Self::default()
    }

    /// Adds a backend; its name must be new for its op.
    pub fn register(&mut self, entry: Entry) -> Result<(), DispatchError> {
        if self.get(entry.op(), entry.name).is_some() {
            return Err(DispatchError::Duplicate {
                op: entry.op(),
                name: entry.name,
            });
        }
        self.entries.push(entry);
        Ok(())
    }

    /// The backends of `op`, in registration order.
    pub fn entries(&self, op: Op) -> impl Iterator<Item = &Entry> {
        self.entries.iter().filter(move |e| e.op() == op)
    }

    pub fn get(&self, op: Op, name: &str) -> Option<&Entry> {
        self.entries(op).find(|e| e.name == name)
    }

    /// `family`'s priority order for `op`: the backends it lists, first choice first.
    pub fn order(&self, op: Op, family: DeviceFamily) -> Vec<&Entry> {
        let mut listed: Vec<(u32, usize, &Entry)> = self
            .entries(op)
            .enumerate()
            .filter_map(|(i, e)| e.rank(family).map(|r| (r, i, e)))
            .collect();
        listed.sort_by_key(|&(rank, i, _)| (rank, i));
        listed.into_iter().map(|(_, _, e)| e).collect()
    }

    /// The dispatch rule (module docs): the forced backend if it validates, else the first valid backend in
    /// the device family's priority order.
    pub fn dispatch(
        &self,
        spec: &OpSpec,
        device: &DeviceDesc,
        forced: Option<&str>,
    ) -> Result<Choice, DispatchError> {
        let op = spec.op;
        let verdicts: Vec<(&Entry, Result<(), Vec<Reason>>)> = self
            .entries(op)
            .map(|e| (e, e.validate(spec, device)))
            .collect();
        let family = device.family();
        let chosen: &Entry = match forced {
            Some(name) => {
                let (entry, verdict) =
                    verdicts
                        .iter()
                        .find(|(e, _)| e.name == name)
                        .ok_or_else(|| DispatchError::UnknownBackend {
                            op,
                            name: name.to_string(),
                            known: self.entries(op).map(|e| e.name).collect(),
                        })?;
                if let Err(reasons) = verdict {
                    return Err(DispatchError::ForcedInvalid {
                        op,
                        name: entry.name,
                        device: device.to_string(),
                        reasons: reasons.clone(),
                    });
                }
                entry
            }
            None => {
                let first_valid = self.order(op, family).into_iter().find(|e| {
                    verdicts
                        .iter()
                        .any(|(v, ok)| std::ptr::eq(*v, *e) && ok.is_ok())
                });
                match first_valid {
                    Some(entry) => entry,
                    None => {
                        return Err(DispatchError::NoValidBackend {
                            op,
                            device: device.to_string(),
                            rejections: verdicts
                                .into_iter()
                                .map(|(e, v)| Rejection {
                                    backend: e.name,
                                    verdict: match v {
                                        Err(reasons) => Verdict::Invalid(reasons),
                                        Ok(()) => Verdict::NotListed { family },
                                    },
                                })
                                .collect(),
                        })
                    }
                }
            }
        };
        let rejected = verdicts
            .into_iter()
            .filter(|(e, _)| !std::ptr::eq(*e, chosen))
            .map(|(e, v)| Rejection {
                backend: e.name,
                verdict: match v {
                    Err(reasons) => Verdict::Invalid(reasons),
                    Ok(()) if forced.is_some() => Verdict::NotForced {
                        forced: chosen.name,
                    },
                    Ok(()) if e.rank(family).is_some() => Verdict::Outranked { by: chosen.name },
                    Ok(()) => Verdict::NotListed { family },
                },
            })
            .collect();
        Ok(Choice {
            entry: chosen.clone(),
            forced: forced.is_some(),
            rejected,
        })
    }
}

/// One op's own entries as a registry, its choices remembered per device and spec: what the op's public
/// functions dispatch through (the model dispatches once per layer instead, when its graph is built). Nothing
/// dispatch reads changes while a process runs, so a call pays for the device query and the dispatch once.
pub(crate) struct OpDispatch {
    entries: fn() -> Vec<Entry>,
    registry: OnceLock<Registry>,
    chosen: OnceLock<Mutex<HashMap<(DeviceLocation, OpSpec), (&'static str, Kernel)>>>,
}

impl OpDispatch {
    pub(crate) const fn new(entries: fn() -> Vec<Entry>) -> Self {
        Self {
            entries,
            registry: OnceLock::new(),
            chosen: OnceLock::new(),
        }
    }

    /// The backend the dispatch rule picks for `spec` on `device`: its name and function (an error naming
    /// every candidate's reasons when none serves it).
    pub(crate) fn choose(
        &self,
        spec: &OpSpec,
        device: &candle_core::Device,
    ) -> crate::Result<(&'static str, Kernel)> {
        let chosen = self.chosen.get_or_init(Default::default);
        let key = (device.location(), spec.clone());
        if let Some(hit) = chosen.lock().ok().and_then(|c| c.get(&key).copied()) {
            return Ok(hit);
        }
        let unsupported = |e: &dyn fmt::Display| crate::OpError::Unsupported(e.to_string());
        let description = DeviceDesc::of(device).map_err(|e| unsupported(&e))?;
        let registry = self.registry.get_or_init(|| {
            let mut registry = Registry::empty();
            registry.entries = (self.entries)();
            registry
        });
        let entry = registry
            .dispatch(spec, &description, None)
            .map_err(|e| unsupported(&e))?
            .entry;
        let pick = (entry.name, entry.kernel);
        if let Ok(mut chosen) = chosen.lock() {
            chosen.insert(key, pick);
        }
        Ok(pick)
    }
}
