//! Connections below axum: the accept loop and each connection's HTTP/1
//! driver (hyper), with the limits that keep slow, idle and half-open
//! clients from holding the server:
//!
//! - at most `max_connections` open and at most `max_per_client` from one
//!   IP address (more are closed at once); when all `max_connections` are
//!   open and another arrives, the oldest idle connection (no request in
//!   flight: it waits for a request head, or sends one slowly) is closed
//!   for it, so idle and half-open sockets from many addresses cannot lock
//!   a new client out; with every connection busy, it waits for one to
//!   end;
//! - a connection must deliver a whole request head within
//!   `header_read_timeout` of being ready for one: after it opens, and
//!   after each response, so this is the idle keep-alive timeout too
//!   (hyper's header-read timer);
//! - a write that makes no progress for `write_timeout` (a client that
//!   stopped reading) ends the connection;
//! - a peer that closed its side ends the connection, and so drops the
//!   request in flight (aborting its generation), even when it had sent
//!   bytes after its request that hyper has not read (hyper alone sees
//!   the end of the stream only with an empty read buffer).
//!
//! The request body's own deadline is [`super::guard`]'s. Every
//! connection has `TCP_NODELAY` set, so each streamed token leaves at once,
//! and a send buffer of [`SEND_BUFFER`] bytes: Linux would otherwise grow
//! it to 4 MiB for a peer that does not read (tens of thousands of
//! streamed tokens), so its writes would stall, and the write timeout
//! start, only that much later.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::Router;
use http_body::{Frame, SizeHint};
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;

use super::metrics::Metrics;

/// How often a connection with a request in flight checks whether its
/// peer closed.
const PEER_CHECK: Duration = Duration::from_millis(200);

/// Each connection's kernel send buffer (bytes; `SO_SNDBUF`, which Linux
/// doubles for its bookkeeping): a few hundred streamed tokens, and far
/// more than a token stream needs in flight on any link.
const SEND_BUFFER: usize = 64 << 10;

/// The connection limits (`te serve` flags).
#[derive(Clone, Debug)]
pub struct Limits {
    /// `--max-connections`: open connections at once (>= 1).
    pub max_connections: usize,
    /// `--max-connections-per-client`: open connections from one IP
    /// address (>= 1).
    pub max_per_client: usize,
    /// `--header-read-timeout-secs`: time to deliver a request head once
    /// the connection waits for one (also the idle keep-alive timeout).
    pub header_read_timeout: Duration,
    /// `--write-timeout-secs`: longest a response write may make no
    /// progress.
    pub write_timeout: Duration,
}

/// Serves `router` on `tcp` until `shutdown` resolves; then stops
/// accepting, asks every connection to close after its response in
/// progress, and resolves once all have closed.
pub async fn serve(
    tcp: TcpListener,
    router: Router,
    limits: Limits,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let clients = Arc::new(Mutex::new(HashMap::new()));
    let open = Arc::new(OpenConnections::default());
    // Each connection holds a receiver; `closed()` waits for them all.
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            a = accept(&tcp, &slots, &open) => a,
            () = &mut shutdown => break,
        };
        let (stream, addr, slot) = accepted;
        let Some(per_client) = ClientSlot::take(&clients, addr.ip(), limits.max_per_client) else {
            metrics.connection_refused();
            tracing::debug!(%addr, "connection refused: --max-connections-per-client reached");
            continue; // dropping the stream closes it
        };
        let stream = Arc::new(stream);
        let io = Connection {
            stream: stream.clone(),
            write_timeout: limits.write_timeout,
            write_stalled: None,
            _slot: slot,
            _per_client: per_client,
        };
        let tracked = open.insert();
        let service = {
            let inner = TowerToHyperService::new(router.clone());
            let activity = tracked.activity.clone();
            hyper::service::service_fn(move |req| {
                let busy = Busy::enter(&activity);
                let response = hyper::service::Service::call(&inner, req);
                async move {
                    let response = response.await?;
                    Ok::<_, std::convert::Infallible>(
                        response.map(|inner| Tracked { inner, _busy: busy }),
                    )
                }
            })
        };
        let conn = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout)
            .serve_connection(TokioIo::new(io), service);
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            let evict = tracked.activity.clone();
            let _tracked = tracked;
            tokio::pin!(conn);
            let mut stopping = *stop.borrow();
            if stopping {
                conn.as_mut().graceful_shutdown();
            }
            loop {
                tokio::select! {
                    _ = conn.as_mut() => break,
                    // Dropping `conn` drops the request in flight.
                    () = peer_closed(&stream) => break,
                    // Closed for a new connection while idle.
                    () = evict.evicted.notified() => {
                        if evict.busy.load(Ordering::Acquire) == 0 {
                            break;
                        }
                    }
                    r = stop.changed(), if !stopping => {
                        stopping = true;
                        if r.is_ok() {
                            conn.as_mut().graceful_shutdown();
                        }
                    }
                }
            }
        });
    }
    drop(tcp); // new connections are refused from now on
    let _ = stop_tx.send(true);
    drop(stop_rx);
    stop_tx.closed().await;
}

/// How often a new connection waiting for a slot, with every open one
/// busy, looks again for an idle one to close.
const EVICT_RETRY: Duration = Duration::from_millis(50);

/// The next connection and its slot: a free one, or the slot of the
/// oldest idle connection, closed for it; with none idle, the first slot
/// to free.
async fn accept(
    tcp: &TcpListener,
    slots: &Arc<Semaphore>,
    open: &OpenConnections,
) -> (TcpStream, SocketAddr, OwnedSemaphorePermit) {
    let (stream, addr) = accept_stream(tcp).await;
    if let Ok(slot) = slots.clone().try_acquire_owned() {
        return (stream, addr, slot);
    }
    loop {
        let evicted = open.evict_oldest_idle();
        if evicted {
            tracing::debug!(%addr, "--max-connections reached: the oldest idle connection closed");
        }
        tokio::select! {
            slot = slots.clone().acquire_owned() => {
                return (stream, addr, slot.expect("the semaphore is never closed"));
            }
            () = tokio::time::sleep(EVICT_RETRY) => {}
        }
    }
}

/// The next accepted TCP stream, set up for streaming.
async fn accept_stream(tcp: &TcpListener) -> (TcpStream, SocketAddr) {
    loop {
        match tcp.accept().await {
            Ok((stream, addr)) => {
                let _ = stream.set_nodelay(true);
                let _ = socket2::SockRef::from(&stream).set_send_buffer_size(SEND_BUFFER);
                return (stream, addr);
            }
            Err(e) => {
                // A peer that gave up before we accepted is no error;
                // anything else (out of file descriptors) is retried
                // after a pause.
                if !matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset
                ) {
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }
}

/// Resolves once the peer has closed its side (or the socket failed).
/// While unread bytes wait, readiness is immediate, so it checks every
/// [`PEER_CHECK`] rather than spinning.
async fn peer_closed(stream: &TcpStream) {
    loop {
        match stream.ready(Interest::READABLE).await {
            Ok(r) if !r.is_read_closed() => {}
            _ => return,
        }
        tokio::time::sleep(PEER_CHECK).await;
    }
}

/// One connection's requests in flight (a request head read, its response
/// body not yet all sent), and its signal to close when idle.
#[derive(Default)]
struct Activity {
    busy: AtomicUsize,
    evicted: Notify,
}

/// A request in flight on a connection; it ends when dropped (with the
/// response body).
struct Busy(Arc<Activity>);

impl Busy {
    fn enter(activity: &Arc<Activity>) -> Busy {
        activity.busy.fetch_add(1, Ordering::AcqRel);
        Busy(activity.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request counted as in flight until the
/// body is sent (or dropped); frames and size hints pass through.
struct Tracked {
    inner: Body,
    _busy: Busy,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The open connections by age (accept order), for closing the oldest
/// idle one when all slots are taken.
#[derive(Default)]
struct OpenConnections {
    by_age: Mutex<BTreeMap<u64, Arc<Activity>>>,
    next: AtomicU64,
}

impl OpenConnections {
    /// Registers a new connection; it leaves the registry when the
    /// returned entry drops.
    fn insert(self: &Arc<Self>) -> OpenEntry {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let activity = Arc::new(Activity::default());
        self.lock().insert(id, activity.clone());
        OpenEntry {
            open: self.clone(),
            id,
            activity,
        }
    }

    /// Signals the oldest connection with no request in flight to close;
    /// false when every one is busy.
    fn evict_oldest_idle(&self) -> bool {
        let mut by_age = self.lock();
        let Some(id) = by_age
            .iter()
            .find(|(_, a)| a.busy.load(Ordering::Acquire) == 0)
            .map(|(id, _)| *id)
        else {
            return false;
        };
        let activity = by_age.remove(&id).expect("found above");
        activity.evicted.notify_one();
        true
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<Activity>>> {
        self.by_age.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A connection's place in [`OpenConnections`].
struct OpenEntry {
    open: Arc<OpenConnections>,
    id: u64,
    activity: Arc<Activity>,
}

impl Drop for OpenEntry {
    fn drop(&mut self) {
        self.open.lock().remove(&self.id);
    }
}

/// One open connection counted against its IP address's cap; the count
/// drops with it.
struct ClientSlot {
    clients: Arc<Mutex<HashMap<IpAddr, usize>>>,
    ip: IpAddr,
}

impl ClientSlot {
    /// A slot for `ip`, or `None` when it holds `max` already.
    fn take(clients: &Arc<Mutex<HashMap<IpAddr, usize>>>, ip: IpAddr, max: usize) -> Option<Self> {
        let mut map = clients.lock().unwrap_or_else(|e| e.into_inner());
        let n = map.entry(ip).or_default();
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(ClientSlot {
            clients: clients.clone(),
            ip,
        })
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut map = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = map.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.ip);
            }
        }
    }
}

/// An accepted connection: the stream (shared with the task that watches
/// for the peer closing), its write deadline, and its slots, which free
/// when it is dropped.
struct Connection {
    stream: Arc<TcpStream>,
    write_timeout: Duration,
    /// Armed while a write waits for the socket.
    write_stalled: Option<Pin<Box<Sleep>>>,
    _slot: OwnedSemaphorePermit,
    _per_client: ClientSlot,
}

impl Connection {
    /// Waits for the socket to take bytes; an error once it has not for
    /// `write_timeout`.
    fn poll_writable(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Poll::Ready(r) = self.stream.poll_write_ready(cx) {
            return Poll::Ready(r);
        }
        let timeout = self.write_timeout;
        let stalled = self
            .write_stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        ready!(stalled.as_mut().poll(cx));
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "the client read nothing for --write-timeout-secs",
        )))
    }

    /// Runs `write` once the socket is writable, until it does not block.
    fn poll_write_with(
        &mut self,
        cx: &mut Context<'_>,
        write: impl Fn(&TcpStream) -> io::Result<usize>,
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.poll_writable(cx))?;
            match write(&self.stream) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                r => {
                    self.write_stalled = None;
                    return Poll::Ready(r);
                }
            }
        }
    }
}

impl AsyncRead for Connection {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            ready!(self.stream.poll_read_ready(cx))?;
            match self.stream.try_read(buf.initialize_unfilled()) {
                Ok(n) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_with(cx, |s| s.try_write(buf))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_with(cx, |s| s.try_write_vectored(bufs))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Writes go straight to the socket.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // The connection closes when it is dropped, right after this.
        Poll::Ready(Ok(()))
    }
}
