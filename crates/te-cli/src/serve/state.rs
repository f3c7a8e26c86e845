//! [`AppState`]: what every handler of the server shares (engine handle,
//! model, configuration, metrics, shutdown flags, request ids), and
//! [`unix_now`], the clock of its `created` times.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use te_engine::EngineHandle;
use te_models::loader::LoadedModel;
use tokio::sync::watch;

use super::api::Endpoint;
use super::metrics::Metrics;

/// What every handler shares.
pub struct AppState {
    pub handle: EngineHandle,
    pub loaded: Arc<LoadedModel>,
    /// The id clients name in `model` (`--served-model-name`, or `--model`).
    pub model_name: String,
    /// Unix seconds at start (the model's `created`).
    pub created: u64,
    pub api_key: Option<String>,
    pub metrics: Arc<Metrics>,
    pub max_concurrent_requests: u64,
    pub max_body_bytes: usize,
    /// `--body-read-timeout-secs`: a request body's deadline from its head.
    pub body_read_timeout: Duration,
    /// `--max-tokens-limit`: the most `max_tokens` a request may ask for.
    pub max_tokens_limit: Option<usize>,
    /// The model's context in tokens.
    pub context_tokens: usize,
    /// Becomes true when the shutdown grace period is over: running
    /// generations end with an error.
    pub cancel: watch::Receiver<bool>,
    /// Whether the engine loop still runs.
    pub engine_alive: Arc<AtomicBool>,
    shutting_down: AtomicBool,
    next_id: AtomicU64,
    random: RandomState,
}

/// The server's settings from the command line, as [`AppState::new`]
/// takes them.
pub struct ServeSettings {
    /// The id clients name in `model` (`--served-model-name`, or `--model`).
    pub model_name: String,
    /// `--api-key`: the bearer token every endpoint but /health and the
    /// chat page's files requires, if any.
    pub api_key: Option<String>,
    /// `--max-concurrent-requests`: generation requests held at once
    /// (queued, running or streaming).
    pub max_concurrent_requests: u64,
    /// `--max-body-bytes`: the largest request body, in bytes.
    pub max_body_bytes: usize,
    /// `--body-read-timeout-secs`: a request body's deadline from its head.
    pub body_read_timeout: Duration,
    /// `--max-tokens-limit`: the most `max_tokens` a request may ask for.
    pub max_tokens_limit: Option<usize>,
}

impl AppState {
    /// A new state (not shutting down).
    pub fn new(
        handle: EngineHandle,
        loaded: Arc<LoadedModel>,
        settings: ServeSettings,
        cancel: watch::Receiver<bool>,
        engine_alive: Arc<AtomicBool>,
    ) -> Self {
        let ServeSettings {
            model_name,
            api_key,
            max_concurrent_requests,
            max_body_bytes,
            body_read_timeout,
            max_tokens_limit,
        } = settings;
        AppState {
            context_tokens: loaded.model.config.max_position_embeddings,
            handle,
            loaded,
            model_name,
            created: unix_now(),
            api_key,
            metrics: Arc::new(Metrics::default()),
            max_concurrent_requests,
            max_body_bytes,
            body_read_timeout,
            max_tokens_limit,
            cancel,
            engine_alive,
            shutting_down: AtomicBool::new(false),
            next_id: AtomicU64::new(0),
            random: RandomState::new(),
        }
    }

    /// New generation requests get 503 from now on.
    pub fn start_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    fn counter(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// A fresh sampling seed for a request that names none.
    pub fn random_seed(&self) -> u64 {
        self.random.hash_one(self.counter())
    }

    /// `cmpl-...` / `chatcmpl-...`, unique for this process.
    pub fn response_id(&self, endpoint: Endpoint) -> String {
        let prefix = match endpoint {
            Endpoint::Completions => "cmpl",
            Endpoint::Chat => "chatcmpl",
        };
        let n = self.counter();
        format!("{prefix}-{:016x}{n:x}", self.random.hash_one(n ^ 0x5eed))
    }
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
