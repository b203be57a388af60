//! Chrome-trace timeline (`HVD_TIMELINE=path`), loadable in Perfetto and chrome://tracing.
//!
//! The engine thread only pushes small [`Event`] values into a vector; formatting and I/O happen on a writer thread
//! that receives batches over a channel, so the hot path costs a push per phase. The file is a JSON array that is
//! valid at every moment between writes: it always ends in `\n]`, and each batch is written with one positioned
//! write that replaces that tail by `,\n{event}...\n]`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Begin,
    End,
    Instant,
}

/// One trace event. `lane` is the tensor's lane (a Chrome-trace thread), 0 for engine-wide marks.
#[derive(Debug, Clone)]
pub struct Event {
    pub phase: Phase,
    pub name: EventName,
    pub lane: u32,
    pub ts_us: u64,
}

/// An event's name: a constant, or one built once and shared (cloning is a reference-count increment, so the
/// engine can stamp it on every lane of a fused group without allocating).
#[derive(Debug, Clone)]
pub enum EventName {
    Static(&'static str),
    Owned(Arc<str>),
}

impl EventName {
    fn as_str(&self) -> &str {
        match self {
            EventName::Static(s) => s,
            EventName::Owned(s) => s,
        }
    }
}

enum Message {
    Events(Vec<Event>),
    LaneName(u32, String),
    Flush(mpsc::Sender<()>),
}

/// The engine's handle on the timeline.
pub struct Timeline {
    start: Instant,
    pending: Vec<Event>,
    last_send: Instant,
    lanes: HashMap<String, u32>,
    tx: Option<mpsc::Sender<Message>>,
    writer: Option<JoinHandle<io::Result<()>>>,
    path: PathBuf,
}

/// Batches are handed to the writer at least this often, and whenever this many events are waiting.
const SEND_INTERVAL: Duration = Duration::from_millis(100);
const SEND_EVENTS: usize = 4096;

impl Timeline {
    /// Creates (truncates) the file and starts the writer thread.
    pub fn create(path: &Path, rank: usize) -> io::Result<Timeline> {
        let file = fs_err::File::create(path)?;
        let (tx, rx) = mpsc::channel();
        let file: File = file.into_parts().0;
        let p = path.to_path_buf();
        let writer = std::thread::Builder::new()
            .name("hvd-timeline".into())
            .spawn(move || write_loop(file, &p, rank, rx))?;
        Ok(Timeline {
            start: Instant::now(),
            pending: Vec::with_capacity(SEND_EVENTS),
            last_send: Instant::now(),
            lanes: HashMap::new(),
            tx: Some(tx),
            writer: Some(writer),
            path: path.to_path_buf(),
        })
    }

    pub fn now_us(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    /// The lane of a tensor, announcing its name to the trace the first time.
    pub fn lane(&mut self, tensor: &str) -> u32 {
        if let Some(l) = self.lanes.get(tensor) {
            return *l;
        }
        let l = self.lanes.len() as u32 + 1;
        self.lanes.insert(tensor.to_string(), l);
        if let Some(tx) = &self.tx {
            let _ = tx.send(Message::LaneName(l, tensor.to_string()));
        }
        l
    }

    pub fn record(&mut self, phase: Phase, name: EventName, lane: u32, ts_us: u64) {
        self.pending.push(Event {
            phase,
            name,
            lane,
            ts_us,
        });
    }

    pub fn begin(&mut self, lane: u32, name: &'static str) {
        let ts = self.now_us();
        self.record(Phase::Begin, EventName::Static(name), lane, ts);
    }

    pub fn end(&mut self, lane: u32) {
        let ts = self.now_us();
        self.record(Phase::End, EventName::Static(""), lane, ts);
    }

    /// Hands buffered events to the writer if enough time or events have accumulated.
    pub fn maybe_send(&mut self) {
        if self.pending.len() >= SEND_EVENTS
            || (!self.pending.is_empty() && self.last_send.elapsed() >= SEND_INTERVAL)
        {
            self.send();
        }
    }

    fn send(&mut self) {
        self.last_send = Instant::now();
        let batch = std::mem::replace(&mut self.pending, Vec::with_capacity(SEND_EVENTS));
        if let Some(tx) = &self.tx {
            let _ = tx.send(Message::Events(batch));
        }
    }

    /// Writes everything recorded so far and waits until it is on disk (in the page cache).
    pub fn flush(&mut self) {
        self.send();
        if let Some(tx) = &self.tx {
            let (done_tx, done_rx) = mpsc::channel();
            if tx.send(Message::Flush(done_tx)).is_ok() {
                let _ = done_rx.recv();
            }
        }
    }

    /// Flushes and stops the writer.
    pub fn close(&mut self) {
        self.send();
        self.tx = None;
        if let Some(w) = self.writer.take() {
            match w.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!("failed to write the timeline {}: {e}", self.path.display())
                }
                Err(_) => {
                    tracing::warn!("the timeline writer for {} panicked", self.path.display())
                }
            }
        }
    }
}

impl Drop for Timeline {
    fn drop(&mut self) {
        self.close();
    }
}

fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"?\"".to_string())
}

/// Appends `s` as a JSON string; event names are plain identifiers, so the escaping path is rare.
fn push_json_string(out: &mut String, s: &str) {
    if s.bytes()
        .all(|b| b >= 0x20 && b != b'"' && b != b'\\' && b < 0x7f)
    {
        out.push('"');
        out.push_str(s);
        out.push('"');
    } else {
        out.push_str(&json_string(s));
    }
}

fn write_loop(file: File, path: &Path, rank: usize, rx: mpsc::Receiver<Message>) -> io::Result<()> {
    let with_path = |e: io::Error| io::Error::new(e.kind(), format!("{}: {e}", path.display()));
    let mut len: u64 = 0;
    let mut first = true;
    let mut put = |text: &str| -> io::Result<()> {
        // Replace the closing `\n]` (or the whole `[]` at first) with `sep + text + \n]` in one write.
        let mut buf = String::with_capacity(text.len() + 4);
        let at = if first { 0 } else { len - 2 };
        buf.push_str(if first { "[\n" } else { ",\n" });
        buf.push_str(text);
        buf.push_str("\n]");
        file.write_all_at(buf.as_bytes(), at).map_err(with_path)?;
        len = at + buf.len() as u64;
        first = false;
        Ok(())
    };
    file.write_all_at(b"[]", 0).map_err(with_path)?;
    put(&format!(
        r#"{{"name":"process_name","ph":"M","pid":{rank},"tid":0,"args":{{"name":"hvd rank {rank}"}}}},
{{"name":"thread_name","ph":"M","pid":{rank},"tid":0,"args":{{"name":"engine"}}}}"#
    ))?;
    // Names of the open `B` events per lane, so that every `E` carries its name (easier to read in raw form).
    let mut open: HashMap<u32, Vec<EventName>> = HashMap::new();
    let mut text = String::new();
    for msg in rx {
        match msg {
            Message::LaneName(lane, name) => put(&format!(
                r#"{{"name":"thread_name","ph":"M","pid":{rank},"tid":{lane},"args":{{"name":{}}}}}"#,
                json_string(&name)
            ))?,
            Message::Events(events) => {
                if events.is_empty() {
                    continue;
                }
                // The hot loop of the writer thread: no allocation per event (names are shared or static, numbers
                // are written straight into one reused buffer).
                text.clear();
                for (i, e) in events.into_iter().enumerate() {
                    if i > 0 {
                        text.push_str(",\n");
                    }
                    let (ph, name) = match e.phase {
                        Phase::Begin => {
                            open.entry(e.lane).or_default().push(e.name.clone());
                            ("B", e.name)
                        }
                        Phase::End => (
                            "E",
                            open.get_mut(&e.lane)
                                .and_then(|v| v.pop())
                                .unwrap_or(EventName::Static("")),
                        ),
                        Phase::Instant => ("i", e.name),
                    };
                    text.push_str(r#"{"name":"#);
                    push_json_string(&mut text, name.as_str());
                    let scope = if ph == "i" { r#","s":"p""# } else { "" };
                    let _ = write!(
                        text,
                        r#","ph":"{ph}"{scope},"pid":{rank},"tid":{},"ts":{}}}"#,
                        e.lane, e.ts_us
                    );
                }
                put(&text)?;
            }
            Message::Flush(done) => {
                let _ = done.send(());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_is_valid_json_after_every_flush() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.json");
        let mut t = Timeline::create(&path, 3).unwrap();
        let lane = t.lane("grad \"w\"");
        for i in 0..3 {
            t.begin(lane, "NEGOTIATE_ALLREDUCE");
            t.end(lane);
            t.record(
                Phase::Instant,
                EventName::Owned(format!("CYCLE {i}").into()),
                0,
                t.now_us(),
            );
            t.flush();
            let v: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            let events = v.as_array().unwrap();
            assert!(
                events
                    .iter()
                    .any(|e| e["ph"] == "E" && e["name"] == "NEGOTIATE_ALLREDUCE")
            );
            assert!(events.iter().any(|e| e["args"]["name"] == "grad \"w\""));
        }
        t.close();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(
            v.as_array()
                .unwrap()
                .iter()
                .filter(|e| e["ph"] == "B")
                .count(),
            3
        );
    }
}
