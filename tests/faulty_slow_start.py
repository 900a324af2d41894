"""tests/faulty.py's factory in a module that takes 2 s to import: a worker that starts up slowly, as on a
loaded machine (the runner's worker imports its factory before it can answer)."""
import time

time.sleep(2)

from tests.faulty import factory  # noqa: E402,F401
