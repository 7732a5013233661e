"""Moved to `labkit.planner.plot` (the planner's subpackage); this old name will be removed.

Importing it warns (DeprecationWarning) and gives the same module object as `labkit.planner.plot`.
"""

import sys
import warnings

from labkit.planner import plot as _moved

warnings.warn("labkit.planplot moved to labkit.planner.plot; import it from there", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
