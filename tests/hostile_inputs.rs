//! A hostile but fair user: each class of bad input from the security review gets one typed error line that
//! names the file, field or argument and the limit; none panics, hangs or allocates without bound. (The
//! malicious Hub is `tests/hub_hostile.rs`; the fuzz targets are `tests/fuzz.rs`, whose finds land here.)

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use glm5::chat::{ChatError, ChatOptions, ChatTemplate, Message};
use glm5::models::config::limits;
use glm5::models::{sizes, Checkpoint, Config, ModelError};
use glm5::tokenizer::{Tokenizer, TokenizerError};
use glm5::{Error, GenerationParams, Glm5, LoadOptions};

fn repo_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn glm5_json() -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(repo_path("tests/assets/glm5_config.json")).unwrap())
        .unwrap()
}

fn with(field: &str, value: serde_json::Value) -> String {
    let mut json = glm5_json();
    json[field] = value;
    json.to_string()
}

/// The embedded model's files, copied so that one can be replaced.
fn model_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(repo_path("assets/tiny-glm5")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    dir
}

fn one_line(message: &str) {
    assert!(
        !message.is_empty() && !message.contains('\n'),
        "not one line: {message:?}"
    );
}

#[test]
fn config_sizes_above_their_bounds_name_the_field_and_the_limit() {
    for (field, limit) in [
        ("index_topk", limits::INDEX_TOPK),
        ("vocab_size", limits::VOCAB_SIZE),
        ("hidden_size", limits::HIDDEN_SIZE),
        ("num_hidden_layers", limits::NUM_HIDDEN_LAYERS),
        ("n_routed_experts", limits::ROUTED_EXPERTS),
        ("max_position_embeddings", limits::MAX_POSITION_EMBEDDINGS),
        ("kv_lora_rank", limits::LORA_RANK),
        ("v_head_dim", limits::HEAD_DIM),
    ] {
        for value in [serde_json::json!(limit + 1), serde_json::json!(u64::MAX)] {
            let err = Config::from_json(&with(field, value)).unwrap_err();
            match &err {
                ModelError::InvalidConfig { field: got, reason } => {
                    assert_eq!(*got, field);
                    assert!(reason.contains(&limit.to_string()), "{reason}");
                }
                other => panic!("{field}: expected InvalidConfig, got {other:?}"),
            }
            one_line(&err.to_string());
        }
    }
    // The 32-TB `index_topk` of the review: refused by the field's bound.
    assert!(Config::from_json(&with("index_topk", serde_json::json!(1u64 << 40))).is_err());
}

#[test]
fn a_model_of_absurd_total_size_is_refused_and_sizes_never_wrap() {
    // Every field within its bound, together 2^46+ parameters.
    let mut json = glm5_json();
    json["vocab_size"] = serde_json::json!(limits::VOCAB_SIZE);
    json["hidden_size"] = serde_json::json!(limits::HIDDEN_SIZE);
    json["num_hidden_layers"] = serde_json::json!(limits::NUM_HIDDEN_LAYERS);
    json["n_routed_experts"] = serde_json::json!(limits::ROUTED_EXPERTS);
    json["moe_intermediate_size"] = serde_json::json!(limits::INTERMEDIATE_SIZE);
    let err = Config::from_json(&json.to_string()).unwrap_err();
    assert!(
        err.to_string().contains(&limits::PARAMETERS.to_string()),
        "{err}"
    );

    // A config built by hand past the bounds: sizes saturate, they never wrap to something that fits.
    let mut config = Config::from_json(&glm5_json().to_string()).unwrap();
    config.vocab_size = usize::MAX / 2;
    let embed = sizes::embedding_tensors(&config, glm5::candle_core::DType::F32);
    assert_eq!(sizes::bytes(&embed), u64::MAX);
    config.num_attention_heads = usize::MAX;
    let layer = sizes::layer_tensors(&config, 0, glm5::candle_core::DType::BF16);
    assert_eq!(sizes::bytes(&layer), u64::MAX);
    // The real GLM-5 is counted the same way by the config and by the tensor list.
    let config = Config::from_json(&glm5_json().to_string()).unwrap();
    let dtype = glm5::candle_core::DType::BF16;
    let mut params = sizes::params(&sizes::embedding_tensors(&config, dtype))
        + sizes::params(&sizes::head_tensors(&config, dtype));
    for layer in 0..config.num_hidden_layers {
        params += sizes::params(&sizes::layer_tensors(&config, layer, dtype));
    }
    assert_eq!(u128::from(params), config.parameter_count());
    assert!(
        params > 700_000_000_000 && params < 800_000_000_000,
        "{params}"
    );
}

#[test]
fn fifos_and_devices_fail_fast_instead_of_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    let made = Command::new("mkfifo").arg(&fifo).status();
    assert!(made.is_ok_and(|s| s.success()), "mkfifo");
    let started = Instant::now();
    for path in [fifo.as_path(), Path::new("/dev/zero")] {
        let err = Tokenizer::from_file(path).err().expect("refused");
        assert!(err.to_string().contains("not a regular file"), "{err}");
        let err = Config::from_file(path).unwrap_err();
        assert!(err.to_string().contains("not a regular file"), "{err}");
        one_line(&err.to_string());
    }
    // As a model's chat template, tokenizer_config.json and generation_config.json.
    for name in [
        "chat_template.jinja",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        let model = model_dir();
        let target = model.path().join(name);
        std::fs::remove_file(&target).unwrap();
        let made = Command::new("mkfifo").arg(&target).status();
        assert!(made.is_ok_and(|s| s.success()));
        if name == "generation_config.json" {
            let err =
                Glm5::from_pretrained(model.path().to_str().unwrap(), &LoadOptions::default())
                    .err()
                    .expect("refused");
            assert!(err.to_string().contains("not a regular file"), "{err}");
        } else {
            let err = ChatTemplate::from_model_dir(model.path())
                .err()
                .expect("refused");
            assert!(matches!(err, ChatError::Io { .. }), "{err:?}");
            assert!(err.to_string().contains("not a regular file"), "{err}");
        }
    }
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn oversized_files_are_refused_before_they_are_read() {
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("tokenizer.json");
    let file = std::fs::File::create(&big).unwrap();
    // Sparse: no disk is used, the size alone is refused.
    file.set_len(glm5::tokenizer::MAX_TOKENIZER_BYTES + 1)
        .unwrap();
    let err = Tokenizer::from_file(&big).err().expect("refused");
    assert!(
        err.to_string()
            .contains(&glm5::tokenizer::MAX_TOKENIZER_BYTES.to_string()),
        "{err}"
    );
    let config = dir.path().join("config.json");
    std::fs::File::create(&config)
        .unwrap()
        .set_len(limits::CONFIG_FILE_BYTES + 1)
        .unwrap();
    let err = Config::from_file(&config).unwrap_err();
    assert!(err.to_string().contains("config.json"), "{err}");
    assert!(
        err.to_string()
            .contains(&limits::CONFIG_FILE_BYTES.to_string()),
        "{err}"
    );
}

#[test]
fn template_errors_keep_their_cause() {
    // A syntax error is a syntax error, naming the file and the line, not "the model ships no chat template".
    let model = model_dir();
    std::fs::write(
        model.path().join("chat_template.jinja"),
        "{% for m in messages %}",
    )
    .unwrap();
    let err = ChatTemplate::from_model_dir(model.path()).err().unwrap();
    assert!(matches!(err, ChatError::Syntax { .. }), "{err:?}");
    assert!(err.to_string().contains("chat_template.jinja"), "{err}");
    one_line(&err.to_string());
    let loaded =
        Glm5::from_pretrained(model.path().to_str().unwrap(), &LoadOptions::default()).unwrap();
    let err = loaded
        .apply_chat_template(&[Message::user("hi")], &ChatOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("does not parse") && !err.contains("ships no"),
        "{err}"
    );

    // Not UTF-8.
    std::fs::write(model.path().join("chat_template.jinja"), [0xff, 0xfe, b'x']).unwrap();
    let err = ChatTemplate::from_model_dir(model.path()).err().unwrap();
    assert!(matches!(err, ChatError::Io { .. }), "{err:?}");
    assert!(err.to_string().contains("UTF-8"), "{err}");

    // An invalid tokenizer_config.json (the template then comes from it).
    std::fs::remove_file(model.path().join("chat_template.jinja")).unwrap();
    std::fs::write(
        model.path().join("tokenizer_config.json"),
        "{\"chat_template\": ",
    )
    .unwrap();
    let err = ChatTemplate::from_model_dir(model.path()).err().unwrap();
    assert!(matches!(err, ChatError::Json { .. }), "{err:?}");
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");

    // Only a missing template is reported as missing.
    std::fs::write(model.path().join("tokenizer_config.json"), "{}").unwrap();
    assert!(matches!(
        ChatTemplate::from_model_dir(model.path()),
        Err(ChatError::MissingTemplate { .. })
    ));
}

#[test]
fn template_work_recursion_and_output_are_bounded() {
    let messages = [Message::user("hi")];
    let started = Instant::now();
    for (source, needle) in [
        // Loops that would run for hours.
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
            "fuel",
        ),
        // 1 GB of output in one expression, and a string doubled 40 times.
        ("{{ 'x' * 1000000000 }}", "fuel"),
        (
            "{% set ns = namespace(x='xxxxxxxx') %}{% for i in range(40) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}{{ ns.x|length }}",
            "fuel",
        ),
        // Endless recursion.
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursion"),
        // Our own tojson: an indent that would allocate terabytes.
        ("{{ messages | tojson(indent=100000000000) }}", "indent"),
    ] {
        let template = ChatTemplate::new(source, None, None).unwrap();
        let err = template
            .render(&messages, &ChatOptions::default())
            .unwrap_err();
        assert!(matches!(err, ChatError::Render(_)), "{err:?}");
        let text = err.to_string();
        assert!(text.to_lowercase().contains(needle), "{source}: {text}");
        one_line(&text);
    }
    assert!(started.elapsed() < Duration::from_secs(20));
    // A long but honest conversation is not cut off by the budget, which grows with it.
    let long = "word ".repeat(2_000_000);
    let template = ChatTemplate::new(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
        None,
        None,
    )
    .unwrap();
    let text = template
        .render(&[Message::user(long.clone())], &ChatOptions::default())
        .unwrap();
    assert_eq!(text.len(), "user: ".len() + long.len() + 1);
}

/// The two minijinja 3.1.0 bugs patched in `third_party/minijinja` (GLM5-PATCH.md): a namespace that holds
/// itself (printing it overflowed the stack and aborted; found by the `template` fuzz target) and a list
/// doubled past the lazy-chain depth (copied into 2^33 items without fuel; it grew past 12 GB).
#[test]
fn template_cycles_and_list_doubling_are_typed_errors() {
    let messages = [Message::user("hi")];
    let unrolled = format!(
        "{{% set x = [1] %}}{}{{{{ x|length }}}}",
        "{% set x = x + x %}".repeat(40)
    );
    let started = Instant::now();
    for (source, needle) in [
        (
            "{% set ns = namespace(x='') %}{% set ns.x = ns %}{{ ns.x ~ 1 }}",
            "cycle",
        ),
        // Through a list, a map and a second namespace.
        ("{% set ns = namespace() %}{% set ns.x = [1, [ns]] %}{{ ns }}", "cycle"),
        ("{% set ns = namespace() %}{% set ns.x = {'a': {'b': ns}} %}{{ ns }}", "cycle"),
        (
            "{% set a = namespace() %}{% set b = namespace(y=a) %}{% set a.x = b %}{{ a }}",
            "cycle",
        ),
        // Through a lazy list chain.
        ("{% set ns = namespace() %}{% set ns.x = [1] + [ns] %}{{ ns }}", "cycle"),
        (
            "{% set ns = namespace(x=[1]) %}{% for i in range(40) %}{% set ns.x = ns.x + ns.x %}{% endfor %}{{ ns.x|length }}",
            "fuel",
        ),
        // The same without a loop.
        (unrolled.as_str(), "fuel"),
    ] {
        let template = ChatTemplate::new(source, None, None).unwrap();
        let err = template
            .render(&messages, &ChatOptions::default())
            .unwrap_err();
        assert!(matches!(err, ChatError::Render(_)), "{err:?}");
        let text = err.to_string();
        assert!(text.to_lowercase().contains(needle), "{source}: {text}");
        one_line(&text);
    }
    assert!(started.elapsed() < Duration::from_secs(20));
    // What templates do with namespaces still works: values copied between namespaces, lists grown by
    // concatenation, a namespace holding another one (no cycle).
    let template = ChatTemplate::new(
        "{% set a = namespace(items=[], n=0) %}{% set b = namespace(inner=a) %}{% for m in messages %}\
         {% set a.items = a.items + [m.content] %}{% set a.n = a.n + 1 %}{% set b.last = m %}{% endfor %}\
         {{ b.inner.n }} {{ a.items|join(',') }} {{ b.last.role }}",
        None,
        None,
    )
    .unwrap();
    let text = template
        .render(
            &[Message::user("x"), Message::assistant("y")],
            &ChatOptions::default(),
        )
        .unwrap();
    assert_eq!(text, "2 x,y assistant");
}

#[test]
fn a_huge_prompt_is_refused_before_it_is_tokenised() {
    let model = Glm5::embedded(&LoadOptions::default()).unwrap();
    let max = model.model().config().max_position_embeddings;
    // Far more bytes than the context could hold at any tokenizer's density: no tokenising at all, so it is
    // immediate, where tokenising 120 MB took 15 GB.
    let huge = "a".repeat(max * glm5::tokenizer::MAX_BYTES_PER_TOKEN + 1);
    let started = Instant::now();
    match model
        .generate(&huge, &GenerationParams::default())
        .err()
        .unwrap()
    {
        Error::Tokenizer(TokenizerError::TooLong { bytes, limit, .. }) => {
            assert_eq!((bytes, limit), (huge.len(), max))
        }
        other => panic!("expected TooLong, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(1));
    // An overflowing max_new_tokens is no overflow: the limit reported is the model's context.
    let params = GenerationParams {
        max_new_tokens: usize::MAX,
        ..Default::default()
    };
    let long = "a ".repeat(max * 2);
    match model.generate(&long, &params).err().unwrap() {
        Error::PromptTooLong { limit, .. } => assert_eq!(limit, max),
        other => panic!("expected PromptTooLong, got {other:?}"),
    }
}

#[test]
fn local_index_shards_stay_inside_the_model_directory() {
    let fixture = repo_path("tests/fixtures/dense_equiv");
    let outside = tempfile::tempdir().unwrap();
    let secret = outside.path().join("secret.safetensors");
    std::fs::copy(fixture.join("model-00001-of-00003.safetensors"), &secret).unwrap();
    for shard in [
        format!(
            "../{}/secret.safetensors",
            outside.path().file_name().unwrap().to_str().unwrap()
        ),
        secret.display().to_string(),
        "a/../../x.safetensors".to_string(),
        String::new(),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let index = serde_json::json!({"weight_map": {"model.embed_tokens.weight": shard}});
        std::fs::write(
            dir.path().join("model.safetensors.index.json"),
            index.to_string(),
        )
        .unwrap();
        let err = Checkpoint::open(dir.path()).err().expect("refused");
        match &err {
            ModelError::Checkpoint { path, reason } => {
                assert!(path.ends_with("model.safetensors.index.json"));
                assert!(reason.contains("inside the model directory"), "{reason}");
            }
            other => panic!("{shard:?}: expected Checkpoint, got {other:?}"),
        }
    }
}

#[test]
fn non_finite_logits_fail_naming_the_step() {
    // The embedded model with every weight byte 0xff (NaN in f32, bf16 and f16): greedy sampling must not
    // print whatever argmax picks from NaN logits.
    let model = model_dir();
    let weights = model.path().join("model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let data = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    bytes[data..].fill(0xff);
    std::fs::write(&weights, bytes).unwrap();
    let broken =
        Glm5::from_pretrained(model.path().to_str().unwrap(), &LoadOptions::default()).unwrap();
    let mut generation = broken
        .generate("hello", &GenerationParams::default())
        .unwrap();
    match generation.next().unwrap() {
        Err(Error::NonFiniteLogits { what, step, .. }) => assert_eq!((what, step), ("NaN", 0)),
        other => panic!("expected NonFiniteLogits, got {other:?}"),
    }

    // The check itself, on each kind of bad logits.
    let device = glm5::candle_core::Device::Cpu;
    let tensor = |v: &[f32]| glm5::candle_core::Tensor::new(v, &device).unwrap();
    match glm5::generate::check_logits(&tensor(&[1.0, f32::NAN, 0.5]), 3, 17) {
        Err(Error::NonFiniteLogits {
            what,
            step,
            position,
        }) => assert_eq!((what, step, position), ("NaN", 3, 17)),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        glm5::generate::check_logits(&tensor(&[1.0, f32::INFINITY]), 0, 1),
        Err(Error::NonFiniteLogits { what: "+inf", .. })
    ));
    assert!(matches!(
        glm5::generate::check_logits(&tensor(&[f32::NEG_INFINITY; 3]), 0, 1),
        Err(Error::NonFiniteLogits {
            what: "only -inf",
            ..
        })
    ));
    assert!(glm5::generate::check_logits(&tensor(&[1.0, f32::NEG_INFINITY, 0.0]), 0, 1).is_ok());
    // Finite logits whose sum overflows pass; +inf and NaN together are NaN.
    assert!(glm5::generate::check_logits(&tensor(&[f32::MAX, f32::MAX]), 0, 1).is_ok());
    assert!(matches!(
        glm5::generate::check_logits(&tensor(&[f32::INFINITY, f32::NAN]), 0, 1),
        Err(Error::NonFiniteLogits { what: "NaN", .. })
    ));
}

fn glm5_bin(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_glm5"))
        .args(args)
        .env_remove("HF_HUB_OFFLINE")
        .env_remove("GLM5_BACKEND")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("runs");
    if let Some(text) = stdin {
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
    } else {
        drop(child.stdin.take());
    }
    child.wait_with_output().unwrap()
}

/// The one error line of a failed run.
fn error_line(out: &Output) -> String {
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.starts_with('[')).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    lines[0].to_string()
}

#[test]
fn cli_arguments_are_checked_with_one_line_naming_them() {
    for (args, needles) in [
        (
            vec!["generate", "--prompt", "hi", "--devices", ""],
            vec!["--devices", "no device"],
        ),
        (
            vec!["generate", "--prompt", "hi", "--devices", ",,"],
            vec!["--devices", "no device"],
        ),
        (
            vec!["plan", "--devices", ","],
            vec!["--devices", "no device"],
        ),
        (
            vec!["generate", "--prompt", "hi", "--layer-map", "0-1=cpu"],
            vec!["--layer-map", "--devices"],
        ),
        (
            vec![
                "generate",
                "--prompt",
                "hi",
                "--max-new-tokens",
                "99999999999999999999999",
            ],
            vec!["--max-new-tokens"],
        ),
        (
            vec!["generate", "--chat", "--max-context", "0"],
            vec!["--max-context", "0", "2.."],
        ),
        (vec!["plan", "--context", "0"], vec!["--context", "1.."]),
        (
            vec!["plan", "--assume", "sm_90:80GB x1000000000"],
            vec!["--assume", "4096"],
        ),
        (vec!["generate"], vec!["--prompt"]),
    ] {
        let started = Instant::now();
        let out = glm5_bin(&args, Some(""));
        let line = error_line(&out);
        for needle in needles {
            assert!(line.contains(needle), "{args:?}: {line}");
        }
        assert!(started.elapsed() < Duration::from_secs(30), "{args:?}");
    }
}

#[test]
fn chat_rejects_a_turn_and_goes_on() {
    // A turn too long for --max-context, then a normal one: the first is refused, the second answered,
    // and the conversation ends normally at end of input.
    let long = "hello ".repeat(3000);
    let input = format!("{long}\nHello there\n");
    let out = glm5_bin(
        &[
            "generate",
            "--chat",
            "--max-context",
            "64",
            "--max-new-tokens",
            "4",
            "--temperature",
            "0",
        ],
        Some(&input),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("this turn was dropped"), "{stderr}");
    assert!(
        stderr.contains("--max-context is 64") || stderr.contains("bytes"),
        "{stderr}"
    );
    // The second turn was answered: one generation summary line.
    assert_eq!(stderr.matches("generation:").count(), 1, "{stderr}");

    // Filling the context: every later turn is refused, the conversation stays until /reset or /exit.
    let input = "Hello there\n".repeat(12) + "/reset\nHello there\n/exit\n";
    let out = glm5_bin(
        &[
            "generate",
            "--chat",
            "--max-context",
            "48",
            "--max-new-tokens",
            "8",
            "--temperature",
            "0",
        ],
        Some(&input),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("this turn was dropped"), "{stderr}");
    assert!(stderr.contains("[conversation cleared]"), "{stderr}");
}

// Inputs the fuzzer (`tests/fuzz.rs`) found, kept as regular tests.

#[test]
fn fuzz_find_tokenizer_syntax_error_inside_the_decoder() {
    // tokenizers 0.23 panicked ("Helper") on a JSON syntax error inside the decoder object.
    let text = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,
"pre_tokenizer":null,"post_processor":null,"decoder":{&type":"ByteLevel","add_prefix_space":true},
"model":{"type":"WordLevel","vocab":{"<unk>":0},"unk_token":"<unk>"}}"#;
    let err = Tokenizer::from_json(text).err().expect("refused");
    assert!(matches!(err, TokenizerError::Load { .. }), "{err:?}");
    one_line(&err.to_string());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, text).unwrap();
    assert!(Tokenizer::from_file(&path).is_err());
}

#[test]
fn fuzz_find_tokenizer_merge_longer_than_the_vocabulary() {
    // tokenizers 0.23 sliced past its buffer (a panic) for a BPE merge longer than every vocabulary entry.
    let text = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,
"pre_tokenizer":null,"post_processor":null,"decoder":null,
"model":{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,"end_of_word_suffix":null,
"fuse_unk":false,"byte_fallback":false,"vocab":{"h":0,"e":1},"merges":["h e"]}}"#;
    let err = Tokenizer::from_json(text).err().expect("refused");
    assert!(err.to_string().contains("merges"), "{err}");
    one_line(&err.to_string());
}

#[test]
fn fuzz_find_layer_map_device_with_a_newline() {
    // The device name of a --layer-map entry was echoed raw: a newline in it broke the one error line.
    let names = ["cpu".to_string()];
    let err = glm5::plan_cli::parse_layer_map("0-1=cpu\ne-320,", &names, 4).unwrap_err();
    one_line(&err.to_string());
}

#[test]
fn fuzz_find_template_error_text_with_line_breaks() {
    // A template's own error text (here raise_exception's; the fuzzer's came from a string literal cut
    // across lines) was printed as is: its line breaks made the error several lines.
    let template = ChatTemplate::new(
        "{{ raise_exception('unknown role\nin two lines') }}",
        None,
        None,
    )
    .unwrap();
    let err = template
        .render(&[Message::user("hi")], &ChatOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown role"), "{err}");
    one_line(&err);
}

#[test]
fn template_recursion_at_the_limit_fits_a_small_thread_stack() {
    // Test threads and tokio workers have 2 MiB of stack: recursion up to the limit must end in an error
    // there, not in a stack overflow (which aborts the process).
    let sources = [
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
        "{% macro f(n) %}{% for x in [1, 2] %}{% if x == 1 %}{{ (f(n ~ 'x') ~ 'y') | upper | trim }}{% endif %}{% endfor %}{% endmacro %}{{ f('a') }}",
        "{% macro f(n) %}{% set ns = namespace(v=n) %}{{ {'a': [ns.v, f(n + 1)]} | tojson }}{% endmacro %}{{ f(0) }}",
        "{% for m in messages recursive %}{{ loop([m, m]) }}{% endfor %}",
    ];
    for source in sources {
        let result = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || {
                let template = ChatTemplate::new(source, None, None).unwrap();
                template
                    .render(&[Message::user("hi")], &ChatOptions::default())
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            })
            .unwrap()
            .join()
            .unwrap();
        assert!(result.is_err(), "{source}");
    }
}

#[test]
fn fuzz_find_gguf_tokenizer_error_carried_candles_backtrace() {
    // With RUST_BACKTRACE set, candle attaches a backtrace to its errors, and a GGUF whose merges name a
    // token outside the vocabulary printed it as part of the error (many lines instead of one).
    let mut bytes = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/tiny-glm5-Q8_0.gguf"),
    )
    .unwrap();
    let merges = bytes
        .windows(21)
        .position(|w| w == b"tokenizer.ggml.merges")
        .unwrap();
    let merge = merges
        + bytes[merges..]
            .windows(3)
            .position(|w| w == b"h e")
            .unwrap();
    bytes[merge + 2] = b'Z';
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_glm5"));
    command
        .args([
            "generate",
            "--model",
            path.to_str().unwrap(),
            "--prompt",
            "hi",
        ])
        .env("RUST_BACKTRACE", "1");
    let output = command.output().unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    one_line(stderr.trim());
    assert!(stderr.contains("Token `hZ` out of vocabulary"), "{stderr}");
    let model = glm5::models::weights::gguf::GgufModel::open(&path).unwrap();
    let err = glm5::gguf::tokenizer(&model).err().expect("refused");
    assert!(matches!(err, TokenizerError::Load { .. }), "{err:?}");
}

#[test]
fn fuzz_find_gguf_key_swallowing_binary_data() {
    // A metadata key whose length covers the binary data after it was quoted whole in the error: kilobytes
    // with newlines. Keys and tensor names with control characters (or past 1 KiB) are refused, quoted short.
    let mut bytes = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/tiny-glm5-Q8_0.gguf"),
    )
    .unwrap();
    let key = bytes
        .windows(21)
        .position(|w| w == b"tokenizer.ggml.merges")
        .unwrap();
    bytes[key - 8..key].copy_from_slice(&300u64.to_le_bytes());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let Err(err) = glm5::models::weights::gguf::GgufModel::open(&path) else {
        panic!("a key with control characters was accepted");
    };
    let text = err.to_string();
    one_line(&text);
    assert!(
        text.contains("is not a name") && text.len() < 1000,
        "{text}"
    );
}

#[test]
fn fuzz_find_gguf_tokenizer_error_on_two_lines() {
    // candle's error for a GGUF tokenizer without merges put its context on a second line.
    let mut bytes = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/tiny-glm5-Q8_0.gguf"),
    )
    .unwrap();
    let key = bytes
        .windows(21)
        .position(|w| w == b"tokenizer.ggml.merges")
        .unwrap();
    bytes[key + 20] = b'x';
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let model = glm5::models::weights::gguf::GgufModel::open(&path).unwrap();
    let err = glm5::gguf::tokenizer(&model).err().expect("refused");
    let text = err.to_string();
    one_line(&text);
    assert!(text.contains("tokenizer.ggml.merges"), "{text}");
}
