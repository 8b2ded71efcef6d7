//! §3.1 the dense MLP and §5 the mixture of experts with its sigmoid router.

use candle_core::{DType, Module, Tensor};

use super::linear::{Loader, Proj};
use crate::config::Config;
use crate::error::Result;

/// §3.1 `down(silu(gate(x)) ⊙ up(x))`: the dense MLP, each routed expert and the shared expert.
pub(super) struct Mlp {
    gate_proj: Proj,
    up_proj: Proj,
    down_proj: Proj,
}

impl Mlp {
    pub(super) fn load(
        loader: &Loader,
        prefix: &str,
        hidden: usize,
        intermediate: usize,
    ) -> Result<Self> {
        Ok(Self {
            gate_proj: loader.linear(&format!("{prefix}.gate_proj"), hidden, intermediate)?,
            up_proj: loader.linear(&format!("{prefix}.up_proj"), hidden, intermediate)?,
            down_proj: loader.linear(&format!("{prefix}.down_proj"), intermediate, hidden)?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let gated =
            (candle_nn::ops::silu(&self.gate_proj.forward(x)?)? * self.up_proj.forward(x)?)?;
        self.down_proj.forward(&gated)
    }
}

/// §5 Sigmoid router (`noaux_tc`) in f32: the correction bias steers selection only.
struct Router {
    weight: Tensor,
    correction_bias: Vec<f32>,
    n_group: usize,
    topk_group: usize,
    /// Experts each token is routed to (`num_experts_per_tok`).
    experts_per_token: usize,
    norm_topk_prob: bool,
    scaling: f32,
}

impl Router {
    /// For every token, its experts and their gate weights.
    fn route(&self, hidden: &Tensor) -> Result<Vec<Vec<(usize, f32)>>> {
        let scores =
            candle_nn::ops::sigmoid(&hidden.to_dtype(DType::F32)?.matmul(&self.weight.t()?)?)?;
        let scores: Vec<Vec<f32>> = scores.to_vec2()?;
        Ok(scores.iter().map(|s| self.route_token(s)).collect())
    }

    fn route_token(&self, scores: &[f32]) -> Vec<(usize, f32)> {
        let choice: Vec<f32> = scores
            .iter()
            .zip(&self.correction_bias)
            .map(|(s, b)| s + b)
            .collect();
        // Group limiting: a group's score is the sum of its two best choice scores; keep topk_group groups.
        let group_size = choice.len() / self.n_group;
        let group_score = |g: usize| {
            let mut members: Vec<f32> = choice[g * group_size..(g + 1) * group_size].to_vec();
            members.sort_by(|a, b| b.total_cmp(a));
            members.iter().take(2).sum::<f32>()
        };
        let kept_groups = top_indices(
            &(0..self.n_group).map(group_score).collect::<Vec<_>>(),
            self.topk_group,
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
        let experts = top_indices(&allowed, self.experts_per_token);
        let mut gates: Vec<f32> = experts.iter().map(|&e| scores[e]).collect();
        if self.norm_topk_prob {
            let total = gates.iter().sum::<f32>() + 1e-20;
            gates.iter_mut().for_each(|g| *g /= total);
        }
        experts
            .into_iter()
            .zip(gates.into_iter().map(|g| g * self.scaling))
            .collect()
    }
}

/// Indices of the `k` largest values, ties toward the lower index.
fn top_indices(values: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// §5 Mixture of experts: routed experts weighted by the router, plus the unweighted shared expert.
pub(super) struct MoE {
    router: Router,
    experts: Vec<Mlp>,
    shared_experts: Option<Mlp>,
}

impl MoE {
    pub(super) fn load(config: &Config, loader: &Loader, prefix: &str) -> Result<Self> {
        let (hidden, n_experts) = (config.hidden_size, config.n_routed_experts);
        let router = Router {
            weight: loader.tensor_f32(&format!("{prefix}.gate.weight"), &[n_experts, hidden])?,
            correction_bias: loader
                .tensor_f32(
                    &format!("{prefix}.gate.e_score_correction_bias"),
                    &[n_experts],
                )?
                .to_vec1()?,
            n_group: config.n_group,
            topk_group: config.topk_group,
            experts_per_token: config.num_experts_per_tok,
            norm_topk_prob: config.norm_topk_prob,
            scaling: config.routed_scaling_factor as f32,
        };
        let experts = (0..n_experts)
            .map(|e| {
                Mlp::load(
                    loader,
                    &format!("{prefix}.experts.{e}"),
                    hidden,
                    config.moe_intermediate_size,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let shared_experts = (config.n_shared_experts > 0)
            .then(|| {
                let width = config.moe_intermediate_size * config.n_shared_experts;
                Mlp::load(loader, &format!("{prefix}.shared_experts"), hidden, width)
            })
            .transpose()?;
        Ok(Self {
            router,
            experts,
            shared_experts,
        })
    }

    pub(super) fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        let routes = self.router.route(hidden)?;
        let mut tokens_of_expert: Vec<Vec<(u32, f32)>> = vec![Vec::new(); self.experts.len()];
        for (token, choices) in routes.iter().enumerate() {
            for &(expert, gate) in choices {
                tokens_of_expert[expert].push((token as u32, gate));
            }
        }
        // Every expert's tokens and gates go to the device in one copy each (a copy per expert costs a
        // host-to-device transfer apiece: 16 per MoE layer at GLM-5's 8 experts per token); each expert
        // reads its slice.
        let assignments: Vec<&(u32, f32)> = tokens_of_expert.iter().flatten().collect();
        let all_rows = Tensor::from_vec(
            assignments.iter().map(|a| a.0).collect(),
            assignments.len(),
            hidden.device(),
        )?;
        let all_gates = Tensor::from_vec(
            assignments.iter().map(|a| a.1).collect(),
            (assignments.len(), 1),
            hidden.device(),
        )?
        .to_dtype(hidden.dtype())?;
        let mut out = hidden.zeros_like()?;
        let mut start = 0;
        for (expert, assigned) in self.experts.iter().zip(&tokens_of_expert) {
            if assigned.is_empty() {
                continue;
            }
            let rows = all_rows.narrow(0, start, assigned.len())?;
            let gates = all_gates.narrow(0, start, assigned.len())?;
            start += assigned.len();
            let y = expert
                .forward(&hidden.index_select(&rows, 0)?)?
                .broadcast_mul(&gates)?;
            out = out.index_add(&rows, &y, 0)?;
        }
        if let Some(shared) = &self.shared_experts {
            out = (out + shared.forward(hidden)?)?;
        }
        Ok(out)
    }
}
