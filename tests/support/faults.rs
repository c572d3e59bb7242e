//! Network faults between a store and its server: a reply lost on its way back, a pipeline held
//! between two of its commands.

use super::*;

/// A TCP proxy in front of a server (Redis, Postgres) that, once armed, lets the next request
/// through but drops the server's reply and closes that connection: a store's statement or
/// script is applied, and its answer lost in transit.
pub struct ReplyCutter {
    pub port: u16,
    armed: std::sync::Arc<std::sync::atomic::AtomicBool>,
    cut: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl ReplyCutter {
    /// A proxy on a free port of 127.0.0.1 to `host:port`.
    pub async fn start(host: &str, port: u16) -> Self {
        use std::sync::atomic::{AtomicBool, AtomicUsize};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = (host.to_owned(), port);
        let port = listener.local_addr().unwrap().port();
        let (armed, cut) = (
            std::sync::Arc::new(AtomicBool::new(false)),
            std::sync::Arc::new(AtomicUsize::new(0)),
        );
        let (armed_, cut_) = (armed.clone(), cut.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(upstream.clone()).await else {
                    continue;
                };
                tokio::spawn(Self::relay(client, server, armed_.clone(), cut_.clone()));
            }
        });
        Self { port, armed, cut }
    }

    /// Cuts the next reply any connection gets.
    pub fn arm(&self) {
        self.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// How many replies were cut.
    pub fn cut(&self) -> usize {
        self.cut.load(std::sync::atomic::Ordering::SeqCst)
    }

    async fn relay(
        client: tokio::net::TcpStream,
        server: tokio::net::TcpStream,
        armed: std::sync::Arc<std::sync::atomic::AtomicBool>,
        cut: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut from_client, mut to_client) = client.into_split();
        let (mut from_server, mut to_server) = server.into_split();
        let requests = async {
            let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
        };
        let replies = async {
            let mut buffer = vec![0; 64 * 1024];
            loop {
                let Ok(n @ 1..) = from_server.read(&mut buffer).await else {
                    return;
                };
                if armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
                    cut.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    return;
                }
                if to_client.write_all(&buffer[..n]).await.is_err() {
                    return;
                }
            }
        };
        // Whichever way ends first closes both: the client sees its connection cut.
        tokio::select! {
            () = requests => {}
            () = replies => {}
        }
    }
}

/// A TCP proxy in front of a Redis server that passes each command on by itself, as the server
/// would run it, and, once told to, holds the next command of a given name (and all that
/// follow it on that connection) for a while before passing it on: a server that stalls in the
/// middle of a pipeline, between two of its commands.
pub struct CommandHolder {
    pub port: u16,
    hold: std::sync::Arc<std::sync::Mutex<Option<(String, Duration)>>>,
    holding: std::sync::Arc<tokio::sync::Notify>,
}

impl CommandHolder {
    /// A proxy on a free port of 127.0.0.1 to the Redis on `port` of 127.0.0.1.
    pub async fn start(port: u16) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy = Self {
            port: listener.local_addr().unwrap().port(),
            hold: Default::default(),
            holding: Default::default(),
        };
        let (hold, holding) = (proxy.hold.clone(), proxy.holding.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
                    continue;
                };
                tokio::spawn(Self::relay(client, server, hold.clone(), holding.clone()));
            }
        });
        proxy
    }

    /// The proxy's URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Holds the next `command` (by name, any case) any connection sends for `pause`: the
    /// commands before it have reached the server, it and those after it reach it `pause`
    /// later. The future returned is ready once the hold has begun.
    pub fn hold(&self, command: &str, pause: Duration) -> tokio::sync::futures::OwnedNotified {
        let begun = std::sync::Arc::clone(&self.holding).notified_owned();
        *self.hold.lock().unwrap() = Some((command.to_ascii_uppercase(), pause));
        begun
    }

    async fn relay(
        client: tokio::net::TcpStream,
        server: tokio::net::TcpStream,
        hold: std::sync::Arc<std::sync::Mutex<Option<(String, Duration)>>>,
        holding: std::sync::Arc<tokio::sync::Notify>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut from_client, mut to_client) = client.into_split();
        let (mut from_server, mut to_server) = server.into_split();
        let requests = async {
            let mut pending = Vec::new();
            let mut buffer = vec![0; 64 * 1024];
            loop {
                let Ok(n @ 1..) = from_client.read(&mut buffer).await else {
                    return;
                };
                pending.extend_from_slice(&buffer[..n]);
                while let Some((name, length)) = resp_command(&pending) {
                    let pause = {
                        let mut hold = hold.lock().unwrap();
                        let due = hold.as_ref().is_some_and(|(command, _)| *command == name);
                        due.then(|| hold.take().unwrap().1)
                    };
                    if let Some(pause) = pause {
                        holding.notify_waiters();
                        tokio::time::sleep(pause).await;
                    }
                    if to_server.write_all(&pending[..length]).await.is_err() {
                        return;
                    }
                    pending.drain(..length);
                }
            }
        };
        let replies = async {
            let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
        };
        tokio::select! {
            () = requests => {}
            () = replies => {}
        }
    }
}

/// The name (upper case) and length in bytes of the whole RESP command at the start of
/// `bytes` (an array of bulk strings, as clients send them), or `None` until it is all there.
fn resp_command(bytes: &[u8]) -> Option<(String, usize)> {
    fn line(bytes: &[u8], at: usize) -> Option<(usize, usize)> {
        let end = at + bytes.get(at..)?.windows(2).position(|w| w == b"\r\n")?;
        let number = std::str::from_utf8(&bytes[at + 1..end])
            .ok()?
            .parse()
            .ok()?;
        Some((number, end + 2))
    }
    let (count, mut at) = line(bytes, 0)?;
    let mut name = None;
    for _ in 0..count {
        let (length, start) = line(bytes, at)?;
        at = start + length + 2;
        if bytes.len() < at {
            return None;
        }
        name.get_or_insert_with(|| {
            String::from_utf8_lossy(&bytes[start..start + length]).to_ascii_uppercase()
        });
    }
    Some((name.unwrap_or_default(), at))
}
