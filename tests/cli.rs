//! The `glm5` binary as a user runs it, on the embedded model.

use std::process::Command;

use glm5::{ChatOptions, GenerationParams, Glm5, LoadOptions, Message};

fn glm5(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_glm5"))
        .args(args)
        .env_remove("HF_HUB_OFFLINE")
        .output()
        .expect("runs")
}

#[test]
fn generate_streams_the_same_text_as_the_library_and_reports_speed() {
    let out = glm5(&[
        "generate",
        "--prompt",
        "Hello there",
        "--max-new-tokens",
        "10",
        "--temperature",
        "0",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stderr: {stderr}");
    assert!(
        stderr.contains("embedded"),
        "the embedded model must be labelled: {stderr}"
    );
    assert!(
        stderr.contains("tok/s") && stderr.contains("prompt:") && stderr.contains("generation:"),
        "{stderr}"
    );

    let model = Glm5::embedded(&LoadOptions::default()).unwrap();
    let prompt = model
        .apply_chat_template(&[Message::user("Hello there")], &ChatOptions::default())
        .unwrap();
    let params = GenerationParams {
        max_new_tokens: 10,
        ..Default::default()
    };
    let expected: String = model
        .generate(&prompt, &params)
        .unwrap()
        .map(|t| t.unwrap().text)
        .collect();
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        format!("{expected}\n")
    );
}

#[test]
fn bad_arguments_fail_with_one_line() {
    for args in [
        vec!["generate", "--prompt", "hi", "--temperature", "warm"],
        vec!["generate"],
        vec!["generate", "--prompt", "hi", "--top-p", "7"],
        vec![
            "generate",
            "--prompt",
            "hi",
            "--model",
            "/nonexistent/model/dir",
        ],
        vec!["generate", "--prompt", "hi", "--device", "tpu:0"],
        vec!["frobnicate"],
    ] {
        let out = glm5(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        let lines: Vec<&str> = stderr
            .lines()
            .filter(|l| !l.starts_with("[model"))
            .collect();
        assert_eq!(
            lines.len(),
            1,
            "{args:?}: expected a one-line error, got {stderr:?}"
        );
        assert!(lines[0].starts_with("error"), "{args:?}: {stderr}");
    }
}

const GLM5_CONFIG: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/assets/glm5_config.json");

/// GLM-5's bf16 weight bytes, recomputed from the tensor list (router in f32).
fn glm5_bf16_weight_bytes() -> (u64, u64) {
    use glm5::models::sizes;
    let config = glm5::Config::from_file(GLM5_CONFIG).unwrap();
    let dtype = glm5::candle_core::DType::BF16;
    let mut tensors = sizes::embedding_tensors(&config, dtype);
    tensors.extend(sizes::head_tensors(&config, dtype));
    for l in 0..config.num_hidden_layers {
        tensors.extend(sizes::layer_tensors(&config, l, dtype));
    }
    (sizes::params(&tensors), sizes::bytes(&tensors))
}

#[test]
fn plan_says_glm5_bf16_does_not_fit_8_rtx_pro_6000_and_by_how_many_bytes() {
    let out = glm5(&["plan", "--model", GLM5_CONFIG, "--assume", "sm_120:96GB x8"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    let (params, weights) = glm5_bf16_weight_bytes();
    let cache = 8192 * 78 * (512 + 64 + 128) * 2;
    let available = 8 * 96 * (1u64 << 30);
    assert!(stderr.contains("does not fit"), "{stderr}");
    assert!(
        stderr.contains(&format!("weights 1.35 TiB = {weights} B")),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("{} B missing", weights + cache - available)),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("the model has {params} parameters")),
        "{stderr}"
    );
}

#[test]
fn plan_places_glm5_bf16_on_16_rtx_pro_6000_with_the_sparse_kernels() {
    let out = glm5(&[
        "plan",
        "--model",
        GLM5_CONFIG,
        "--assume",
        "sm_120:96GB x16",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        // sparse_mla and dsa_indexer both on glm5's kernels.
        .filter(|l| l.contains(" cuda-bf16-mma ") && l.trim_end().ends_with("cuda-bf16-mma"))
        .collect();
    assert_eq!(rows.len(), 78, "{stdout}");
    let (params, weights) = glm5_bf16_weight_bytes();
    assert!(
        stdout.contains(&format!("weights: {weights} B")),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("for {params} parameters")),
        "{stdout}"
    );
    assert!(
        stdout.contains("cuda-f32-fma: needs dtype ∈ {f32}, got bf16"),
        "{stdout}"
    );
    assert!(
        stdout.contains("max context") && stdout.contains("cuda:15"),
        "{stdout}"
    );
    // How the experts and the decode step run, with the switch points the ops use.
    let switch = format!(
        "cuBLAS's grouped GEMM from {}",
        glm5::ops::moe::GROUPED_GEMM_MIN_TOKENS
    );
    assert!(stdout.contains(&switch), "{stdout}");
    // 16 GPUs hold the bf16 layers: a decode graph per GPU's run of layers.
    assert!(
        stdout.contains("replay them from CUDA graphs")
            && stdout.contains("here 16 devices, the hidden state handed between their graphs")
            && !stdout.contains("here eager"),
        "{stdout}"
    );
}

#[test]
fn plan_labels_dense_mode_and_rejects_an_invalid_forced_backend() {
    let out = glm5(&["plan", "--attention", "dense"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(
        stdout.contains("DENSE attention") && stdout.contains("skipped (dense mode)"),
        "{stdout}"
    );

    let out = glm5(&["plan", "--backend", "sparse_mla=cuda-bf16-mma"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("forced backend cuda-bf16-mma cannot serve it on cpu"),
        "{stderr}"
    );

    let out = glm5(&["plan", "--assume", "sm_75:24GB", "--dtype", "bf16"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(
        stdout.contains("needs compute capability ∈ {9.0,12.x}, got 7.5"),
        "{stdout}"
    );
}

#[test]
fn plan_and_generate_with_the_mtp_layer() {
    // GLM-5 with its MTP layer on 16 x 96 GB: one more row, with the head, and its bytes in the total.
    let out = glm5(&[
        "plan",
        "--model",
        GLM5_CONFIG,
        "--assume",
        "sm_120:96GB x16",
        "--mtp",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let config = glm5::Config::from_file(GLM5_CONFIG).unwrap();
    let n = config.num_hidden_layers;
    let mtp_row = stdout
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("MTP {n}")))
        .unwrap_or_else(|| panic!("no MTP row: {stdout}"));
    assert!(
        mtp_row.contains("cuda:15") && mtp_row.contains("moe"),
        "{mtp_row}"
    );
    let mtp_bytes = glm5::models::sizes::bytes(&glm5::models::sizes::mtp_tensors(
        &config,
        glm5::candle_core::DType::BF16,
    ));
    let (_, weights) = glm5_bf16_weight_bytes();
    assert!(
        stdout.contains(&format!("weights: {} B", weights + mtp_bytes)),
        "{stdout}"
    );
    assert!(stdout.contains("the MTP layer"), "{stdout}");

    // generate --mtp on the embedded model: greedy text as without it, and the drafts counted.
    let args = [
        "generate",
        "--prompt",
        "Hello there",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
    ];
    let plain = glm5(&args);
    let mut with_mtp = args.to_vec();
    with_mtp.push("--mtp");
    let speculative = glm5(&with_mtp);
    let stderr = String::from_utf8_lossy(&speculative.stderr);
    assert!(speculative.status.success(), "{stderr}");
    assert_eq!(speculative.stdout, plain.stdout);
    assert!(stderr.contains("MTP drafts:"), "{stderr}");

    // --enforce-eager changes nothing on the CPU (its steps are eager already).
    with_mtp.push("--enforce-eager");
    let eager = glm5(&with_mtp);
    assert!(eager.status.success());
    assert_eq!(eager.stdout, plain.stdout);
}
