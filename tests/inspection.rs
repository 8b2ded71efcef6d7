//! The inspection helpers notebooks use: top next tokens, DSA selection maps, per-layer backends.

use glm5::generate::argmax;
use glm5::{AttentionMode, Glm5, LoadOptions};

const LONG: &str = "Once upon a time, in a small village by the sea, there lived an old fisherman who went out every \
                    morning before dawn and came back every evening with stories.";

#[test]
fn top_next_tokens_are_the_softmax_of_the_last_logits() {
    let model = Glm5::embedded(&LoadOptions::default()).unwrap();
    let top = model.top_next_tokens("Hello there", 5).unwrap();
    let ids = model.tokenizer().encode("Hello there").unwrap();
    let mut cache = model.new_cache(ids.len()).unwrap();
    let logits = model.forward(&ids, 0, &mut cache).unwrap();
    let last = logits.get(ids.len() - 1).unwrap();
    assert_eq!(top[0].id, argmax(&last).unwrap());
    let row: Vec<f32> = last.to_vec1().unwrap();
    let ratio = (top[0].probability / top[1].probability).ln();
    assert!((ratio - (row[top[0].id as usize] - row[top[1].id as usize])).abs() < 1e-4);
    assert!(top.iter().map(|t| t.probability).sum::<f32>() <= 1.0 + 1e-6);
}

#[test]
fn selection_map_shows_each_layers_top_k_of_the_last_token() {
    let model = Glm5::embedded(&LoadOptions::default()).unwrap();
    let map = model.selection_map(LONG).unwrap();
    let topk = model.model().config().index_topk;
    assert!(map.tokens.len() > topk);
    assert_eq!(map.layers.len(), model.model().config().num_hidden_layers);
    for layer in &map.layers {
        assert_eq!(layer.len(), topk);
        assert!(layer.windows(2).all(|w| w[0] < w[1]) && *layer.last().unwrap() <= map.query());
    }
    let svg = map.to_svg();
    assert_eq!(
        svg.matches("<rect").count(),
        map.layers.len() * map.tokens.len()
    );
    assert_eq!(svg.matches("#1f5fbf").count(), map.layers.len() * topk);

    let dense = Glm5::embedded(&LoadOptions {
        attention: AttentionMode::Dense,
        ..Default::default()
    })
    .unwrap();
    let all = dense.selection_map(LONG).unwrap();
    assert!(all
        .layers
        .iter()
        .all(|l| *l == (0..=all.query()).collect::<Vec<_>>()));
}

#[test]
fn layer_backends_name_the_cpu_reference_and_the_mode() {
    let model = Glm5::embedded(&LoadOptions::default()).unwrap();
    let plan = model.model().layer_backends();
    assert_eq!(plan.len(), model.model().config().num_hidden_layers);
    assert!(plan
        .iter()
        .all(|l| l.sparse_mla.starts_with("reference") && l.attention == AttentionMode::Sparse));
    let dense = Glm5::embedded(&LoadOptions {
        attention: AttentionMode::Dense,
        ..Default::default()
    })
    .unwrap();
    assert!(dense.model().layer_backends()[0]
        .to_string()
        .contains("Dense"));
}
