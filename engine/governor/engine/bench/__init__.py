"""The engine's benchmarks behind `governor bench`: offline throughput (against transformers on the same workload),
decode latency, the prefix and KV caches, speculation, and decode attention alone."""
