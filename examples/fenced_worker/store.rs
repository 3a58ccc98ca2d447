//! The protected resource of the example: an SQLite database that records,
//! per resource, the highest fencing token it has accepted, and refuses any
//! write carrying a lower one. The check and the write happen in one
//! `IMMEDIATE` transaction, and the check is the `WHERE fence <= ?token` of
//! the update itself, so no interleaving of writers can slip a stale write
//! in. Several processes may share one database file.

use std::path::Path;
use std::time::Duration;

use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};

/// What the resource did with a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Write {
    /// Applied; the resource's fence is now this write's token.
    Accepted,
    /// Refused: the resource had already accepted `highest`, a newer token.
    Rejected { highest: u64 },
}

pub struct FencedStore {
    conn: Connection,
}

impl FencedStore {
    /// Opens (and if needed creates) the database at `path`.
    pub fn open(path: &Path) -> rusqlite::Result<Self> {
        let conn = Connection::open(path)?;
        // Writers from several processes queue on SQLite's file lock.
        conn.busy_timeout(Duration::from_secs(10))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS fences (
                 resource TEXT PRIMARY KEY,
                 fence    INTEGER NOT NULL
             );
             CREATE TABLE IF NOT EXISTS writes (
                 seq      INTEGER PRIMARY KEY AUTOINCREMENT,
                 resource TEXT NOT NULL,
                 token    INTEGER NOT NULL,
                 payload  TEXT NOT NULL
             );",
        )?;
        Ok(Self { conn })
    }

    /// Appends `payload` to `resource` if `token` is not older than every
    /// token the resource has accepted; otherwise changes nothing.
    pub fn write(&mut self, resource: &str, token: u64, payload: &str) -> rusqlite::Result<Write> {
        let token = lockrouter_client::fencing::as_i64(token)
            .ok_or(rusqlite::Error::IntegralValueOutOfRange(1, token as i64))?;
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        tx.execute(
            "INSERT INTO fences (resource, fence) VALUES (?1, 0) ON CONFLICT (resource) DO NOTHING",
            params![resource],
        )?;
        // `<=`: the holder may write many times under one token.
        let admitted = tx.execute(
            "UPDATE fences SET fence = ?2 WHERE resource = ?1 AND fence <= ?2",
            params![resource, token],
        )?;
        if admitted == 0 {
            let highest: Option<i64> = tx
                .query_row(
                    "SELECT fence FROM fences WHERE resource = ?1",
                    params![resource],
                    |r| r.get(0),
                )
                .optional()?;
            // Dropping the transaction rolls it back: nothing was changed.
            return Ok(Write::Rejected {
                highest: highest.unwrap_or(0) as u64,
            });
        }
        tx.execute(
            "INSERT INTO writes (resource, token, payload) VALUES (?1, ?2, ?3)",
            params![resource, token, payload],
        )?;
        tx.commit()?;
        Ok(Write::Accepted)
    }
}
