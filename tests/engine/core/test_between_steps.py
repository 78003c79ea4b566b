"""Jobs handed to the stepping thread: they run there, before a step, never beside one."""

from __future__ import annotations

import logging
import threading

from engine.core.between_steps import BetweenSteps


def test_a_job_from_another_thread_runs_only_when_the_stepping_thread_asks_and_stays_pending_while_it_runs():
    jobs, ran, woken = BetweenSteps(), [], []
    jobs.wake = lambda: woken.append(threading.current_thread().name)
    other = threading.Thread(target=jobs.add, args=(lambda: ran.append((threading.current_thread(), jobs.pending)),),
                             name="compile")
    other.start()
    other.join()
    assert ran == [] and jobs.pending and woken == ["compile"], "added, not run, and the sleeping loop woken"
    jobs.run()
    assert ran == [(threading.current_thread(), True)], "run here, and pending until it is done"
    assert not jobs.pending


def test_a_job_that_fails_is_logged_and_the_next_one_still_runs(caplog):
    jobs, ran = BetweenSteps(), []

    def failing() -> None:
        raise RuntimeError("a profile that failed")

    jobs.add(failing)
    jobs.add(lambda: ran.append(1))
    with caplog.at_level(logging.ERROR, logger="engine.core.between_steps"):
        jobs.run()
    assert ran == [1] and not jobs.pending
    assert "a job between steps failed" in caplog.text and "a profile that failed" in caplog.text
