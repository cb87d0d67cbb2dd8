//! Rendezvous: torchrun-style environment variables and a TCP exchange of one byte blob.
//!
//! Rank 0 listens on `MASTER_ADDR:MASTER_PORT`; every other rank connects (retrying until the deadline,
//! since rank 0 may start later), says who it is, and waits. When all `WORLD_SIZE - 1` peers have joined,
//! rank 0 sends each of them the blob (for NCCL: the 128-byte unique id). The exchange is therefore also
//! a join barrier: if a peer never joins, rank 0 fails with a timeout naming the missing ranks and tells
//! the peers that did join, so no rank waits forever. Nothing here needs NCCL.
//!
//! Wire format (little endian): peer -> rank 0: `b"FSDPRDV1"`, rank `u32`, world size `u32`;
//! rank 0 -> peer: `b"FSDPRDV1"`, status `u8` (0 = ok, 1 = error), length `u32`, then the blob or a
//! UTF-8 error message.

use crate::error::CommError;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

const MAGIC: &[u8; 8] = b"FSDPRDV1";
/// Largest blob accepted, so a foreign peer cannot make us allocate without bound.
pub const MAX_BLOB_BYTES: usize = 1 << 20;
/// Default bound on the whole rendezvous.
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);
const RETRY_INTERVAL: Duration = Duration::from_millis(50);

/// This process's place in a job, from torchrun-style variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// `RANK`: global rank.
    pub rank: usize,
    /// `WORLD_SIZE`: number of ranks.
    pub world_size: usize,
    /// `LOCAL_RANK`: rank on this host (the GPU ordinal).
    pub local_rank: usize,
    /// `LOCAL_WORLD_SIZE`: ranks on this host (defaults to `WORLD_SIZE`).
    pub local_world_size: usize,
    /// `MASTER_ADDR`: host of rank 0.
    pub master_addr: String,
    /// `MASTER_PORT`: port rank 0 listens on.
    pub master_port: u16,
}

impl DistEnv {
    /// A job of one rank on this host (port 0: rank 0 serves nobody).
    pub fn single() -> Self {
        DistEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
        }
    }

    /// Reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` from
    /// the process environment. `LOCAL_RANK` defaults to `RANK` and `LOCAL_WORLD_SIZE` to `WORLD_SIZE`.
    pub fn from_env() -> Result<Self, CommError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Whether `RANK` is set (a launcher started this process).
    pub fn is_launched() -> bool {
        std::env::var_os("RANK").is_some()
    }

    /// Like [`DistEnv::from_env`] with a custom variable lookup (for tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, CommError> {
        let parse = |name: &str, default: Option<usize>| -> Result<usize, CommError> {
            match get(name) {
                Some(v) => v.trim().parse::<usize>().map_err(|e| CommError::Env {
                    name: name.into(),
                    detail: format!("{v:?} is not a non-negative integer ({e})"),
                }),
                None => default.ok_or_else(|| CommError::Env {
                    name: name.into(),
                    detail: "not set (start the program with fsdp-run or torchrun)".into(),
                }),
            }
        };
        let rank = parse("RANK", None)?;
        let world_size = parse("WORLD_SIZE", None)?;
        let local_rank = parse("LOCAL_RANK", Some(rank))?;
        let local_world_size = parse("LOCAL_WORLD_SIZE", Some(world_size))?;
        let master_addr = get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let port = parse("MASTER_PORT", None)?;
        let env = DistEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port: u16::try_from(port).map_err(|_| CommError::Env {
                name: "MASTER_PORT".into(),
                detail: format!("{port} is not a port number"),
            })?,
        };
        env.check()?;
        Ok(env)
    }

    fn check(&self) -> Result<(), CommError> {
        let bad = |name: &str, detail: String| {
            Err(CommError::Env {
                name: name.into(),
                detail,
            })
        };
        if self.world_size == 0 {
            return bad("WORLD_SIZE", "must be at least 1".into());
        }
        if self.rank >= self.world_size {
            return bad(
                "RANK",
                format!("{} is not below WORLD_SIZE {}", self.rank, self.world_size),
            );
        }
        if self.local_rank >= self.local_world_size.max(1) {
            return bad(
                "LOCAL_RANK",
                format!(
                    "{} is not below LOCAL_WORLD_SIZE {}",
                    self.local_rank, self.local_world_size
                ),
            );
        }
        if self.master_addr.is_empty() {
            return bad("MASTER_ADDR", "is empty".into());
        }
        Ok(())
    }

    /// `MASTER_ADDR:MASTER_PORT`, resolved.
    pub fn master_socket_addr(&self) -> Result<SocketAddr, CommError> {
        let text = format!("{}:{}", self.master_addr, self.master_port);
        text.to_socket_addrs()
            .map_err(|e| CommError::io(format!("resolving MASTER_ADDR {text}"), e))?
            .next()
            .ok_or_else(|| CommError::Env {
                name: "MASTER_ADDR".into(),
                detail: format!("{text} resolves to no address"),
            })
    }
}

/// Rank 0's side: a bound listener that hands a blob to every peer once all have joined.
#[derive(Debug)]
pub struct RendezvousServer {
    listener: TcpListener,
}

impl RendezvousServer {
    /// Listens on `addr` (port 0 picks a free port; see [`RendezvousServer::local_addr`]).
    pub fn bind(addr: SocketAddr) -> Result<Self, CommError> {
        let listener = TcpListener::bind(addr)
            .map_err(|e| CommError::io(format!("rendezvous: binding {addr}"), e))?;
        Ok(RendezvousServer { listener })
    }

    /// The address peers connect to.
    pub fn local_addr(&self) -> Result<SocketAddr, CommError> {
        self.listener
            .local_addr()
            .map_err(|e| CommError::io("rendezvous: listener address", e))
    }

    /// Waits until ranks `1..world_size` have all joined, then sends each of them `blob`. If they do not
    /// all join within `timeout`, the peers that did are told why and a [`CommError::Timeout`] naming
    /// the missing ranks is returned.
    pub fn serve(self, blob: &[u8], world_size: usize, timeout: Duration) -> Result<(), CommError> {
        if blob.len() > MAX_BLOB_BYTES {
            return Err(CommError::Rendezvous(format!(
                "blob of {} bytes exceeds the limit of {MAX_BLOB_BYTES}",
                blob.len()
            )));
        }
        let deadline = Instant::now() + timeout;
        self.listener
            .set_nonblocking(true)
            .map_err(|e| CommError::io("rendezvous: listener", e))?;
        let mut peers: Vec<Option<TcpStream>> = (0..world_size).map(|_| None).collect();
        let mut joined = 0usize;
        while joined + 1 < world_size {
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (1..world_size).filter(|&r| peers[r].is_none()).collect();
                let msg = format!(
                    "rendezvous timed out after {timeout:?}: rank(s) {missing:?} never joined"
                );
                for s in peers.iter_mut().flatten() {
                    let _ = reply(s, 1, msg.as_bytes());
                }
                return Err(CommError::Timeout {
                    op: "rendezvous".into(),
                    rank: 0,
                    missing,
                    timeout,
                });
            }
            match self.listener.accept() {
                Ok((mut stream, from)) => {
                    match read_hello(&mut stream, deadline, world_size) {
                        Ok(r) if peers[r].is_some() => {
                            let _ = reply(
                                &mut stream,
                                1,
                                format!("rank {r} joined twice (second from {from})").as_bytes(),
                            );
                        }
                        Ok(r) => {
                            peers[r] = Some(stream);
                            joined += 1;
                        }
                        Err(e) => {
                            // A foreign or confused peer: tell it and keep waiting for the real ones.
                            let _ = reply(&mut stream, 1, e.to_string().as_bytes());
                        }
                    }
                }
                Err(e)
                    if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted =>
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(CommError::io("rendezvous: accept", e)),
            }
        }
        for (r, s) in peers.iter_mut().enumerate() {
            if let Some(s) = s {
                reply(s, 0, blob)
                    .map_err(|e| CommError::io(format!("rendezvous: sending to rank {r}"), e))?;
            }
        }
        Ok(())
    }
}

fn read_hello(
    stream: &mut TcpStream,
    deadline: Instant,
    world_size: usize,
) -> Result<usize, CommError> {
    stream
        .set_nonblocking(false)
        .map_err(|e| CommError::io("rendezvous: peer socket", e))?;
    let remaining = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(10));
    stream
        .set_read_timeout(Some(remaining))
        .map_err(|e| CommError::io("rendezvous: peer socket", e))?;
    let mut hello = [0u8; 16];
    stream
        .read_exact(&mut hello)
        .map_err(|e| CommError::io("rendezvous: reading a peer's hello", e))?;
    if &hello[..8] != MAGIC {
        return Err(CommError::Rendezvous(
            "peer is not an fsdp-comm rendezvous client".into(),
        ));
    }
    let rank = u32::from_le_bytes([hello[8], hello[9], hello[10], hello[11]]) as usize;
    let world = u32::from_le_bytes([hello[12], hello[13], hello[14], hello[15]]) as usize;
    if world != world_size {
        return Err(CommError::Rendezvous(format!(
            "peer rank {rank} has WORLD_SIZE {world} but rank 0 has {world_size}"
        )));
    }
    if rank == 0 || rank >= world_size {
        return Err(CommError::Rendezvous(format!(
            "peer claims rank {rank}, expected 1..{world_size}"
        )));
    }
    Ok(rank)
}

fn reply(stream: &mut TcpStream, status: u8, payload: &[u8]) -> std::io::Result<()> {
    let len = u32::try_from(payload.len()).map_err(|_| ErrorKind::InvalidInput)?;
    let mut msg = Vec::with_capacity(13 + payload.len());
    msg.extend_from_slice(MAGIC);
    msg.push(status);
    msg.extend_from_slice(&len.to_le_bytes());
    msg.extend_from_slice(payload);
    stream.write_all(&msg)?;
    stream.flush()
}

/// A peer's side: connects to rank 0 at `addr` (retrying until `timeout`), joins as `rank` of
/// `world_size`, and returns the blob rank 0 hands out once everyone has joined.
pub fn fetch(
    addr: SocketAddr,
    rank: usize,
    world_size: usize,
    timeout: Duration,
) -> Result<Vec<u8>, CommError> {
    let deadline = Instant::now() + timeout;
    let rank32 = u32::try_from(rank)
        .map_err(|_| CommError::Rendezvous(format!("rank {rank} does not fit the protocol")))?;
    let world32 = u32::try_from(world_size).map_err(|_| {
        CommError::Rendezvous(format!("world size {world_size} does not fit the protocol"))
    })?;
    let mut last_err = String::from("no attempt");
    let mut stream = loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(CommError::Rendezvous(format!(
                "rank {rank} could not reach rank 0 at {addr} within {timeout:?} (last error: {last_err})"
            )));
        }
        let attempt = (deadline - now).min(Duration::from_secs(1));
        match TcpStream::connect_timeout(&addr, attempt) {
            Ok(s) => break s,
            Err(e) => {
                last_err = e.to_string();
                std::thread::sleep(
                    RETRY_INTERVAL.min(deadline.saturating_duration_since(Instant::now())),
                );
            }
        }
    };
    let mut hello = Vec::with_capacity(16);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&rank32.to_le_bytes());
    hello.extend_from_slice(&world32.to_le_bytes());
    stream
        .write_all(&hello)
        .map_err(|e| CommError::io(format!("rendezvous: rank {rank} sending its hello"), e))?;
    let remaining = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(10));
    stream
        .set_read_timeout(Some(remaining))
        .map_err(|e| CommError::io("rendezvous: socket", e))?;
    let mut header = [0u8; 13];
    stream.read_exact(&mut header).map_err(|e| match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => CommError::Rendezvous(format!(
            "rank {rank} joined rank 0 at {addr} but got no answer within {timeout:?} (other ranks \
             did not join, or rank 0 is stuck)"
        )),
        ErrorKind::UnexpectedEof => CommError::Rendezvous(format!(
            "rank 0 at {addr} closed the connection before answering rank {rank}"
        )),
        _ => CommError::io(
            format!("rendezvous: rank {rank} reading rank 0's answer"),
            e,
        ),
    })?;
    if &header[..8] != MAGIC {
        return Err(CommError::Rendezvous(format!(
            "{addr} is not an fsdp-comm rendezvous server"
        )));
    }
    let len = u32::from_le_bytes([header[9], header[10], header[11], header[12]]) as usize;
    if len > MAX_BLOB_BYTES {
        return Err(CommError::Rendezvous(format!(
            "rank 0 announced {len} bytes, above the limit of {MAX_BLOB_BYTES}"
        )));
    }
    let mut payload = vec![0u8; len];
    stream
        .read_exact(&mut payload)
        .map_err(|e| CommError::io(format!("rendezvous: rank {rank} reading the blob"), e))?;
    match header[8] {
        0 => Ok(payload),
        _ => Err(CommError::Rendezvous(format!(
            "rank 0 reported: {}",
            String::from_utf8_lossy(&payload)
        ))),
    }
}

/// The whole exchange for this process: rank 0 makes the blob with `make_blob` and serves it on
/// `MASTER_ADDR:MASTER_PORT`; other ranks fetch it. Every rank returns the same blob.
pub fn exchange(
    env: &DistEnv,
    make_blob: impl FnOnce() -> Result<Vec<u8>, CommError>,
    timeout: Duration,
) -> Result<Vec<u8>, CommError> {
    if env.rank == 0 {
        let blob = make_blob()?;
        if env.world_size > 1 {
            let server = RendezvousServer::bind(env.master_socket_addr()?)?;
            server.serve(&blob, env.world_size, timeout)?;
        }
        Ok(blob)
    } else {
        fetch(env.master_socket_addr()?, env.rank, env.world_size, timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn env_is_parsed_and_checked() {
        let env = DistEnv::from_lookup(lookup(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.2"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap();
        assert_eq!(
            env,
            DistEnv {
                rank: 3,
                world_size: 4,
                local_rank: 1,
                local_world_size: 2,
                master_addr: "10.0.0.2".into(),
                master_port: 29500
            }
        );
        // Defaults for the local variables.
        let env = DistEnv::from_lookup(lookup(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_PORT", "1"),
        ]))
        .unwrap();
        assert_eq!((env.local_rank, env.local_world_size), (1, 2));

        let err = |vars: &[(&str, &str)]| DistEnv::from_lookup(lookup(vars)).unwrap_err();
        assert!(matches!(err(&[("WORLD_SIZE", "2"), ("MASTER_PORT", "1")]),
            CommError::Env { name, .. } if name == "RANK"));
        assert!(
            matches!(err(&[("RANK", "2"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")]),
            CommError::Env { name, .. } if name == "RANK")
        );
        assert!(
            matches!(err(&[("RANK", "x"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")]),
            CommError::Env { name, .. } if name == "RANK")
        );
        assert!(
            matches!(err(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "70000")]),
            CommError::Env { name, .. } if name == "MASTER_PORT")
        );
    }
}
