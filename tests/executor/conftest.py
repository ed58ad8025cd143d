"""Fixtures: see tests/service_fixtures.py (real Redis, real broker, leak-checked processes)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # incarnation_support, under --import-mode=importlib

from service_fixtures import *  # noqa: F401,F403 - pytest collects the fixtures by name
