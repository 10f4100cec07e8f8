"""The lock that runs whole_gpu tests alone (gpu_lock.py), checked on CPU: shared holders
run together, an exclusive one runs with none, and a waiting exclusive holder goes before
shared holders that come after it. Each GpuLock opens the files anew, so two of them in one
process lock each other out as two xdist workers do."""

from __future__ import annotations

import threading

from gpu_lock import GpuLock

WAIT_S = 0.3  # long enough for a thread to reach a flock it blocks in


class Holder(threading.Thread):
    def __init__(self, lock: GpuLock, exclusive: bool, order: list[str], name: str) -> None:
        super().__init__(daemon=True)
        self.lock, self.exclusive, self.order, self.label = lock, exclusive, order, name
        self.entered, self.release = threading.Event(), threading.Event()

    def run(self) -> None:
        with self.lock.hold(self.exclusive):
            self.order.append(self.label)
            self.entered.set()
            self.release.wait(30)


def test_shared_holders_run_together_and_an_exclusive_one_alone(tmp_path) -> None:
    path = tmp_path / "gpu.lock"
    order: list[str] = []
    first, second = Holder(GpuLock(path), False, order, "a"), Holder(GpuLock(path), False, order, "b")
    first.start()
    second.start()
    assert first.entered.wait(5) and second.entered.wait(5), "two shared holders did not run together"
    alone = Holder(GpuLock(path), True, order, "whole")
    alone.start()
    assert not alone.entered.wait(WAIT_S), "the exclusive holder ran beside shared ones"
    first.release.set()
    assert not alone.entered.wait(WAIT_S), "the exclusive holder ran beside a shared one"
    second.release.set()
    assert alone.entered.wait(5)
    after = Holder(GpuLock(path), False, order, "c")
    after.start()
    assert not after.entered.wait(WAIT_S), "a shared holder ran beside the exclusive one"
    alone.release.set()
    assert after.entered.wait(5)
    after.release.set()


def test_a_waiting_exclusive_holder_goes_before_later_shared_ones(tmp_path) -> None:
    path = tmp_path / "gpu.lock"
    order: list[str] = []
    running = Holder(GpuLock(path), False, order, "running")
    running.start()
    assert running.entered.wait(5)
    whole = Holder(GpuLock(path), True, order, "whole")
    whole.start()
    assert not whole.entered.wait(WAIT_S)  # waiting for `running`
    later = Holder(GpuLock(path), False, order, "later")
    later.start()
    assert not later.entered.wait(WAIT_S), "a shared holder went past a waiting exclusive one"
    running.release.set()
    assert whole.entered.wait(5)
    assert not later.entered.wait(WAIT_S)
    whole.release.set()
    assert later.entered.wait(5)
    later.release.set()
    assert order == ["running", "whole", "later"]
