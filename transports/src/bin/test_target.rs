//! A target process for the transport's tests (and for trying the protocol
//! by hand): registers segments, prints how to reach them, serves until
//! killed or until its standard input closes.
//!
//! ```text
//! quiesce-test-target [--listen ADDR] [--segment NAME:LEN:RIGHTS]... [--max-frame N] [--rdma]
//! ```
//! `--rdma` serves the segments over RDMA verbs too (memory regions on the
//! first active device).
//! RIGHTS is `r`, `w` or `rw`. Prints `segment NAME ID LEN TOKEN` per segment,
//! then `listening ADDR`. Tests slow it down with SIGSTOP/SIGCONT.

use std::io::Write;
use std::os::fd::AsFd;
use std::time::Duration;

use quiesce_runtime::{time, Runtime};
use quiesce_transports::rdma::{RdmaConfig, RdmaEngine};
use quiesce_transports::{AlignedBuf, Engine, EngineConfig, Rights};

fn main() {
    let mut cfg = EngineConfig {
        node: "test-target".into(),
        ..Default::default()
    };
    let mut segments = Vec::new();
    let mut rdma = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--listen" => {
                cfg.listen = args
                    .next()
                    .expect("--listen ADDR")
                    .parse()
                    .expect("address")
            }
            "--max-frame" => {
                cfg.max_frame = args.next().expect("--max-frame N").parse().expect("number")
            }
            "--rdma" => rdma = true,
            "--segment" => {
                let spec = args.next().expect("--segment NAME:LEN:RIGHTS");
                let mut it = spec.split(':');
                let (name, len, rights) = (
                    it.next().unwrap(),
                    it.next().unwrap(),
                    it.next().unwrap_or("rw"),
                );
                let len: usize = len.parse().expect("segment length");
                let mut r = Rights::empty();
                r.set(Rights::READ, rights.contains('r'));
                r.set(Rights::WRITE, rights.contains('w'));
                segments.push((name.to_string(), len, r));
            }
            other => panic!("unknown argument {other:?}"),
        }
    }
    let rt = Runtime::new().expect("runtime");
    rt.block_on(async move {
        let rdma = rdma.then(|| {
            RdmaEngine::bind(RdmaConfig {
                control: cfg.clone(),
                ..Default::default()
            })
            .expect("rdma bind")
        });
        let engine = match &rdma {
            Some(r) => r.control().clone(),
            None => Engine::bind(cfg).expect("bind"),
        };
        let mut out = std::io::stdout().lock();
        for (name, len, rights) in segments {
            let seg = match &rdma {
                Some(r) => r.register(&name, AlignedBuf::new(len), rights),
                None => engine.register(&name, AlignedBuf::new(len), rights),
            }
            .expect("register");
            writeln!(
                out,
                "segment {} {} {} {}",
                seg.name(),
                seg.id(),
                seg.len(),
                seg.token()
            )
            .unwrap();
        }
        writeln!(out, "listening {}", engine.local_addr()).unwrap();
        out.flush().unwrap();
        drop(out);
        // Exit when the parent closes our stdin (or dies).
        let stdin = std::io::stdin()
            .as_fd()
            .try_clone_to_owned()
            .expect("stdin");
        let stdin = quiesce_runtime::fd::Fd::new(stdin).expect("stdin fd");
        loop {
            let (r, _) = stdin.read(vec![0u8; 64]).await;
            if !matches!(r, Ok(n) if n > 0) {
                break;
            }
        }
        time::sleep(Duration::from_millis(1)).await;
    });
}
