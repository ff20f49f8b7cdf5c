//! The runtime alone, without transports or batches: a loopback echo over
//! io_uring (or epoll), then the quiescence promise shown on one op: a receive
//! abandoned in flight keeps its buffer until the kernel's completion is reaped.
//!
//! Run: `cargo run --release --example echo`

use std::time::{Duration, Instant};

use quiesce::runtime::net::{TcpListener, TcpStream};
use quiesce::runtime::{spawn_local, stats, time, IoBuf, Runtime};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rt = Runtime::new()?;
    println!("driver: {}", rt.driver_kind());
    rt.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        spawn_local(async move {
            let (s, _) = listener.accept().await.expect("accept");
            let mut buf = vec![0u8; 1024];
            loop {
                let (res, b) = s.read(buf).await;
                let n = match res {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                let (res, b) = s.write_all(b.slice(..n)).await;
                buf = b.into_inner();
                if res.is_err() {
                    break;
                }
            }
        });

        let client = TcpStream::connect(addr).await?;
        client.set_nodelay(true)?;
        let rounds = 20_000;
        let mut out = vec![7u8; 1024];
        let mut back = vec![0u8; 1024];
        let t0 = Instant::now();
        for _ in 0..rounds {
            let (r, o) = client.write_all(out).await;
            r?;
            out = o;
            let (r, b) = client.read_exact(back).await;
            r?;
            back = b;
        }
        let took = t0.elapsed();
        assert_eq!(out, back);
        println!(
            "echo: {rounds} round trips of 1 KiB in {:.1} ms ({:.1} µs each)",
            took.as_secs_f64() * 1e3,
            took.as_secs_f64() * 1e6 / rounds as f64
        );

        // Abandon a receive that the kernel holds, and watch the buffer's fate.
        let before = stats();
        let pending = client.read(vec![0u8; 1 << 20]);
        let abandoned = time::timeout(Duration::from_millis(5), pending).await;
        assert!(abandoned.is_err(), "nobody sent anything");
        let parked = stats();
        time::sleep(Duration::from_millis(5)).await;
        let after = stats();
        println!(
            "abandoned recv: parked {} op(s), posted {} cancel(s), released {} buffer(s) after their CQE",
            parked.ops_parked - before.ops_parked,
            parked.cancels_posted - before.cancels_posted,
            after.parked_released - before.parked_released,
        );
        println!("stats: {after:?}");
        Ok::<_, std::io::Error>(())
    })?;
    Ok(())
}
