//! Message brokers of the tests' own (NATS with JetStream, RabbitMQ), on free ports, for tests
//! that restart them; what they store lives in a directory of their own and survives a restart.

use super::*;

/// Which broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerKind {
    /// `nats-server -js` (`NATS_SERVER`).
    Nats,
    /// `rabbitmq-server` (`RABBITMQ_SERVER`), a node of its own beside the machine's.
    RabbitMq,
}

/// A broker of the test's own, stopped (and its directory removed) when dropped.
pub struct Broker {
    kind: BrokerKind,
    pub port: u16,
    /// RabbitMQ's distribution port (its node name is made of the AMQP port).
    dist_port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl Broker {
    pub async fn start(kind: BrokerKind) -> Self {
        let dir = std::env::temp_dir().join(format!("broker-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut broker = Self {
            kind,
            port: free_port(),
            dist_port: free_port(),
            dir,
            child: None,
        };
        broker.spawn().await;
        broker
    }

    pub fn kind(&self) -> BrokerKind {
        self.kind
    }

    pub fn url(&self) -> String {
        match self.kind {
            BrokerKind::Nats => format!("nats://127.0.0.1:{}", self.port),
            BrokerKind::RabbitMq => format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port),
        }
    }

    async fn spawn(&mut self) {
        let mut command = match self.kind {
            BrokerKind::Nats => self.nats_command(),
            BrokerKind::RabbitMq => self.rabbitmq_command(),
        };
        let log = std::fs::File::create(self.dir.join("server.log")).unwrap();
        let child = command
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start the {:?} broker: {e}", self.kind));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_err()
        {
            assert!(
                Instant::now() < deadline,
                "the {:?} broker did not start: {}",
                self.kind,
                std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn nats_command(&self) -> Command {
        let program = Need::NatsServer.path();
        let mut command = Command::new(program);
        command
            .args([
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-sd",
            ])
            .arg(self.dir.join("jetstream"));
        command
    }

    /// A node of its own: its own name, ports, configuration, database and logs. Debian's
    /// script runs the node as the `rabbitmq` user, which must own the directory.
    fn rabbitmq_command(&self) -> Command {
        let program = Need::RabbitMqServer.path();
        let dir = &self.dir;
        let config = dir.join("rabbitmq.conf");
        std::fs::write(
            &config,
            format!("listeners.tcp.local = 127.0.0.1:{}\n", self.port),
        )
        .unwrap();
        std::fs::write(dir.join("enabled_plugins"), "[].\n").unwrap();
        let _ = Command::new("chown")
            .args(["-R", "rabbitmq"])
            .arg(dir)
            .status();
        let mut command = Command::new(program);
        command
            .env("RABBITMQ_NODENAME", format!("test-{}@localhost", self.port))
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_CONFIG_FILE", &config)
            .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
            .env("RABBITMQ_FEATURE_FLAGS_FILE", dir.join("feature_flags"))
            .env("RABBITMQ_LOG_BASE", dir.join("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", dir.join("enabled_plugins"))
            .env("RABBITMQ_PID_FILE", dir.join("pid"));
        command
    }

    /// Stops the broker (SIGTERM: it shuts down as a restart would) and waits until it is gone.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if self.kind == BrokerKind::RabbitMq
            && let Ok(pid) = std::fs::read_to_string(self.dir.join("pid"))
        {
            let pid = pid.trim();
            signal(pid, "-TERM");
            let deadline = Instant::now() + Duration::from_secs(30);
            while std::path::Path::new(&format!("/proc/{pid}")).exists()
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            signal(pid, "-KILL");
        }
        signal(&child.id().to_string(), "-TERM");
        let _ = child.wait();
    }

    /// Stops the broker and starts it again on the same port, with what it stored.
    pub async fn restart(&mut self) {
        self.stop();
        self.spawn().await;
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Sends `signal` to `pid`, whether or not it is still there.
fn signal(pid: &str, signal: &str) {
    let _ = Command::new("kill")
        .args([signal, pid])
        .stderr(Stdio::null())
        .status();
}
