//! `glm5 serve`: an OpenAI-compatible HTTP server over one model.
//!
//! - [`routes`]: `POST /v1/chat/completions` and `/v1/completions` (JSON or server-sent events),
//!   `GET /v1/models`, `/health`, `/metrics`; OpenAI's error shape ([`error`]).
//! - [`openai`]: the request fields and their checks.
//! - [`scheduler`]: the engine thread that owns the model and runs the admitted sequences step by step
//!   in one batched forward over a paged KV pool (continuous batching, chunked prefill, preemption when
//!   blocks run out, prefix reuse, cancellation of disconnected clients).
//! - [`metrics`]: Prometheus counters.
//!
//! Connections are served by hyper directly (through axum's router) so that a client that sends its
//! headers too slowly is dropped, and so that shutdown (SIGTERM or ctrl-c) first stops accepting, then lets
//! running requests finish for a grace period, then cancels what is left.

pub mod error;
pub mod metrics;
pub mod openai;
pub mod routes;
pub mod scheduler;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

use crate::chat::ChatTemplate;
use crate::models::PagedCacheOptions;
use crate::tokenizer::Tokenizer;
use crate::{GenerationParams, Glm5};
use metrics::Metrics;
use routes::AppState;
pub use scheduler::StepModel;
use scheduler::{Scheduler, SchedulerConfig};

/// How to serve.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Address to listen on (port 0: any free port; the bound address is printed).
    pub addr: SocketAddr,
    /// Bearer token every `/v1` request must carry.
    pub api_key: Option<String>,
    /// The model name clients use (`/v1/models`).
    pub model_name: String,
    /// Most sequences running at once.
    pub max_seqs: usize,
    /// Most sequences waiting; beyond, requests get 429.
    pub max_queue: usize,
    /// Tokens of context per sequence.
    pub max_model_len: usize,
    /// KV cache tokens over all sequences, the size of the paged pool allocated at start (`None`:
    /// `max_seqs * max_model_len`).
    pub kv_budget: Option<usize>,
    /// Most prompt tokens one sequence feeds per step.
    pub prefill_chunk: usize,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// How long a client may take to send its request headers, and then its body.
    pub read_timeout: Duration,
    /// How long running requests may finish after SIGTERM / ctrl-c before they are cancelled.
    pub shutdown_grace: Duration,
    /// Replay decode steps from CUDA graphs where the model allows it
    /// ([`crate::Glm5ForCausalLM::forward_batch_graphed`]; the default); other steps run eagerly.
    pub cuda_graphs: bool,
    /// Forward calls a step is split into ([`scheduler::SchedulerConfig::micro_batches`]; `None`: one per
    /// stage of the model's placement, [`StepModel::pipeline_stages`]).
    pub micro_batches: Option<usize>,
}

impl ServeOptions {
    /// Defaults for `model_name`, listening on `addr`.
    pub fn new(addr: SocketAddr, model_name: impl Into<String>) -> Self {
        Self {
            addr,
            api_key: None,
            model_name: model_name.into(),
            max_seqs: 32,
            max_queue: 256,
            max_model_len: 8192,
            kv_budget: None,
            prefill_chunk: 512,
            max_body_bytes: 8 << 20,
            read_timeout: Duration::from_secs(30),
            shutdown_grace: Duration::from_secs(30),
            cuda_graphs: true,
            micro_batches: None,
        }
    }
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A limit is zero or does not fit the model.
    #[error("invalid serve option: {0}")]
    Option(String),
    /// The address cannot be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The KV pool could not be allocated (too large for the devices, or a backend that cannot read it).
    #[error("cannot allocate the KV cache pool: {0}")]
    Pool(#[source] crate::Error),
    /// Waiting for the devices' queued work (the model's and the pool's uploads) failed.
    #[error("the GPU failed while the model was made ready: {0}")]
    Device(#[source] crate::Error),
    /// The async runtime could not start.
    #[error("cannot start the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
}

/// Serves `model` until SIGTERM or ctrl-c; `on_listening` gets the bound address.
pub fn run(
    model: Glm5,
    options: ServeOptions,
    on_listening: impl FnOnce(SocketAddr),
) -> Result<(), ServeError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("glm5-http")
        .build()
        .map_err(ServeError::Runtime)?;
    runtime.block_on(serve(model, options, on_listening, shutdown_signal()))
}

/// Resolves on SIGTERM or ctrl-c.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = terminate => {},
    }
}

/// What the server needs of a model besides its forward pass.
pub struct ModelInfo {
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// Its chat template (`None`: only `/v1/completions` works).
    pub chat_template: Option<ChatTemplate>,
    /// Token ids that end generation.
    pub eos_token_ids: Vec<u32>,
    /// Sampling defaults (generation_config.json).
    pub sampling_defaults: GenerationParams,
    /// Its context length.
    pub context: usize,
}

impl ModelInfo {
    /// The tokenizer, template, stop ids and defaults of `model`.
    pub fn of(model: &Glm5) -> Self {
        Self {
            tokenizer: model.tokenizer().clone(),
            chat_template: ChatTemplate::from_model_dir(model.dir()).ok(),
            eos_token_ids: model.eos_token_ids().to_vec(),
            sampling_defaults: model.sampling_defaults().clone(),
            context: model.model().config().max_position_embeddings,
        }
    }
}

/// Serves `model` until `shutdown` resolves (inside a tokio runtime).
pub async fn serve(
    model: Glm5,
    options: ServeOptions,
    on_listening: impl FnOnce(SocketAddr),
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let info = ModelInfo::of(&model);
    serve_model(model, info, options, on_listening, shutdown).await
}

/// Serves any [`StepModel`] described by `info` until `shutdown` resolves (inside a tokio runtime).
pub async fn serve_model<M: StepModel + Send + 'static>(
    model: M,
    info: ModelInfo,
    options: ServeOptions,
    on_listening: impl FnOnce(SocketAddr),
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let context = info.context;
    if options.max_seqs == 0
        || options.prefill_chunk == 0
        || options.max_model_len < 2
        || options.micro_batches == Some(0)
    {
        return Err(ServeError::Option(
            "--max-seqs, --prefill-chunk and --micro-batches must be at least 1, --max-model-len at least 2"
                .into(),
        ));
    }
    if options.max_model_len > context {
        return Err(ServeError::Option(format!(
            "--max-model-len {} is more than the model's context ({context} tokens)",
            options.max_model_len
        )));
    }
    let kv_budget = options
        .kv_budget
        .unwrap_or(options.max_seqs.saturating_mul(options.max_model_len));
    if kv_budget < scheduler::KV_BLOCK.min(options.max_model_len) {
        return Err(ServeError::Option(format!(
            "--kv-budget {kv_budget} holds less than one KV block ({} tokens)",
            scheduler::KV_BLOCK
        )));
    }
    // The KV pool: the budget in whole blocks, allocated once.
    let pool = model
        .new_pool(PagedCacheOptions {
            num_blocks: kv_budget.div_ceil(scheduler::KV_BLOCK),
            block_size: scheduler::KV_BLOCK,
        })
        .map_err(ServeError::Pool)?;
    let kv_budget = pool.num_blocks() * pool.block_size();
    let metrics = Arc::new(Metrics::new(pool.num_blocks(), pool.block_size()));
    let ModelInfo {
        tokenizer,
        chat_template: template,
        eos_token_ids,
        sampling_defaults: defaults,
        ..
    } = info;
    let micro_batches = options
        .micro_batches
        .unwrap_or_else(|| model.pipeline_stages());
    let config = SchedulerConfig {
        max_seqs: options.max_seqs,
        max_queue: options.max_queue,
        max_model_len: options.max_model_len,
        kv_budget,
        prefill_chunk: options.prefill_chunk,
        eos_token_ids,
        cuda_graphs: options.cuda_graphs,
        micro_batches,
    };
    // The engine thread runs every step on its own stream: what this thread queued must be done first.
    model.synchronize().map_err(ServeError::Device)?;
    let (scheduler, _engine) =
        Scheduler::start(model, pool, tokenizer.clone(), config, metrics.clone());
    let state = Arc::new(AppState {
        scheduler: scheduler.clone(),
        tokenizer,
        template,
        model_name: options.model_name.clone(),
        defaults,
        api_key: options.api_key.clone(),
        max_body_bytes: options.max_body_bytes,
        body_timeout: options.read_timeout,
        metrics,
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default(),
        next_id: AtomicU64::new(0),
    });
    let app = routes::router(state);
    let listener = TcpListener::bind(options.addr)
        .await
        .map_err(|source| ServeError::Bind {
            addr: options.addr,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| ServeError::Bind {
        addr: options.addr,
        source,
    })?;
    tracing::info!(%addr, model = %options.model_name, max_seqs = options.max_seqs,
        max_model_len = options.max_model_len, kv_budget, micro_batches, "listening");
    on_listening(addr);

    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of file descriptors and the like: wait instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let service = TowerToHyperService::new(app.clone());
                let connection = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(options.read_timeout)
                    .serve_connection(TokioIo::new(stream), service);
                let connection = graceful.watch(connection);
                tokio::spawn(async move {
                    if let Err(e) = connection.await {
                        tracing::debug!(%peer, error = %e, "connection ended with an error");
                    }
                });
            }
            _ = &mut shutdown => break,
        }
    }
    drop(listener);
    scheduler.stop_accepting();
    tracing::info!(
        grace_seconds = options.shutdown_grace.as_secs_f64(),
        "shutting down: finishing running requests"
    );
    tokio::select! {
        _ = graceful.shutdown() => tracing::info!("all requests finished"),
        _ = tokio::time::sleep(options.shutdown_grace) => {
            tracing::warn!("grace period over: cancelling the requests still running");
            scheduler.cancel_all();
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    Ok(())
}
