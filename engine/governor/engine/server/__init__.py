"""The engine as a network service: OpenAI-compatible API, metrics, live knobs, backpressure."""
