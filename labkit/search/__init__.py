"""The workbook's search (notebook 08): one search space, trials predicted then trained under the budget, Optuna studies."""

from labkit.search.space import MEMORY_KNOBS, Param, active, check_params, suggest, workbook_space
from labkit.search.config import StudyConfig
from labkit.search.study import chapter_settings, plain_setting
from labkit.search.trial import (FinalistTiming, SettingStep, TrialResult, confirm_oom, measure_setting,
                                 predict_peak_bytes, predict_step, projected_step_s, runs_here, time_finalists,
                                 time_settings, train, untrained_loss, validation_batch)

__all__ = ["FinalistTiming", "MEMORY_KNOBS", "Param", "SettingStep", "StudyConfig", "TrialResult", "active",
           "chapter_settings", "check_params", "confirm_oom", "measure_setting", "plain_setting", "predict_peak_bytes",
           "predict_step", "projected_step_s", "runs_here", "suggest", "time_finalists", "time_settings", "train",
           "untrained_loss", "validation_batch", "workbook_space"]
