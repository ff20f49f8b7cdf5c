//! A `quiesce target` child process: what `quiesce demo` and `quiesce bench`
//! start, and what the end-to-end tests run against.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Lines, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use quiesce_runtime::process;
use quiesce_transports::Token;

/// A `quiesce target` child process, killed on drop.
pub struct TargetChild {
    child: Child,
    /// Its answers to stdin commands.
    lines: Lines<BufReader<ChildStdout>>,
    /// Where it listens.
    pub addr: SocketAddr,
    /// Segment name → token.
    pub tokens: HashMap<String, Token>,
    /// Segment name → id.
    pub ids: HashMap<String, u64>,
}

impl TargetChild {
    /// Starts `EXE target --size SIZE --transport tcp|rdma` and reads its
    /// segments and address. It exits when its stdin (kept here) closes.
    pub fn spawn(
        exe: &Path,
        size: usize,
        rdma: bool,
    ) -> Result<TargetChild, Box<dyn std::error::Error>> {
        TargetChild::spawn_with(exe, size, rdma, &[])
    }

    /// [`spawn`](Self::spawn) with more `quiesce target` arguments
    /// (`--ignore-fences`).
    pub fn spawn_with(
        exe: &Path,
        size: usize,
        rdma: bool,
        extra: &[&str],
    ) -> Result<TargetChild, Box<dyn std::error::Error>> {
        TargetChild::spawn_command(Command::new(exe), size, rdma, extra)
    }

    /// [`spawn_with`](Self::spawn_with) through a launcher: `cmd` is the
    /// program up to the `quiesce` executable (`ip netns exec NS EXE`), which
    /// must exec it, so signals reach the target itself.
    pub fn spawn_command(
        mut cmd: Command,
        size: usize,
        rdma: bool,
        extra: &[&str],
    ) -> Result<TargetChild, Box<dyn std::error::Error>> {
        let transport = if rdma { "rdma" } else { "tcp" };
        let mut child = cmd
            .args([
                "target",
                "--size",
                &size.to_string(),
                "--transport",
                transport,
            ])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        // The local transport's target reads and writes this process's
        // memory, and under YAMA's ptrace_scope 1 a child may not touch its
        // parent's: name the child as allowed (EINVAL without YAMA, where
        // nothing needs allowing).
        // SAFETY: prctl with integer arguments only.
        let _ = unsafe { libc::prctl(libc::PR_SET_PTRACER, child.id() as libc::c_ulong, 0, 0, 0) };
        let mut tokens = HashMap::new();
        let mut ids = HashMap::new();
        let stdout = child.stdout.take();
        let listing = stdout.ok_or_else(|| "no stdout".into()).and_then(|out| {
            let mut lines = BufReader::new(out).lines();
            let addr = loop {
                let line = lines.next().ok_or("the target exited before listening")??;
                let w: Vec<&str> = line.split_whitespace().collect();
                match w.as_slice() {
                    ["segment", name, id, _, token] => {
                        tokens.insert(name.to_string(), token.parse()?);
                        ids.insert(name.to_string(), id.parse()?);
                    }
                    ["listening", addr] => break addr.parse()?,
                    _ => return Err(format!("unexpected target output {line:?}").into()),
                }
            };
            Ok::<_, Box<dyn std::error::Error>>((lines, addr))
        });
        match listing {
            Ok((lines, addr)) => Ok(TargetChild {
                child,
                lines,
                addr,
                tokens,
                ids,
            }),
            Err(e) => {
                // A bare `Child` neither kills nor reaps on drop: the target
                // would serve on until it noticed its stdin gone, then stay
                // a zombie.
                let _ = child.kill();
                let _ = child.wait();
                Err(e)
            }
        }
    }

    /// Revokes the whole segment `name` at the target (its owner's call);
    /// returns once the revoke resolved there.
    pub fn revoke(&mut self, name: &str) -> Result<(), Box<dyn std::error::Error>> {
        let stdin = self.child.stdin.as_mut().ok_or("no stdin")?;
        writeln!(stdin, "revoke {name}")?;
        stdin.flush()?;
        let line = self.lines.next().ok_or("the target exited")??;
        match line.strip_prefix("revoked ") {
            Some(n) if n == name => Ok(()),
            _ => Err(format!("revoke {name}: {line}").into()),
        }
    }

    /// The target's heap now: (bytes live, allocations live, allocations
    /// made), from its counting allocator.
    pub fn heap(&mut self) -> Result<(i64, i64, u64), Box<dyn std::error::Error>> {
        let stdin = self.child.stdin.as_mut().ok_or("no stdin")?;
        writeln!(stdin, "heap")?;
        stdin.flush()?;
        let line = self.lines.next().ok_or("the target exited")??;
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.as_slice() {
            ["heap", b, l, a] => Ok((b.parse()?, l.parse()?, a.parse()?)),
            _ => Err(format!("heap: {line}").into()),
        }
    }

    /// The process id.
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Sends `sig` to the process; for SIGSTOP, returns once every thread
    /// of it has stopped. The kernel wakes one thread for a stop signal and
    /// that one stops the rest, so right after kill(2) the target's reactor
    /// thread can still serve a transfer for a while.
    pub fn signal(&self, sig: i32) -> std::io::Result<()> {
        // SAFETY: kill(2) takes no pointers.
        if unsafe { libc::kill(self.pid(), sig) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if sig == libc::SIGSTOP {
            process::wait_stopped(self.child.id(), Duration::from_secs(10))?;
        }
        Ok(())
    }
}

impl TargetChild {
    /// Kills the target process (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Stops the target the way it stops by itself: closes its stdin, so it
    /// shuts its engine down and exits (its threads' exit work done: a
    /// `timeline` build writes its readings then), and reaps it; killed if
    /// it has not exited within `grace`.
    pub fn stop(mut self, grace: std::time::Duration) {
        drop(self.child.stdin.take());
        let until = std::time::Instant::now() + grace;
        while std::time::Instant::now() < until {
            match self.child.try_wait() {
                Ok(Some(_)) | Err(_) => return,
                Ok(None) => std::thread::sleep(std::time::Duration::from_millis(10)),
            }
        }
        // Drop kills and reaps it.
    }
}

impl Drop for TargetChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The local transport's target copies from this process's memory; under
/// YAMA's ptrace_scope 1 only a process this one names may, and the target
/// here is not known before the attach (a `--connect` target, or under
/// `--compare`'s callgrind runs a sibling): any process of this user may
/// then, for the benchmark's life. (Without YAMA: nothing changes.)
pub fn allow_any_ptracer() {
    // SAFETY: prctl with integer arguments only; it changes nothing this
    // process relies on.
    let _ = unsafe {
        libc::prctl(
            libc::PR_SET_PTRACER,
            libc::PR_SET_PTRACER_ANY as libc::c_ulong,
            0,
            0,
            0,
        )
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A launcher whose output is not a target's listing: the spawn fails,
    /// and the process it started is killed and reaped, not left serving
    /// (then a zombie) as a bare `Child` dropped on the error was.
    #[test]
    fn a_start_that_fails_leaves_no_process() {
        let pid_file = std::env::temp_dir().join(format!("quiesce-tc-{}", std::process::id()));
        let mut cmd = Command::new("sh");
        cmd.args([
            "-c",
            &format!(
                "echo $$ > {}; echo garbage; exec sleep 30",
                pid_file.display()
            ),
            "sh",
        ]);
        let err = TargetChild::spawn_command(cmd, 4096, false, &[])
            .err()
            .expect("garbage is no listing");
        assert!(
            err.to_string().contains("unexpected target output"),
            "{err}"
        );
        let pid = std::fs::read_to_string(&pid_file).expect("pid file");
        let _ = std::fs::remove_file(&pid_file);
        assert!(
            !std::path::Path::new(&format!("/proc/{}", pid.trim())).exists(),
            "the launcher {} lives on",
            pid.trim()
        );
    }
}
