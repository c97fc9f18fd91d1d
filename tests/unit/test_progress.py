"""The live progress bar of bpo train: drawn on a terminal with success, tokens/s and an ETA;
silent when the output is a file (logs stay plain lines)."""

import io

from rich.console import Console

from bpo.progress import IterationProgress


def test_bar_shows_success_tokens_per_second_and_eta_on_a_terminal():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with IterationProgress(4, done=1, console=console) as bar:
        bar.update(0.625, 321.4)
    text = out.getvalue()
    assert "2/4" in text and "success 0.625" in text and "321 tok/s" in text and "ETA" in text


def test_bar_is_silent_when_the_output_is_not_a_terminal():
    out = io.StringIO()
    with IterationProgress(2, console=Console(file=out, force_terminal=False)) as bar:
        bar.update(0.5, 10.0)
    assert out.getvalue() == ""
