"""The recovery tests' stand-in ranks (driver/sim_rank.py, the default of tests/service_fixtures.py) step
every 0.1 s, so a fault and its recovery take seconds."""
import pytest


@pytest.fixture(autouse=True)
def quick_steps(monkeypatch):
    monkeypatch.setenv("SIM_STEP_S", "0.1")
