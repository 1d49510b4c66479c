"""`governor bench serve`: a torch-free load generator for OpenAI-compatible servers (like `vllm bench serve`).

    from governor.loadgen import BenchConfig, run
    result = run(BenchConfig("http://127.0.0.1:8000", "my-model", request_rate=4.0, num_prompts=200))
    print(result.to_dict()["ttft_ms"])

Modules: `workload` (prompts, lengths, arrivals), `client` (one streaming request and its timings),
`benchmark` (the load loop), `report` (percentiles, goodput, table, envelope), `cli` (the command).
"""

from governor.loadgen.benchmark import BenchConfig, run, run_benchmark
from governor.loadgen.client import RequestRecord
from governor.loadgen.report import SLO, BenchResult

__all__ = ["SLO", "BenchConfig", "BenchResult", "RequestRecord", "run", "run_benchmark"]
