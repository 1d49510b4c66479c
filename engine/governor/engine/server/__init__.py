"""The engine as a network service: OpenAI-compatible API, metrics, live knobs, backpressure."""

# Defaults the `governor serve` parser needs before anything heavy is imported.
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 2**20  # 16 MiB: dozens of times a long-context prompt, as text or token ids
TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # the formats tool calls are parsed from (`server.tool_calls`)
