//! Checks the executed quickstart notebook (CI runs it with nbconvert first and names the result in
//! `GLM5_EXECUTED_NOTEBOOK`): no cell failed, and the top-5 next tokens it printed are the ones computed here,
//! independently, from `forward()` logits for the same prompt.

use glm5::{Glm5, LoadOptions};
use serde_json::Value;

fn cell_text(cell: &Value, key: &str) -> String {
    match &cell[key] {
        Value::String(s) => s.clone(),
        Value::Array(lines) => lines.iter().filter_map(Value::as_str).collect(),
        _ => String::new(),
    }
}

/// (source, text of the outputs) of every code cell.
fn code_cells(notebook: &Value) -> Vec<(String, String)> {
    notebook["cells"]
        .as_array()
        .expect("cells")
        .iter()
        .filter(|c| c["cell_type"] == "code")
        .map(|c| {
            let outputs = c["outputs"].as_array().cloned().unwrap_or_default();
            let text = outputs
                .iter()
                .map(|o| {
                    assert_ne!(o["output_type"], "error", "a notebook cell failed: {o}");
                    let mut t = cell_text(o, "text");
                    if let Some(data) = o["data"].as_object() {
                        for value in data.values() {
                            t.push_str(&cell_text(&serde_json::json!({ "v": value }), "v"));
                        }
                    }
                    t
                })
                .collect();
            (cell_text(c, "source"), text)
        })
        .collect()
}

#[test]
fn executed_notebook_outputs_match_the_library() {
    let Some(path) = std::env::var_os("GLM5_EXECUTED_NOTEBOOK") else {
        eprintln!("GLM5_EXECUTED_NOTEBOOK is not set: the notebook was not executed here (.ci/run executes it)");
        return;
    };
    let notebook: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("executed notebook")).unwrap();
    let cells = code_cells(&notebook);

    let (source, output) = cells
        .iter()
        .find(|(s, _)| s.contains("top_next_tokens"))
        .expect("the top-5 cell");
    let prompt = source
        .split("let prompt = \"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .expect("prompt literal");
    let printed: Vec<(u32, f32)> = output
        .lines()
        .filter_map(|l| l.strip_prefix("top5 "))
        .map(|l| {
            let mut parts = l.split_whitespace();
            (
                parts.next().unwrap().parse().unwrap(),
                parts.next().unwrap().parse().unwrap(),
            )
        })
        .collect();

    // Independently: logits of the last position, softmax in f64, five largest.
    let model = Glm5::embedded(&LoadOptions::default()).unwrap();
    let ids = model.tokenizer().encode(prompt).unwrap();
    let mut cache = model.new_cache(ids.len()).unwrap();
    let logits: Vec<Vec<f32>> = model
        .forward(&ids, 0, &mut cache)
        .unwrap()
        .to_vec2()
        .unwrap();
    let last = logits.last().unwrap();
    let max = last.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let total: f64 = last.iter().map(|&l| (l as f64 - max).exp()).sum();
    let mut ranked: Vec<(u32, f64)> = last
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, (l as f64 - max).exp() / total))
        .collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
    assert_eq!(printed.len(), 5, "the notebook printed {printed:?}");
    for ((id, p), (want_id, want_p)) in printed.iter().zip(&ranked[..5]) {
        assert_eq!(
            id,
            want_id,
            "notebook top-5 {printed:?} vs {:?}",
            &ranked[..5]
        );
        assert!(
            (*p as f64 - want_p).abs() < 1e-5,
            "probability of {id}: {p} vs {want_p}"
        );
    }

    let (_, svg) = cells
        .iter()
        .find(|(s, _)| s.contains("selection_map"))
        .expect("the selection cell");
    assert!(
        svg.contains("<svg") && svg.contains("DSA selections"),
        "the selection map was not displayed"
    );
    let (_, plan) = cells
        .iter()
        .find(|(s, _)| s.contains("layer_backends"))
        .expect("the plan cell");
    assert!(plan.contains("sparse_mla:"), "{plan}");
}
