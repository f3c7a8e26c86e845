//! Driving the engine from several threads: the engine runs on a thread
//! of its own ([`Engine::run`]) and other threads talk to it through an
//! [`EngineHandle`] (submit, abort, snapshot); each request's events
//! arrive on its own receiver, and dropping a receiver aborts the request
//! at the next step.

use std::collections::HashMap;
use std::sync::mpsc;

use crate::engine::{Engine, EngineSnapshot};
use crate::output::Event;
use crate::request::{Request, RequestError, RequestId};
use crate::Result;

/// A command for [`Engine::run`], sent by an [`EngineHandle`].
pub enum Command {
    /// Add a request; its events go to `events`, the result of
    /// `add_request` to `reply`.
    Submit {
        request: Box<Request>,
        events: mpsc::Sender<Event>,
        reply: mpsc::Sender<std::result::Result<RequestId, RequestError>>,
    },
    /// Abort a request (unknown ids are ignored).
    Abort(RequestId),
    /// Send [`Engine::snapshot`] to the sender.
    Snapshot(mpsc::Sender<EngineSnapshot>),
}

/// The thread-safe side of [`Engine::run`]: cheap to clone, usable from
/// any thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
}

/// A handle and the receiver [`Engine::run`] takes.
pub fn channel() -> (EngineHandle, mpsc::Receiver<Command>) {
    let (tx, rx) = mpsc::channel();
    (EngineHandle { tx }, rx)
}

/// The engine loop has stopped (its thread ended or failed).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the engine has stopped")]
pub struct EngineStopped;

impl EngineHandle {
    /// Submits `request`; blocks until the engine has validated it (at most
    /// one step). Returns its id and the receiver of its events, or the
    /// validation error.
    ///
    /// Errors: the outer error when the engine loop has stopped.
    #[allow(clippy::type_complexity)]
    pub fn submit(
        &self,
        request: Request,
    ) -> std::result::Result<
        std::result::Result<(RequestId, mpsc::Receiver<Event>), RequestError>,
        EngineStopped,
    > {
        let (events, rx) = mpsc::channel();
        let (reply, reply_rx) = mpsc::channel();
        self.tx
            .send(Command::Submit {
                request: Box::new(request),
                events,
                reply,
            })
            .map_err(|_| EngineStopped)?;
        let result = reply_rx.recv().map_err(|_| EngineStopped)?;
        Ok(result.map(|id| (id, rx)))
    }

    /// The engine's [`EngineSnapshot`]; blocks until the engine takes the
    /// command (at most one step).
    ///
    /// Errors: the engine loop has stopped.
    pub fn snapshot(&self) -> std::result::Result<EngineSnapshot, EngineStopped> {
        let (reply, rx) = mpsc::channel();
        self.tx
            .send(Command::Snapshot(reply))
            .map_err(|_| EngineStopped)?;
        rx.recv().map_err(|_| EngineStopped)
    }

    /// Asks the engine to abort `id` at its next step.
    ///
    /// Errors: the engine loop has stopped.
    pub fn abort(&self, id: RequestId) -> std::result::Result<(), EngineStopped> {
        self.tx.send(Command::Abort(id)).map_err(|_| EngineStopped)
    }
}

impl Engine<'_> {
    /// The engine loop for a multi-threaded caller (see the module doc):
    /// takes commands from the [`EngineHandle`]s of `commands`, steps while
    /// there is work, sends each request's events to its receiver, and
    /// returns when every handle is dropped and all work is done. A request
    /// whose receiver is dropped is aborted.
    ///
    /// Errors: a failing step (after which every open request receives a
    /// `Finished` event with reason `abort`).
    pub fn run(&mut self, commands: mpsc::Receiver<Command>) -> Result<()> {
        let mut sinks: HashMap<RequestId, mpsc::Sender<Event>> = std::collections::HashMap::new();
        let mut open = true;
        loop {
            // Block for a command only when idle.
            if !self.has_work() && open {
                match commands.recv() {
                    Ok(cmd) => self.apply(cmd, &mut sinks),
                    Err(_) => open = false,
                }
            }
            loop {
                match commands.try_recv() {
                    Ok(cmd) => self.apply(cmd, &mut sinks),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            if !self.has_work() {
                if open {
                    continue;
                }
                return Ok(());
            }
            let events = match self.step() {
                Ok(ev) => ev,
                Err(e) => {
                    let ids: Vec<RequestId> = sinks.keys().copied().collect();
                    for id in ids {
                        let _ = self.abort(id);
                    }
                    for ev in self.take_pending() {
                        if let Some(tx) = sinks.get(&ev.id()) {
                            let _ = tx.send(ev);
                        }
                    }
                    return Err(e);
                }
            };
            for ev in events {
                let id = ev.id();
                let done = matches!(ev, Event::Finished { .. });
                let delivered = sinks.get(&id).is_some_and(|tx| tx.send(ev).is_ok());
                if done {
                    sinks.remove(&id);
                } else if !delivered {
                    // The caller went away: free its sequence now.
                    sinks.remove(&id);
                    let _ = self.abort(id);
                }
            }
        }
    }

    fn apply(&mut self, cmd: Command, sinks: &mut HashMap<RequestId, mpsc::Sender<Event>>) {
        match cmd {
            Command::Submit {
                request,
                events,
                reply,
            } => {
                let result = self.add_request(*request);
                if let Ok(id) = result {
                    sinks.insert(id, events);
                }
                let _ = reply.send(result);
            }
            Command::Abort(id) => {
                let _ = self.abort(id);
            }
            Command::Snapshot(reply) => {
                let _ = reply.send(self.snapshot());
            }
        }
    }
}
