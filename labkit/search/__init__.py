"""The workbook's search (notebook 08): one search space, trials predicted then trained under the budget, Optuna studies.

    from labkit import search
    config = search.StudyConfig(budget_bytes=ex.budget_bytes)
    search.measure_setting(params, config)          # one trial: peak under the budget, then tokens/s
    search.train(params, config)                    # one trial trained with validation losses (labkit.search.trial)
    space = config.space()                          # the chapters' knobs (labkit.search.space)
"""

from labkit.search.space import Param, active, check_params, suggest, workbook_space
from labkit.search.trial import (MEMORY_KNOBS, STATUSES, SettingStep, StudyConfig, TrialResult, chapter_settings,
                                 confirm_oom, measure_setting, predict_peak_bytes, time_settings, train, untrained_loss,
                                 validation_batch)

__all__ = ["MEMORY_KNOBS", "Param", "STATUSES", "SettingStep", "StudyConfig", "TrialResult", "active",
           "chapter_settings", "check_params", "confirm_oom", "measure_setting", "predict_peak_bytes", "suggest",
           "time_settings", "train", "untrained_loss", "validation_batch", "workbook_space"]
