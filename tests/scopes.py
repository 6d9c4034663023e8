"""The units the suite's workers run whole (``tests/conftest.py``'s scheduler), named from test
ids; without side effects, so that ``bench/suite_budget.py`` names a run's scopes alike."""

from __future__ import annotations

from pathlib import Path

# Modules whose module fixture is a run per parameter (a twin's): each parameter's tests are a unit.
RUN_PER_PARAMETER_MODULES = {"test_twin_workflows"}


def module_of(nodeid: str) -> str:
    return Path(nodeid.split("::", 1)[0]).stem


def scope(nodeid: str) -> str:
    """The unit a worker runs whole: a run-per-parameter module's tests of one parameter, else
    the test's module."""
    module = module_of(nodeid)
    if module in RUN_PER_PARAMETER_MODULES:
        return f"{module}[{nodeid.rsplit('[', 1)[1]}"
    return module
