"""Structured outputs: per-token masks that keep a request's output inside a JSON Schema, any JSON object, a regex, a
choice of strings or an EBNF grammar (docs/design/structured-outputs.md).

`StructuredOutputs` imports the grammar library (xgrammar) when it is created, so importing this package costs nothing
for an engine that never sees a structured request.
"""

from governor.engine.structured.bitmask import allocate_bitmask, apply_bitmask
from governor.engine.structured.grammar_state import GrammarState
from governor.engine.structured.structured_outputs import StructuredOutputs

__all__ = ["GrammarState", "StructuredOutputs", "allocate_bitmask", "apply_bitmask"]
