"""Progress bars (``checkpoint.progress``): on a terminal only, and the reading bar counts what the readers read."""

from __future__ import annotations

import io
from pathlib import Path

from gefen_titan.checkpoint import progress
from gefen_titan.checkpoint.io import storage
from gefen_titan.ckpt_tools import verify

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "v2_debug_fsdp2_step3"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_shows_on_a_terminal_only():
    quiet, tty = io.StringIO(), Terminal()
    for out in (quiet, tty):
        with progress.bar(3, "validate: runs", unit="run", file=out) as b:
            b.update(3)
    assert quiet.getvalue() == "" and "validate: runs" in tty.getvalue()


def test_the_reading_bar_counts_every_item_a_checkpoint_read_checks():
    data = sum(f.stat().st_size for f in FIXTURE.glob("*.distcp"))
    progress.advance(10)  # outside a reading bar: nothing to count, no error
    with progress.reading(data, "export: reading", file=Terminal()) as bar:
        storage.load_all(FIXTURE)
        read = bar.n
    assert 0.99 * data <= read <= data  # every stored item, once (a few bytes of padding are no item)


def test_verify_reads_its_own_way_and_counts_on_the_bar_too():
    data = sum(f.stat().st_size for f in FIXTURE.glob("*.distcp"))
    with progress.reading(data, "verify: reading", file=Terminal()) as bar:
        report = verify.verify_checkpoint(str(FIXTURE), None)
        read = bar.n
    # every item once, plus the records its record stage reads again through the checkpoint reader
    assert report["checked"]["bytes"] <= read <= 1.01 * data and read >= 0.99 * data


def test_a_line_printed_under_a_bar_clears_it_first(capsys):
    """Else the line is glued to the bar's on a terminal (tqdm's DummyTqdmFile under redirect_stdout)."""
    tty = Terminal()
    with progress.bar(2, "runs", unit="run", file=tty) as b:
        drawn = tty.getvalue()
        print("  line 0", flush=True)
        cleared = tty.getvalue()[len(drawn):]
        b.update(2)
    assert capsys.readouterr().out == "  line 0\n"
    assert cleared.startswith("\r") and "runs:" in cleared  # cleared, then redrawn
