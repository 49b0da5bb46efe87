"""``python -m streams``: run the streams app until SIGTERM (or SIGINT)."""

from __future__ import annotations

import importlib
import sys

from streams.stop_signals import StopSignals


def main(argv: list[str] | None = None) -> int:
    # The stop signals are handled first, and the app imported only then: its imports
    # (Faust's) take about a second, and a SIGTERM during them must stop it cleanly too.
    stops = StopSignals.install()
    service = importlib.import_module("streams.service")
    code: int = service.run(argv, stops, usage=__doc__)
    return code


if __name__ == "__main__":
    sys.exit(main())
