"""The two ways a dataset can fail to load; both name the files and what to do."""

from __future__ import annotations


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's files are absent and could not (or were not allowed to) be downloaded."""


class DatasetCorruptError(ValueError):
    """A dataset's files are present but cannot be parsed (truncated, damaged or of another
    format version)."""
