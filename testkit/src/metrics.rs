//! Prometheus text as etcd and the router expose it on `/metrics`: the sum
//! of a metric's samples, all of them or those carrying given labels, and a
//! histogram's buckets with the quantiles read from them.

/// Every sample of metric `name` whose labels contain all of `labels`
/// (`key="value"` pairs), as its line and its value.
fn samples<'a>(
    text: &'a str,
    name: &'a str,
    labels: &'a [(&str, &str)],
) -> impl Iterator<Item = (&'a str, f64)> + 'a {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(move |l| l.split(['{', ' ']).next() == Some(name))
        .filter(move |l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| Some((l, l.rsplit(' ').next()?.parse::<f64>().ok()?)))
}

/// Sum of every sample of metric `name` whose labels contain all of
/// `labels` (`key="value"` pairs); 0 when there is none.
pub fn sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    samples(text, name, labels).map(|(_, v)| v).sum()
}

/// The cumulative counts of histogram `name`'s buckets (its `_bucket`
/// samples with `labels`, summed over their other labels), by upper bound,
/// lowest first, `+Inf` last.
pub fn buckets(text: &str, name: &str, labels: &[(&str, &str)]) -> Vec<(f64, f64)> {
    let series = format!("{name}_bucket");
    let mut by_le: Vec<(f64, f64)> = Vec::new();
    for (line, count) in samples(text, &series, labels) {
        let le = line
            .split_once("le=\"")
            .and_then(|(_, rest)| rest.split_once('"'))
            .and_then(|(le, _)| match le {
                "+Inf" => Some(f64::INFINITY),
                le => le.parse::<f64>().ok(),
            });
        let Some(le) = le else {
            continue;
        };
        match by_le.iter_mut().find(|(b, _)| *b == le) {
            Some((_, c)) => *c += count,
            None => by_le.push((le, count)),
        }
    }
    by_le.sort_by(|a, b| a.0.total_cmp(&b.0));
    by_le
}

/// What `later`'s buckets counted since `earlier`'s (the same histogram
/// read twice), by upper bound.
pub fn buckets_since(later: &[(f64, f64)], earlier: &[(f64, f64)]) -> Vec<(f64, f64)> {
    later
        .iter()
        .map(|&(le, c)| {
            let before = earlier.iter().find(|(b, _)| *b == le).map_or(0.0, |b| b.1);
            (le, c - before)
        })
        .collect()
}

/// The `q` quantile of cumulative buckets, interpolated within the bucket
/// it falls in, as Prometheus' `histogram_quantile` reads them (one in
/// `+Inf` reads the highest finite bound); none without samples.
pub fn quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last().map(|b| b.1).filter(|&n| n > 0.0)?;
    let rank = q * total;
    let (mut lower, mut below) = (0.0, 0.0);
    for &(le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return Some(lower);
            }
            let within = count - below;
            let share = if within > 0.0 {
                (rank - below) / within
            } else {
                1.0
            };
            return Some(lower + (le - lower) * share);
        }
        (lower, below) = (le, count);
    }
    Some(lower)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_matching_samples_only() {
        let text = "# HELP x\n\
            grpc_server_handled_total{grpc_code=\"OK\",grpc_method=\"Txn\",grpc_service=\"etcdserverpb.KV\",grpc_type=\"unary\"} 7\n\
            grpc_server_handled_total{grpc_code=\"Unavailable\",grpc_method=\"Txn\",grpc_service=\"etcdserverpb.KV\",grpc_type=\"unary\"} 2\n\
            grpc_server_handled_total{grpc_code=\"OK\",grpc_method=\"Range\",grpc_service=\"etcdserverpb.KV\",grpc_type=\"unary\"} 5\n\
            etcd_server_proposals_committed_total 1.2e+06\n\
            etcd_server_proposals_committed_total_other 3\n";
        assert_eq!(
            sum(text, "grpc_server_handled_total", &[("grpc_method", "Txn")]),
            9.0
        );
        assert_eq!(sum(text, "grpc_server_handled_total", &[]), 14.0);
        assert_eq!(
            sum(text, "etcd_server_proposals_committed_total", &[]),
            1.2e6
        );
        assert_eq!(sum(text, "absent", &[]), 0.0);
    }

    #[test]
    fn a_histogram_read_twice_gives_the_quantiles_of_what_came_between() {
        let before = "x_bucket{op=\"acquire\",le=\"0.001\"} 10\n\
            x_bucket{op=\"acquire\",le=\"0.002\"} 10\n\
            x_bucket{op=\"acquire\",le=\"+Inf\"} 10\n";
        // Two shards' series of one op, summed; another op left out.
        let after = "# TYPE x histogram\n\
            x_bucket{shard=\"a\",op=\"acquire\",le=\"0.001\"} 40\n\
            x_bucket{shard=\"a\",op=\"acquire\",le=\"0.002\"} 100\n\
            x_bucket{shard=\"a\",op=\"acquire\",le=\"+Inf\"} 105\n\
            x_bucket{shard=\"b\",op=\"acquire\",le=\"0.001\"} 0\n\
            x_bucket{shard=\"b\",op=\"acquire\",le=\"0.002\"} 0\n\
            x_bucket{shard=\"b\",op=\"acquire\",le=\"+Inf\"} 5\n\
            x_bucket{shard=\"a\",op=\"release\",le=\"0.001\"} 999\n\
            x_sum{shard=\"a\",op=\"acquire\"} 1\n";
        let b = buckets(after, "x", &[("op", "acquire")]);
        assert_eq!(
            b,
            vec![(0.001, 40.0), (0.002, 100.0), (f64::INFINITY, 110.0)]
        );
        let d = buckets_since(&b, &buckets(before, "x", &[("op", "acquire")]));
        assert_eq!(
            d,
            vec![(0.001, 30.0), (0.002, 90.0), (f64::INFINITY, 100.0)]
        );
        // The 50th of 100 falls in (1 ms, 2 ms], 20 of its 60 in.
        let p50 = quantile(&d, 0.5).unwrap();
        assert!((p50 - (0.001 + 0.001 * 20.0 / 60.0)).abs() < 1e-12, "{p50}");
        // The 99th is past the last finite bound: read as that bound.
        assert_eq!(quantile(&d, 0.99), Some(0.002));
        assert_eq!(quantile(&buckets_since(&d, &d), 0.5), None);
        assert_eq!(quantile(&[], 0.5), None);
    }
}
