"""``python -m tests.streams_fault``: ``python -m streams`` with a bug planted for a test.

Folding a record of team ``team-fault`` raises, as a bug in the processor would:
``STREAMS_FAULT=once`` the first time only (the file ``STREAMS_FAULT_MARKER`` names then
exists, and the restart folds it), ``always`` every time. Everything else is the real entry
point.
"""

from __future__ import annotations

import os
import runpy
from pathlib import Path

from streams.processor import UsageProcessor

FAULT_TEAM = b'"team-fault"'

_always = os.environ["STREAMS_FAULT"] == "always"
_marker = Path(os.environ["STREAMS_FAULT_MARKER"])
_handle = UsageProcessor.handle


def _faulty(self: UsageProcessor, raw: bytes | None, partition: int, offset: int) -> None:
    if raw is not None and FAULT_TEAM in raw and (_always or not _marker.exists()):
        _marker.touch()
        raise RuntimeError("a planted bug")
    _handle(self, raw, partition, offset)


UsageProcessor.handle = _faulty  # type: ignore[method-assign]
runpy.run_module("streams", run_name="__main__", alter_sys=True)
