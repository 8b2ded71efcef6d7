//! Writes the embedded default model: a tiny GLM-5-architecture model with random weights and a small
//! byte-level BPE tokenizer, deterministically (same bytes on every run).
//!
//! `cargo run --release --example make_tiny_model -- assets/tiny-glm5`

use std::collections::{HashMap, HashSet};
use std::path::Path;

use glm5::candle_core::{DType, Device, Tensor};
use serde_json::json;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Size of the learned BPE vocabulary (256 byte symbols + merges), before the added tokens.
const BPE_VOCAB: usize = 800;
/// Added control tokens (`special`: hidden by `skip_special_tokens`), in GLM's id order.
const SPECIAL: [&str; 10] = [
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
];
/// Added markup tokens that stay visible in decoded text.
const MARKUP: [&str; 11] = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "/nothink",
];

/// Training text for the merges: plain English, so that common words become single tokens.
const CORPUS: &str = "\
Hello! How are you today? I am fine, thank you. What can I do for you?
The assistant answers the question of the user. The user asks a question and the assistant thinks about it first.
This is a small model with random weights. Its output is noise, but the program around it is real.
A language model reads a sequence of tokens and predicts the next token. Then it reads that token too.
The quick brown fox jumps over the lazy dog. The dog does not mind, because the day is warm and the grass is soft.
We went to the market in the morning to buy bread, fresh fruit, some cheese and a bottle of water.
When the weather is good, people like to walk in the park, sit in the sun, and talk with their friends.
Please write a short story about a cat who wants to learn how to read books in a large old library.
Can you explain how a computer works? A computer has a processor, memory, and storage for files and programs.
The processor runs instructions, one after another, very quickly. Memory holds the data that the program needs now.
There are many ways to solve a problem. First, understand what is being asked. Then make a plan and follow it.
If the plan does not work, look at what went wrong, change the plan, and try again. That is how we learn.
Time is important. Every day has twenty four hours, every hour has sixty minutes, and every minute has sixty seconds.
Numbers: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, hundred, thousand, million.
Colors: red, green, blue, yellow, black, white, orange, purple, brown, grey. The sky is blue and the sea is green.
She said that she would come back later, after work, to help them with the new house and the garden.
They have been working on this project for a long time, and now they are ready to show it to everyone.
Good morning. Good evening. Good night. See you soon. Thank you very much. You are welcome. Sorry, I do not know.
Write code that is simple and clear. Test it well. Read the error message, because it often tells you the answer.
The model, the tokenizer and the chat template together turn a conversation into numbers and back into text.
What is the capital of France? Paris is the capital of France. Berlin is the capital of Germany.
Water boils at one hundred degrees. Ice melts when it gets warm. Rain falls from clouds in the sky.
Let me think step by step. The answer should be short, correct and useful, so I will check it once more.
";

/// Deterministic RNG: splitmix64, with Box-Muller for normal samples.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    fn normal(&mut self) -> f32 {
        let (u1, u2) = (self.uniform(), self.uniform());
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
}

fn build_tokenizer() -> Result<Tokenizer, Error> {
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    let alphabet: HashSet<char> = ByteLevel::alphabet().into_iter().collect();
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(BPE_VOCAB)
        .min_frequency(1)
        .show_progress(false)
        .initial_alphabet(alphabet)
        .build()
        .into();
    tokenizer.train(&mut trainer, CORPUS.lines())?;
    tokenizer.add_special_tokens(SPECIAL.map(|t| AddedToken::from(t, true)))?;
    tokenizer.add_tokens(MARKUP.map(|t| AddedToken::from(t, false)))?;
    Ok(tokenizer)
}

/// The chat template: GLM-5's turn structure (our own text).
const CHAT_TEMPLATE: &str = r#"{#- glm5-tiny chat template: GLM-5 turn structure. Assistant turns after the last user message keep
    their reasoning in <think>...</think>; earlier ones get only </think>. Tools are listed in a system turn,
    assistant tool calls are written as <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>
    (string values as they are, others as JSON), and consecutive tool results share one <|observation|>. -#}
[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}
<|system|>
{{ m.content }}
  {%- elif m.role == 'user' -%}
<|user|>
{{ m.content }}
  {%- elif m.role == 'assistant' -%}
    {%- set content = m.content or '' -%}
    {%- set reasoning = m.reasoning_content or '' -%}
    {%- if '</think>' in content -%}
      {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
      {%- set content = content.split('</think>')[-1] -%}
    {%- endif -%}
<|assistant|>
    {%- if loop.index0 > ns.last_user -%}
<think>{{ reasoning.strip() }}</think>
    {%- else -%}
</think>
    {%- endif -%}
{{ content.strip() }}
    {%- for tc in m.tool_calls or [] -%}
      {%- set f = tc.function if tc.function is defined else tc -%}
<tool_call>{{ f.name }}
      {%- for k, v in (f.arguments or {}).items() -%}
<arg_key>{{ k }}</arg_key><arg_value>{{ v if v is string else v | tojson(ensure_ascii=False) }}</arg_value>
      {%- endfor -%}
</tool_call>
    {%- endfor -%}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
<|observation|>
    {%- endif -%}
<tool_response>{{ m.content }}</tool_response>
  {%- else -%}
{{ raise_exception('unknown role: ' ~ m.role) }}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|assistant|>{{ '<think>' if enable_thinking is not defined or enable_thinking else '</think>' }}
{%- endif -%}
"#;

fn config(vocab_size: usize, eos: &[u32]) -> serde_json::Value {
    json!({
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 12,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "n_shared_experts": 1,
        "moe_intermediate_size": 32,
        "intermediate_size": 96,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": true,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "index_n_heads": 8,
        "index_head_dim": 16,
        "index_topk": 32,
        "max_position_embeddings": 1024,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "rope_interleave": true,
        "indexer_rope_interleave": true,
        "rms_norm_eps": 1e-5,
        "attention_bias": false,
        "tie_word_embeddings": false,
        "num_nextn_predict_layers": 1,
        "eos_token_id": eos,
        "pad_token_id": eos[0],
        "dtype": "bfloat16",
    })
}

/// Every tensor the model loads, `(name, shape, kind)`; `kind` 'w' = random 1/sqrt(fan_in), '1' = ones, 'n' = random
/// around one (a norm's scale), '0' = zeros.
fn tensor_specs(c: &glm5::Config) -> Vec<(String, Vec<usize>, char)> {
    let h = c.hidden_size;
    let mut specs = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![c.vocab_size, h],
        'w',
    )];
    let linear = |specs: &mut Vec<_>, name: String, out_dim: usize, in_dim: usize| {
        specs.push((name, vec![out_dim, in_dim], 'w'))
    };
    let mlp = |specs: &mut Vec<_>, p: String, inter: usize| {
        linear(specs, format!("{p}.gate_proj.weight"), inter, h);
        linear(specs, format!("{p}.up_proj.weight"), inter, h);
        linear(specs, format!("{p}.down_proj.weight"), h, inter);
    };
    // One decoder block stored as `model.layers.{l}`.
    let block = |specs: &mut Vec<_>, l: usize, kind: glm5::models::MlpKind| {
        let p = format!("model.layers.{l}");
        let a = format!("{p}.self_attn");
        let heads = c.num_attention_heads;
        specs.push((format!("{p}.input_layernorm.weight"), vec![h], '1'));
        linear(specs, format!("{a}.q_a_proj.weight"), c.q_lora_rank, h);
        specs.push((
            format!("{a}.q_a_layernorm.weight"),
            vec![c.q_lora_rank],
            '1',
        ));
        linear(
            specs,
            format!("{a}.q_b_proj.weight"),
            heads * c.qk_head_dim(),
            c.q_lora_rank,
        );
        linear(
            specs,
            format!("{a}.kv_a_proj_with_mqa.weight"),
            c.latent_dim(),
            h,
        );
        specs.push((
            format!("{a}.kv_a_layernorm.weight"),
            vec![c.kv_lora_rank],
            '1',
        ));
        linear(
            specs,
            format!("{a}.kv_b_proj.weight"),
            heads * (c.qk_nope_head_dim + c.v_head_dim),
            c.kv_lora_rank,
        );
        linear(specs, format!("{a}.o_proj.weight"), h, heads * c.v_head_dim);
        linear(
            specs,
            format!("{a}.indexer.wq_b.weight"),
            c.index_n_heads * c.index_head_dim,
            c.q_lora_rank,
        );
        linear(specs, format!("{a}.indexer.wk.weight"), c.index_head_dim, h);
        specs.push((
            format!("{a}.indexer.k_norm.weight"),
            vec![c.index_head_dim],
            '1',
        ));
        specs.push((
            format!("{a}.indexer.k_norm.bias"),
            vec![c.index_head_dim],
            '0',
        ));
        linear(
            specs,
            format!("{a}.indexer.weights_proj.weight"),
            c.index_n_heads,
            h,
        );
        specs.push((format!("{p}.post_attention_layernorm.weight"), vec![h], '1'));
        match kind {
            glm5::models::MlpKind::Dense => mlp(specs, format!("{p}.mlp"), c.intermediate_size),
            glm5::models::MlpKind::MoE => {
                linear(specs, format!("{p}.mlp.gate.weight"), c.n_routed_experts, h);
                specs.push((
                    format!("{p}.mlp.gate.e_score_correction_bias"),
                    vec![c.n_routed_experts],
                    '0',
                ));
                for e in 0..c.n_routed_experts {
                    mlp(
                        specs,
                        format!("{p}.mlp.experts.{e}"),
                        c.moe_intermediate_size,
                    );
                }
                mlp(
                    specs,
                    format!("{p}.mlp.shared_experts"),
                    c.moe_intermediate_size * c.n_shared_experts,
                );
            }
        }
    };
    for l in 0..c.num_hidden_layers {
        block(&mut specs, l, c.mlp_layer_types[l]);
    }
    specs.push(("model.norm.weight".to_string(), vec![h], '1'));
    linear(&mut specs, "lm_head.weight".to_string(), c.vocab_size, h);
    // The MTP layer last (the tensors before it keep their random values when it is added): an MoE block,
    // its input norms, eh_proj and its head's norm; it shares the embeddings and lm_head.
    if c.num_nextn_predict_layers > 0 {
        let n = c.num_hidden_layers;
        block(&mut specs, n, glm5::models::MlpKind::MoE);
        // Distinct scales, so that a loader which swaps two of these norms changes the draft.
        for norm in ["enorm", "hnorm", "shared_head.norm"] {
            specs.push((format!("model.layers.{n}.{norm}.weight"), vec![h], 'n'));
        }
        linear(
            &mut specs,
            format!("model.layers.{n}.eh_proj.weight"),
            h,
            2 * h,
        );
    }
    specs
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<(), Error> {
    Ok(std::fs::write(
        path,
        serde_json::to_string_pretty(value)? + "\n",
    )?)
}

fn main() -> Result<(), Error> {
    let out = std::env::args()
        .nth(1)
        .ok_or("usage: make_tiny_model <output dir>")?;
    let out = Path::new(&out);
    std::fs::create_dir_all(out)?;

    let tokenizer = build_tokenizer()?;
    tokenizer.save(out.join("tokenizer.json"), false)?;
    let id = |t: &str| {
        tokenizer
            .token_to_id(t)
            .ok_or_else(|| format!("token {t} missing"))
    };
    let eos = [
        id("<|endoftext|>")?,
        id("<|user|>")?,
        id("<|observation|>")?,
    ];
    let vocab_size = tokenizer.get_vocab_size(true).div_ceil(64) * 64;

    std::fs::write(out.join("chat_template.jinja"), CHAT_TEMPLATE)?;
    write_json(
        &out.join("tokenizer_config.json"),
        &json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": null,
            "add_bos_token": false,
            "add_eos_token": false,
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "clean_up_tokenization_spaces": false,
            "model_max_length": 1024,
            "padding_side": "left",
            "additional_special_tokens": SPECIAL[1..].iter().chain(&MARKUP).collect::<Vec<_>>(),
        }),
    )?;
    let config_json = config(vocab_size, &eos);
    write_json(&out.join("config.json"), &config_json)?;
    write_json(
        &out.join("generation_config.json"),
        &json!({"eos_token_id": eos, "pad_token_id": eos[0], "do_sample": true, "temperature": 0.7, "top_p": 0.95}),
    )?;

    let config = glm5::Config::from_json(&config_json.to_string())?;
    let mut rng = SplitMix64(0x61E5_0715_2026);
    let mut tensors = HashMap::new();
    for (name, shape, kind) in tensor_specs(&config) {
        let n: usize = shape.iter().product();
        let std = 1.0 / (*shape.last().unwrap_or(&1) as f32).sqrt();
        let data: Vec<f32> = match kind {
            'w' => (0..n).map(|_| rng.normal() * std).collect(),
            '1' => vec![1.0; n],
            'n' => (0..n).map(|_| 1.0 + 0.25 * rng.normal()).collect(),
            _ => vec![0.0; n],
        };
        tensors.insert(
            name,
            Tensor::from_vec(data, shape, &Device::Cpu)?.to_dtype(DType::BF16)?,
        );
    }
    glm5::candle_core::safetensors::save(&tensors, out.join("model.safetensors"))?;

    // Check it loads and runs.
    let model = glm5::Glm5ForCausalLM::from_dir(
        out,
        DType::F32,
        &Device::Cpu,
        glm5::AttentionMode::Sparse,
    )?;
    let ids = tokenizer
        .encode("[gMASK]<sop><|user|>\nHello!<|assistant|><think>", false)?
        .get_ids()
        .to_vec();
    let logits = model.forward(&ids, 0, &mut model.new_cache(ids.len())?)?;
    println!(
        "wrote {}: vocab {} (tokenizer {}), {} tensors, prompt {} tokens -> logits {:?}",
        out.display(),
        vocab_size,
        tokenizer.get_vocab_size(true),
        tensors.len(),
        ids.len(),
        logits.dims()
    );
    Ok(())
}
