"""The stateful fuzzer (tests/fuzz_machine.py), a short run; scripts/fuzz.py runs it long."""

import os

import pytest
from hypothesis import HealthCheck, settings

from fuzz_machine import TreeMachine


@pytest.mark.parametrize("device", ["cpu"])  # the machine's oracle and injections are CPU's
def test_stateful_fuzzer_finds_no_wrong_read(device):
    TreeMachine.device = device
    TreeMachine.steps = 0
    runner = TreeMachine.TestCase
    runner.settings = settings(
        max_examples=int(os.environ.get("GRAPHTREES_FUZZ_EXAMPLES", "30")),
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    runner().runTest()
    assert TreeMachine.steps > 100  # the calls really ran
