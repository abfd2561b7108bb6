"""conv2d from several Python threads at once: same results as serial calls, and the
extension really lets other Python threads run while a kernel computes. (A Conv2d
shared by threads and two processes tuning one shape are in test_runtime.py.)"""
import threading
import time

import numpy as np
import pytest

import ttile
from conftest import AVAILABLE_ISAS

CASES = [  # (layout, x shape, w shape, stride, padding): different shapes per thread
    ("NHWC", (1, 17, 13, 5), (3, 3, 5, 33), 1, 1),
    ("NCHW", (2, 7, 11, 9), (20, 7, 5, 5), 2, 2),
    ("NHWC", (1, 9, 9, 16), (1, 1, 16, 48), 1, 0),
    ("NCHW", (3, 3, 23, 19), (17, 3, 7, 7), 3, 3),
    ("NHWC", (1, 12, 30, 24), (3, 5, 24, 40), (2, 1), (1, 2)),
    ("NCHW", (1, 32, 14, 14), (64, 32, 3, 3), 1, "same"),
]


@pytest.mark.parametrize("isa", AVAILABLE_ISAS, indirect=True)
def test_threads_calling_conv2d_on_different_shapes_match_serial_calls(isa):
    rng = np.random.default_rng(0)
    inputs = [(rng.uniform(-1, 1, xs).astype(np.float32), rng.uniform(-1, 1, ws).astype(np.float32))
              for _, xs, ws, _, _ in CASES]
    serial = [ttile.conv2d(x, w, stride=stride, padding=pad, layout=layout, threads=1)
              for (layout, _, _, stride, pad), (x, w) in zip(CASES, inputs)]
    errors, barrier = [], threading.Barrier(len(CASES) * 2)

    def worker(i: int) -> None:
        layout, _, _, stride, pad = CASES[i % len(CASES)]
        x, w = inputs[i % len(CASES)]
        try:
            barrier.wait()
            for round_ in range(10):
                y = ttile.conv2d(x, w,
                                 stride=stride,
                                     padding=pad, layout=layout, threads=1 + (i + round_) % 2)
                np.testing.assert_allclose(y, serial[i % len(CASES)], rtol=1e-5, atol=1e-5)
        except Exception as exc:  # reported below
            errors.append((i, exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(CASES) * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a conv2d call hung"
    assert not errors, errors


def test_the_gil_is_released_while_a_kernel_runs():
    """A Python thread counting during one long kernel call keeps counting: with the GIL
    held for the whole call (no bytecode runs in the caller to hand it over) it would
    stand still."""
    rng = np.random.default_rng(1)
    x = rng.uniform(-1, 1, (1, 128, 128, 128)).astype(np.float32)
    w = rng.uniform(-1, 1, (3, 3, 128, 256)).astype(np.float32)   # ~10 GFLOP per call
    count, stop = [0], threading.Event()

    def counter() -> None:
        while not stop.is_set():
            count[0] += 1

    t = threading.Thread(target=counter)
    t.start()
    time.sleep(0.1)
    before, t0 = count[0], time.perf_counter()
    time.sleep(0.1)
    idle_rate = (count[0] - before) / (time.perf_counter() - t0)
    before, t0 = count[0], time.perf_counter()
    ttile.conv2d(x, w, stride=1, padding=1, layout="NHWC", threads=1)
    during, seconds = count[0] - before, time.perf_counter() - t0
    stop.set()
    t.join()
    assert seconds > 0.02
    assert during > 0.2 * idle_rate * seconds, (during, idle_rate, seconds)
