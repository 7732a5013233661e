"""`make gpu-check` (workbook.gpucheck over labkit.tools.gpucheck): one line and status 2 without CUDA; its checks' code
rehearsed on the CPU at a tiny size."""

from __future__ import annotations

import json

import pytest
import torch

from labkit.tools import gpucheck
from workbook import gpucheck as repo_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the real checks run instead")
def test_without_cuda_says_so_in_one_line_and_exits_2(capsys, tmp_path):
    assert gpucheck.main(["--out", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "needs CUDA" in out
    assert not (tmp_path / "gpu-check.json").exists()


def test_rehearsal_on_cpu_runs_every_check(tmp_path, one_thread):
    assert repo_check.main(["--rehearse-on-cpu", "--out", str(tmp_path)]) == 0  # make gpu-check's command
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    rows = {r["check"]: r for r in report["rows"]}
    assert list(rows) == list(gpucheck.CHECKS) + list(repo_check.REPO_CHECKS)  # labkit's rows, then the repository's
    assert report["rehearsal"] is True and report["complete"] is True
    assert rows["budget"]["ok"] is True and rows["budget"]["figures"]["next_step_ran"] is True
    offload = rows["offload"]["figures"]
    assert offload["peak_bytes"]["offload+prefetch"] < offload["peak_bytes"]["plain"]
    l2l = rows["l2l"]["figures"]
    assert max(l2l["peak_bytes"].values()) < l2l["plain_peak_bytes"]
    assert 0 < rows["precision"]["figures"]["activation_ratio_to_fp32"]["bf16"] < 1
    assert "fp16" not in rows["precision"]["figures"]["step_s"]  # never fp16 compute on a CPU
    roofline = rows["roofline"]["figures"]
    assert rows["roofline"]["ok"] is None and list(roofline["step_s"]) == ["fp32"]  # no 16-bit timing on a CPU
    assert roofline["flops"]["fp32"]["fp32"] > 0 and roofline["bytes_accessed"]["fp32"] > 0
    assert roofline["bound_s"]["fp32"] == max(roofline["compute_s"]["fp32"], roofline["memory_s"]["fp32"])
    assert rows["plan"]["ok"] is None and all(e == 0 for e in rows["plan"]["figures"]["relative_difference"].values())
    assert rows["tests"]["ok"] is None and rows["notebooks"]["ok"] is None  # GPU only, said so


def test_a_check_that_raises_is_a_failed_row(monkeypatch, one_thread):
    def broken(setup):
        raise RuntimeError("copy engine on fire")

    monkeypatch.setattr(gpucheck, "check_meter", broken)
    setup = gpucheck.Setup(torch.device("cpu"), gpucheck.GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=8,
                                                                   vocab_size=32), 1, 8, 1, 1)
    (row,) = gpucheck.run_checks(setup, ["meter"])
    assert row.ok is False and "copy engine on fire" in row.note


def test_a_run_stopped_part_way_leaves_the_rows_it_finished(monkeypatch, tmp_path, one_thread):
    def interrupted(setup):
        raise KeyboardInterrupt  # a time limit or Ctrl-C during the third check

    monkeypatch.setattr(gpucheck, "check_offload", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gpucheck.main(["--rehearse-on-cpu", "--out", str(tmp_path), "--skip", "plan"])
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [r["check"] for r in report["rows"]] == ["meter", "budget"] and report["complete"] is False


def test_chapters_chooses_the_notebooks_row_s_chapters_and_names_an_unknown_one(capsys):
    chosen = repo_check.chapter_notebooks(["10", "04", "06b"])
    assert [nb.name.split("_")[0] for nb in chosen] == ["04", "06b", "10"]  # the chapters' order, not the argument's
    notebooks = repo_check.ROOT / "notebooks"
    assert len(repo_check.chapter_notebooks()) == len(list(notebooks.glob("[0-9][0-9]*_*.ipynb")))
    with pytest.raises(SystemExit) as exit_:  # before any work, CUDA or not
        repo_check.main(["--chapters", "04", "4b"])
    assert exit_.value.code == 2 and "--chapters: no chapter 4b" in capsys.readouterr().err


def test_an_installed_labkit_runs_its_own_rows_only(tmp_path, one_thread):
    """python -m labkit.tools.gpucheck (a hosted notebook, no repository): labkit's rows, none of the repository's."""
    assert gpucheck.main(["--rehearse-on-cpu", "--out", str(tmp_path), "--skip", "plan"]) == 0
    rows = [r["check"] for r in json.loads((tmp_path / "gpu-check.json").read_text())["rows"]]
    assert rows == [c for c in gpucheck.CHECKS if c != "plan"]
    with pytest.raises(SystemExit):
        gpucheck.main(["--chapters", "04"])  # the notebooks row and its option are the repository's


def test_the_precision_rows_note_says_what_gradscaler_did():
    # the H200's gpu-check (2026-12-04): no step skipped, the scale stayed at 65536; its note had said steps were skipped
    kept = gpucheck._scaler_note({"fp16_skipped_steps": 0, "fp16_initial_scale": 65536.0, "fp16_final_scale": 65536.0})
    assert kept.startswith("GradScaler skipped no step") and "65536 at first, 65536 last" in kept
    cut = gpucheck._scaler_note({"fp16_skipped_steps": 3, "fp16_initial_scale": 65536.0, "fp16_final_scale": 8192.0})
    assert cut.startswith("GradScaler skipped 3 steps") and "from 65536 to 8192" in cut
