//! Helpers shared by the engine tests with in-process ranks (`mod common;` in engine.rs and process_sets.rs).

use std::time::Duration;

use hvd_runtime::{Engine, EngineConfig, LocalTransport};

/// `v` as little-endian f32 bytes.
pub fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Little-endian f32 bytes as values.
pub fn to_f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Runs `body(rank, engine)` on `size` in-process ranks and returns each rank's result.
pub fn ranks<T: Send>(
    size: usize,
    config: EngineConfig,
    body: impl Fn(usize, &Engine) -> T + Sync,
) -> Vec<T> {
    let transports = LocalTransport::group(size, Duration::from_secs(10));
    std::thread::scope(|s| {
        let handles: Vec<_> = transports
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                let config = config.clone();
                let body = &body;
                s.spawn(move || {
                    let engine = Engine::start(Box::new(t), config).unwrap();
                    let out = body(rank, &engine);
                    engine.shutdown();
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}
