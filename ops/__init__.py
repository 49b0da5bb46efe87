"""Operating laneway: the ``laneway`` command line, the local stack it runs (``laneway up``:
Kafka and Redis from local binaries, the supervisor, the local autoscaler) and the drills.

The top layer: it may import every service package (ingress, workers, streams, quota and
the shared core ``laneway``); none of them imports it (``lint-imports`` checks).
"""
