//! From async request handlers to the engine thread: submitting a request
//! through the blocking [`EngineHandle`] and receiving its events
//! asynchronously.
//!
//! Each request gets one blocking-pool thread that submits it (waiting at
//! most one engine step for validation) and then forwards its events from
//! the engine's std channel to a tokio channel. The [`Generation`] that the
//! handler holds aborts the request when dropped before its `Finished`
//! event: a client that goes away frees its sequence at the engine's next
//! step.

use te_engine::{EngineHandle, Event, Request, RequestError, RequestId};
use tokio::sync::{mpsc, oneshot};

/// Why a request did not start.
#[derive(Debug)]
pub enum SubmitError {
    /// The engine refused it (the field at fault is named).
    Rejected(RequestError),
    /// The engine loop has stopped.
    Stopped,
}

/// A running request: its id and its events.
pub struct Generation {
    events: mpsc::UnboundedReceiver<Event>,
    abort: AbortOnDrop,
}

struct AbortOnDrop {
    handle: EngineHandle,
    id: RequestId,
    finished: bool,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if !self.finished {
            // The engine may have stopped already; then there is nothing to free.
            let _ = self.handle.abort(self.id);
        }
    }
}

/// Submits `request`; resolves once the engine has accepted or refused it.
///
/// Errors: [`SubmitError`].
pub async fn submit(handle: &EngineHandle, request: Request) -> Result<Generation, SubmitError> {
    let (tx, rx) = mpsc::unbounded_channel();
    let (reply_tx, reply_rx) = oneshot::channel();
    let submitter = handle.clone();
    tokio::task::spawn_blocking(move || {
        let events = match submitter.submit(request) {
            Ok(Ok((id, events))) => {
                if reply_tx.send(Ok(id)).is_err() {
                    // The handler went away while we waited.
                    let _ = submitter.abort(id);
                    return;
                }
                events
            }
            Ok(Err(e)) => {
                let _ = reply_tx.send(Err(SubmitError::Rejected(e)));
                return;
            }
            Err(_) => {
                let _ = reply_tx.send(Err(SubmitError::Stopped));
                return;
            }
        };
        // Hold no handle while forwarding: the engine loop ends when every
        // handle is gone.
        drop(submitter);
        for event in events {
            if tx.send(event).is_err() {
                break;
            }
        }
    });
    let id = reply_rx.await.map_err(|_| SubmitError::Stopped)??;
    Ok(Generation {
        events: rx,
        abort: AbortOnDrop {
            handle: handle.clone(),
            id,
            finished: false,
        },
    })
}

impl Generation {
    /// The next event; `None` when the engine stopped without finishing
    /// the request.
    pub async fn next(&mut self) -> Option<Event> {
        let event = self.events.recv().await;
        if matches!(event, Some(Event::Finished { .. })) {
            self.abort.finished = true;
        }
        event
    }
}
