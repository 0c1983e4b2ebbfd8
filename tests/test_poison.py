"""PoisonHunt: the request that makes steps fail is found in halves and fails alone; the rest run on.

A simulated engine runs whatever is queued; a step fails while any poison request is in it.
"""

import random

import pytest

from actors.driver.poison import PoisonHunt
from actors.errors import StepError, WorkerFailure


def simulate(live: list[str], poison: set[str], seed: int = 0, max_steps: int = 500):
    """Every queued request needs 3 good steps to finish. -> (failed ids, finished ids, failed steps)."""
    rng = random.Random(seed)
    hunt = PoisonHunt()
    queued = {r: 0 for r in live}  # rid -> steps done
    failed, finished, num_failures = [], [], 0
    for _ in range(max_steps):
        if not queued and not hunt.active:
            return failed, finished, num_failures
        running = [r for r in queued if rng.random() < 0.9 or len(queued) == 1]  # some wait a step
        if poison & set(running):
            num_failures += 1
            everyone = list(queued) + [r for r in live if hunt.is_held(r)]
            verdict = hunt.step_failed(running, everyone)
            failed += verdict.culprits
            queued = {r: 0 for r in verdict.run}  # recompute: progress is lost
            assert not set(verdict.run) & set(verdict.held)
            continue
        for r in running:
            queued[r] += 1
            done = queued[r] >= 3
            if done:
                del queued[r]
                finished.append(r)
            for again in hunt.progressed(r, done):
                queued[again] = 0
    raise AssertionError("did not settle")


@pytest.mark.parametrize(
    "n,poison,seed", [(1, {"r0"}, 0), (8, {"r5"}, 1), (9, {"r0", "r7"}, 2), (16, {"r3", "r4", "r11"}, 3), (5, set(), 4)]
)
def test_poison_found_and_failed_alone(n, poison, seed):
    live = [f"r{i}" for i in range(n)]
    failed, finished, num_failures = simulate(live, poison, seed)
    assert sorted(failed) == sorted(poison)
    assert sorted(finished) == sorted(set(live) - poison)  # every other request completes
    # Halving: a few failed steps per poison request, not one per request.
    assert num_failures <= len(poison) * (2 + 2 * max(1, n).bit_length())


def test_lone_failure_gets_one_more_try_then_fails():
    hunt = PoisonHunt()
    v = hunt.step_failed(["a"], ["a", "b"])
    assert v.culprits == [] and v.run == ["a"] and v.held == ["b"]
    v = hunt.step_failed(["a"], ["a", "b"])
    assert v.culprits == ["a"] and v.run == ["b"] and not hunt.active


def test_forget_during_a_hunt_moves_on():
    hunt = PoisonHunt()
    v = hunt.step_failed(["a", "b", "c", "d"], ["a", "b", "c", "d", "e"])
    assert v.run == ["a", "b"]
    assert hunt.progressed("a", finished=True) == []
    assert hunt.forget("b") == ["c", "d"]  # the probe passed without b (aborted)
    assert hunt.forget("e") == []  # held: simply dropped
    assert hunt.progressed("c", False) == [] and hunt.progressed("d", False) == []
    assert not hunt.active


# ---- the restart budget: spent on worker deaths only, also on a death during a rebuild ------------
class _Engine:
    def running_request_ids(self) -> list[str]:
        return []

    def reset_requests(self) -> None:
        pass


def _recovery(budget: int, deaths_during_rebuild: int):
    """A Recovery whose rebuilds die `deaths_during_rebuild` times, as new workers dying in load_model do."""
    from actors.config.engine import EngineConfig, ModelConfig, ParallelConfig
    from actors.driver.mailbox import Mailbox
    from actors.driver.poison import PoisonIsolation
    from actors.driver.recovery import EngineHooks, Recovery

    builds, restarts = [], []

    def build() -> None:
        builds.append(1)
        if len(builds) <= deaths_during_rebuild:
            raise WorkerFailure(0, "its actor died during load_model")

    config = EngineConfig(
        model=ModelConfig(model="tiny-random"), parallel=ParallelConfig(device="cpu", max_worker_restarts=budget)
    )
    mailbox = Mailbox()
    hooks = EngineHooks(
        engine=_Engine,
        shut_down=lambda: None,
        build=build,
        requeue=lambda rid: None,
        record_restart=lambda: restarts.append(1),
    )
    isolation = PoisonIsolation(0, mailbox, hooks.requeue)
    recovery = Recovery(config, 0, None, mailbox, isolation, hooks)
    return recovery, mailbox, restarts


def test_a_death_during_a_rebuild_spends_the_budget_and_the_next_restart_is_tried():
    failure = WorkerFailure(1, "killed")
    recovery, mailbox, rebuilt = _recovery(budget=3, deaths_during_rebuild=2)
    assert recovery.recover(failure) is True  # rebuild 1 and 2 died, rebuild 3 held
    assert recovery.restarts == 3 and mailbox.fatal is None and len(rebuilt) == 1
    recovery, mailbox, rebuilt = _recovery(budget=2, deaths_during_rebuild=2)
    assert recovery.recover(failure) is False
    assert recovery.restarts == 2 and not rebuilt
    assert "after 2 of parallel.max_worker_restarts=2 restarts" in mailbox.fatal, mailbox.fatal


def test_a_step_error_goes_to_the_hunt_and_spends_no_restart():
    recovery, mailbox, rebuilt = _recovery(budget=1, deaths_during_rebuild=0)
    assert recovery.recover(StepError(0, "ValueError('bad input')")) is True
    assert recovery.restarts == 0 and mailbox.fatal is None and not rebuilt
