"""data.prepare.progress: a bar with rate and ETA on a terminal, nothing on anything else."""

import io

from data.prepare.progress import progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_bar_on_a_terminal_shows_rate_and_eta():
    out = Terminal()
    with progress(total=4 << 20, desc="tokenize", unit="B", stream=out) as bar:
        for _ in range(4):
            bar.update(1 << 20)
        bar.refresh()
        shown = out.getvalue()
    assert "tokenize" in shown and "B/s" in shown and "<" in shown  # rate, elapsed<ETA
    assert "4.19M/4.19M" in shown


def test_silent_when_not_a_terminal():
    out = io.StringIO()
    assert list(progress(range(5), total=5, desc="pairs", stream=out)) == [0, 1, 2, 3, 4]
    assert out.getvalue() == ""
