"""training/plots.py: matplotlib imported ahead of the loss plot, on a thread that Python's exit
waits for."""

from training.plots import import_in_background, pyplot


def test_the_background_import_is_a_thread_the_exit_waits_for():
    """A daemon thread still importing when a run ends early is stopped inside matplotlib's C++
    modules at Python's shutdown, which aborts the process: the import is not a daemon."""
    importing = import_in_background()
    assert not importing.daemon
    importing.join()
    assert pyplot().get_backend().lower() == "agg"
