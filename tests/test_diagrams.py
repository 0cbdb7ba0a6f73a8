"""Reliability diagrams: two valid PNGs, written atomically."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.metrics.diagrams import plot_calibration_diagrams

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EXPECTED = {"calibration_pred.png", "calibration_bounds.png"}


def random_table(seed: int = 0, n: int = 300) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    cr = rng.normal(size=n) + 0.5
    rr = rng.normal(size=n)
    uc, ur = rng.gamma(2.0, 0.3, n), rng.gamma(2.0, 0.3, n)
    return pd.DataFrame({
        "id": [f"pair{i}" for i in range(n)], "subset": "test", "weight": rng.uniform(0.5, 2.0, n),
        "chosen_reward": cr, "chosen_lower": cr - uc, "chosen_upper": cr + uc,
        "rejected_reward": rr, "rejected_lower": rr - ur, "rejected_upper": rr + ur,
    })


def test_writes_two_valid_pngs(tmp_path):
    out = tmp_path / "nested" / "plots"  # created on demand
    paths = plot_calibration_diagrams(random_table(), out, n_bins=10, title="unit test")
    assert [p.name for p in paths] == ["calibration_pred.png", "calibration_bounds.png"]
    for p in paths:
        assert p.parent == out
        data = p.read_bytes()
        assert data[:8] == PNG_MAGIC
        assert len(data) > 10_000  # axes, bars and text, not an empty canvas
    # The bounds figure has two panels side by side: wider than the single-panel one (PNG IHDR width, bytes 16-20).
    widths = [int.from_bytes(p.read_bytes()[16:20], "big") for p in paths]
    assert widths[1] > 1.5 * widths[0]


def test_no_leftover_temp_files_and_overwrite(tmp_path):
    plot_calibration_diagrams(random_table(0), tmp_path)
    first = (tmp_path / "calibration_pred.png").read_bytes()
    plot_calibration_diagrams(random_table(1), tmp_path)  # overwrite in place
    assert {p.name for p in tmp_path.iterdir()} == EXPECTED
    assert (tmp_path / "calibration_pred.png").read_bytes() != first


def test_final_files_appear_only_after_saving(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    real_savefig = Figure.savefig
    present_after_each_save = []

    def recording_savefig(self, *args, **kwargs):
        real_savefig(self, *args, **kwargs)
        present_after_each_save.append({p.name for p in tmp_path.iterdir() if p.name in EXPECTED})

    monkeypatch.setattr(Figure, "savefig", recording_savefig)
    plot_calibration_diagrams(random_table(), tmp_path)
    # Each PNG is rendered into a temp file and renamed afterwards, never rendered into its final name.
    assert present_after_each_save == [set(), {"calibration_pred.png"}]
    assert {p.name for p in tmp_path.iterdir()} == EXPECTED


def test_failed_save_leaves_no_partial_files(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    def broken_savefig(self, fh, **kwargs):
        fh.write(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken_savefig)
    with pytest.raises(RuntimeError, match="disk full"):
        plot_calibration_diagrams(random_table(), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_bad_input_raises_before_writing(tmp_path):
    with pytest.raises(UserError, match="n_bins"):
        plot_calibration_diagrams(random_table(), tmp_path / "out", n_bins=0)
    assert not (tmp_path / "out").exists()
