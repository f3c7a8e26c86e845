//! Server benchmark: `te serve` on loopback, driven by 1, 8 and 32
//! concurrent streaming clients (plain threads speaking HTTP/1.1 over
//! `TcpStream`; no HTTP library). Each client sends its requests one after
//! another: a distinct ~20-token prompt, 32 new tokens (`ignore_eos`),
//! greedy, `stream: true` with `return_token_ids` so that every token
//! arrives as its own event. Time to first token is measured from the
//! request's first byte sent to its first token event, inter-token latency
//! between consecutive token events of one request.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// Concurrent clients of each row.
const LEVELS: [usize; 3] = [1, 8, 32];
/// Tokens generated per request.
const NEW_TOKENS: usize = 32;

/// Markdown rows: `| clients | requests | requests/s | generated tok/s |
/// TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |`.
pub fn run(model: &str) -> anyhow::Result<Vec<String>> {
    let te = crate::build_te(&[])?;
    let mut server = Server::start(&te, model)?;
    // Warm up (first-touch of the KV pool and the workspace).
    request(&server.addr, model, "Warm-up request:")?;
    let mut rows = Vec::new();
    for clients in LEVELS {
        let per_client = (8 / clients).max(2);
        let start = Instant::now();
        let results: Vec<anyhow::Result<Vec<Timing>>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..clients)
                .map(|c| {
                    let addr = server.addr.clone();
                    s.spawn(move || {
                        (0..per_client)
                            .map(|r| {
                                let prompt = format!(
                                    "Request {r} of client {c} at level {clients}: write a few \
                                     sentences about the history of topic number {}.",
                                    c * 1000 + r
                                );
                                request(&addr, model, &prompt)
                            })
                            .collect()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a client thread panicked"))
                .collect()
        });
        let wall = start.elapsed().as_secs_f64();
        let mut ttft = Vec::new();
        let mut itl = Vec::new();
        let mut tokens = 0;
        for r in results {
            for t in r? {
                if t.token_times.len() != NEW_TOKENS {
                    bail!(
                        "a request got {} tokens, expected {NEW_TOKENS}",
                        t.token_times.len()
                    );
                }
                tokens += t.token_times.len();
                ttft.push(t.token_times[0]);
                itl.extend(t.token_times.windows(2).map(|w| w[1] - w[0]));
            }
        }
        let requests = clients * per_client;
        rows.push(format!(
            "| {clients} | {requests} | {:.2} | {:.0} | {:.0} | {:.0} | {:.1} | {:.1} |",
            requests as f64 / wall,
            tokens as f64 / wall,
            1e3 * percentile(&mut ttft, 0.50),
            1e3 * percentile(&mut ttft, 0.99),
            1e3 * percentile(&mut itl, 0.50),
            1e3 * percentile(&mut itl, 0.99),
        ));
    }
    server.stop();
    Ok(rows)
}

struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(te: &std::path::Path, model: &str) -> anyhow::Result<Server> {
        let mut child = Command::new(te)
            .args([
                "serve",
                "--model",
                model,
                "--port",
                "0",
                "--max-batch-size",
                "32",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", te.display()))?;
        let mut stderr = BufReader::new(child.stderr.take().expect("piped"));
        let mut line = String::new();
        while stderr.read_line(&mut line)? > 0 {
            if let Some(rest) = line.split("listening on http://").nth(1) {
                let addr = rest.split_whitespace().next().unwrap_or("").to_string();
                // Drain the log so the server never blocks on a full pipe.
                std::thread::spawn(move || for _ in stderr.lines() {});
                return Ok(Server { child, addr });
            }
            line.clear();
        }
        let _ = child.kill();
        bail!("te serve exited before listening")
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Seconds from sending a request to each of its token events.
struct Timing {
    token_times: Vec<f64>,
}

/// One streaming completion over a fresh connection.
fn request(addr: &str, model: &str, prompt: &str) -> anyhow::Result<Timing> {
    let body = serde_json::json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "return_token_ids": true,
    })
    .to_string();
    let mut stream = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(Duration::from_secs(300)))?;
    let start = Instant::now();
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut r = BufReader::new(stream);
    let mut line = String::new();
    r.read_line(&mut line)?;
    if !line.starts_with("HTTP/1.1 200") {
        bail!("te serve answered {}", line.trim());
    }
    loop {
        line.clear();
        r.read_line(&mut line)?;
        if line == "\r\n" || line.is_empty() {
            break;
        }
    }
    // Chunked transfer encoding; SSE events end with a blank line.
    let mut events = String::new();
    let mut token_times = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line)?;
        let size = usize::from_str_radix(line.trim(), 16)
            .with_context(|| format!("bad chunk size line {line:?}"))?;
        if size == 0 {
            break;
        }
        let mut chunk = vec![0; size + 2];
        r.read_exact(&mut chunk)?;
        let now = start.elapsed().as_secs_f64();
        events.push_str(std::str::from_utf8(&chunk[..size])?);
        while let Some(end) = events.find("\n\n") {
            let event: String = events.drain(..end + 2).collect();
            if event.contains("\"token_ids\"") {
                token_times.push(now);
            } else if event.contains("\"error\"") {
                bail!("stream error: {event}");
            }
        }
    }
    Ok(Timing { token_times })
}

/// The `q` quantile (nearest rank) of `xs`.
fn percentile(xs: &mut [f64], q: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    let rank = ((q * xs.len() as f64).ceil() as usize).clamp(1, xs.len());
    xs[rank - 1]
}
