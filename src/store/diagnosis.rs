//! What an operator should know about the servers a store runs on: [`Admin::diagnose`](super::Admin::diagnose).

use std::fmt;

/// How much a [`Finding`] matters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Severity {
    /// As it should be; said so that the report shows what was checked.
    Ok,
    /// Worth a look: costs load or time, or could not be checked, but no guarantee depends on it.
    Warning,
    /// A guarantee is at risk: a retry may run twice, or a key may never converge.
    Risk,
}

impl Severity {
    /// `ok`, `warning` or `risk`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Warning => "warning",
            Self::Risk => "risk",
        }
    }
}

/// The result of one check of a store's server.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Finding {
    /// How much it matters.
    pub severity: Severity,
    /// The store it is about ([`Store::kind`](super::Store::kind)).
    pub store: &'static str,
    /// What was checked, a stable name: `version`, `maxmemory-policy`, `migrations`, …
    pub check: &'static str,
    /// What was found and, unless it is fine, what to do.
    pub message: String,
}

impl Finding {
    /// A finding of `severity`.
    pub fn new(
        severity: Severity,
        store: &'static str,
        check: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Self {
            severity,
            store,
            check,
            message: message.into(),
        }
    }
}

/// `risk     redis     maxmemory-policy  allkeys-lru evicts …`: one line, aligned.
impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<8} {:<9} {:<20} {}",
            self.severity.as_str(),
            self.store,
            self.check,
            self.message
        )
    }
}

/// Everything [`Admin::diagnose`](super::Admin::diagnose) found, in the order it checked.
///
/// ```
/// use tower_idempotency::{MemoryStore, store::{Admin, Severity}};
///
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let diagnosis = MemoryStore::new().diagnose().await;
/// // One process only: nothing protects a fleet.
/// assert_eq!(diagnosis.worst(), Severity::Warning);
/// println!("{diagnosis}");
/// # });
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Diagnosis {
    /// The findings, one per check (per server, on a cluster).
    pub findings: Vec<Finding>,
}

impl Diagnosis {
    /// The most serious finding's severity (`Ok` when there is none).
    pub fn worst(&self) -> Severity {
        self.findings
            .iter()
            .map(|finding| finding.severity)
            .max()
            .unwrap_or(Severity::Ok)
    }

    /// Whether any finding puts a guarantee at risk: an operator's check should fail.
    pub fn at_risk(&self) -> bool {
        self.worst() == Severity::Risk
    }

    /// Logs every finding, each at its severity's level: a risk as an error, a warning as a
    /// warning, what is fine at debug. With [`ready`](Self::ready), the start-up check.
    pub fn log(&self) {
        for finding in &self.findings {
            match finding.severity {
                Severity::Risk => tracing::error!("{finding}"),
                Severity::Warning => tracing::warn!("{finding}"),
                Severity::Ok => tracing::debug!("{finding}"),
            }
        }
    }

    /// Whether the store can serve requests at all: `Err` with the findings that say it cannot
    /// (a server it cannot reach, a schema it needs that is missing or behind, a cluster with
    /// slots nobody serves), each naming what to fix. What only puts a guarantee at risk is left
    /// to [`at_risk`](Self::at_risk) and the operator.
    ///
    /// Call it at start-up, so that a wrong URL, a missing password or a database never
    /// migrated stops the process with a clear error instead of answering every request 503:
    ///
    /// ```no_run
    /// use tower_idempotency::store::{Admin, PostgresStore};
    ///
    /// # async fn start(store: PostgresStore) {
    /// let diagnosis = store.diagnose().await;
    /// diagnosis.log();
    /// if let Err(error) = diagnosis.ready() {
    ///     eprintln!("{error}");
    ///     std::process::exit(1);
    /// }
    /// # }
    /// ```
    pub fn ready(&self) -> Result<(), NotReady> {
        let blocking: Vec<Finding> = self
            .findings
            .iter()
            .filter(|f| f.severity == Severity::Risk && BLOCKING.contains(&f.check))
            .cloned()
            .collect();
        if blocking.is_empty() {
            Ok(())
        } else {
            Err(NotReady { findings: blocking })
        }
    }

    /// The findings of `check`.
    pub fn of(&self, check: &str) -> impl Iterator<Item = &Finding> {
        self.findings.iter().filter(move |f| f.check == check)
    }

    pub(crate) fn push(
        &mut self,
        severity: Severity,
        store: &'static str,
        check: &'static str,
        message: impl Into<String>,
    ) {
        self.findings
            .push(Finding::new(severity, store, check, message));
    }
}

/// The checks whose risk means no request can be served: the others put a guarantee at risk.
const BLOCKING: [&str; 3] = ["reachable", "migrations", "cluster"];

/// A store that cannot serve requests at all, from [`Diagnosis::ready`]: the findings that say
/// why, each with what to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the idempotency store cannot serve requests:\n{}", Diagnosis { findings: self.findings.clone() })]
#[non_exhaustive]
pub struct NotReady {
    /// What stops it.
    pub findings: Vec<Finding>,
}

/// A line per finding.
impl fmt::Display for Diagnosis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.findings
            .iter()
            .try_for_each(|finding| writeln!(f, "{finding}"))
    }
}
