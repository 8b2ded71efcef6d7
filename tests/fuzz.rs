//! Fuzz targets: every file and argument glm5 parses, mutated from valid seeds (see `fuzz/harness.rs` for
//! what each run must hold and how to run longer: `GLM5_FUZZ_ITERS=1000000 cargo test --release --test fuzz`).
//!
//! Adding a target: write a function returning a [`Target`] (seeds, dictionary, the code under test,
//! returning its typed error's message) and a `#[test]` calling `fuzz(that())`. Inputs that once failed
//! become regular tests in `tests/hostile_inputs.rs`.

#[path = "fuzz/harness.rs"]
mod harness;

use std::path::{Path, PathBuf};

use glm5::candle_core::{DType, Device};
use glm5::chat::{ChatOptions, ChatTemplate, Message};
use glm5::models::weights::gguf::GgufModel;
use glm5::models::{sizes, Checkpoint, Config, Plan, PlanOptions};
use glm5::tokenizer::{TokenStream, Tokenizer};
use glm5::{AttentionMode, Glm5ForCausalLM, Registry};
use harness::{fuzz, Target};

/// The command line's clap definitions, as the `glm5` binary parses them (`Cli` is `pub(crate)` there for
/// this).
#[allow(dead_code)]
#[path = "../src/main.rs"]
mod glm5_main;

#[global_allocator]
static ALLOCATOR: harness::Limited = harness::Limited;

fn repo_file(rel: &str) -> Vec<u8> {
    std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)).unwrap()
}

fn words(list: &[&str]) -> Vec<Vec<u8>> {
    list.iter().map(|w| w.as_bytes().to_vec()).collect()
}

fn text(bytes: &[u8]) -> Result<&str, String> {
    std::str::from_utf8(bytes).map_err(|e| format!("not UTF-8: {e}"))
}

/// `config.json`: parse and validate, then the sizes and a plan of what passed, checked against each other.
fn config() -> Target {
    let registry = Registry::builtin();
    Target {
        name: "config",
        seeds: vec![
            repo_file("assets/tiny-glm5/config.json"),
            repo_file("tests/assets/glm5_config.json"),
            repo_file("tests/fixtures/dense_equiv/config.json"),
            br#"{"model_type": "glm_moe_dsa"}"#.to_vec(),
            br#"{"model_type": "glm_moe_dsa", "num_hidden_layers": 4, "mlp_layer_types": ["dense", "sparse", "moe", "dense"], "q_lora_rank": null}"#.to_vec(),
        ],
        dictionary: words(&[
            "\"index_topk\": ",
            "\"vocab_size\": ",
            "\"num_hidden_layers\": ",
            "\"n_routed_experts\": ",
            "\"mlp_layer_types\": [\"dense\"]",
            "\"q_lora_rank\": null",
            "\"eos_token_id\": [1, 2, 3]",
            "\"rope_parameters\": {\"rope_theta\": 0}",
            "\"rope_scaling\": {}",
            "\"first_k_dense_replace\": ",
            "\"n_group\": ",
            "\"topk_group\": ",
            "\"tie_word_embeddings\": true",
            "\"model_type\": \"llama\"",
            "1048576",
            "4096",
            "4097",
            "513",
        ]),
        run: Box::new(move |bytes| {
            let config = Config::from_json(text(bytes)?).map_err(|e| e.to_string())?;
            let dtype = DType::BF16;
            let mut params = sizes::params(&sizes::embedding_tensors(&config, dtype))
                + sizes::params(&sizes::head_tensors(&config, dtype));
            let _ = sizes::cache_bytes_per_token(&config, dtype, glm5::KeyFormat::Fp8E4m3);
            // Listing every expert of every layer is the plan's cost: only for configs of sane size here,
            // so that each input stays fast (the bounds keep even the largest at seconds).
            if config.n_routed_experts * config.num_hidden_layers <= 20_000 {
                for layer in 0..config.num_hidden_layers {
                    params += sizes::params(&sizes::layer_tensors(&config, layer, dtype));
                }
                assert_eq!(u128::from(params), config.parameter_count());
                let devices =
                    glm5::plan_cli::parse_assumed("sm_90:141GB x8").map_err(|e| e.to_string())?;
                let options = PlanOptions::new(dtype, AttentionMode::Sparse);
                Plan::build(&config, devices, &options, &registry).map_err(|e| e.to_string())?;
            }
            Ok(())
        }),
        ci_iterations: 6_000,
        max_seconds: 5.0,
    }
}

/// A safetensors file from `(name, dtype, shape)` with zeroed data.
fn safetensors(tensors: &[(&str, &str, &[usize])]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, dtype, shape) in tensors {
        let size = shape.iter().product::<usize>() * if *dtype == "F32" { 4 } else { 2 };
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}),
        );
        offset += size;
    }
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let header = serde_json::to_vec(&header).unwrap();
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend(header);
    file.extend(vec![0u8; offset]);
    file
}

/// A scratch directory for targets that need files (mmap, paths).
fn scratch() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("fuzz-scratch")
        .join(format!("{:?}", std::thread::current().id()).replace(['(', ')'], ""));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Safetensors headers: the Hub's header check, then the checkpoint reader loading every tensor the header
/// names, with the shape it declares.
fn safetensors_header() -> Target {
    let dir = scratch().join("safetensors");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    Target {
        name: "safetensors",
        seeds: vec![
            safetensors(&[("a.weight", "F32", &[4, 8]), ("b.bias", "BF16", &[8])]),
            safetensors(&[("model.norm.weight", "F16", &[16])]),
            safetensors(&[("x", "F32", &[0]), ("y", "I64", &[2, 2])]),
        ],
        dictionary: words(&[
            "\"dtype\":\"F64\"",
            "\"dtype\":\"BOOL\"",
            "\"dtype\":\"F8_E4M3\"",
            "\"shape\":[]",
            "\"shape\":[18446744073709551615,2]",
            "\"data_offsets\":[0,18446744073709551615]",
            "\"data_offsets\":[8,4]",
            "\"__metadata__\":{\"a\":1}",
        ]),
        run: Box::new(move |bytes| {
            let path = dir.join("model.safetensors");
            std::fs::write(&path, bytes).map_err(|e| e.to_string())?;
            let hub = glm5::hub::validate::check_safetensors(&path, bytes.len() as u64)
                .map_err(|e| e.to_string())?;
            let checkpoint = Checkpoint::open(&dir).map_err(|e| e.to_string());
            // The Hub's check is a subset of the reader's: what the reader opens, the Hub accepts.
            if let (Ok(_), Err(e)) = (&checkpoint, &hub) {
                panic!("the reader opened a file the Hub check refuses: {e}");
            }
            let checkpoint = checkpoint?;
            let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let header: serde_json::Map<String, serde_json::Value> =
                serde_json::from_slice(&bytes[8..8 + header_len]).map_err(|e| e.to_string())?;
            for (name, info) in header.iter().filter(|(n, _)| *n != "__metadata__") {
                let shape: Vec<usize> = info["shape"]
                    .as_array()
                    .map(|dims| {
                        dims.iter()
                            .filter_map(|d| d.as_u64())
                            .map(|d| d as usize)
                            .collect()
                    })
                    .unwrap_or_default();
                checkpoint
                    .tensor(name, &shape, DType::F32, &Device::Cpu)
                    .map_err(|e| e.to_string())?;
            }
            hub
        }),
        ci_iterations: 2_000,
        max_seconds: 5.0,
    }
}

/// `model.safetensors.index.json`: the Hub's shard names and the local checkpoint reader, which must both
/// confine the shards to the model directory.
fn safetensors_index() -> Target {
    let dir = scratch().join("index");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dense_equiv");
    for entry in std::fs::read_dir(&fixture).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
        }
    }
    Target {
        name: "index",
        seeds: vec![repo_file(
            "tests/fixtures/dense_equiv/model.safetensors.index.json",
        )],
        dictionary: words(&[
            "../../../../etc/passwd",
            "/etc/passwd",
            "reference.safetensors",
            "model-00001-of-00003.safetensors/../model-00002-of-00003.safetensors",
            "./model-00001-of-00003.safetensors",
            "C:\\\\x",
            "\"weight_map\": {}",
            "\"weight_map\": []",
        ]),
        run: Box::new(move |bytes| {
            let index = dir.join("model.safetensors.index.json");
            std::fs::write(&index, bytes).map_err(|e| e.to_string())?;
            let json =
                serde_json::from_slice::<serde_json::Value>(bytes).map_err(|e| e.to_string());
            let hub = json.and_then(|j| glm5::hub::validate::index_shards(&j));
            let local = Checkpoint::open(&dir).map_err(|e| e.to_string());
            if local.is_ok() {
                // Opened locally: every shard it names is a plain path inside the directory.
                // (serde_json's `Value` refuses numbers the reader's typed parse skips, e.g. 1e400.)
                let json: serde_json::Value = serde_json::from_slice(bytes).unwrap_or_default();
                for shard in json["weight_map"]
                    .as_object()
                    .into_iter()
                    .flat_map(|m| m.values())
                {
                    let shard = shard.as_str().unwrap();
                    if let Err(e) = glm5::hub::names::check_relative("shard", shard) {
                        panic!("the local reader accepted {e}");
                    }
                }
            }
            hub.map(|_| ()).and(local.map(|_| ()))
        }),
        ci_iterations: 2_000,
        max_seconds: 5.0,
    }
}

const TINY_WORDLEVEL: &str = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[{"id":4,"content":"<|user|>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}],
"normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
"model":{"type":"WordLevel","vocab":{"<unk>":0,"hello":1,"world":2,"!":3},"unk_token":"<unk>"}}"#;

const TINY_BPE: &str = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
"normalizer":{"type":"NFC"},"pre_tokenizer":{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true},
"post_processor":null,"decoder":{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true},
"model":{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,"end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,
"vocab":{"h":0,"e":1,"l":2,"o":3,"he":4,"ll":5,"hell":6,"hello":7,"Ġ":8,"w":9,"r":10,"d":11},"merges":["h e","l l","he ll","hell o"]}}"#;

/// `tokenizer.json`: load, then encode, decode and stream a text with special tokens, non-ASCII and control
/// characters.
fn tokenizer() -> Target {
    Target {
        name: "tokenizer",
        seeds: vec![
            TINY_WORDLEVEL.as_bytes().to_vec(),
            TINY_BPE.as_bytes().to_vec(),
            repo_file("assets/tiny-glm5/tokenizer.json"),
        ],
        dictionary: words(&[
            "\"type\":\"BPE\"",
            "\"type\":\"WordPiece\"",
            "\"type\":\"Unigram\"",
            "\"type\":\"Split\",\"pattern\":{\"Regex\":\"(a+)+$\"},\"behavior\":\"Isolated\",\"invert\":false",
            "\"pattern\":{\"Regex\":\"a{999999999}\"}",
            "\"type\":\"TemplateProcessing\",\"single\":[{\"SpecialToken\":{\"id\":\"<x>\",\"type_id\":0}}],\"pair\":[],\"special_tokens\":{}",
            "\"truncation\":{\"direction\":\"Right\",\"max_length\":0,\"strategy\":\"LongestFirst\",\"stride\":5}",
            "\"padding\":{\"strategy\":{\"Fixed\":1000000000},\"direction\":\"Right\",\"pad_to_multiple_of\":null,\"pad_id\":0,\"pad_type_id\":0,\"pad_token\":\"[PAD]\"}",
            "\"byte_fallback\":true",
            "\"dropout\":1.5",
            "\"id\":4294967295",
        ]),
        run: Box::new(|bytes| {
            let tokenizer = Tokenizer::from_json(text(bytes)?).map_err(|e| e.to_string())?;
            let ids = tokenizer
                .encode_bounded("hello world! <|user|> héllo 你好 \u{0}\t\n", 1024, "the sample")
                .map_err(|e| e.to_string())?;
            tokenizer.decode(&ids).map_err(|e| e.to_string())?;
            let mut stream = TokenStream::new(&tokenizer);
            for &id in ids.iter().chain(&[0, 1, 7, u32::MAX]) {
                if let Err(e) = stream.push(id) {
                    return Err(e.to_string());
                }
            }
            stream.finish().map_err(|e| e.to_string())?;
            Ok(())
        }),
        ci_iterations: 1_500,
        max_seconds: 5.0,
    }
}

/// Chat templates: compile, then render a conversation; loops, recursion and huge output run out of
/// budget.
fn chat_template() -> Target {
    let messages = vec![
        Message::system("You are terse."),
        Message::user("Hello there"),
        Message::assistant("Hi.").with_reasoning("The user greets."),
        Message::user("And now?"),
    ];
    Target {
        name: "template",
        seeds: vec![
            repo_file("assets/tiny-glm5/chat_template.jinja"),
            b"{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}".to_vec(),
            b"{% macro r(n) %}{% if n > 0 %}{{ r(n - 1) }}{% endif %}{% endmacro %}{{ r(10) }}{{ messages | tojson(indent=2) }}".to_vec(),
            b"{% set ns = namespace(x='') %}{% for i in range(10) %}{% set ns.x = ns.x ~ i %}{% endfor %}{{ ns.x | length }}{{ bos_token }}{{ raise_exception('no') if false }}".to_vec(),
        ],
        dictionary: words(&[
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
            "{{ 'x' * 1000000000 }}",
            "{{ messages | tojson(indent=100000000000) }}",
            "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
            "{{ raise_exception('refused') }}",
            "{% set x = [1] %}{% for i in range(30) %}{% set x = x + x %}{% endfor %}",
            "{{ 'a'.replace('', 'bbbbbbbbbbbbbbbb') }}",
            "{{ '%s' | format(messages) }}",
            "{{ m.content.split('</think>')[-1].strip() }}",
            "{% include 'x' %}",
            "{% extends 'y' %}",
            "{{",
            "{%",
            "}}",
            "%}",
            "{# ",
            "loop.cycle(",
            "|join(",
            "namespace(",
            " recursive",
        ]),
        run: Box::new(move |bytes| {
            let template = ChatTemplate::new(text(bytes)?, Some("<bos>".into()), Some("<eos>".into()))
                .map_err(|e| e.to_string())?;
            template
                .render(&messages, &ChatOptions::default())
                .map_err(|e| e.to_string())?;
            Ok(())
        }),
        ci_iterations: 2_500,
        max_seconds: 5.0,
    }
}

/// Command-line values glm5 parses itself: `--assume`, `--devices`/`--device`, `--layer-map`, `--backend`
/// and `GLM5_BACKEND`. An input is `KIND\0VALUE`.
fn cli_values() -> Target {
    let names = vec!["cpu".to_string(), "cuda:0".to_string()];
    Target {
        name: "cli",
        seeds: words(&[
            "assume\0sm_120:96GB x8",
            "assume\0sm_90:141GB x2,cpu:512GB",
            "assume\0cpu:64GB",
            "devices\0cpu",
            "devices\0cpu,,cpu",
            "device\0cuda:0",
            "layer-map\x000-1=cpu,2-77=#1",
            "layer-map\x005=cuda:0",
            "backend\0sparse_mla=reference",
            "env\0sparse_mla=reference,dsa_indexer=reference",
        ]),
        dictionary: words(&[
            "x4294967296",
            "x18446744073709551615",
            " x0",
            "99999999999999999999TB",
            "0.0000001GB",
            "-1GB",
            "sm_999999999999",
            "#18446744073709551615",
            "0-18446744073709551615=cpu",
            "77-0=cpu",
            "=",
            ",",
            ":",
            "cuda:18446744073709551616",
        ]),
        run: Box::new(move |bytes| {
            let input = text(bytes)?;
            let (kind, value) = input.split_once('\0').unwrap_or(("assume", input));
            let result = match kind {
                "assume" => glm5::plan_cli::parse_assumed(value).map(|_| ()),
                "devices" => glm5::plan_cli::parse_devices(value).map(|_| ()),
                "device" => glm5::plan_cli::parse_device(value).map(|_| ()),
                "layer-map" => glm5::plan_cli::parse_layer_map(value, &names, 78).map(|_| ()),
                "backend" => glm5::ops::registry::parse_forced(value)
                    .map(|_| ())
                    .map_err(glm5::Error::from),
                _ => glm5::plan_cli::forced_backends(&Default::default(), Some(value)).map(|_| ()),
            };
            result.map_err(|e| e.to_string())
        }),
        ci_iterations: 6_000,
        max_seconds: 2.0,
    }
}

/// GGUF files (llama.cpp's `glm-dsa`): the header and metadata, the config they map to, the tensor types,
/// every weight loaded, and the tokenizer and chat template from the metadata. Seeds: the fixtures made by
/// llama.cpp's own converter and quantiser, and one with i-quant (IQ4_NL) blocks made by gguf-py.
fn gguf() -> Target {
    let dir = scratch().join("gguf");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let le = |v: u64, bytes: usize| v.to_le_bytes()[..bytes].to_vec();
    let mut dictionary = vec![
        le(u64::MAX, 8),
        le(u64::MAX / 2, 8),
        le(1 << 40, 8),
        le(u32::MAX as u64, 4),
        le(0, 8),
        le(0, 4),
        le(1, 4),
        // Type ids: value types past the last (12), ggml types unknown (40) or IQ (16..=23).
        le(13, 4),
        le(9, 4),
        le(40, 4),
        le(16, 4),
        le(3, 4),
        b"GGUF".to_vec(),
        b"glm-dsa".to_vec(),
        b"general.alignment".to_vec(),
        b"glm-dsa.block_count".to_vec(),
        b"glm-dsa.attention.indexer.top_k".to_vec(),
        b"glm-dsa.expert_count".to_vec(),
        b"tokenizer.ggml.tokens".to_vec(),
        b"tokenizer.chat_template".to_vec(),
        b"blk.0.attn_q_a.weight".to_vec(),
        b"token_embd.weight".to_vec(),
    ];
    dictionary.extend(words(&["{{ messages }}", "\u{0}", "../x.gguf"]));
    Target {
        name: "gguf",
        seeds: vec![
            repo_file("tests/fixtures/gguf/tiny-glm5-Q8_0.gguf"),
            repo_file("tests/fixtures/gguf/tiny-glm5-Q4_K_M.gguf"),
            repo_file("tests/fixtures/gguf/tiny-glm5-IQ4_NL.gguf"),
        ],
        dictionary,
        run: Box::new(move |bytes| {
            let path = dir.join("model.gguf");
            std::fs::write(&path, bytes).map_err(|e| e.to_string())?;
            let model = GgufModel::open(&path).map_err(|e| e.to_string())?;
            // The metadata's tokenizer and template may fail on their own; the weights are still tried.
            let tokenizer = glm5::gguf::tokenizer(&model).map(|t| t.vocab_size());
            let template = glm5::gguf::chat_template(&model)
                .map(|t| t.and_then(|t| t.render(&[Message::user("hi")], &ChatOptions::default())));
            let (config, checkpoint) = Checkpoint::open_gguf(&path).map_err(|e| e.to_string())?;
            Glm5ForCausalLM::load(
                &config,
                &checkpoint,
                DType::F32,
                &Device::Cpu,
                AttentionMode::Sparse,
            )
            .map_err(|e| e.to_string())?;
            tokenizer.map_err(|e| e.to_string())?;
            if let Some(template) = template {
                template.map_err(|e| e.to_string())?;
            }
            Ok(())
        }),
        ci_iterations: 250,
        max_seconds: 10.0,
    }
}

/// Whole `glm5` command lines (`generate`, `plan`, `serve`), parsed by clap as the binary parses them. An
/// input is the arguments after `glm5`, separated by NUL bytes; they need not be UTF-8.
fn cli_args() -> Target {
    use clap::Parser;
    use std::os::unix::ffi::OsStrExt;
    Target {
        name: "cli-args",
        seeds: words(&[
            "generate\x00--prompt\x00Hello\x00--max-new-tokens\x008",
            "generate\x00--chat\x00--system\x00terse\x00--temperature\x000.7\x00--top-p\x000.9\x00--seed\x001",
            "generate\x00--model\x00zai-org/GLM-5\x00--revision\x00main\x00--offline\x00--dtype\x00bf16\x00--prompt\x00x",
            "generate\x00--devices\x00cuda:0,cuda:1\x00--layer-map\x000-1=cuda:0\x00--backend\x00sparse_mla=reference\x00--prompt\x00x\x00--raw",
            "generate\x00--model\x00unsloth/GLM-5-GGUF\x00--quant\x00UD-Q2_K_XL\x00--prompt\x00x\x00--stop\x00\n\x00--no-think",
            "plan\x00--assume\x00sm_120:96GB x8\x00--context\x00202752\x00--index-cache\x00fp8",
            "plan\x00--model\x00x.gguf\x00--devices\x00cpu\x00--attention\x00dense\x00--layer-map\x000-3=#0\x00-v",
            "serve\x00--port\x000\x00--host\x00::1\x00--api-key\x00k\x00--max-seqs\x004\x00--max-queue\x0016",
            "serve\x00--max-model-len\x00512\x00--kv-budget\x004096\x00--prefill-chunk\x0064\x00--read-timeout\x000.5\x00--shutdown-grace\x001",
            "serve\x00--devices\x00cuda:0,cuda:1\x00--micro-batches\x004",
            "generate\x00--prompt\x00x\x00--presence-penalty\x00-0.5\x00--frequency-penalty\x001.5",
        ]),
        dictionary: words(&[
            "\x00--prompt\x00",
            "\x00--chat\x00",
            "\x00--model\x00",
            "\x00--quant\x00",
            "\x00--devices\x00",
            "\x00--device\x00",
            "\x00--assume\x00",
            "\x00--layer-map\x00",
            "\x00--backend\x00",
            "\x00--max-new-tokens\x00",
            "\x00--port\x00",
            "\x00--max-seqs\x00",
            "\x00--read-timeout\x00",
            "\x00--dtype\x00",
            "\x00--help\x00",
            "\x00--version\x00",
            "\x00-vvvvvvvv\x00",
            "\x00--\x00",
            "\x00-\x00",
            "=",
            "\u{ff}",
            "\u{80}",
            "\x00generate\x00",
            "\x00plan\x00",
            "\x00serve\x00",
        ]),
        run: Box::new(move |bytes| {
            let args = std::iter::once(std::ffi::OsStr::new("glm5"))
                .chain(bytes.split(|&b| b == 0).map(std::ffi::OsStr::from_bytes));
            match glm5_main::Cli::try_parse_from(args) {
                Ok(_) => Ok(()),
                // --help and --version are not errors of the input.
                Err(e) if matches!(e.kind(), clap::error::ErrorKind::DisplayHelp
                    | clap::error::ErrorKind::DisplayVersion
                    | clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand) => Ok(()),
                // clap's message is a few lines (the error, usage, a hint); its first names the argument.
                Err(e) => {
                    let text = e.render().to_string();
                    let first = text.lines().next().unwrap_or_default().trim();
                    if first.is_empty() {
                        return Err(String::new());
                    }
                    Err(format!("{:?}: {first}", e.kind()))
                }
            }
        }),
        ci_iterations: 5_000,
        max_seconds: 2.0,
    }
}

#[test]
fn fuzz_config() {
    fuzz(config());
}

#[test]
fn fuzz_safetensors_header() {
    fuzz(safetensors_header());
}

#[test]
fn fuzz_safetensors_index() {
    fuzz(safetensors_index());
}

#[test]
fn fuzz_tokenizer() {
    fuzz(tokenizer());
}

#[test]
fn fuzz_chat_template() {
    fuzz(chat_template());
}

#[test]
fn fuzz_cli_values() {
    fuzz(cli_values());
}

#[test]
fn fuzz_gguf() {
    fuzz(gguf());
}

#[test]
fn fuzz_cli_args() {
    fuzz(cli_args());
}
