"""One optimizer driven from several threads: a second concurrent call is refused at once, by name, before
anything changes; close() from another thread ends a waiting step within a second with an error that says so;
a stress of step / state_dict / close from several threads never deadlocks, crashes or raises an internal
error. Latches (paused jobs), no sleeps."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import regression_data, small_mlp, train

import asteria


def make(model, **runtime):
    config = asteria.RuntimeConfig(workers=1, deterministic=True, stagger=False, device_refresh=False,
                                   **({"timeout_s": 60.0} | runtime))
    return asteria.Shampoo(model.parameters(), lr=0.01, eps=1e-4, precondition_frequency=2,
                           start_preconditioning_step=2, runtime=config)


def stepper(model, opt, data, outcome):
    """Runs one step in a thread, keeping what it raised (or None)."""
    def run():
        try:
            train(model, opt, 1, data=data)
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - the test reads it
            outcome.append(error)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def hold_a_step(model, opt, data, outcome):
    """A thread inside step(), waiting for a version whose job is paused; returns it once the job is paused."""
    train(model, opt, 1, data=data)  # step 1; step 2 refreshes version 1 and waits for it (used at once)
    engine = opt._refresher.engine
    for block_id in opt._refresher.ids[0]:
        engine.inject_fault(block_id, 1, "pause")
    thread = stepper(model, opt, data, outcome)
    engine.wait_paused(1, 30.0)
    return thread


def test_the_same_tensor_twice_in_one_group_is_refused_by_name():
    x = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"Invalid param_groups\[0\]\['params'\]: the tensor at position 1 "
                                         r"\(shape \(4, 4\)\) is the one at position 0 again"):
        asteria.Shampoo([x, x])


def test_a_second_thread_is_refused_while_a_step_runs():
    model, data = small_mlp(), regression_data()
    with make(model) as opt:
        outcome: list = []
        thread = hold_a_step(model, opt, data, outcome)
        before = [p.detach().clone() for p in model.parameters()]
        for call in (lambda: opt.step(), opt.state_dict, lambda: opt.load_state_dict({})):
            with pytest.raises(RuntimeError, match=r"Invalid concurrent .*: another thread is inside step\(\)"):
                call()
        opt.prefetch()  # the hooks' calls do nothing meanwhile
        opt.poll()
        opt._refresher.engine.release_pauses()
        thread.join(30.0)
        assert outcome == [None]
        assert opt._step == 2
        assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        train(model, opt, 2, data=data)  # and it goes on


def test_close_from_another_thread_ends_a_waiting_step_at_once():
    model, data = small_mlp(), regression_data()
    opt = make(model)
    outcome: list = []
    thread = hold_a_step(model, opt, data, outcome)
    started = time.monotonic()
    opt.close()
    thread.join(30.0)
    assert not thread.is_alive() and time.monotonic() - started < 5.0  # not the 60 s timeout
    assert isinstance(outcome[0], RuntimeError) and "close() was called" in str(outcome[0])
    with pytest.raises(RuntimeError, match="after close"):
        opt.step()


def test_threads_stepping_saving_and_closing_at_once_end_cleanly():
    """A bounded stress: four threads step, take state_dicts and close one optimizer in any order. Every call
    either works or raises one of the documented errors; nothing hangs (each join is bounded)."""
    model, data = small_mlp(), regression_data()
    opt = make(model, timeout_s=10.0)
    train(model, opt, 3, data=data)
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)
    # The threads share one model: autograd must not free a .grad (zero_grad) that another thread's backward
    # is accumulating into, so the gradients are computed under a lock; the optimizer's calls race freely.
    model_lock = threading.Lock()
    x, y = data[0][:32], data[1][:32]

    def worker(kind: int) -> None:
        barrier.wait()
        for _ in range(15):
            try:
                if kind == 3:
                    opt.close() if _ == 10 else opt.state_dict()
                else:
                    with model_lock:
                        opt.zero_grad(set_to_none=True)
                        torch.nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
            except RuntimeError as error:
                message = str(error)
                if not ("concurrent" in message or "close" in message):
                    errors.append(error)
            except BaseException as error:  # noqa: BLE001 - anything else is a failure
                errors.append(error)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60.0)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    opt.close()
    assert errors == [], errors
