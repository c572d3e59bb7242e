//! The manual: one guide per topic, with examples that compile (and run, where they need no
//! server) as this crate's doctests.
//!
//! | guide | read it to |
//! |---|---|
//! | [`how_it_works`] | know what the layer does with a request, what it promises, whose key a key is, and which answers are kept |
//! | [`configuration`] | set the layer up, and order it among tower-http's layers and your authentication |
//! | [`stores`] | choose between memory, Redis, Postgres and Redis in front of Postgres, and run them |
//! | [`recovery`] | write a handler of several steps that a retry resumes where a dead attempt stopped |
//! | [`client`] | call an API that honours the key: one key per logical call, safe retries |
//! | [`units_of_work`] | run queue consumers and scheduled jobs once per key |
//! | [`grpc`] | guard a tonic server or a plain hyper one |
//! | [`webhooks`] | receive webhooks once per event: the key where the sender puts it, the signature checked before the claim |
//! | [`operating`] | read the metrics, load the dashboard and alerts, check the stores, unstick a key |
//! | [`failure_matrix`] | see each fault the crate was tested against, what callers got, and the test |
//! | [`sizing_and_limits`] | size Redis and Postgres for a load, and know what the crate does not do |
//!
//! Each guide is a file of the repository's `docs/` folder, readable there too.

pub mod how_it_works {
    #![doc = include_str!("../docs/how-it-works.md")]
}

pub mod configuration {
    #![doc = include_str!("../docs/configuration.md")]
}

pub mod stores {
    #![doc = include_str!("../docs/stores.md")]
}

pub mod recovery {
    #![doc = include_str!("../docs/recovery.md")]
}

pub mod client {
    #![doc = include_str!("../docs/client.md")]
}

pub mod units_of_work {
    #![doc = include_str!("../docs/units-of-work.md")]
}

pub mod grpc {
    #![doc = include_str!("../docs/grpc.md")]
}

pub mod webhooks {
    #![doc = include_str!("../docs/webhooks.md")]
}

pub mod operating {
    #![doc = include_str!("../docs/operating.md")]
}

pub mod failure_matrix {
    #![doc = include_str!("../docs/failure-matrix.md")]
}

pub mod sizing_and_limits {
    #![doc = include_str!("../docs/sizing-and-limits.md")]
}

/// The README's examples, compiled as doctests; not part of the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct Readme;
