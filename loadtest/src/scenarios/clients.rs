//! The clientIds a scenario's locks are acquired for. A router keeps one
//! session lease per (client, shard, TTL), so how many clients share the
//! load decides what an acquire costs besides its txn: with a few clients
//! every session is refreshed many times a second and one keepalive covers
//! many acquires; with as many clients as production has, nearly every
//! acquire refreshes its session with a keepalive of its own.

/// A pool of `count` clientIds, `<prefix>-c0` to `<prefix>-c<count - 1>`,
/// used in turn.
#[derive(Debug, Clone)]
pub struct Clients {
    prefix: String,
    count: usize,
}

impl Clients {
    pub fn new(prefix: &str, count: usize) -> Self {
        Self {
            prefix: prefix.to_string(),
            count: count.max(1),
        }
    }

    /// The clientId of the `n`th use (in turn: `n` modulo the pool's size).
    pub fn id(&self, n: u64) -> String {
        format!("{}-c{}", self.prefix, n % self.count as u64)
    }

    pub fn count(&self) -> usize {
        self.count
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_go_round() {
        let c = super::Clients::new("t", 3);
        assert_eq!(c.id(0), "t-c0");
        assert_eq!(c.id(4), "t-c1");
        assert_eq!(c.count(), 3);
    }
}
