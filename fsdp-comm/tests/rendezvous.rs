//! The TCP rendezvous on 127.0.0.1 with ephemeral ports (no NCCL needed).

use fsdp_comm::rendezvous::{exchange, fetch, RendezvousServer};
use fsdp_comm::{CommError, DistEnv};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Never below 5 s in CI.
const TIMEOUT: Duration = Duration::from_secs(5);

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

#[test]
fn every_peer_receives_rank_zeros_blob() {
    let server = RendezvousServer::bind(loopback()).unwrap();
    let addr = server.local_addr().unwrap();
    let blob: Vec<u8> = (0..128u32).map(|i| (i * 7 + 3) as u8).collect();
    let world = 6;
    std::thread::scope(|s| {
        let served = s.spawn(|| server.serve(&blob, world, Duration::from_secs(30)));
        // Peers start in reverse order, some after a delay: order and timing do not matter.
        let peers: Vec<_> = (1..world)
            .rev()
            .map(|r| {
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(20 * r as u64));
                    fetch(addr, r, world, Duration::from_secs(30))
                })
            })
            .collect();
        for p in peers {
            assert_eq!(p.join().unwrap().unwrap(), blob);
        }
        served.join().unwrap().unwrap();
    });
}

#[test]
fn peers_retry_until_rank_zero_listens() {
    // Take a free port, release it, start the peer first, then rank 0.
    let port = fsdp_comm::launch::pick_free_port("127.0.0.1").unwrap();
    let env = |rank| DistEnv {
        rank,
        world_size: 2,
        local_rank: rank,
        local_world_size: 2,
        master_addr: "127.0.0.1".into(),
        master_port: port,
    };
    std::thread::scope(|s| {
        let peer = s.spawn(|| exchange(&env(1), || unreachable!(), Duration::from_secs(30)));
        std::thread::sleep(Duration::from_millis(300));
        let root = exchange(
            &env(0),
            || Ok(b"unique-id".to_vec()),
            Duration::from_secs(30),
        );
        assert_eq!(root.unwrap(), b"unique-id");
        assert_eq!(peer.join().unwrap().unwrap(), b"unique-id");
    });
}

#[test]
fn a_peer_that_never_joins_is_a_timeout_on_every_rank() {
    let server = RendezvousServer::bind(loopback()).unwrap();
    let addr = server.local_addr().unwrap();
    let start = Instant::now();
    std::thread::scope(|s| {
        let served = s.spawn(|| server.serve(b"id", 4, TIMEOUT));
        // Ranks 1 and 3 join; rank 2 never does.
        let peers: Vec<_> = [1usize, 3]
            .into_iter()
            .map(|r| s.spawn(move || fetch(addr, r, 4, Duration::from_secs(30))))
            .collect();
        let err = served.join().unwrap().unwrap_err();
        match &err {
            CommError::Timeout { missing, .. } => assert_eq!(missing, &vec![2]),
            other => panic!("{other}"),
        }
        for p in peers {
            let e = p.join().unwrap().unwrap_err();
            // The joined peers learn why from rank 0 instead of waiting for their own deadline.
            assert!(e.to_string().contains("[2] never joined"), "{e}");
        }
    });
    let elapsed = start.elapsed();
    assert!(
        elapsed >= TIMEOUT && elapsed < Duration::from_secs(25),
        "{elapsed:?}"
    );
}

#[test]
fn a_missing_rank_zero_is_a_clear_error() {
    let port = fsdp_comm::launch::pick_free_port("127.0.0.1").unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let start = Instant::now();
    let e = fetch(addr, 1, 2, TIMEOUT).unwrap_err();
    assert!(start.elapsed() >= TIMEOUT);
    assert!(e.to_string().contains("could not reach rank 0"), "{e}");
}

#[test]
fn foreign_or_inconsistent_peers_are_rejected() {
    let server = RendezvousServer::bind(loopback()).unwrap();
    let addr = server.local_addr().unwrap();
    std::thread::scope(|s| {
        let served = s.spawn(|| server.serve(b"blob", 2, Duration::from_secs(20)));
        // Wrong world size, then a rank outside the group: both told why; then the real peer.
        let e = fetch(addr, 1, 3, Duration::from_secs(20)).unwrap_err();
        assert!(e.to_string().contains("WORLD_SIZE 3"), "{e}");
        let e = fetch(addr, 5, 2, Duration::from_secs(20)).unwrap_err();
        assert!(e.to_string().contains("claims rank 5"), "{e}");
        assert_eq!(fetch(addr, 1, 2, Duration::from_secs(20)).unwrap(), b"blob");
        served.join().unwrap().unwrap();
    });
}
