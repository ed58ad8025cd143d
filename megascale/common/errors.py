"""Errors from other libraries, made into the one line a user is shown."""
from __future__ import annotations


def first_line(e: BaseException) -> str:
    """The first line of `e`'s message, or its type's name when it has none: libraries' messages run to many
    lines (pyarrow's HDFS loader lists every path it tried for libjvm), and a user is shown one."""
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0].rstrip(".")
