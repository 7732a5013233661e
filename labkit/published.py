"""Moved to `labkit.planner.published` (the planner's subpackage); this old name will be removed.

Importing it warns (DeprecationWarning) and gives the same module object as `labkit.planner.published`.
"""

import sys
import warnings

from labkit.planner import published as _moved

warnings.warn("labkit.published moved to labkit.planner.published; import it from there", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
