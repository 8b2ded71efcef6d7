//! The runtime's model handle: GLM-5 weights plus the tokenizer, the chat template and the generation
//! defaults of one model directory, local or from the Hugging Face Hub.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde::Deserialize;

use crate::chat::{ChatOptions, ChatTemplate, Message};
use crate::error::{Error, Result};
use crate::generate::{Generation, GenerationParams, SequenceCache};
use crate::hub::{resolve_model, HubOptions};
use crate::plan_cli::{forced_backends, BACKEND_ENV};
use crate::tokenizer::{TokenStream, Tokenizer};
use crate::viz::SelectionMap;
use crate::{
    embedded, AttentionMode, Checkpoint, Config, DeviceDesc, Glm5ForCausalLM, KeyFormat, KvCache,
    Op, Plan, PlanOptions, Registry,
};

/// Where and how to load a model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Where weights and the KV cache live (when `devices` is empty).
    pub device: Device,
    /// Several devices: the layers are split over them (automatically, or by `layer_map`).
    pub devices: Vec<Device>,
    /// Index into `devices` of every layer; `None`: placement by weight and KV-cache bytes.
    pub layer_map: Option<Vec<usize>>,
    /// Backend forced per op; ops not named here take `GLM5_BACKEND`, then the registry's priority order.
    pub backends: BTreeMap<Op, String>,
    /// The backends to choose from.
    pub registry: Registry,
    /// Tokens of KV cache the plan reserves per layer (`None`: glm5_models' default).
    pub context: Option<usize>,
    /// Activation and weight dtype; `None` picks f32 on CPU and bf16 on GPUs.
    pub dtype: Option<DType>,
    /// Sparse (DSA, the default) or the explicit dense debugging mode.
    pub attention: AttentionMode,
    /// How the indexer key cache stores keys: the model's dtype (default) or FP8 with a scale per key.
    pub index_keys: KeyFormat,
    /// Load the checkpoint's MTP layer: [`Glm5::generate`] then decodes speculatively (`--mtp`;
    /// [`SequenceCache::speculative`]).
    pub mtp: bool,
    /// Quantise the checkpoint's unquantised projections (attention, indexer, dense MLPs) to block-scaled FP8
    /// as they load (`--fp8-projections`; `glm5_models::sizes::quantized_at_load`): for the bf16 attention an
    /// NVFP4 export keeps, half the bytes every token reads.
    pub fp8_projections: bool,
    /// Revision, offline mode, endpoint and cache of Hub downloads.
    pub hub: HubOptions,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            devices: Vec::new(),
            layer_map: None,
            backends: BTreeMap::new(),
            registry: Registry::builtin(),
            context: None,
            dtype: None,
            attention: AttentionMode::Sparse,
            index_keys: KeyFormat::Float,
            mtp: false,
            fp8_projections: false,
            hub: HubOptions::from_env(),
        }
    }
}

impl LoadOptions {
    /// The devices the layers go on.
    pub fn devices(&self) -> Vec<Device> {
        if self.devices.is_empty() {
            vec![self.device.clone()]
        } else {
            self.devices.clone()
        }
    }

    /// The graph-build pass for `config` on the real devices, before any weight is read: the [`Plan`] the
    /// model will be loaded with (forced backends from `backends`, then `GLM5_BACKEND`).
    pub fn plan(&self, config: &Config) -> Result<Plan> {
        self.plan_sized(config, &|t| glm5_models::sizes::resident_bytes(config, t))
    }

    /// [`LoadOptions::plan`] with each tensor costing `resident_bytes` (see `Plan::build_sized`).
    pub fn plan_sized(
        &self,
        config: &Config,
        resident_bytes: &dyn Fn(&glm5_models::sizes::TensorInfo) -> u64,
    ) -> Result<Plan> {
        let devices = self.devices();
        let descriptions = devices
            .iter()
            .map(DeviceDesc::of)
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let dtype = self.dtype.unwrap_or(if devices[0].is_cpu() {
            DType::F32
        } else {
            DType::BF16
        });
        let options = PlanOptions {
            dtype,
            attention: self.attention,
            context: self.context,
            forced: forced_backends(&self.backends, std::env::var(BACKEND_ENV).ok().as_deref())?,
            layer_devices: self.layer_map.clone(),
            index_keys: self.index_keys,
            mtp: self.mtp,
            fp8_projections: self.fp8_projections,
        };
        Ok(Plan::build_sized(
            config,
            descriptions,
            &options,
            &self.registry,
            resident_bytes,
        )?)
    }
}

/// `generation_config.json`, the fields glm5 uses.
#[derive(Deserialize, Default)]
struct GenerationConfig {
    eos_token_id: Option<serde_json::Value>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<usize>,
}

/// One candidate next token and its probability.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenProbability {
    /// Token id.
    pub id: u32,
    /// Its text.
    pub text: String,
    /// Softmax probability at temperature 1.
    pub probability: f32,
}

/// GLM-5 ready to run: weights, tokenizer, chat template and generation defaults.
pub struct Glm5 {
    model: Glm5ForCausalLM,
    tokenizer: Tokenizer,
    /// The template, or why it cannot be used (kept until a chat is rendered: raw prompts work without it).
    chat_template: std::result::Result<ChatTemplate, crate::chat::ChatError>,
    eos_token_ids: Vec<u32>,
    sampling_defaults: GenerationParams,
    label: String,
    dir: PathBuf,
}

impl Glm5 {
    /// Loads a model from a local directory or a Hub repo id (`zai-org/GLM-5-FP8`), downloading what is
    /// missing into the Hugging Face cache.
    pub fn from_pretrained(id_or_dir: &str, options: &LoadOptions) -> Result<Self> {
        if let Some((repo, quant)) = crate::hub_gguf::split_quant(id_or_dir) {
            let first = crate::hub_gguf::fetch_quant(repo, quant, &options.hub)?;
            return Self::from_gguf(&first, id_or_dir, options);
        }
        if crate::gguf::is_gguf(Path::new(id_or_dir)) {
            return Self::from_gguf(Path::new(id_or_dir), id_or_dir, options);
        }
        let dir = resolve_model(id_or_dir, &options.hub)?;
        Self::from_dir(&dir, id_or_dir, options)
    }

    /// Loads a llama.cpp GGUF model (`.gguf` file, one part of a split set, or a directory holding one):
    /// config, tokenizer and chat template from its metadata, quantised matrices kept quantised.
    pub fn from_gguf(path: &Path, label: &str, options: &LoadOptions) -> Result<Self> {
        if options.fp8_projections {
            return Err(Error::InvalidOption(
                "--fp8-projections quantises safetensors checkpoints; a GGUF file's matrices are already quantised"
                    .into(),
            ));
        }
        let (config, checkpoint) = Checkpoint::open_gguf(path)?;
        let plan = options.plan_sized(&config, &|t| {
            checkpoint.resident_bytes(&t.name, &t.shape, t.dtype)
        })?;
        let model = Glm5ForCausalLM::load_planned(&config, &checkpoint, plan, &options.devices())?;
        let gguf = glm5_models::weights::gguf::GgufModel::open(path)
            .map_err(glm5_models::ModelError::from)?;
        let tokenizer = crate::gguf::tokenizer(&gguf)?;
        // As for a model folder, a missing or broken template fails only when a chat is rendered, with its cause.
        let chat_template = crate::gguf::chat_template(&gguf).unwrap_or_else(|| {
            Err(crate::chat::ChatError::MissingTemplate {
                dir: path.to_path_buf(),
            })
        });
        let sampling = |key: &str| gguf.float(key).ok().flatten();
        let sampling_defaults = GenerationParams {
            temperature: sampling("general.sampling.temp").unwrap_or(0.0),
            top_p: sampling("general.sampling.top_p").filter(|p| *p < 1.0),
            top_k: gguf
                .uint("general.sampling.top_k")
                .ok()
                .flatten()
                .map(|k| k as usize)
                .filter(|k| *k > 0),
            ..GenerationParams::default()
        };
        Ok(Self {
            eos_token_ids: config.eos_token_ids.clone(),
            model,
            tokenizer,
            chat_template,
            sampling_defaults,
            label: label.to_string(),
            dir: checkpoint.dir().map(Path::to_path_buf).unwrap_or_default(),
        })
    }

    /// The tiny random-weight GLM-5-architecture model built into glm5 (works offline; its output is noise).
    pub fn embedded(options: &LoadOptions) -> Result<Self> {
        let dir = embedded::materialize().map_err(|e| Error::ModelFile {
            path: std::env::temp_dir(),
            reason: format!("cannot write the embedded model: {e}"),
        })?;
        Self::from_dir(&dir, embedded::NAME, options)
    }

    fn from_dir(dir: &Path, label: &str, options: &LoadOptions) -> Result<Self> {
        let started = std::time::Instant::now();
        let config = Config::from_file(dir.join("config.json"))?;
        let plan = options.plan(&config)?;
        let dtype = plan.dtype;
        let model = Glm5ForCausalLM::load_planned(
            &config,
            &Checkpoint::open(dir)?,
            plan,
            &options.devices(),
        )?;
        tracing::debug!(
            dir = %dir.display(),
            ?dtype,
            devices = ?options.devices(),
            attention = ?options.attention,
            layers = model.config().num_hidden_layers,
            seconds = started.elapsed().as_secs_f64(),
            "model loaded"
        );
        let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))?;
        let chat_template = ChatTemplate::from_model_dir(dir);
        let generation = read_generation_config(&dir.join("generation_config.json"))?;
        let mut eos_token_ids = model.config().eos_token_ids.clone();
        for id in generation.eos_token_id.iter().flat_map(token_ids) {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
        let sampling_defaults = GenerationParams {
            temperature: generation.temperature.unwrap_or(0.0),
            top_p: generation.top_p.filter(|p| *p < 1.0),
            top_k: generation.top_k.filter(|k| *k > 0),
            ..GenerationParams::default()
        };
        Ok(Self {
            model,
            tokenizer,
            chat_template,
            eos_token_ids,
            sampling_defaults,
            label: label.to_string(),
            dir: dir.to_path_buf(),
        })
    }

    /// What was loaded: the repo id or directory given, or the embedded model's name.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The local directory the files were read from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The module graph (config, forward, cache).
    pub fn model(&self) -> &Glm5ForCausalLM {
        &self.model
    }

    /// The model's tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Token ids that end generation (config.json and generation_config.json together).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// Sampling settings from generation_config.json, on top of [`GenerationParams::default`].
    pub fn sampling_defaults(&self) -> &GenerationParams {
        &self.sampling_defaults
    }

    /// An empty KV cache for up to `capacity` tokens.
    pub fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        Ok(self.model.new_cache(capacity)?)
    }

    /// Logits `[len, vocab]` of `input_ids` at `start_pos..`, appended to `cache`.
    pub fn forward(
        &self,
        input_ids: &[u32],
        start_pos: usize,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        Ok(self.model.forward(input_ids, start_pos, cache)?)
    }

    /// The `k` most likely tokens after `prompt` (text used as is), most likely first.
    pub fn top_next_tokens(&self, prompt: &str, k: usize) -> Result<Vec<TokenProbability>> {
        let ids = self.tokenizer.encode(prompt)?;
        let mut cache = self.new_cache(ids.len().max(1))?;
        let logits = self.model.forward(&ids, 0, &mut cache)?;
        let last = logits.get(logits.dim(0)? - 1)?;
        let probabilities: Vec<f32> = candle_nn::ops::softmax_last_dim(&last)?.to_vec1()?;
        let mut order: Vec<usize> = (0..probabilities.len()).collect();
        order.sort_by(|&a, &b| {
            probabilities[b]
                .total_cmp(&probabilities[a])
                .then(a.cmp(&b))
        });
        order
            .into_iter()
            .take(k)
            .map(|id| {
                Ok(TokenProbability {
                    id: id as u32,
                    text: self.tokenizer.decode(&[id as u32])?,
                    probability: probabilities[id],
                })
            })
            .collect()
    }

    /// Which positions every layer attended to for the last token of `prompt` (text used as is).
    pub fn selection_map(&self, prompt: &str) -> Result<SelectionMap> {
        let ids = self.tokenizer.encode(prompt)?;
        let mut cache = self.new_cache(ids.len().max(1))?;
        let (_, selections) = self.model.forward_with_selections(&ids, 0, &mut cache)?;
        let layers = selections
            .iter()
            .map(|selected| {
                let last: Vec<i32> = selected.get(selected.dim(0)? - 1)?.to_vec1()?;
                let mut positions: Vec<usize> = last
                    .into_iter()
                    .filter(|&p| p >= 0)
                    .map(|p| p as usize)
                    .collect();
                positions.sort_unstable();
                Ok(positions)
            })
            .collect::<Result<Vec<_>>>()?;
        let tokens = ids
            .iter()
            .map(|&id| self.tokenizer.decode(&[id]))
            .collect::<std::result::Result<_, _>>()?;
        Ok(SelectionMap {
            tokens,
            layers,
            index_topk: self.model.config().index_topk,
        })
    }

    /// Renders a conversation with the model's own chat template.
    pub fn apply_chat_template(
        &self,
        messages: &[Message],
        options: &ChatOptions,
    ) -> Result<String> {
        let template = match &self.chat_template {
            Ok(template) => template,
            Err(crate::chat::ChatError::MissingTemplate { .. }) => {
                return Err(Error::ModelFile {
                    path: self.dir.clone(),
                    reason: "the model ships no chat template (chat_template.jinja or tokenizer_config.json)".into(),
                })
            }
            // The cause (syntax error, unreadable or oversized file, invalid tokenizer_config.json) is kept.
            Err(e) => {
                return Err(Error::ModelFile {
                    path: self.dir.clone(),
                    reason: format!("its chat template cannot be used: {e}"),
                })
            }
        };
        Ok(template.render(messages, options)?)
    }

    /// Streams the continuation of `prompt` (text, used as is: render chats with
    /// [`Glm5::apply_chat_template`] first).
    pub fn generate(&self, prompt: &str, params: &GenerationParams) -> Result<Generation<'_>> {
        let (ids, capacity) = self.prompt_and_capacity(prompt, params)?;
        self.generate_ids(ids, params, self.new_sequence(capacity)?)
    }

    /// An empty sequence of up to `capacity` tokens for [`Self::generate_ids`]: decoded speculatively with
    /// the MTP layer where the model was loaded with it ([`LoadOptions::mtp`]).
    pub fn new_sequence(&self, capacity: usize) -> Result<SequenceCache> {
        match self.model.has_mtp() {
            true => SequenceCache::speculative(&self.model, capacity),
            false => Ok(SequenceCache::new(self.new_cache(capacity)?)),
        }
    }

    /// [`Self::generate`] in a paged pool of its own whose decode steps are replayed from CUDA graphs where
    /// the model allows ([`SequenceCache::graphed`]; the same tokens).
    pub fn generate_graphed(
        &self,
        prompt: &str,
        params: &GenerationParams,
    ) -> Result<Generation<'_>> {
        let (ids, capacity) = self.prompt_and_capacity(prompt, params)?;
        let sequence = SequenceCache::graphed(&self.model, capacity)?;
        self.generate_ids(ids, params, sequence)
    }

    /// `prompt`'s ids and the cache a generation of them needs.
    fn prompt_and_capacity(
        &self,
        prompt: &str,
        params: &GenerationParams,
    ) -> Result<(Vec<u32>, usize)> {
        let max_positions = self.model.config().max_position_embeddings;
        // Refused before tokenising when far too long; the count is checked below.
        let ids = self
            .tokenizer
            .encode_bounded(prompt, max_positions, "the prompt")?;
        // Room for the prompt and its new tokens (at least one, which the prefill produces anyway).
        let capacity = ids
            .len()
            .saturating_add(params.max_new_tokens.max(1))
            .min(max_positions);
        if ids.len() >= capacity {
            return Err(Error::PromptTooLong {
                prompt_tokens: ids.len(),
                limit: max_positions,
            });
        }
        Ok((ids, capacity))
    }

    /// Streams the continuation of `prompt_ids` in `sequence`, reusing the cached tokens the prompt starts
    /// with (a chat turn re-sends the whole conversation); get the sequence back with
    /// [`Generation::into_sequence`].
    pub fn generate_ids(
        &self,
        prompt_ids: Vec<u32>,
        params: &GenerationParams,
        sequence: SequenceCache,
    ) -> Result<Generation<'_>> {
        Generation::start(
            &self.model,
            sequence,
            prompt_ids,
            params,
            TokenStream::new(&self.tokenizer),
            &self.eos_token_ids,
        )
    }
}

fn token_ids(value: &serde_json::Value) -> Vec<u32> {
    match value {
        serde_json::Value::Number(n) => n.as_u64().map(|id| vec![id as u32]).unwrap_or_default(),
        serde_json::Value::Array(items) => items.iter().flat_map(token_ids).collect(),
        _ => Vec::new(),
    }
}

fn read_generation_config(path: &Path) -> Result<GenerationConfig> {
    if !path.exists() {
        return Ok(GenerationConfig::default());
    }
    // Bounded, regular files only: GLM-5's generation_config.json has a few hundred bytes.
    let text =
        glm5_models::config::read_text_file(path, 16 << 20).map_err(|e| Error::ModelFile {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    serde_json::from_str(&text).map_err(|e| Error::ModelFile {
        path: path.to_path_buf(),
        reason: format!("invalid JSON: {e}"),
    })
}
