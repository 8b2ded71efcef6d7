//! With the `cuda` feature: compiles every `src/*.cu` with nvcc into one fatbin per file holding SASS for
//! sm_90 and sm_120 and compute_120 PTX (for JIT on newer GPUs); `src/*_sm90.cu` (Hopper-only
//! instructions) get sm_90a SASS only. Without it: nothing.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        cuda::build();
    }
}

mod cuda {
    use std::path::{Path, PathBuf};
    use std::process::Command;

    fn nvcc() -> PathBuf {
        for var in ["NVCC", "CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
            if let Some(value) = std::env::var_os(var) {
                let path = PathBuf::from(value);
                let candidate = if var == "NVCC" {
                    path
                } else {
                    path.join("bin").join("nvcc")
                };
                if candidate.is_file() {
                    return candidate;
                }
            }
        }
        PathBuf::from("nvcc")
    }

    pub fn build() {
        let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
        let src = Path::new("src");
        let mut sources: Vec<PathBuf> = std::fs::read_dir(src)
            .expect("kernels/src exists")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "cu"))
            .collect();
        sources.sort();
        let nvcc = nvcc();
        for source in &sources {
            println!("cargo:rerun-if-changed={}", source.display());
            let stem = source
                .file_stem()
                .and_then(|s| s.to_str())
                .expect("utf-8 kernel file name");
            let output = out_dir.join(format!("{stem}.fatbin"));
            // `*_sm90.cu` use Hopper-only instructions (wgmma): sm_90a SASS and nothing else.
            let targets: &[&str] = if stem.ends_with("_sm90") {
                &["arch=compute_90a,code=sm_90a"]
            } else {
                &[
                    "arch=compute_90,code=sm_90",
                    "arch=compute_120,code=sm_120",
                    "arch=compute_120,code=compute_120",
                ]
            };
            let status = Command::new(&nvcc)
                .args(["--fatbin", "-O3", "-std=c++17", "-lineinfo", "-Xptxas=-v"])
                .args(targets.iter().flat_map(|target| ["-gencode", target]))
                .arg(source)
                .arg("-o")
                .arg(&output)
                .status()
                .unwrap_or_else(|e| {
                    panic!(
                        "cannot run nvcc ({}): {e}. The `cuda` feature needs CUDA 13.0's nvcc: set CUDA_HOME or put \
                         nvcc on PATH (without a toolkit: `eval \"$(shared/tools/install-cuda-toolchain.sh)\"`).",
                        nvcc.display()
                    )
                });
            assert!(status.success(), "nvcc failed on {}", source.display());
        }
    }
}
