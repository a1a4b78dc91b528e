"""A thread's scratch for plain kernel calls (qbackend/kernels/scratch.py): kept between calls,
grown when a call needs more, its own per thread."""
import threading

from qbackend.kernels.scratch import MIN_BYTES, thread_scratch


def test_a_thread_gets_the_same_scratch_until_it_needs_more():
    first = thread_scratch(100)
    assert thread_scratch(MIN_BYTES) == first
    grown = thread_scratch(4 * MIN_BYTES)
    assert thread_scratch(10) == grown


def test_each_thread_has_its_own():
    mine, theirs = thread_scratch(100), []
    worker = threading.Thread(target=lambda: theirs.append(thread_scratch(100)))
    worker.start()
    worker.join()
    assert theirs and theirs[0] != mine
