//! The reference: routing on the host in f32, one chain of candle ops per chosen expert. It accumulates the
//! experts' outputs in `x`'s dtype with `index_add`, expert by expert in ascending id order (equal to the
//! contract in f32; in bf16 within the rounding of those adds).

use candle_core::Tensor;

use super::{RouteRule, Routes};
use crate::error::Result;

pub(super) fn route(
    logits: &Tensor,
    correction_bias: &Tensor,
    rule: &RouteRule,
    shared_expert: Option<u32>,
) -> Result<Routes> {
    let device = logits.device();
    let scores: Vec<Vec<f32>> = logits.to_vec2()?;
    let bias: Vec<f32> = correction_bias.to_vec1()?;
    let slots = rule.top_k + usize::from(shared_expert.is_some());
    let (mut ids, mut gates) = (
        Vec::with_capacity(scores.len() * slots),
        Vec::with_capacity(scores.len() * slots),
    );
    for logits_of_token in &scores {
        let score: Vec<f32> = logits_of_token
            .iter()
            .map(|&l| 1.0 / (1.0 + (-l).exp()))
            .collect();
        for (expert, gate) in route_token(&score, &bias, rule) {
            ids.push(expert as u32);
            gates.push(gate);
        }
        if let Some(shared) = shared_expert {
            ids.push(shared);
            gates.push(1.0);
        }
    }
    let t = scores.len();
    Ok(Routes {
        ids: Tensor::from_vec(ids, (t, slots), device)?,
        gates: Tensor::from_vec(gates, (t, slots), device)?,
    })
}

/// One token's experts and gates from its sigmoid scores.
fn route_token(score: &[f32], bias: &[f32], rule: &RouteRule) -> Vec<(usize, f32)> {
    let choice: Vec<f32> = score.iter().zip(bias).map(|(s, b)| s + b).collect();
    // Group limiting: a group's score is the sum of its two best choice scores; keep topk_group groups.
    let group_size = choice.len() / rule.n_group;
    let group_score = |g: usize| {
        let mut members: Vec<f32> = choice[g * group_size..(g + 1) * group_size].to_vec();
        members.sort_by(|a, b| b.total_cmp(a));
        members.iter().take(2).sum::<f32>()
    };
    let kept_groups = top_indices(
        &(0..rule.n_group).map(group_score).collect::<Vec<_>>(),
        rule.topk_group,
    );
    let allowed: Vec<f32> = choice
        .iter()
        .enumerate()
        .map(|(e, &c)| {
            if kept_groups.contains(&(e / group_size)) {
                c
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect();
    let experts = top_indices(&allowed, rule.top_k);
    let mut gates: Vec<f32> = experts.iter().map(|&e| score[e]).collect();
    if rule.normalise {
        let total = gates.iter().sum::<f32>() + 1e-20;
        gates.iter_mut().for_each(|g| *g /= total);
    }
    experts
        .into_iter()
        .zip(gates.into_iter().map(|g| g * rule.scaling))
        .collect()
}

/// Indices of the `k` largest values, ties toward the lower index.
fn top_indices(values: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

pub(super) fn experts(
    x: &Tensor,
    routes: &Routes,
    gate_up: &Tensor,
    down: &Tensor,
) -> Result<Tensor> {
    let n_experts = gate_up.dim(0)?;
    let inter = gate_up.dim(1)? / 2;
    let ids: Vec<Vec<u32>> = routes.ids.to_vec2()?;
    let gates: Vec<Vec<f32>> = routes.gates.to_vec2()?;
    let mut tokens_of_expert: Vec<Vec<(u32, f32)>> = vec![Vec::new(); n_experts];
    for (token, (ids, gates)) in ids.iter().zip(&gates).enumerate() {
        for (&expert, &gate) in ids.iter().zip(gates) {
            let list = tokens_of_expert.get_mut(expert as usize).ok_or_else(|| {
                crate::OpError::Unsupported(format!(
                    "moe experts: token {token} is routed to expert {expert} of {n_experts}"
                ))
            })?;
            list.push((token as u32, gate));
        }
    }
    // Every expert's tokens and gates go to the device in one copy each; each expert reads its slice.
    let assignments: Vec<&(u32, f32)> = tokens_of_expert.iter().flatten().collect();
    let all_rows = Tensor::from_vec(
        assignments.iter().map(|a| a.0).collect(),
        assignments.len(),
        x.device(),
    )?;
    let all_gates = Tensor::from_vec(
        assignments.iter().map(|a| a.1).collect(),
        (assignments.len(), 1),
        x.device(),
    )?
    .to_dtype(x.dtype())?;
    let mut out = x.zeros_like()?;
    let mut start = 0;
    for (expert, assigned) in tokens_of_expert.iter().enumerate() {
        if assigned.is_empty() {
            continue;
        }
        let rows = all_rows.narrow(0, start, assigned.len())?;
        let gates = all_gates.narrow(0, start, assigned.len())?;
        start += assigned.len();
        let weights = gate_up.get(expert)?;
        let xs = x.index_select(&rows, 0)?;
        let gate = xs.matmul(&weights.narrow(0, 0, inter)?.t()?)?;
        let up = xs.matmul(&weights.narrow(0, inter, inter)?.t()?)?;
        let h = (gate.silu()? * up)?;
        let y = h.matmul(&down.get(expert)?.t()?)?.broadcast_mul(&gates)?;
        out = out.index_add(&rows, &y, 0)?;
    }
    Ok(out)
}
