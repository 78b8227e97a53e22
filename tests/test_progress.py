"""The start-up progress line (runtime.progress): redrawn in place on a terminal, a line per phase's start and
end in a log."""

import io

from runtime.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_line_as_a_phase_starts_and_one_as_it_ends():
    log = io.StringIO()
    progress = Progress(stream=log)
    progress.start("compiling kernels", 2)
    assert log.getvalue() == "compiling kernels ...\n"     # what a log cut off mid-phase shows
    progress.advance()
    progress.advance()
    progress.finish("35 kernels")
    first, second = log.getvalue().splitlines()
    assert first == "compiling kernels ..." and second.startswith("compiling kernels: done in ")
    assert second.endswith(" s (35 kernels)") and "\r" not in log.getvalue()


def test_a_terminal_gets_one_line_redrawn_and_a_disabled_progress_nothing():
    screen = Terminal()
    progress = Progress(stream=screen)
    progress.start("loading weights", 4 * 2 ** 30, "B")
    progress.advance(2 * 2 ** 30)
    progress.finish()
    text = screen.getvalue()
    assert text.startswith("\rloading weights: [") and "0.00 GiB / 4.00 GiB" in text and " ...\n" not in text
    assert text.count("\n") == 1 and text.split("\r")[-1].startswith("loading weights: done in ")
    silent = io.StringIO()
    quiet = Progress(enabled=False, stream=silent)
    quiet.start("x", 1)
    quiet.finish()
    assert silent.getvalue() == ""
