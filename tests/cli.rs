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
