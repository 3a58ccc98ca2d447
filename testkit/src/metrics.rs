//! Prometheus text as etcd and the router expose it on `/metrics`: the sum
//! of a metric's samples, all of them or those carrying given labels.
//! Enough for counters and gauges; a histogram is read through its `_count`
//! and `_sum` series.

/// Sum of every sample of metric `name` whose labels contain all of
/// `labels` (`key="value"` pairs); 0 when there is none.
pub fn sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
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
}
