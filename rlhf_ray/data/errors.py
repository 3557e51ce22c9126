"""The one error the data layer raises for bad input, so a job can refuse to start with a readable message."""

from __future__ import annotations


class DataError(ValueError):
    """Bad or missing data: an unknown dataset name, an unreadable or malformed file, a row without a required
    field, an empty split. The message names where (file:line, file: row index, or dataset and split) and what
    (the field), because it is shown to the user as is before any training starts.

    A subclass of ValueError so callers that already treat bad input as ValueError keep working."""

    def __init__(self, message: str, *, where: str | None = None, field: str | None = None):
        super().__init__(f"{where}: {message}" if where else message)
        self.where = where
        """file:line, `file: row index N`, or `dataset split S`; None when the problem is not tied to a row."""
        self.field = field
        """The dotted field the problem is about, when there is one."""
