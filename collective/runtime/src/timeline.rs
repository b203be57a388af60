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

/// One trace event on one lane (a tensor's Chrome-trace thread; 0 for engine-wide marks) or on every lane of a
/// fused group at once (one push on the engine thread for the whole group).
#[derive(Debug, Clone)]
pub struct Event {
    pub phase: Phase,
    pub name: EventName,
    pub lanes: Lanes,
    pub ts_us: u64,
}

#[derive(Debug, Clone)]
pub enum Lanes {
    One(u32),
    Group(Arc<[u32]>),
}

impl Lanes {
    fn as_slice(&self) -> &[u32] {
        match self {
            Lanes::One(l) => std::slice::from_ref(l),
            Lanes::Group(g) => g,
        }
    }
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
    /// New lanes' names, then events (which may use them).
    Events(Vec<(u32, String)>, Vec<Event>),
    Flush(mpsc::Sender<()>),
}

/// The engine's handle on the timeline.
pub struct Timeline {
    start: Instant,
    pending: Vec<Event>,
    /// Lanes named since the last batch: they travel with it, so a new tensor costs no wake-up of the writer.
    pending_lanes: Vec<(u32, String)>,
    last_send: Instant,
    lanes: HashMap<String, u32>,
    tx: Option<mpsc::SyncSender<Message>>,
    writer: Option<JoinHandle<io::Result<()>>>,
    path: PathBuf,
}

/// Batches are handed to the writer at least this often, and whenever this many events are waiting.
const SEND_INTERVAL: Duration = Duration::from_millis(100);
const SEND_EVENTS: usize = 4096;
/// Batches waiting for the writer at most (about 12 MB of events): the writer runs at a low priority, and
/// if it cannot keep up at all the engine waits for it rather than the backlog growing without bound.
const MAX_BATCHES_IN_FLIGHT: usize = 64;

impl Timeline {
    /// Creates (truncates) the file and starts the writer thread.
    pub fn create(path: &Path, rank: usize) -> io::Result<Timeline> {
        let file = fs_err::File::create(path)?;
        let (tx, rx) = mpsc::sync_channel(MAX_BATCHES_IN_FLIGHT);
        let file: File = file.into_parts().0;
        let p = path.to_path_buf();
        let writer = std::thread::Builder::new()
            .name("hvd-timeline".into())
            .spawn(move || write_loop(file, &p, rank, rx))?;
        Ok(Timeline {
            start: Instant::now(),
            pending: Vec::with_capacity(SEND_EVENTS),
            pending_lanes: Vec::new(),
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
        self.pending_lanes.push((l, tensor.to_string()));
        l
    }

    pub fn record(&mut self, phase: Phase, name: EventName, lane: u32, ts_us: u64) {
        self.record_lanes(phase, name, Lanes::One(lane), ts_us);
    }

    pub fn record_lanes(&mut self, phase: Phase, name: EventName, lanes: Lanes, ts_us: u64) {
        self.pending.push(Event {
            phase,
            name,
            lanes,
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
        if self.pending.len() + self.pending_lanes.len() >= SEND_EVENTS
            || (!self.pending.is_empty() && self.last_send.elapsed() >= SEND_INTERVAL)
        {
            self.send();
        }
    }

    fn send(&mut self) {
        self.last_send = Instant::now();
        let batch = std::mem::replace(&mut self.pending, Vec::with_capacity(SEND_EVENTS));
        let lanes = std::mem::take(&mut self.pending_lanes);
        if let Some(tx) = &self.tx {
            let _ = tx.send(Message::Events(lanes, batch));
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

/// The writer is background work: at a low priority (nice 10) it runs in the gaps that the engine and the training
/// threads leave instead of taking turns with them (on a busy 2-core machine those turns showed as slower steps).
fn lower_priority() {
    // SAFETY: gettid has no preconditions; setpriority on a thread id changes that thread only (Linux). Failure
    // just leaves the priority as it was.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 10);
    }
}

fn write_loop(file: File, path: &Path, rank: usize, rx: mpsc::Receiver<Message>) -> io::Result<()> {
    lower_priority();
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
    // The open phases of every lane. A phase is written once, complete (`"ph":"X"` with its duration), when it
    // ends: half the events of `B`/`E` pairs, so half the writer's work. Phases still open when the timeline
    // closes are written as `B` events.
    // Lanes are small dense integers: a vector indexed by lane.
    let mut open: Vec<Vec<(EventName, u64)>> = Vec::new();
    let pid = rank.to_string();
    let mut text = String::new();
    for msg in rx {
        match msg {
            Message::Events(lanes, events) => {
                if !lanes.is_empty() {
                    let names: Vec<String> = lanes
                        .iter()
                        .map(|(lane, name)| {
                            format!(
                                r#"{{"name":"thread_name","ph":"M","pid":{rank},"tid":{lane},"args":{{"name":{}}}}}"#,
                                json_string(name)
                            )
                        })
                        .collect();
                    put(&names.join(",\n"))?;
                }
                // The hot loop of the writer thread: no allocation per event (names are shared or static, numbers
                // are written straight into one reused buffer).
                text.clear();
                for e in events {
                    for &lane in e.lanes.as_slice() {
                        match e.phase {
                            Phase::Begin => {
                                let l = lane as usize;
                                if open.len() <= l {
                                    open.resize_with(l + 1, Vec::new);
                                }
                                open[l].push((e.name.clone(), e.ts_us));
                            }
                            Phase::End => {
                                let Some((name, start)) =
                                    open.get_mut(lane as usize).and_then(|v| v.pop())
                                else {
                                    continue;
                                };
                                separate(&mut text);
                                text.push_str(r#"{"name":"#);
                                push_json_string(&mut text, name.as_str());
                                text.push_str(r#","ph":"X","pid":"#);
                                text.push_str(&pid);
                                text.push_str(r#","tid":"#);
                                push_u64(&mut text, u64::from(lane));
                                text.push_str(r#","ts":"#);
                                push_u64(&mut text, start);
                                text.push_str(r#","dur":"#);
                                push_u64(&mut text, e.ts_us.saturating_sub(start));
                                text.push('}');
                            }
                            Phase::Instant => {
                                separate(&mut text);
                                text.push_str(r#"{"name":"#);
                                push_json_string(&mut text, e.name.as_str());
                                let _ = write!(
                                    text,
                                    r#","ph":"i","s":"p","pid":{rank},"tid":{lane},"ts":{}}}"#,
                                    e.ts_us
                                );
                            }
                        }
                    }
                }
                if !text.is_empty() {
                    put(&text)?;
                }
            }
            Message::Flush(done) => {
                let _ = done.send(());
            }
        }
    }
    text.clear();
    for (lane, phases) in open.into_iter().enumerate() {
        for (name, start) in phases {
            separate(&mut text);
            text.push_str(r#"{"name":"#);
            push_json_string(&mut text, name.as_str());
            let _ = write!(
                text,
                r#","ph":"B","pid":{rank},"tid":{lane},"ts":{start}}}"#
            );
        }
    }
    if !text.is_empty() {
        put(&text)?;
    }
    Ok(())
}

/// Appends the decimal digits of `v` (what `write!` does, without the formatting machinery).
fn push_u64(text: &mut String, mut v: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    for d in &digits[at..] {
        text.push(char::from(*d));
    }
}

fn separate(text: &mut String) {
    if !text.is_empty() {
        text.push_str(",\n");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_written_in_decimal() {
        for v in [0u64, 7, 10, 1234567890, u64::MAX] {
            let mut s = String::new();
            push_u64(&mut s, v);
            assert_eq!(s, v.to_string());
        }
    }

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
            assert!(events.iter().any(|e| e["ph"] == "X"
                && e["name"] == "NEGOTIATE_ALLREDUCE"
                && e["dur"].is_u64()));
            assert!(events.iter().any(|e| e["args"]["name"] == "grad \"w\""));
        }
        // A fused group: one event for several lanes; and a phase still open when the timeline closes.
        let other = t.lane("grad.b");
        let group = Lanes::Group(vec![lane, other].into());
        let copy = EventName::Static("MEMCPY_IN_FUSION_BUFFER");
        t.record_lanes(Phase::Begin, copy.clone(), group.clone(), 10);
        t.record_lanes(Phase::End, copy, group, 15);
        t.begin(other, "QUEUE");
        t.close();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let events = v.as_array().unwrap();
        let count = |ph: &str, name: &str| {
            events
                .iter()
                .filter(|e| e["ph"] == ph && e["name"] == name)
                .count()
        };
        assert_eq!(count("X", "NEGOTIATE_ALLREDUCE"), 3);
        assert_eq!(count("X", "MEMCPY_IN_FUSION_BUFFER"), 2);
        assert!(
            events.iter().any(|e| e["name"] == "MEMCPY_IN_FUSION_BUFFER"
                && e["tid"] == other
                && e["dur"] == 5)
        );
        assert_eq!(count("B", "QUEUE"), 1, "open phases are written at close");
    }
}
