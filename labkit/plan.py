"""Moved to `labkit.planner.plan` (the planner's subpackage); this old name will be removed.

Importing it warns (DeprecationWarning) and gives the same module object as `labkit.planner.plan`.
"""

import sys
import warnings

from labkit.planner import plan as _moved

if __name__ == "__main__":  # python -m labkit.plan
    raise SystemExit(_moved.main())
warnings.warn("labkit.plan moved to labkit.planner.plan; import it from there", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
