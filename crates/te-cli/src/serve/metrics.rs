//! `GET /metrics`: Prometheus text exposition (format 0.0.4) of the
//! server's counters and histograms and the engine's gauges.
//!
//! | metric | kind |
//! |---|---|
//! | `te_http_requests_total{endpoint, status}` (499: the client left first) | counter |
//! | `te_requests_finished_total{reason}` (`stop`, `length`, `abort`) | counter |
//! | `te_prompt_tokens_total`, `te_generation_tokens_total` | counter |
//! | `te_requests_in_flight` (generation requests the server holds) | gauge |
//! | `te_connections_refused_total` (over `--max-connections-per-client`) | counter |
//! | `te_sequences_running`, `te_sequences_waiting` | gauge |
//! | `te_kv_cache_pages_in_use`, `te_kv_cache_pages_total` | gauge |
//! | `te_engine_preemptions_total` | counter |
//! | `te_draft_tokens_total`, `te_accepted_tokens_total`, `te_verifications_total` (speculative decoding) | counter |
//! | `te_draft_acceptance_rate`, `te_draft_mean_accepted_length` | gauge |
//! | `te_time_to_first_token_seconds` | histogram |
//! | `te_inter_token_latency_seconds` | histogram |

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use te_engine::EngineSnapshot;

/// Upper bounds of the time-to-first-token buckets, seconds.
const TTFT_BOUNDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// Upper bounds of the inter-token latency buckets, seconds.
const ITL_BOUNDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// A Prometheus histogram with fixed buckets.
struct Histogram {
    bounds: &'static [f64],
    state: Mutex<HistogramState>,
}

#[derive(Default)]
struct HistogramState {
    /// Observations per bucket (not cumulative); the last is +Inf.
    counts: Vec<u64>,
    sum: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            state: Mutex::new(HistogramState {
                counts: vec![0; bounds.len() + 1],
                sum: 0.0,
            }),
        }
    }

    fn observe(&self, x: f64) {
        let i = self.bounds.partition_point(|&b| b < x);
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.counts[i] += 1;
        s.sum += x;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (i, &b) in self.bounds.iter().enumerate() {
            cumulative += s.counts[i];
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cumulative}");
        }
        cumulative += s.counts[self.bounds.len()];
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cumulative}");
        let _ = writeln!(out, "{name}_sum {}", s.sum);
        let _ = writeln!(out, "{name}_count {cumulative}");
    }
}

/// The server's metrics (shared by every request).
pub struct Metrics {
    http: Mutex<BTreeMap<(String, u16), u64>>,
    finished: Mutex<BTreeMap<&'static str, u64>>,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    in_flight: AtomicU64,
    connections_refused: AtomicU64,
    ttft: Histogram,
    itl: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            http: Mutex::default(),
            finished: Mutex::default(),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            connections_refused: AtomicU64::new(0),
            ttft: Histogram::new(TTFT_BOUNDS),
            itl: Histogram::new(ITL_BOUNDS),
        }
    }
}

impl Metrics {
    /// A response with `status` to a request for `endpoint` (the route).
    pub fn http_request(&self, endpoint: &str, status: u16) {
        let mut m = self.http.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry((endpoint.to_string(), status)).or_default() += 1;
    }

    /// A request for `endpoint` (the route) has arrived: its response is
    /// counted by [`HttpRequest::answered`], or as status 499 (nginx's
    /// "client closed request") if the client left before it.
    pub fn http_started(self: &Arc<Self>, endpoint: String) -> HttpRequest {
        HttpRequest {
            metrics: self.clone(),
            endpoint,
            counted: false,
            arrived: std::time::Instant::now(),
        }
    }

    /// A generation finished: `reason` is `stop`, `length` or `abort`.
    pub fn finished(&self, reason: &'static str, prompt_tokens: usize, generated: usize) {
        *self
            .finished
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(reason)
            .or_default() += 1;
        self.prompt_tokens
            .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        self.generation_tokens
            .fetch_add(generated as u64, Ordering::Relaxed);
    }

    /// A connection closed at once: its client address holds
    /// `--max-connections-per-client` already.
    pub fn connection_refused(&self) {
        self.connections_refused.fetch_add(1, Ordering::Relaxed);
    }

    /// Seconds from a request's arrival to its first token.
    pub fn time_to_first_token(&self, s: f64) {
        self.ttft.observe(s);
    }

    /// Seconds between two tokens of one request.
    pub fn inter_token_latency(&self, s: f64) {
        self.itl.observe(s);
    }

    /// Generation requests held now (see [`InFlight`]).
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Counts one more request in flight if fewer than `limit` are;
    /// `None` when the limit is reached.
    pub fn try_enter(self: &Arc<Self>, limit: u64) -> Option<InFlight> {
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .ok()
            .map(|_| InFlight(self.clone()))
    }

    /// The exposition text; `engine` is `None` when the engine has stopped.
    pub fn render(&self, engine: Option<&EngineSnapshot>) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        counter(
            &mut out,
            "te_http_requests_total",
            "HTTP responses by route and status code.",
        );
        for ((endpoint, status), n) in self.http.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = writeln!(
                out,
                "te_http_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}"
            );
        }
        counter(
            &mut out,
            "te_requests_finished_total",
            "Generation requests finished, by reason (stop, length, abort).",
        );
        let finished = self.finished.lock().unwrap_or_else(|e| e.into_inner());
        for reason in ["stop", "length", "abort"] {
            let n = finished.get(reason).copied().unwrap_or(0);
            let _ = writeln!(out, "te_requests_finished_total{{reason=\"{reason}\"}} {n}");
        }
        drop(finished);
        counter(
            &mut out,
            "te_prompt_tokens_total",
            "Prompt tokens of finished requests.",
        );
        let _ = writeln!(
            out,
            "te_prompt_tokens_total {}",
            self.prompt_tokens.load(Ordering::Relaxed)
        );
        counter(
            &mut out,
            "te_generation_tokens_total",
            "Tokens generated for finished requests.",
        );
        let _ = writeln!(
            out,
            "te_generation_tokens_total {}",
            self.generation_tokens.load(Ordering::Relaxed)
        );
        gauge(
            &mut out,
            "te_requests_in_flight",
            "Generation requests the server holds (queued, running or streaming).",
            self.in_flight(),
        );
        counter(
            &mut out,
            "te_connections_refused_total",
            "Connections closed at once: their client address held --max-connections-per-client.",
        );
        let _ = writeln!(
            out,
            "te_connections_refused_total {}",
            self.connections_refused.load(Ordering::Relaxed)
        );
        if let Some(e) = engine {
            gauge(
                &mut out,
                "te_sequences_running",
                "Sequences in the running batch.",
                e.running as u64,
            );
            gauge(
                &mut out,
                "te_sequences_waiting",
                "Sequences waiting for admission.",
                e.waiting as u64,
            );
            gauge(
                &mut out,
                "te_kv_cache_pages_in_use",
                "KV-cache pages in use.",
                e.kv_pages_in_use as u64,
            );
            gauge(
                &mut out,
                "te_kv_cache_pages_total",
                "KV-cache pages in the pool.",
                e.kv_pages_total as u64,
            );
            counter(
                &mut out,
                "te_engine_preemptions_total",
                "Sequences preempted (freed, to be recomputed).",
            );
            let _ = writeln!(out, "te_engine_preemptions_total {}", e.stats.preemptions);
            counter(
                &mut out,
                "te_prefix_cache_hit_tokens_total",
                "Prompt tokens whose keys and values came from shared pages.",
            );
            let _ = writeln!(
                out,
                "te_prefix_cache_hit_tokens_total {}",
                e.stats.prefix_hit_tokens
            );
            for (name, help, value) in [
                (
                    "te_draft_tokens_total",
                    "Drafted tokens verified (speculative decoding).",
                    e.stats.draft_tokens,
                ),
                (
                    "te_accepted_tokens_total",
                    "Drafted tokens the model accepted.",
                    e.stats.accepted_tokens,
                ),
                (
                    "te_verifications_total",
                    "Steps in which a sequence verified a draft.",
                    e.stats.verifications,
                ),
            ] {
                counter(&mut out, name, help);
                let _ = writeln!(out, "{name} {value}");
            }
            for (name, help, value) in [
                (
                    "te_draft_acceptance_rate",
                    "Accepted over drafted tokens (0 before any draft).",
                    e.stats.acceptance_rate(),
                ),
                (
                    "te_draft_mean_accepted_length",
                    "Accepted drafted tokens per verification (0 before any).",
                    e.stats.mean_accepted_length(),
                ),
            ] {
                let _ = writeln!(
                    out,
                    "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
                );
            }
        }
        self.ttft.render(
            &mut out,
            "te_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token.",
        );
        self.itl.render(
            &mut out,
            "te_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
        );
        out
    }
}

/// A request being answered (see [`Metrics::http_started`]).
///
/// Logs one line per request, but for generations that started (their
/// own line says more: tokens, time to first token).
pub struct HttpRequest {
    metrics: Arc<Metrics>,
    endpoint: String,
    counted: bool,
    arrived: std::time::Instant,
}

impl HttpRequest {
    /// Counts the response's `status`.
    pub fn answered(mut self, status: u16) {
        self.counted = true;
        self.record(status);
    }

    fn record(&self, status: u16) {
        self.metrics.http_request(&self.endpoint, status);
        let generation =
            self.endpoint.starts_with("/v1/") && self.endpoint.ends_with("completions");
        if !(generation && status == 200) {
            tracing::info!(
                route = %self.endpoint,
                status,
                ms = self.arrived.elapsed().as_millis() as u64,
                "request"
            );
        }
    }
}

impl Drop for HttpRequest {
    fn drop(&mut self) {
        if !self.counted {
            self.record(499);
        }
    }
}

/// A generation request counted in `te_requests_in_flight` while alive.
pub struct InFlight(Arc<Metrics>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        for s in [0.003, 0.007, 0.007, 100.0] {
            m.time_to_first_token(s);
        }
        let text = m.render(None);
        assert!(text.contains("te_time_to_first_token_seconds_bucket{le=\"0.005\"} 1\n"));
        assert!(text.contains("te_time_to_first_token_seconds_bucket{le=\"0.01\"} 3\n"));
        assert!(text.contains("te_time_to_first_token_seconds_bucket{le=\"60\"} 3\n"));
        assert!(text.contains("te_time_to_first_token_seconds_bucket{le=\"+Inf\"} 4\n"));
        assert!(text.contains("te_time_to_first_token_seconds_count 4\n"));
        assert!(!text.contains("te_sequences_running"), "no engine gauges");
    }

    #[test]
    fn counters_gauges_and_the_in_flight_limit() {
        let m = Arc::new(Metrics::default());
        m.http_request("/v1/completions", 200);
        m.http_request("/v1/completions", 200);
        m.http_request("/v1/completions", 400);
        m.finished("stop", 5, 3);
        let a = m.try_enter(2).expect("below the limit");
        let _b = m.try_enter(2).expect("below the limit");
        assert!(m.try_enter(2).is_none(), "at the limit");
        drop(a);
        assert_eq!(m.in_flight(), 1);
        let snap = EngineSnapshot {
            running: 3,
            waiting: 1,
            kv_pages_in_use: 9,
            kv_pages_total: 64,
            stats: te_engine::EngineStats {
                draft_tokens: 40,
                accepted_tokens: 30,
                verifications: 10,
                ..te_engine::EngineStats::default()
            },
        };
        let text = m.render(Some(&snap));
        for line in [
            "te_http_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 2",
            "te_http_requests_total{endpoint=\"/v1/completions\",status=\"400\"} 1",
            "te_requests_finished_total{reason=\"stop\"} 1",
            "te_requests_finished_total{reason=\"abort\"} 0",
            "te_prompt_tokens_total 5",
            "te_generation_tokens_total 3",
            "te_requests_in_flight 1",
            "te_sequences_running 3",
            "te_sequences_waiting 1",
            "te_kv_cache_pages_in_use 9",
            "te_kv_cache_pages_total 64",
            "te_draft_tokens_total 40",
            "te_accepted_tokens_total 30",
            "te_verifications_total 10",
            "te_draft_acceptance_rate 0.75",
            "te_draft_mean_accepted_length 3",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
    }
}
