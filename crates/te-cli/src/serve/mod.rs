//! `te serve`: an OpenAI-compatible HTTP server (axum on tokio) over the
//! continuous-batching engine, and a chat page at `/`.
//!
//! ```text
//! HTTP clients ──> axum handlers ──submit/abort──> EngineHandle ──> engine thread (Engine::run)
//!                        ^                                              │
//!                        └──── tokio channel <── bridge thread <── events (one std channel per request)
//! ```
//!
//! The engine runs on a thread of its own; every request joins the running
//! batch at its next step, and a client that disconnects mid-stream frees
//! its sequence at the step after. Modules: [`state`] (what every handler
//! shares), [`routes`] (router, API key, small endpoints), [`completions`]
//! (the two generation endpoints), [`api`] (request parsing and
//! validation), [`response`] (response and chunk bodies), [`error`] (OpenAI
//! error bodies), [`bridge`] (async side of the engine handle), [`metrics`]
//! (Prometheus text), [`listener`] (connections: caps and timeouts),
//! [`guard`] (the request body's deadline, the browser checks),
//! [`browser`] (which hosts and origins browsers may use).
//!
//! Shutdown (SIGINT or SIGTERM): answer `/health` and new generation
//! requests with 503, let running ones finish for `--shutdown-grace-secs`,
//! then end the rest with an error (a second signal ends them at once);
//! stop accepting connections once none runs, stop the engine, exit 0.
//!
//! Liveness: if the engine thread ends while serving (an error, or a
//! panic), `/health` answers 503 at once, the server shuts down as on a
//! signal, and the process exits non-zero: a supervisor restarts it. The
//! engine is not restarted in process.
//!
//! Every request is logged (through `tracing`, to stderr) in one line.

mod api;
mod bridge;
mod browser;
mod completions;
mod error;
mod guard;
mod listener;
mod metrics;
mod response;
mod routes;
mod state;
mod tools;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use te_engine::{channel, EngineConfig};
use tokio::sync::watch;

use state::{AppState, ServeSettings};

#[derive(clap::Args)]
pub struct Args {
    /// GGUF file, Hugging Face directory, or known model name
    /// (smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b).
    #[arg(long)]
    model: String,
    #[command(flatten)]
    threads: crate::Threads,
    #[command(flatten)]
    precision: crate::PrecisionArg,
    /// Address to listen on (loopback by default; 0.0.0.0 for every
    /// interface).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port; the address is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// The model id clients use in `model` (default: the --model value).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Most sequences in the running batch.
    #[arg(long, default_value_t = 32)]
    max_batch_size: usize,
    /// KV cache capacity in tokens, all sequences together (default: the
    /// model's context, at most 32768).
    #[arg(long)]
    kv_cache_tokens: Option<usize>,
    /// Do not share the KV pages of common prompt prefixes.
    #[arg(long)]
    no_prefix_caching: bool,
    /// Speculative decoding (the server default; a request may lower
    /// `speculative.n_max`, 0 turning it off, and set `speculative.n_min`).
    #[command(flatten)]
    draft: crate::draft::DraftArgs,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health
    /// and the chat page's files (repeat for several keys; visible to
    /// other local users in the process list: prefer --api-key-file or
    /// TE_API_KEY).
    #[arg(long)]
    api_key: Vec<String>,
    /// A file of API keys, one a line (blank lines and `#` comments
    /// skipped); the environment variable TE_API_KEY adds one more.
    #[arg(long)]
    api_key_file: Option<std::path::PathBuf>,
    /// Who shares cached prompt prefixes: `per-key` (each API key's
    /// requests among themselves; the default with API keys) or `shared`
    /// (the default without). Requests that give different `cache_salt`s
    /// never share.
    #[arg(long, value_enum)]
    prefix_cache_scope: Option<state::PrefixCacheScope>,
    /// A host name a server without API keys answers to, beside IP
    /// addresses and localhost (repeatable; `*`: any; the defence against
    /// DNS rebinding).
    #[arg(long)]
    allowed_host: Vec<String>,
    /// An origin (`https://app.example:8443`) whose pages may call the API
    /// (CORS; repeatable). Other origins' requests are refused.
    #[arg(long)]
    cors_origin: Vec<String>,
    /// Largest request body in bytes (larger: 413).
    #[arg(long, default_value_t = 2 * 1024 * 1024)]
    max_body_bytes: usize,
    /// Most open connections; more wait to be accepted.
    #[arg(long, default_value_t = 512)]
    max_connections: usize,
    /// Most open connections from one client IP address; more are closed
    /// at once.
    #[arg(long, default_value_t = 64)]
    max_connections_per_client: usize,
    /// Seconds a connection has to send a whole request head once it
    /// waits for one (after opening, and after each response: the idle
    /// keep-alive timeout too).
    #[arg(long, default_value_t = 10.0)]
    header_read_timeout_secs: f64,
    /// Seconds a request body has to arrive, from its head (later: 400).
    #[arg(long, default_value_t = 30.0)]
    body_read_timeout_secs: f64,
    /// Seconds a response write may make no progress (a client that
    /// stopped reading) before the connection is closed.
    #[arg(long, default_value_t = 30.0)]
    write_timeout_secs: f64,
    /// Most generation requests held at once (queued, running or
    /// streaming); more get 429.
    #[arg(long, default_value_t = 256)]
    max_concurrent_requests: u64,
    /// The most `max_tokens` a request may ask for (more: 400); also the
    /// default of chat requests that name none (else the rest of the
    /// context).
    #[arg(long)]
    max_tokens_limit: Option<usize>,
    /// Seconds in-flight requests may take to finish after SIGINT/SIGTERM
    /// before they are cancelled.
    #[arg(long, default_value_t = 30)]
    shutdown_grace_secs: u64,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    args.threads.init()?;
    // One line per request and the server's events, to stderr.
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_max_level(tracing::Level::INFO)
        // A closed stderr must not fail requests: the subscriber would
        // report its own write error with `eprintln!`, which panics there.
        .log_internal_errors(false)
        .try_init();
    for (name, v) in [
        ("--max-batch-size", args.max_batch_size),
        (
            "--max-connections-per-client",
            args.max_connections_per_client,
        ),
        ("--max-body-bytes", args.max_body_bytes),
        ("--max-connections", args.max_connections),
        (
            "--max-concurrent-requests",
            args.max_concurrent_requests as usize,
        ),
        ("--kv-cache-tokens", args.kv_cache_tokens.unwrap_or(1)),
        ("--max-tokens-limit", args.max_tokens_limit.unwrap_or(1)),
    ] {
        if v == 0 {
            bail!("{name} must be at least 1");
        }
    }
    let header_read_timeout = seconds("--header-read-timeout-secs", args.header_read_timeout_secs)?;
    let body_read_timeout = seconds("--body-read-timeout-secs", args.body_read_timeout_secs)?;
    let write_timeout = seconds("--write-timeout-secs", args.write_timeout_secs)?;
    let api_keys = api_keys(&args)?;
    let prefix_cache_scope = args.prefix_cache_scope.unwrap_or(if api_keys.is_empty() {
        state::PrefixCacheScope::Shared
    } else {
        state::PrefixCacheScope::PerKey
    });
    // Bind before loading the model: a taken port fails at once.
    let tcp = std::net::TcpListener::bind((args.host.as_str(), args.port))
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    tcp.set_nonblocking(true)
        .context("making the listening socket non-blocking")?;
    let loaded = Arc::new(crate::load(&args.model, args.precision.precision)?);
    if loaded.tokenizer.chat_template().is_none() {
        crate::note(format_args!(
            "{} has no chat template (a base model): /v1/chat/completions and the chat page \
             answer 400; /v1/completions continues text",
            args.model
        ));
    }
    let drafting = args.draft.load(&loaded)?;
    let config = EngineConfig {
        max_batch_size: args.max_batch_size,
        kv_cache_tokens: args.kv_cache_tokens,
        prefix_caching: !args.no_prefix_caching,
        ..EngineConfig::default()
    };
    let (handle, commands) = channel();
    let engine_alive = Arc::new(AtomicBool::new(true));
    let engine_stopped = Arc::new(tokio::sync::Notify::new());
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let engine_thread = std::thread::Builder::new()
        .name("te-engine".into())
        .spawn({
            let loaded = loaded.clone();
            let alive = EngineAlive {
                alive: engine_alive.clone(),
                stopped: engine_stopped.clone(),
            };
            move || -> anyhow::Result<()> {
                // Cleared however the thread ends, a panic included.
                let _alive = alive;
                let engine = drafting.engine(&loaded.model, Some(&loaded.tokenizer), config);
                let mut engine = match engine {
                    Ok(e) => e,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return Ok(());
                    }
                };
                let _ = ready_tx.send(Ok((engine.kv_capacity_tokens(), engine.prefix_caching())));
                let result = engine.run(commands);
                if let Err(e) = &result {
                    eprintln!("error: the engine stopped: {e}");
                }
                Ok(result?)
            }
        })
        .context("starting the engine thread")?;
    let (kv_tokens, prefix_caching) = ready_rx
        .recv()
        .context("the engine thread ended before starting")??;
    eprintln!(
        "kv cache: {kv_tokens} tokens{}, batch up to {} sequences",
        if prefix_caching {
            ", prefix caching on"
        } else {
            ""
        },
        args.max_batch_size
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        // One blocking thread forwards each request's events.
        .max_blocking_threads(args.max_concurrent_requests as usize + 64)
        .build()
        .context("starting the async runtime")?;
    let (cancel_tx, cancel_rx) = watch::channel(false);
    let settings = ServeSettings {
        model_name: args
            .served_model_name
            .clone()
            .unwrap_or_else(|| args.model.clone()),
        browser: browser::BrowserPolicy {
            allowed_hosts: args
                .allowed_host
                .iter()
                .map(|h| h.to_ascii_lowercase())
                .collect(),
            cors_origins: args.cors_origin.clone(),
            keyless: api_keys.is_empty(),
        },
        api_keys,
        prefix_cache_scope,
        max_concurrent_requests: args.max_concurrent_requests,
        max_body_bytes: args.max_body_bytes,
        body_read_timeout,
        max_tokens_limit: args.max_tokens_limit,
    };
    let state = Arc::new(AppState::new(
        handle,
        loaded.clone(),
        settings,
        cancel_rx,
        engine_alive,
    ));
    let limits = listener::Limits {
        max_connections: args.max_connections,
        max_per_client: args.max_connections_per_client,
        header_read_timeout,
        write_timeout,
    };
    let served = runtime.block_on(serve(&args, tcp, limits, state, cancel_tx, engine_stopped));
    // Ends what is left (cancelled streams) and drops every engine handle,
    // so the engine loop returns.
    runtime.shutdown_timeout(Duration::from_secs(10));
    let stopped_early = served?;
    match engine_thread.join() {
        Ok(result) => result?,
        Err(_) => bail!("the engine thread panicked; the server drained and exits"),
    }
    if stopped_early {
        bail!("the engine stopped; the server drained and exits");
    }
    eprintln!("shut down");
    Ok(())
}

/// The engine thread's liveness: cleared, and the server told, when the
/// thread ends (returning or panicking).
struct EngineAlive {
    alive: Arc<AtomicBool>,
    stopped: Arc<tokio::sync::Notify>,
}

impl Drop for EngineAlive {
    fn drop(&mut self) {
        self.alive.store(false, Ordering::SeqCst);
        self.stopped.notify_one();
    }
}

/// The API keys of `--api-key`, `--api-key-file` and `TE_API_KEY`.
///
/// Errors: an unreadable file or one without a key, an empty key (or one
/// with whitespace or control characters, which no `Authorization` header
/// carries).
fn api_keys(args: &Args) -> anyhow::Result<Vec<String>> {
    let mut keys: Vec<(String, String)> = args
        .api_key
        .iter()
        .map(|k| (k.clone(), "--api-key".to_string()))
        .collect();
    if let Some(path) = &args.api_key_file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading --api-key-file {}", path.display()))?;
        let before = keys.len();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if !line.is_empty() && !line.starts_with('#') {
                keys.push((
                    line.to_string(),
                    format!("{} line {}", path.display(), i + 1),
                ));
            }
        }
        if keys.len() == before {
            // An empty file must not quietly leave the server open.
            bail!(
                "--api-key-file {} holds no key (one per line; blank and # lines are skipped)",
                path.display()
            );
        }
    }
    if let Some(k) = std::env::var_os("TE_API_KEY") {
        let k = k
            .into_string()
            .map_err(|_| anyhow::anyhow!("TE_API_KEY is not UTF-8"))?;
        keys.push((k, "TE_API_KEY".to_string()));
    }
    for (key, from) in &keys {
        if key.is_empty() || key.chars().any(|c| c.is_whitespace() || c.is_control()) {
            bail!("the API key of {from} is empty or holds whitespace or control characters");
        }
    }
    Ok(keys.into_iter().map(|(k, _)| k).collect())
}

/// A positive, finite number of seconds from flag `name`.
fn seconds(name: &str, secs: f64) -> anyhow::Result<Duration> {
    if !(secs.is_finite() && secs > 0.0 && secs < 1e9) {
        bail!("{name} must be a positive number of seconds, not {secs}");
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Serves on `tcp` until a signal or the engine's end, then shuts down
/// gracefully; returns whether the engine stopped first.
async fn serve(
    args: &Args,
    tcp: std::net::TcpListener,
    limits: listener::Limits,
    state: Arc<AppState>,
    cancel: watch::Sender<bool>,
    engine_stopped: Arc<tokio::sync::Notify>,
) -> anyhow::Result<bool> {
    let tcp = tokio::net::TcpListener::from_std(tcp).context("listening")?;
    let addr = tcp.local_addr()?;
    // Signals seen: 1 starts the graceful shutdown, 2 cancels at once.
    // The engine's end counts as the first.
    let (signals_tx, mut signals) = watch::channel(0u32);
    let signals_tx = Arc::new(signals_tx);
    tokio::spawn(count_signals(signals_tx.clone()));
    let engine_failed = Arc::new(AtomicBool::new(false));
    tokio::spawn({
        let failed = engine_failed.clone();
        async move {
            engine_stopped.notified().await;
            failed.store(true, Ordering::SeqCst);
            tracing::error!("the engine stopped: draining, then exiting with an error");
            signals_tx.send_modify(|n| *n = (*n).max(1));
        }
    });
    let mut first_signal = signals.clone();
    let drained = state.clone();
    let router = routes::router(state.clone()).layer(axum::middleware::from_fn_with_state(
        state.clone(),
        guard::body_deadline,
    ));
    let server = listener::serve(tcp, router, limits, state.metrics.clone(), async move {
        let _ = first_signal.wait_for(|&n| n >= 1).await;
        // Keep accepting while requests run (new ones get 503, /health
        // too), then close.
        while drained.metrics.in_flight() > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    let mut server = tokio::spawn(server);
    eprintln!("listening on http://{addr} (model {})", state.model_name);
    tokio::select! {
        result = &mut server => return finished(result, &engine_failed),
        _ = signals.wait_for(|&n| n >= 1) => {}
    }
    state.start_shutdown();
    eprintln!(
        "shutting down: {} requests in flight, {} s to finish",
        state.metrics.in_flight(),
        args.shutdown_grace_secs
    );
    let grace = Duration::from_secs(args.shutdown_grace_secs);
    tokio::select! {
        result = &mut server => return finished(result, &engine_failed),
        _ = tokio::time::sleep(grace) => {}
        _ = signals.wait_for(|&n| n >= 2) => {}
    }
    eprintln!(
        "cancelling {} requests still in flight",
        state.metrics.in_flight()
    );
    let _ = cancel.send(true);
    // Cancelled streams end at once; do not wait forever for a client
    // that stopped reading.
    match tokio::time::timeout(Duration::from_secs(5), &mut server).await {
        Ok(result) => finished(result, &engine_failed),
        Err(_) => {
            server.abort();
            Ok(engine_failed.load(Ordering::SeqCst))
        }
    }
}

fn finished(
    result: Result<(), tokio::task::JoinError>,
    engine_failed: &AtomicBool,
) -> anyhow::Result<bool> {
    result.context("the server task failed")?;
    Ok(engine_failed.load(Ordering::SeqCst))
}

/// Counts SIGINT and SIGTERM into `tx`.
async fn count_signals(tx: Arc<watch::Sender<u32>>) {
    #[cfg(unix)]
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => Some(s),
        Err(e) => {
            eprintln!("cannot listen for SIGTERM: {e}");
            None
        }
    };
    loop {
        #[cfg(unix)]
        let got = async {
            match term.as_mut() {
                Some(t) => {
                    t.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        #[cfg(not(unix))]
        let got = std::future::pending::<()>();
        tokio::select! {
            r = tokio::signal::ctrl_c() => {
                if r.is_err() {
                    return;
                }
            }
            _ = got => {}
        }
        tx.send_modify(|n| *n += 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engine_thread_that_panics_clears_liveness_and_tells_the_server() {
        let alive = Arc::new(AtomicBool::new(true));
        let stopped = Arc::new(tokio::sync::Notify::new());
        let guard = EngineAlive {
            alive: alive.clone(),
            stopped: stopped.clone(),
        };
        let thread = std::thread::spawn(move || {
            let _alive = guard;
            panic!("a failed step");
        });
        assert!(thread.join().is_err());
        assert!(!alive.load(Ordering::SeqCst));
        // The notification waits for the server's task.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(5), stopped.notified())
                .await
                .expect("the server was told");
        });
    }
}
