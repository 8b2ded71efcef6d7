//! `glm5` CLI. For now: greedy-decode token ids with a local model directory
//! (`glm5 <model_dir> [token ids...]`); `glm5 generate` with tokenizer, chat template and the Hub comes next.

use std::process::ExitCode;

use glm5::candle_core::{DType, Device, D};
use glm5::{AttentionMode, Glm5};

fn run(args: &[String]) -> Result<(), Box<dyn std::error::Error>> {
    let dir = args.first().ok_or("usage: glm5 <model_dir> [prompt token ids...]")?;
    let mut ids: Vec<u32> = args[1..].iter().map(|a| a.parse()).collect::<Result<_, _>>()?;
    if ids.is_empty() {
        ids = vec![4, 5, 6, 7];
    }
    let model = Glm5::from_dir(dir, DType::F32, &Device::Cpu, AttentionMode::Sparse)?;
    let new_tokens = 16;
    let mut cache = model.new_cache(ids.len() + new_tokens)?;
    let mut logits = model.forward(&ids, 0, &mut cache)?;
    for _ in 0..new_tokens {
        let last = logits.get(logits.dim(0)? - 1)?;
        let next = last.argmax(D::Minus1)?.to_scalar::<u32>()?;
        ids.push(next);
        logits = model.forward(&[next], ids.len() - 1, &mut cache)?;
    }
    println!("{}", ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" "));
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
