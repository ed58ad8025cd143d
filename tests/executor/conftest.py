"""Fixtures: see tests/service_fixtures.py (real Redis, real broker, leak-checked processes)."""
from service_fixtures import *  # noqa: F401,F403 - pytest collects the fixtures by name
