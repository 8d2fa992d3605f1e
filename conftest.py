"""The test run keeps the lessons as it executed them, for the course book (tests/support/kept_lessons.py).

Loaded here at the top of the checkout rather than in tests/conftest.py so that a run of the lessons
alone (``python -m pytest notebooks``) keeps them too.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "tests" / "support"))

pytest_plugins = ["kept_lessons"]
