"""Kernel tests: the ``full_matrix`` tests (the peer suite's whole matrix, long in Triton's
interpreter, and the sm_90 compile check of every kernel, 5 minutes on a cold Triton cache) run
only when asked for with ``-m full_matrix`` (or ``-m`` naming them otherwise): ``make test-full``."""


def pytest_collection_modifyitems(config, items):
    if "full_matrix" in (config.getoption("markexpr") or ""):
        return
    skipped = [item for item in items if item.get_closest_marker("full_matrix")]
    if skipped:
        config.hook.pytest_deselected(items=skipped)
        items[:] = [item for item in items if not item.get_closest_marker("full_matrix")]
