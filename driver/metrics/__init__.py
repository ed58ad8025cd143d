"""Observability: per-rank step timings shipped over Kafka, stored as Parquet, searched for
stragglers, served as a dashboard, a Chrome trace and Prometheus metrics (README, *Observability*)."""
