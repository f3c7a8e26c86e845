//! [`AppState`]: what every handler of the server shares (engine handle,
//! model, configuration, metrics, shutdown flags, request ids), and
//! [`unix_now`], the clock of its `created` times.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use te_engine::constraint::{GrammarError, Grammars};
use te_engine::EngineHandle;
use te_models::loader::LoadedModel;
use tokio::sync::watch;

use super::api::Endpoint;
use super::browser::BrowserPolicy;
use super::metrics::Metrics;

/// What every handler shares.
pub struct AppState {
    pub handle: EngineHandle,
    pub loaded: Arc<LoadedModel>,
    /// The id clients name in `model` (`--served-model-name`, or `--model`).
    pub model_name: String,
    /// Unix seconds at start (the model's `created`).
    pub created: u64,
    /// The API keys clients may present (none: no key needed).
    pub api_keys: Vec<String>,
    /// Who shares cached prompt prefixes with whom.
    pub prefix_cache_scope: PrefixCacheScope,
    /// Which hosts and origins browsers may use.
    pub browser: BrowserPolicy,
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
    /// The vocabulary for constrained decoding, built at the first request
    /// that needs it ([`AppState::grammars`]).
    grammars: OnceLock<Result<Arc<Grammars>, GrammarError>>,
    shutting_down: AtomicBool,
    next_id: AtomicU64,
    random: RandomState,
}

/// The server's settings from the command line, as [`AppState::new`]
/// takes them.
pub struct ServeSettings {
    /// The id clients name in `model` (`--served-model-name`, or `--model`).
    pub model_name: String,
    /// `--api-key`, `--api-key-file`, `TE_API_KEY`: the bearer tokens
    /// every endpoint but /health and the chat page's files accepts (none:
    /// no key needed).
    pub api_keys: Vec<String>,
    /// `--prefix-cache-scope`.
    pub prefix_cache_scope: PrefixCacheScope,
    /// `--allowed-host`, `--cors-origin`.
    pub browser: BrowserPolicy,
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
            api_keys,
            prefix_cache_scope,
            browser,
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
            api_keys,
            prefix_cache_scope,
            browser,
            metrics: Arc::new(Metrics::default()),
            max_concurrent_requests,
            max_body_bytes,
            body_read_timeout,
            max_tokens_limit,
            cancel,
            engine_alive,
            grammars: OnceLock::new(),
            shutting_down: AtomicBool::new(false),
            next_id: AtomicU64::new(0),
            random: RandomState::new(),
        }
    }

    /// The model's [`Grammars`] (built on first use: a pass over the
    /// vocabulary; call it off the async threads).
    ///
    /// Errors: a vocabulary llguidance cannot take (the same every call).
    pub fn grammars(&self) -> Result<Arc<Grammars>, GrammarError> {
        self.grammars
            .get_or_init(|| {
                let c = &self.loaded.model.config;
                Grammars::new(&self.loaded.tokenizer, c.vocab_size, &c.eos_token_ids).map(Arc::new)
            })
            .clone()
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

/// Who shares cached prompt prefixes (`--prefix-cache-scope`).
///
/// A shared cache still leaks through timing: a prompt whose prefix
/// another client sent recently starts faster (less prefill), whether or
/// not `cached_tokens` is reported; only separate scopes (per key, or a
/// `cache_salt` per trust domain) close that channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PrefixCacheScope {
    /// Every client shares with every other (but requests that give
    /// different `cache_salt`s).
    Shared,
    /// Each API key's requests share only among themselves.
    PerKey,
}

/// The API key a request presented: its index among the server's keys
/// (a request extension set by the key check).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientKey(pub usize);

impl AppState {
    /// The index of `given` among the API keys, comparing with every key
    /// in time independent of where they differ.
    pub fn key_index(&self, given: &str) -> Option<usize> {
        let mut found = None;
        for (i, key) in self.api_keys.iter().enumerate() {
            if same_secret(given.as_bytes(), key.as_bytes()) {
                found = Some(i);
            }
        }
        found
    }

    /// The prefix-cache salt of a request from `key` that gave `salt`:
    /// the key (with the per-key scope) and the salt, or `None` for the
    /// shared scope without a salt.
    pub fn cache_salt(&self, key: Option<ClientKey>, salt: Option<&str>) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        if let (PrefixCacheScope::PerKey, Some(ClientKey(i))) = (self.prefix_cache_scope, key) {
            out.extend_from_slice(b"key:");
            out.extend_from_slice(&(i as u64).to_le_bytes());
        }
        if let Some(salt) = salt {
            out.extend_from_slice(b"salt:");
            out.extend_from_slice(salt.as_bytes());
        }
        (!out.is_empty()).then_some(out)
    }
}

/// Equality that takes the same time wherever the first difference is.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
