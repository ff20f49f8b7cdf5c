//! What the fuzz targets that talk to a live engine share: a panic anywhere
//! aborts (which libFuzzer reports), and the engine runs on a thread of its
//! own with small frames and a short handshake deadline.

use std::future::Future;
use std::time::Duration;

use quiesce_runtime::Runtime;
use quiesce_transports::{Engine, EngineConfig};

/// Binds an engine on a new thread's runtime and runs `serve` with it there.
pub fn spawn<F, Fut>(serve: F)
where
    F: FnOnce(Engine) -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    std::panic::set_hook(Box::new(|info| {
        eprintln!("{info}");
        std::process::abort();
    }));
    std::thread::spawn(move || {
        let rt = Runtime::new().unwrap();
        rt.block_on(async move {
            let cfg = EngineConfig {
                max_frame: 1 << 16,
                slice_size: 1 << 16,
                handshake_timeout: Duration::from_millis(200),
                ..Default::default()
            };
            serve(Engine::bind(cfg).unwrap()).await
        });
    });
}
