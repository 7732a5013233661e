"""Deprecated: `labkit.work.WorkCounter` counts what a rank hands to collectives and sends, with the rest of its work.

`CommCounter` is its former name, kept for rank scripts written against it; its table of c10d operators is
`labkit.work.COLLECTIVES`.
"""

from labkit.work import COLLECTIVES, NOT_COMMUNICATION, WorkCounter as CommCounter  # noqa: F401
