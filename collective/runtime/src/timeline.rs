//! Chrome-trace timeline (`HVD_TIMELINE=path`), loadable in Perfetto and chrome://tracing.
//!
//! The engine thread only pushes small [`Event`] values into a vector; formatting and I/O happen on a writer thread
//! that receives batches over a channel, so the hot path costs a push per phase. The file is a JSON array that is
//! valid at every moment between writes: it always ends in `\n]`, and each batch is written with one positioned
//! write that replaces that tail by `,\n{event}...\n]`.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::io::Write as _;
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
    /// An operation leaves negotiation for execution: on each lane, ends the open phase (the negotiation), then
    /// begins the event's name (the operation) and, inside it, `QUEUE`. One event where there would be three.
    Execute,
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
    /// Lane events the pending ones stand for (a group's event counts once per lane): the writer's work waiting.
    pending_weight: usize,
    /// Lanes named since the last batch: they travel with it, so a new tensor costs no wake-up of the writer.
    pending_lanes: Vec<(u32, String)>,
    last_send: Instant,
    lanes: HashMap<String, u32>,
    /// The next lane number (0 is the engine's).
    next_lane: u32,
    tx: Option<mpsc::SyncSender<Message>>,
    /// Batches the writer has emptied, to fill again (no allocation and first touch of fresh memory per batch).
    recycled: mpsc::Receiver<Vec<Event>>,
    writer: Option<JoinHandle<io::Result<()>>>,
    path: PathBuf,
}

/// Batches are handed to the writer at least this often, and whenever they stand for this many written events (a
/// group's event counts once per lane). Small batches keep the writer's bursts short (about 30 us of work): on a
/// machine whose cores are busy with the ranks, one long burst holds up a rank's thread for its whole length. The
/// per-tensor benchmark step (600 written events) cost +3.5% to +6% with batches of 4096 against about 0-4% with
/// 32 to 512 (interleaved in one run, twice).
const SEND_INTERVAL: Duration = Duration::from_millis(100);
const SEND_WEIGHT: usize = 256;
/// Batches waiting for the writer at most (about 12 MB of events): the writer runs at a low priority, and
/// if it cannot keep up at all the engine waits for it rather than the backlog growing without bound.
const MAX_BATCHES_IN_FLIGHT: usize = 1024;

impl Timeline {
    /// Creates (truncates) the file and starts the writer thread.
    pub fn create(path: &Path, rank: usize) -> io::Result<Timeline> {
        let file: File = fs_err::File::create(path)?.into_parts().0;
        // Valid JSON from the moment this returns, before the writer thread runs.
        file.write_all_at(b"[]", 0)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        let (tx, rx) = mpsc::sync_channel(MAX_BATCHES_IN_FLIGHT);
        let (back, recycled) = mpsc::channel();
        let p = path.to_path_buf();
        let writer = std::thread::Builder::new()
            .name("hvd-timeline".into())
            .spawn(move || write_loop(file, &p, rank, rx, back))?;
        Ok(Timeline {
            start: Instant::now(),
            pending: Vec::with_capacity(SEND_WEIGHT),
            pending_weight: 0,
            pending_lanes: Vec::new(),
            last_send: Instant::now(),
            lanes: HashMap::new(),
            next_lane: 1,
            tx: Some(tx),
            recycled,
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
        let l = self.next_lane;
        self.next_lane += 1;
        self.lanes.insert(tensor.to_string(), l);
        self.pending_lanes.push((l, tensor.to_string()));
        l
    }

    /// Records `phase` on every lane of `lanes`, now.
    pub fn mark(&mut self, phase: Phase, name: EventName, lanes: &Lanes) {
        let ts = self.now_us();
        self.record_lanes(phase, name, lanes.clone(), ts);
    }

    pub fn record(&mut self, phase: Phase, name: EventName, lane: u32, ts_us: u64) {
        self.record_lanes(phase, name, Lanes::One(lane), ts_us);
    }

    pub fn record_lanes(&mut self, phase: Phase, name: EventName, lanes: Lanes, ts_us: u64) {
        self.pending_weight += lanes.as_slice().len();
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
        if self.pending_weight + self.pending_lanes.len() >= SEND_WEIGHT
            || (!self.pending.is_empty() && self.last_send.elapsed() >= SEND_INTERVAL)
        {
            self.send();
        }
    }

    fn send(&mut self) {
        self.last_send = Instant::now();
        self.pending_weight = 0;
        let fresh = self
            .recycled
            .try_recv()
            .unwrap_or_else(|_| Vec::with_capacity(SEND_WEIGHT));
        let batch = std::mem::replace(&mut self.pending, fresh);
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

/// The start of a complete event for each distinct phase name, `,\n{"name":"X","ph":"X","pid":P,"tid":`, rendered
/// once: the writer's hot loop then copies it and writes three numbers. Names are looked up by address and length:
/// the table holds every name string it has seen (so a shared one's memory cannot be reused for another name), and
/// a name seen again at another address becomes one more key for the same prefix.
struct Prefixes {
    keys: Vec<(EventName, (usize, usize), u32)>,
    rendered: Vec<Vec<u8>>,
    pid: String,
}

impl Prefixes {
    fn index(&mut self, name: &EventName) -> u32 {
        let s = name.as_str();
        let key = (s.as_ptr() as usize, s.len());
        if let Some((_, _, i)) = self.keys.iter().find(|(_, k, _)| *k == key) {
            return *i;
        }
        let i = match self.keys.iter().find(|(n, _, _)| n.as_str() == s) {
            Some((_, _, i)) => *i,
            None => {
                let mut r = Vec::new();
                r.extend_from_slice(b",\n");
                r.extend_from_slice(br#"{"name":"#);
                r.extend_from_slice(json_string(s).as_bytes());
                r.extend_from_slice(br#","ph":"X","pid":"#);
                r.extend_from_slice(self.pid.as_bytes());
                r.extend_from_slice(br#","tid":"#);
                self.rendered.push(r);
                (self.rendered.len() - 1) as u32
            }
        };
        self.keys.push((name.clone(), key, i));
        i
    }

    /// The name of prefix `i`.
    fn name(&self, i: u32) -> &str {
        self.keys
            .iter()
            .find(|(_, _, j)| *j == i)
            .map_or("", |(n, _, _)| n.as_str())
    }
}

fn write_loop(
    file: File,
    path: &Path,
    rank: usize,
    rx: mpsc::Receiver<Message>,
    back: mpsc::Sender<Vec<Event>>,
) -> io::Result<()> {
    lower_priority();
    let with_path = |e: io::Error| io::Error::new(e.kind(), format!("{}: {e}", path.display()));
    let mut len: u64 = 0;
    let mut first = true;
    // Writes `batch` (entries that each start with `,\n`) in place of the closing `\n]` (or, the first time, of the
    // whole `[]`, with the first separator turned into `[\n`), followed by a new `\n]`: one positioned write.
    let mut put = |batch: &mut Vec<u8>| -> io::Result<()> {
        let at = if first { 0 } else { len - 2 };
        if first {
            batch[..2].copy_from_slice(b"[\n");
        }
        batch.extend_from_slice(b"\n]");
        file.write_all_at(batch, at).map_err(with_path)?;
        len = at + batch.len() as u64;
        first = false;
        Ok(())
    };
    let mut text: Vec<u8> = Vec::new();
    text.extend_from_slice(
        format!(
            r#",
{{"name":"process_name","ph":"M","pid":{rank},"tid":0,"args":{{"name":"hvd rank {rank}"}}}},
{{"name":"thread_name","ph":"M","pid":{rank},"tid":0,"args":{{"name":"engine"}}}}"#
        )
        .as_bytes(),
    );
    put(&mut text)?;
    // The open phases of every lane. A phase is written once, complete (`"ph":"X"` with its duration), when it
    // ends: half the events of `B`/`E` pairs, so half the writer's work. Phases still open when the timeline
    // closes are written as `B` events.
    // Lanes are small dense integers: a vector indexed by lane; a phase is its name's prefix and its start.
    let mut open: Vec<Vec<(u32, u64)>> = Vec::new();
    let mut tail = Tail::default();
    let mut prefixes = Prefixes {
        keys: Vec::new(),
        rendered: Vec::new(),
        pid: rank.to_string(),
    };
    for msg in rx {
        match msg {
            Message::Events(lanes, mut events) => {
                // The hot loop of the writer thread: no allocation per event (names are rendered once, numbers
                // are written straight into one reused buffer).
                text.clear();
                for (lane, name) in &lanes {
                    text.extend_from_slice(b",\n");
                    text.extend_from_slice(
                        format!(
                            r#"{{"name":"thread_name","ph":"M","pid":{rank},"tid":{lane},"args":{{"name":{}}}}}"#,
                            json_string(name)
                        )
                        .as_bytes(),
                    );
                }
                // Ends the open phase of `lane` at `ts`: written now, complete.
                let mut end = |text: &mut Vec<u8>,
                               open: &mut Vec<Vec<(u32, u64)>>,
                               prefixes: &Prefixes,
                               lane: u32,
                               ts: u64| {
                    if let Some((name, start)) = open.get_mut(lane as usize).and_then(|v| v.pop()) {
                        push_complete(
                            text,
                            &prefixes.rendered[name as usize],
                            lane,
                            tail.of(start, ts.saturating_sub(start)),
                        );
                    }
                };
                let begin = |open: &mut Vec<Vec<(u32, u64)>>, lane: u32, name: u32, ts: u64| {
                    let l = lane as usize;
                    if open.len() <= l {
                        open.resize_with(l + 1, Vec::new);
                    }
                    open[l].push((name, ts));
                };
                for e in events.drain(..) {
                    match e.phase {
                        Phase::Begin => {
                            let name = prefixes.index(&e.name);
                            for &lane in e.lanes.as_slice() {
                                begin(&mut open, lane, name, e.ts_us);
                            }
                        }
                        Phase::End => {
                            for &lane in e.lanes.as_slice() {
                                end(&mut text, &mut open, &prefixes, lane, e.ts_us);
                            }
                        }
                        Phase::Execute => {
                            let op = prefixes.index(&e.name);
                            let queue = prefixes.index(&EventName::Static("QUEUE"));
                            for &lane in e.lanes.as_slice() {
                                end(&mut text, &mut open, &prefixes, lane, e.ts_us);
                                begin(&mut open, lane, op, e.ts_us);
                                begin(&mut open, lane, queue, e.ts_us);
                            }
                        }
                        Phase::Instant => {
                            for &lane in e.lanes.as_slice() {
                                text.extend_from_slice(b",\n");
                                text.extend_from_slice(
                                    format!(
                                        r#"{{"name":{},"ph":"i","s":"p","pid":{rank},"tid":{lane},"ts":{}}}"#,
                                        json_string(e.name.as_str()),
                                        e.ts_us
                                    )
                                    .as_bytes(),
                                );
                            }
                        }
                    }
                }
                let _ = back.send(events);
                if !text.is_empty() {
                    put(&mut text)?;
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
            text.extend_from_slice(b",\n");
            let _ = write!(
                text,
                r#"{{"name":{},"ph":"B","pid":{rank},"tid":{lane},"ts":{start}}}"#,
                json_string(prefixes.name(name))
            );
        }
    }
    if !text.is_empty() {
        put(&mut text)?;
    }
    Ok(())
}

/// Appends one complete event: `prefix` (a separator and the name, see [`Prefixes`]), the lane, then `tail` (its
/// time and duration, see [`Tail`]). The writer's innermost work, once per phase and lane: two copies and one
/// small number.
fn push_complete(text: &mut Vec<u8>, prefix: &[u8], lane: u32, tail: &[u8]) {
    let mut digits = [0u8; 20];
    text.extend_from_slice(prefix);
    text.extend_from_slice(digits_of(u64::from(lane), &mut digits));
    text.extend_from_slice(tail);
}

/// The end of a complete event, `,"ts":start,"dur":dur}`, rendered again only when it changes: the members of a
/// fused group share their phases' times (the engine marks them at once), so one rendering serves the whole group.
#[derive(Default)]
struct Tail {
    key: Option<(u64, u64)>,
    text: Vec<u8>,
}

impl Tail {
    fn of(&mut self, start: u64, dur: u64) -> &[u8] {
        if self.key != Some((start, dur)) {
            let mut digits = [0u8; 20];
            self.text.clear();
            self.text.extend_from_slice(br#","ts":"#);
            self.text.extend_from_slice(digits_of(start, &mut digits));
            self.text.extend_from_slice(br#","dur":"#);
            self.text.extend_from_slice(digits_of(dur, &mut digits));
            self.text.push(b'}');
            self.key = Some((start, dur));
        }
        &self.text
    }
}

/// The decimal digits of `v`, two at a time, at the end of `buf`.
fn digits_of(mut v: u64, buf: &mut [u8; 20]) -> &[u8] {
    const PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819202122232425262728293031323334353637383940\
        414243444546474849505152535455565758596061626364656667686970717273747576777879808182838485868788899091\
        9293949596979899";
    let mut at = buf.len();
    while v >= 100 {
        let pair = (v % 100) as usize * 2;
        v /= 100;
        at -= 2;
        buf[at..at + 2].copy_from_slice(&PAIRS[pair..pair + 2]);
    }
    if v >= 10 {
        let pair = v as usize * 2;
        at -= 2;
        buf[at..at + 2].copy_from_slice(&PAIRS[pair..pair + 2]);
    } else {
        at -= 1;
        buf[at] = b'0' + v as u8;
    }
    &buf[at..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_written_in_decimal() {
        for v in [0u64, 7, 9, 10, 99, 100, 101, 1234567890, u64::MAX] {
            let mut buf = [0u8; 20];
            assert_eq!(digits_of(v, &mut buf), v.to_string().as_bytes());
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
        t.record_lanes(Phase::End, copy, group.clone(), 15);
        // One group event ending phases that began at different times: each lane keeps its own start and duration
        // (the writer renders a time only once for lanes that share it).
        t.record(Phase::Begin, EventName::Static("QUEUE"), lane, 20);
        t.record(Phase::Begin, EventName::Static("QUEUE"), other, 22);
        t.record_lanes(Phase::End, EventName::Static(""), group, 30);
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
        let queue = |tid: u32| {
            events
                .iter()
                .find(|e| e["ph"] == "X" && e["name"] == "QUEUE" && e["tid"] == tid)
                .map(|e| (e["ts"].as_u64().unwrap(), e["dur"].as_u64().unwrap()))
        };
        assert_eq!(queue(lane), Some((20, 10)));
        assert_eq!(queue(other), Some((22, 8)));
        assert_eq!(count("B", "QUEUE"), 1, "open phases are written at close");
    }
}
