//! What to copy to embed quiesce: a target that serves KV memory and an
//! initiator that writes a batch of pages to it, reads them back, and
//! handles every outcome — including a target that could not confirm, and
//! the target's revoke.
//!
//! ```text
//! cargo run --release --example kv_transfer                  # both roles (the target as a child process)
//! cargo run --release --example kv_transfer -- target        # prints: ADDR TOKEN; `revoke` on stdin revokes kv
//! cargo run --release --example kv_transfer -- initiator ADDR TOKEN
//! ```

use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use quiesce::batch::{Batch, BatchOptions, FailurePolicy, Outcome, Quiesced, RemoteRange, Tcp};
use quiesce::runtime::Runtime;
use quiesce::transports::{AlignedBuf, Engine, EngineConfig, Rights, Token, TransferError};

const PAGE: usize = 256 << 10;
const PAGES: usize = 8;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // quiesce's warnings (a fence out of grace, an unconfirmed target) on
    // stderr; QUIESCE_LOG=info adds every batch's outcome.
    quiesce::logs::init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["target"] => target(),
        ["initiator", addr, token] => initiator(addr.parse()?, token.parse()?, None),
        [] => {
            let mut child = Command::new(std::env::current_exe()?)
                .arg("target")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()?;
            let mut lines = std::io::BufReader::new(child.stdout.take().ok_or("stdout")?).lines();
            let first = lines.next().ok_or("the target exited")??;
            let (addr, token) = first.split_once(' ').ok_or("bad target output")?;
            let control = Control {
                stdin: child.stdin.take().ok_or("stdin")?,
                lines,
            };
            let r = initiator(addr.parse()?, token.parse()?, Some(control));
            child.kill()?;
            child.wait()?;
            r
        }
        _ => Err("usage: kv_transfer [target | initiator ADDR TOKEN]".into()),
    }
}

/// The target: one `kv` segment; prints `ADDR TOKEN`; `revoke` on stdin
/// takes the whole segment back and answers `revoked`.
fn target() -> Result<(), Box<dyn std::error::Error>> {
    Runtime::new()?.block_on(async {
        let engine = Engine::bind(EngineConfig::default())?;
        let kv = engine.register(
            "kv",
            AlignedBuf::new(PAGE * PAGES),
            Rights::READ | Rights::WRITE,
        )?;
        println!("{} {}", engine.local_addr(), kv.token());
        std::io::stdout().flush()?;
        // Commands arrive on a blocking stdin: read them on a thread, hand
        // them to this runtime through a shard channel.
        let (tx, mut rx) = quiesce::runtime::shard::channel::<String>();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        while let Some(cmd) = rx.recv().await {
            if cmd.trim() == "revoke" {
                // Resolves once no byte of any earlier write can land in kv.
                kv.revoke(0..kv.len()).await?;
                println!("revoked");
                std::io::stdout().flush()?;
            }
        }
        engine.shutdown();
        Ok(())
    })
}

/// Asks the example's own target child to revoke (one-process mode).
struct Control {
    stdin: std::process::ChildStdin,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
}

/// Turns an outcome into the buffers, saying what each case means.
async fn settle<B>(outcome: Outcome<B>) -> Quiesced<B> {
    match outcome {
        Outcome::Quiesced(q) if q.all_completed() => {
            println!("0: every page landed; the buffers are ours again");
            q
        }
        Outcome::Quiesced(q) if q.remote_confirmed() => {
            // The buffers are ours; the target confirmed nothing more lands.
            println!(
                "-1: failed, target confirmed: safe to retry or reuse ({:?})",
                q.tasks()[0].status
            );
            q
        }
        Outcome::Quiesced(q) => {
            // The buffers are ours, but bytes already sent may still land in
            // the target's range: the target must revoke it before reuse.
            println!(
                "-1: failed, target did NOT confirm: have it revoke the range before trusting it"
            );
            q
        }
        Outcome::CompletionUnknown(mut ticket) => {
            // Never touch or free the buffers yet: only the ticket gives them back.
            println!("-2: completion unknown; waiting on the ticket");
            loop {
                match ticket.wait_for(Duration::from_secs(1)).await {
                    Ok(q) => break q,
                    Err(t) => ticket = t,
                }
            }
        }
    }
}

fn initiator(
    addr: SocketAddr,
    token: Token,
    mut control: Option<Control>,
) -> Result<(), Box<dyn std::error::Error>> {
    Runtime::new()?.block_on(async {
        let engine = Engine::bind(EngineConfig::default())?;
        let peer = engine.connect(addr).await?;
        let kv = peer.open("kv", token).await?;
        let opts = BatchOptions::default()
            .policy(FailurePolicy::FailFast)
            .deadline(Duration::from_secs(2))
            .fence_grace(Duration::from_millis(200));

        // A batch of pages written, each from its own buffer (the batch owns them).
        let mut batch = Batch::new(Tcp, opts);
        for i in 0..PAGES {
            let page = vec![i as u8 + 1; PAGE];
            batch
                .write(page, RemoteRange::new(&kv, (i * PAGE) as u64, PAGE as u64))
                .map_err(|r| r.reason)?;
        }
        let written = settle(batch.submit().await).await;

        // Read them back into fresh buffers and check.
        let mut batch = Batch::new(Tcp, opts);
        for i in 0..PAGES {
            batch
                .read(
                    vec![0u8; PAGE],
                    RemoteRange::new(&kv, (i * PAGE) as u64, PAGE as u64),
                )
                .map_err(|r| r.reason)?;
        }
        let read = settle(batch.submit().await).await;
        let same = read
            .buffers()
            .iter()
            .zip(written.buffers())
            .all(|(a, b)| a == b);
        println!(
            "read back: {}",
            if same { "identical" } else { "DIFFERENT" }
        );

        // The target's revoke: later writes from grants proven before it are refused.
        if let Some(c) = control.as_mut() {
            writeln!(c.stdin, "revoke")?;
            c.stdin.flush()?;
            let answer = c.lines.next().ok_or("the target exited")??;
            println!("target: {answer}");
            let (r, _) = kv.write(0, vec![0xEE; 16], u64::MAX).await;
            assert!(matches!(r, Err(TransferError::Revoked { .. })), "{r:?}");
            println!("a write under the old grant: {}", r.unwrap_err());
            let kv = peer.open("kv", token).await?; // proves the token again: a new grant
            let (r, _) = kv.write(0, vec![0xEE; 16], u64::MAX - 1).await;
            println!("after re-opening: wrote {} bytes", r?);
        }
        engine.shutdown();
        if same {
            Ok(())
        } else {
            Err("read-back mismatch".into())
        }
    })
}
