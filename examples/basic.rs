//! The client SDK in a few lines: acquire, work under the lock, release;
//! then the same with `with_lock`, which also stops the work if the lock is
//! lost.
//!
//! ```sh
//! make run     # a router on 127.0.0.1:8080, in another terminal
//! cargo run --example basic -- http://127.0.0.1:8080
//! ```

use std::time::Duration;

use lockrouter_client::{Client, Error};

#[tokio::main]
async fn main() -> Result<(), Error> {
    let router = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "http://127.0.0.1:8080".to_string());
    let client = Client::new(&router, None)?;
    let ttl = Duration::from_secs(10);

    match client.acquire("example:report", ttl).await? {
        Some(lock) => {
            println!(
                "holding {} with fencing token {}",
                lock.name(),
                lock.fencing_token()
            );
            tokio::select! {
                reason = lock.lost() => println!("lost it ({reason}): stop writing"),
                _ = tokio::time::sleep(Duration::from_secs(1)) => println!("work done"),
            }
            lock.release().await?;
        }
        None => println!("someone else holds example:report"),
    }

    let outcome = client
        .with_lock("example:report", ttl, |lock| async move {
            // Pass lock.fencing_token() with every write to the resource.
            tokio::time::sleep(Duration::from_millis(200)).await;
            lock.fencing_token()
        })
        .await;
    match outcome {
        Ok(token) => println!("with_lock finished under token {token}"),
        Err(Error::NotAcquired { .. }) => println!("busy, try later"),
        Err(e) => return Err(e),
    }
    Ok(())
}
