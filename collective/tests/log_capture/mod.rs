//! A global `tracing` subscriber for test worker processes that keeps every event's message, so a test can see
//! which path the library took (the library logs its one-time decisions at debug level).

#![allow(dead_code, reason = "each test binary uses part of it")]

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

static MESSAGES: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Capture {
    next_span: AtomicU64,
}

struct Message(String);

impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

impl Subscriber for Capture {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(self.next_span.fetch_add(1, Ordering::Relaxed) + 1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut m = Message(String::new());
        event.record(&mut m);
        MESSAGES.lock().unwrap_or_else(|e| e.into_inner()).push(m.0);
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

/// Installs the capturing subscriber for the whole process (once; later calls do nothing).
pub fn install() {
    let _ = tracing::subscriber::set_global_default(Capture {
        next_span: AtomicU64::new(0),
    });
}

/// Whether an event whose message contains `text` was logged since [`install`].
pub fn logged(text: &str) -> bool {
    MESSAGES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .any(|m| m.contains(text))
}

/// Every message logged since [`install`].
pub fn messages() -> Vec<String> {
    MESSAGES.lock().unwrap_or_else(|e| e.into_inner()).clone()
}
