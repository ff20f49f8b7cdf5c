//! The early-return baseline of `quiesce demo`: the seed scenario as a
//! transfer engine's sync wrapper runs it when it returns at the first failed
//! transfer (Mooncake's `batch_transfer_sync` does): the caller gets -1 while
//! the other transfer still reads its source, and reuses the source at once.
//!
//! Plain blocking sockets and threads speaking quiesce's wire protocol. The
//! caller's source is shared with the sending thread behind a mutex, copied
//! out one 64 KiB piece at a time, so the "reuse" is memory-safe here; what
//! it shows is what reuse does to the destination.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use quiesce::scenario::POST_OUTCOME;
use quiesce::transports::wire::Status;

use super::bench::raw::Raw;
use super::bench::SegInfo;

const PIECE: usize = 64 << 10;
const FRAME: usize = 1 << 20;

/// One round: the refused 4 KiB write and the valid `size`-byte write run
/// at once on two connections; at the refusal the call "returns -1" and the
/// caller overwrites the source. Returns how many post-outcome bytes landed.
pub fn round(
    addr: SocketAddr,
    kv: &SegInfo,
    ro: &SegInfo,
    size: usize,
    round: u32,
) -> std::io::Result<usize> {
    let pre = (round % 200) as u8 + 1;
    let src = Arc::new(Mutex::new(vec![pre; size]));
    let mut big = Raw::connect(addr, kv, Some(ro), false, None)?;
    let mut small = Raw::connect(addr, kv, Some(ro), false, None)?;
    let sender = {
        let src = src.clone();
        std::thread::spawn(move || -> std::io::Result<()> {
            // 1 MiB frames, pipelined on the one stream, each payload copied
            // out of the caller's memory piece by piece as the socket takes it.
            let mut piece = vec![0u8; PIECE];
            let frames = size.div_ceil(FRAME);
            for f in 0..frames {
                let (start, end) = (f * FRAME, size.min((f + 1) * FRAME));
                big.send_write_header(start as u64, (end - start) as u64)?;
                for off in (start..end).step_by(PIECE) {
                    let n = PIECE.min(end - off);
                    piece[..n].copy_from_slice(&src.lock().expect("source")[off..off + n]);
                    big.send_payload(&piece[..n])?;
                }
            }
            for _ in 0..frames {
                big.status()?;
            }
            Ok(())
        })
    };
    let ro_id = small.ro();
    small.send_write(ro_id, 0, &[pre; 4096])?;
    let refused = small.status()?;
    debug_assert_ne!(refused, Status::Ok);
    // "-1": the caller takes its memory back and reuses it, as told it may.
    src.lock().expect("source").fill(POST_OUTCOME);
    sender
        .join()
        .map_err(|_| std::io::Error::other("sender panicked"))??;
    std::thread::sleep(Duration::from_millis(20));
    let mut back = vec![0u8; size];
    for (i, chunk) in back.chunks_mut(8 << 20).enumerate() {
        small.read((i * (8 << 20)) as u64, chunk)?;
    }
    Ok(back.iter().filter(|&&b| b == POST_OUTCOME).count())
}
