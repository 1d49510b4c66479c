"""Keeping the garbage collector off the objects of a started engine (docs/design/step-pipeline.md, "Garbage
collection")."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_startup_objects() -> None:
    """After one full collection, move every object alive now out of the garbage collector's reach
    (gc.freeze): for a process whose engine lives as long as it does (a server, a benchmark), once the engine
    has started. Otherwise each full collection rescans every object of torch, the model and the engine: a
    pause of 0.18-0.29 s (`scripts/profile-host.py`, throughput workload, H100; docs/design/step-pipeline.md)
    that stalls whichever step it falls in. Objects frozen are still freed when their last reference goes; only
    reference cycles among them are never collected, which is why the `LLM` library class does not do this by
    itself."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def startup_objects_frozen() -> Iterator[None]:
    """`freeze_startup_objects` for a timed run inside a longer process (a benchmark called from tests):
    the objects are given back to the collector (gc.unfreeze) when it ends."""
    freeze_startup_objects()
    try:
        yield
    finally:
        gc.unfreeze()
