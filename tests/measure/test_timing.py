"""A sweep stops on Ctrl-C even where Python lost the KeyboardInterrupt (raised in a finalizer, say)."""

import gc
import os
import signal

import pytest

from cs336_systems.measure import timing


@pytest.fixture
def fresh_sigint_handling():
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    timing._interrupted.clear()
    yield
    signal.signal(signal.SIGINT, previous)
    timing._interrupted.clear()


class InterruptedWhileCollected:
    """Sends this process SIGINT from its finalizer, where Python reports the KeyboardInterrupt and goes on."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10_000):  # bytecode for the handler to run in, inside the finalizer
            pass


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the lost KeyboardInterrupt
def test_a_lost_interrupt_still_stops_the_next_step(fresh_sigint_handling):
    steps = []
    timing.time_phases(
        {"step": lambda: steps.append(1)}, 0, 2, "cpu"
    )  # installs the handler, runs both steps
    assert steps == [1, 1] and signal.getsignal(signal.SIGINT) is timing._remember_and_interrupt
    try:
        InterruptedWhileCollected()
        gc.collect()
    except KeyboardInterrupt:  # had the handler run after the finalizer returned: not lost, also fine
        pass
    with pytest.raises(KeyboardInterrupt):
        timing.time_phases({"step": lambda: steps.append(1)}, 0, 2, "cpu")
    assert steps == [1, 1]  # no step ran after the interrupt
    with pytest.raises(KeyboardInterrupt):
        timing.rows_or_oom("t", "cell", lambda: [{"x": 1}], list)
