"""Moved to `labkit.planner.check` (the planner's subpackage); this old name will be removed.

Importing it warns (DeprecationWarning) and gives the same module object as `labkit.planner.check`.
"""

import sys
import warnings

from labkit.planner import check as _moved

warnings.warn("labkit.plancheck moved to labkit.planner.check; import it from there", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
