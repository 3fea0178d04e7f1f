"""validate's figure of one pair (``validation.figure``), without any run."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image as mpimg

from gefen_titan.validation import figure
from gefen_titan.validation.report import PairResult
from gefen_titan.validation.runs import Settings

REF = {1: 7.9, 2: 7.6, 3: 7.4, 4: 7.2, 5: 7.05, 6: 6.9, 7: 6.8}


def _result(exact: bool = True, dropped: bool = True) -> PairResult:
    resumed = {5: 7.1, 6: 6.95, 7: 6.78}
    state = {"blocking": "agreed", "exact": exact, "problems": [] if exact else ["momentum differs"]}
    return PairResult("2->1", 2, 1, "gloo", REF, resumed, 0.05, 0.39, state, {"total": 1, "optimizer": 1}, 0.1, 0.1,
                      [] if exact else ["2->1: momentum error 1 > 0"], {5: 0.05, 6: 0.05, 7: 0.02},
                      layouts={"source": {"fsdp": 2, "tp": 1}, "target": {"fsdp": 1, "tp": 1}},
                      dropped_losses={5: 7.3, 6: 7.2, 7: 7.0} if dropped else None)


def _texts(fig) -> str:
    return "\n".join([t.get_text() for t in fig.texts] + [t.get_text() for a in fig.axes for t in a.texts]
                     + [a.get_title() for a in fig.axes])


def test_one_pair_figure_is_wide_titled_and_says_the_state_verdict(tmp_path):
    settings = Settings(recipe="recipes/llama_gefen.toml", steps_before=4, steps_after=3)
    fig = figure.pair_figure(_result(), settings)
    text = _texts(fig)
    assert "llama_gefen.toml: pair 2->1, saved at 2 ranks (fsdp 2), resumed at 1 rank" in text
    assert "1 ranks" not in text
    assert "State after the load: BIT-EXACT (agreed blocking)" in text and "PASS" in text
    assert "optimizer state dropped: max |loss - reference| 0.3000, inside the band" in text
    loss_ax, dev_ax = fig.axes[0], fig.axes[1]
    assert dev_ax.get_ylabel() == "|loss - reference|"
    labels = [line.get_label() for line in dev_ax.get_lines()]
    assert "resumed" in labels and "optimizer state dropped" in labels
    ys = dict(zip(labels, (list(line.get_ydata()) for line in dev_ax.get_lines())))
    assert [round(y, 4) for y in ys["optimizer state dropped"]] == [0.25, 0.3, 0.2]
    assert any("dropped" in line.get_label() for line in loss_ax.get_lines())
    png = figure.plot_pair(_result(), settings, tmp_path / "f.png")
    height, width = mpimg.imread(png).shape[:2]
    assert width >= 1200 and height >= 500


def test_a_broken_state_is_written_on_the_figure():
    fig = figure.pair_figure(_result(exact=False, dropped=False), Settings(recipe="r.toml"))
    text = _texts(fig)
    assert "State after the load: DIFFER (agreed blocking): momentum differs" in text
    assert "FAIL: 1 figure out of tolerance" in text and "dropped" not in text


def test_one_file_a_pair_where_there_are_several():
    base = Path("/o/loss_curves.png")
    assert figure.path_for(base, "2->1", 1) == base
    assert figure.path_for(base, "2@ep2->1", 2) == Path("/o/loss_curves-2atep2-to-1.png")


def test_each_pair_is_resumed_once_more_with_its_optimizer_state_dropped(monkeypatch, tmp_path):
    """The figure's dropped-state line is measured (command._run), unless the resume itself is the fault;
    a failed measurement leaves the pair without it and is no verdict."""
    from gefen_titan.validation import command
    from gefen_titan.validation.layouts import Side
    from gefen_titan.validation.runs import Run

    calls = []

    def reference(settings, side, *, out, cache=None, quiet=False, tag="ref"):
        return Run(str(out / f"ref-{side.label}"), side.nproc, dict(REF), 1.0)

    def resume(settings, ref, side, folder, fault=None, measure=False):
        calls.append((folder.name, fault, measure))
        if measure and "broken" in str(folder):
            raise RuntimeError("rank 0 died")
        return Run(str(folder), side.nproc, {5: 7.3}, 1.0)

    monkeypatch.setattr(command, "reference_run", reference)
    monkeypatch.setattr(command, "resume_run", resume)
    pair = (Side(2), Side(1))
    runs = command._run(Settings(recipe="r.toml"), [pair], tmp_path, None, None, None)
    assert calls == [("2-to-1", None, False), ("2-to-1-optimizer-dropped", "drop-optimizer", True)]
    assert runs.dropped[pair].losses == {5: 7.3}
    calls.clear()
    runs = command._run(Settings(recipe="r.toml"), [pair], tmp_path, None, "drop-optimizer", None)
    assert calls == [("2-to-1", "drop-optimizer", False)] and runs.dropped == {}
    runs = command._run(Settings(recipe="r.toml"), [pair], tmp_path / "broken", None, None, None)
    assert runs.dropped == {pair: None}
    calls.clear()
    command._run(Settings(recipe="r.toml"), [pair], tmp_path, None, None, None, dropped_state=False)
    assert calls == [("2-to-1", None, False)]
