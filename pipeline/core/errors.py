"""Errors a stage knows how to explain: the CLI prints them as one line and exits 1."""

from __future__ import annotations


class PipelineError(Exception):
    """A failure with a clear cause and remedy; the message names the file, key or line."""


class ConfigError(PipelineError):
    """Bad keys in a settings file (or the environment, ``source``): one line per problem, each naming its key."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source, self.problems = source, list(problems)
        listing = "".join(f"\n  - {p}" for p in self.problems)
        super().__init__(f"{source}: {self.problems[0]}" if len(self.problems) == 1
                         else f"{source}: {len(self.problems)} problem(s) in the configuration:{listing}")


class DataError(PipelineError):
    """An input file is malformed (bad UTF-8, misaligned pairs, empty corpus, corrupt shard...)."""


class DownloadError(PipelineError):
    """A source could not be fetched or failed its integrity checks."""


class CheckpointError(PipelineError):
    """A checkpoint is missing, incomplete, corrupt or from another configuration."""


class OutputError(PipelineError):
    """An output could not be written: disk full, quota, file size limit, permission, read-only disk."""
